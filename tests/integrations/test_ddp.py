"""Data parallel training of a streamed model (DistributedDataParallel): two processes at
half the batch each train like one process at the whole batch; gloo on the CPU, and NCCL
on two GPUs (gpu marker; needs two CUDA devices)."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import layerstream

from tiny import data_parallel_losses, peft_pair, stream

STEPS, GLOBAL_BATCH = 4, 4


def _model(device="cpu"):
    model, _ = peft_pair("llama", layers=4)
    stream(model, device, slots=2, prefetch=1)
    return model.to(device)


def _worker(rank, world, rendezvous, out, device_type):
    device = "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    # a file rendezvous: no port to pick, so no race with other processes for one
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        model = _model(device)
        ddp = DistributedDataParallel(model, device_ids=[rank] if device_type == "cuda" else None)
        streamed = {id(v) for r in layerstream.get_runtime(model).records for v in r.host_values}
        assert ddp.parameters_to_ignore, "DDP must be told to ignore streamed tensors"
        assert not any(id(p) in streamed for p in ddp._module_parameters)
        assert str(layerstream.get_runtime(model).device) == device
        losses = data_parallel_losses(ddp, STEPS, GLOBAL_BATCH, rank, world, device)
        if rank == 0:
            torch.save(losses, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's helper threads can keep an exiting interpreter waiting forever; the results
    # are on disk, so leave without the interpreter's shutdown
    os._exit(0)


DEVICE_TYPES = [
    pytest.param("cpu", id="gloo-cpu"),
    pytest.param("cuda", id="nccl-2gpu", marks=[pytest.mark.gpu, pytest.mark.multigpu]),
]


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
def test_two_processes_train_like_one_at_the_same_global_batch(tmp_path, device_type):
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        pytest.fail("the two-GPU data-parallel test needs two CUDA devices (run it on a two-GPU machine)")
    device = "cuda:0" if device_type == "cuda" else "cpu"
    single = data_parallel_losses(_model(device), STEPS, GLOBAL_BATCH, device=device)
    out = tmp_path / "losses.pt"
    context = mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(out), device_type), nprocs=2, join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two data-parallel processes did not finish within 180 s")
    parallel = torch.load(out)
    assert len(parallel) == STEPS
    print("single", single, "two processes", parallel)
    assert torch.allclose(torch.tensor(parallel), torch.tensor(single), rtol=1e-5, atol=1e-6), (parallel, single)
    assert parallel[-1] < parallel[0]


def test_ddp_names_cover_the_transformers_model_and_a_peft_wrapper():
    model = _model()
    names = set(model.base_model.model._ddp_params_and_buffers_to_ignore)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in names
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in names
    assert set(model._ddp_params_and_buffers_to_ignore) == names  # found through PEFT's lookup
    assert not any("lora_" in n for n in names)
    layerstream.unstream_model(model)
    assert not hasattr(model.base_model.model, "_ddp_params_and_buffers_to_ignore")


def test_ddp_names_follow_peft_applied_after_streaming():
    """PEFT after streaming moves each weight under ``base_layer``: the names DDP skips
    must be the new ones, or its first broadcast writes into the host store."""
    from peft import get_peft_model

    from tiny import lora_config, tiny_model

    base = tiny_model("llama", layers=4)
    stream(base, "cpu", slots=2)
    model = get_peft_model(base, lora_config())
    names = set(model._ddp_params_and_buffers_to_ignore)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in names
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names  # the name before PEFT
    streamed = {id(e.current()) for r in layerstream.get_runtime(model).records for e in r.entries if e.bound}
    by_name = dict(model.base_model.model.named_parameters(remove_duplicate=False))
    assert {n for n, p in by_name.items() if id(p) in streamed} == {n for n in names if n in by_name}
