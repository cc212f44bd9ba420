"""Accelerate and Trainer place a streamed model like any other, moving only its resident part."""

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import Trainer, TrainingArguments

import layerstream

from tiny import assert_traces_equal, batch, peft_pair, stream, train_steps


def test_accelerator_prepare_keeps_the_model_streamed():
    streamed, resident = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2)
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(streamed)
    assert layerstream.is_streamed(prepared)
    assert_traces_equal(train_steps(prepared, 10), train_steps(resident, 10))


def _trainer_losses(model, tmp_path, name):
    rows = [{"input_ids": batch(96, size=1, seq=10, seed=s)[0].tolist()} for s in range(16)]
    data = Dataset.from_list(rows).map(lambda r: {"labels": r["input_ids"]})
    args = TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        max_steps=6,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        data_seed=0,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_trains_a_streamed_model_like_the_resident_one(tmp_path):
    streamed, resident = peft_pair("qwen3", layers=4)
    stream(streamed, "cpu", slots=2)
    got = _trainer_losses(streamed, tmp_path, "streamed")
    expected = _trainer_losses(resident, tmp_path, "resident")
    assert len(got) == 6 and got == expected
    assert layerstream.get_runtime(streamed).stats()["layer_loads"] > 0


def _adapters_added_after_streaming(device):
    """A streamed model, then PEFT on top (its adapters start on the host, beside the
    streamed weights' host copies), never moved again; and the same model resident."""
    import copy

    from peft import get_peft_model

    from tiny import lora_config, tiny_model

    base = tiny_model("llama", layers=4)
    resident = get_peft_model(copy.deepcopy(base).to(device), lora_config())
    stream(base, device, slots=2)
    streamed = get_peft_model(base, lora_config())
    streamed.load_state_dict(resident.state_dict())
    return streamed, resident


def test_adapters_of_streamed_layers_follow_the_layers_device():
    """The selection: adapters move, the streamed weights stay in the host store."""
    import torch

    from layerstream.modules.layer import tensors_off_device

    streamed, _ = _adapters_added_after_streaming("cpu")
    records = layerstream.get_runtime(streamed).records
    assert list(tensors_off_device(records, torch.device("cpu"))) == []
    off = {id(t) for *_, t in tensors_off_device(records, torch.device("meta"))}
    lora = {id(p) for n, p in streamed.named_parameters() if "lora_" in n and ".layers." in n}
    assert off == lora and lora  # the adapters, and nothing the store holds


@pytest.mark.gpu
def test_adapters_added_after_streaming_train_on_the_gpu_without_a_move():
    """A 4-bit model is never moved by the Trainer: adapters PEFT left on the host must
    still train on the GPU, exactly as the resident model does."""
    streamed, resident = _adapters_added_after_streaming("cuda")
    assert any(p.device.type == "cpu" for n, p in streamed.named_parameters() if "lora_" in n)
    assert_traces_equal(train_steps(streamed, 4, device="cuda"), train_steps(resident, 4, device="cuda"))


def test_placement_is_checked_again_only_after_tensors_were_registered(monkeypatch):
    """The model's own forward (Llama slices its ModuleList on every call) must not make
    each pass walk every module; registering an adapter must."""
    from peft import get_peft_model

    from layerstream.modules import layer

    from tiny import lora_config, tiny_model

    walks = []
    real = layer.place_resident_tensors
    monkeypatch.setattr(layer, "place_resident_tensors", lambda *a: walks.append(1) or real(*a))
    model = tiny_model("llama", layers=4)
    stream(model, "cpu")
    ids = batch(96, size=2, seq=8)
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=ids)
    assert len(walks) == 1  # the first pass only
    model = get_peft_model(model, lora_config())
    model(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(walks) == 2  # once more, after PEFT registered its adapters
