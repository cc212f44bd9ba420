"""One streamed model leaves no process-wide state behind for the next: a model whose
training stopped on an error, with every long-sequence and tier feature on, is followed
in the same process by a model that trains exactly like its resident twin.

The state at stake is autograd's saved-tensor hook stack: torch before 2.13 leaves a
non-reentrant checkpoint's hooks pushed when the checkpointed function raises, for as
long as the caught exception lives (a retry loop, a logger, a test's excinfo), and every
later forward in the process saves into that dead checkpoint."""

import gc
import os
import traceback

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import layerstream
from layerstream.errors import DiskReadError
from layerstream.runtime import passes

from tiny import assert_traces_equal, lora_config, peft_pair, save_tiny, train_steps


def _saved_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _torch_leaks_hooks_of_a_failed_checkpoint() -> bool:
    def failing(x):
        raise ValueError("stop")

    try:
        torch_checkpoint.checkpoint(failing, torch.ones(1, requires_grad=True), use_reentrant=False)
    except ValueError as exc:
        kept = exc  # noqa: F841 (the traceback lives on, as a caught exception's does)
        leaked = _saved_hooks() is not None
    del kept
    return leaked


def _first_model_stops_mid_forward(tmp_path, device):
    """Every long-sequence and tier feature on; a disk read caught by its checksum stops
    the first training step inside a checkpointed layer. The caught error is kept."""
    directory = tmp_path / "ckpt"
    save_tiny(directory, layers=6, dtype=torch.float32, shard="60KB")
    plain = layerstream.from_pretrained(directory, stream=layerstream.StreamConfig(device="cpu"))
    budget = 5 * layerstream.get_runtime(plain).store.largest_layer_bytes
    config = layerstream.StreamConfig(
        device=device,
        slots=2,
        vram_budget=None,
        host_budget=budget,
        checksum=True,
        offload_activations=True,
        loss_chunk_tokens=4,
        mlp_tile_tokens=4,
    )
    model = layerstream.from_pretrained(directory, stream=config).to(device)
    torch.manual_seed(0)
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(lora_dropout=0.0))
    tier = layerstream.get_runtime(model).disk
    chunk = tier.layers[tier.tiers.disk[0]].chunks[0]
    begin, end, _ = chunk.pieces[0]
    stat = os.stat(chunk.file.path)
    with open(chunk.file.path, "r+b") as handle:  # flip a high byte inside a float32 weight
        handle.seek(begin + (end - begin) // 2 + 3)
        value = handle.read(1)[0]
        handle.seek(begin + (end - begin) // 2 + 3)
        handle.write(bytes([value ^ 0x40]))
    # the file's times as they were: the check of a changed file at the pass's start (outside
    # any checkpoint) passes, and the read's checksum, inside the layer's checkpoint, catches it
    os.utime(chunk.file.path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DiskReadError, match="debug checksum") as caught:
        train_steps(model, 1, device=device)
    frames = [frame.f_code for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
    assert any(code.co_filename == torch_checkpoint.__file__ and code.co_name == "checkpoint" for code in frames), (
        "the error did not stop the step inside a checkpointed layer, so the tests here could not fail"
    )
    return caught


def _second_model_trains_like_its_resident_twin(device):
    streamed, resident = peft_pair("llama", layers=5)
    layerstream.stream_model(streamed, device=device, slots=2, vram_budget=None)
    streamed.to(device), resident.to(device)
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


def test_a_model_stopped_mid_step_leaves_the_next_model_exact(tmp_path, device):
    caught = _first_model_stops_mid_forward(tmp_path, device)
    assert _saved_hooks() is None, "the failed checkpoint's saved-tensor hooks are still pushed"
    _second_model_trains_like_its_resident_twin(device)
    assert caught.value is not None


def test_without_closing_the_failed_checkpoint_its_hooks_stay_where_torch_leaves_them(tmp_path, device, monkeypatch):
    """Negative control: with torch's checkpoint called bare, the hooks leak exactly where
    torch itself leaks them (before 2.13), so the test above can fail there."""
    torch_leaks = _torch_leaks_hooks_of_a_failed_checkpoint()

    def bare(function, *args, **kwargs):
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    monkeypatch.setattr(passes, "checkpoint", bare)
    caught = _first_model_stops_mid_forward(tmp_path, device)
    leaked = _saved_hooks() is not None
    del caught
    gc.collect()  # the traceback goes, the checkpoint's generator closes, its hooks go
    assert leaked == torch_leaks and _saved_hooks() is None
