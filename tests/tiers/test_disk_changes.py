"""A QLoRA script's ``prepare_model_for_kbit_training`` with layers on disk: the cast norms of
the layers the disk tier reads stay on the device with their new values, and training equals
the plain model's prepared the same way; a change the device should not hold is refused."""

import logging

import pytest
import torch
from peft import get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import layerstream
from layerstream.errors import StreamingError

from tiny import assert_traces_equal, lora_config, portable_cpu_nf4, save_tiny, train_steps

LAYERS = 6
QUANT = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("disk-changes") / "ckpt", layers=LAYERS, dtype=torch.bfloat16, wide=True)


def _layer_bytes(checkpoint, quantization) -> int:
    model = layerstream.from_pretrained(
        checkpoint,
        quantization_config=quantization,
        dtype=torch.bfloat16,
        stream=layerstream.StreamConfig(device="cpu"),
    )
    return layerstream.get_runtime(model).store.largest_layer_bytes


def _streamed(checkpoint, cache, device, quantization=QUANT):
    """Every layer but one read from disk (the NF4 layer cache, or the checkpoint's files);
    no VRAM budget: on a GPU the window would otherwise keep the tiny layers."""
    config = layerstream.StreamConfig(
        device=device,
        slots=2,
        host_budget=5 * _layer_bytes(checkpoint, quantization),
        disk_cache_dir=cache,
        vram_budget=None,
    )
    model = layerstream.from_pretrained(
        checkpoint, quantization_config=quantization, dtype=torch.bfloat16, stream=config
    )
    assert len(layerstream.get_runtime(model).disk.tiers.disk) >= LAYERS - 2, "the layers are read from disk"
    return model.to(device)


def _plain(checkpoint, device):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=QUANT, dtype=torch.bfloat16, device_map=device
    )
    return portable_cpu_nf4(model) if device == "cpu" else model


def _peft(model):
    torch.manual_seed(0)  # the same non-zero LoRA B (init_lora_weights=False) on both
    return get_peft_model(model, lora_config())


def test_prepare_model_for_kbit_training_with_layers_on_disk_trains_as_the_plain_model(
    checkpoint, tmp_path, device, caplog
):
    streamed = prepare_model_for_kbit_training(_streamed(checkpoint, tmp_path / "cache", device), False)
    runtime = layerstream.get_runtime(streamed)
    disk_layer = runtime.disk.tiers.disk[0]
    resident = _peft(prepare_model_for_kbit_training(_plain(checkpoint, device), False))
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        streamed = _peft(streamed)
        assert_traces_equal(train_steps(streamed, 2, device=device), train_steps(resident, 2, device=device))
    said = [r.getMessage() for r in caplog.records if "were changed" in r.getMessage()]
    assert len(said) == 1 and "prepare_model_for_kbit_training" in said[0] and f"stay on {device}" in said[0]
    norm = streamed.get_parameter(f"base_model.model.model.layers.{disk_layer}.input_layernorm.weight")
    assert norm.dtype == torch.float32 and norm.device.type == torch.device(device).type
    names = {e.qualified_name for e in runtime.records[disk_layer].entries}
    assert f"model.layers.{disk_layer}.input_layernorm.weight" not in names, "the cast norm no longer streams"
    assert any("q_proj" in name for name in names), "the 4-bit weights still stream from disk"
    assert runtime.stats()["disk_reads"] > 0


def test_new_values_of_a_disk_layers_norms_reach_the_computation(checkpoint, tmp_path):
    """Not only the dtype: norms scaled after the cast compute with the new values (a cast
    of bfloat16 to float32 alone leaves every value as it was)."""

    def scaled(model):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.mul_(1.5)
        return model

    streamed = _peft(scaled(prepare_model_for_kbit_training(_streamed(checkpoint, tmp_path / "cache", "cpu"), False)))
    resident = _peft(scaled(prepare_model_for_kbit_training(_plain(checkpoint, "cpu"), False)))
    unscaled = _peft(prepare_model_for_kbit_training(_plain(checkpoint, "cpu"), False))
    want = train_steps(resident, 1)
    assert_traces_equal(train_steps(streamed, 1), want)
    with pytest.raises(AssertionError):  # the scaling shows in the numbers
        assert_traces_equal(train_steps(unscaled, 1), want)


def test_a_second_load_from_the_same_nf4_cache_trains_as_the_plain_model(checkpoint, tmp_path):
    """A layer read back from the NF4 cache: a cast of one norm is not taken for a write to
    every tensor of the layer (which would refuse the run)."""
    _streamed(checkpoint, tmp_path / "cache", "cpu")  # writes the cache
    streamed = _peft(prepare_model_for_kbit_training(_streamed(checkpoint, tmp_path / "cache", "cpu"), False))
    resident = _peft(prepare_model_for_kbit_training(_plain(checkpoint, "cpu"), False))
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))


def test_a_kept_norm_changed_between_a_forward_and_its_backward_is_refused(checkpoint, tmp_path):
    """Kept on the device, a norm is still watched: the recompute would use the new values
    where autograd differentiates the old ones."""
    model = _peft(prepare_model_for_kbit_training(_streamed(checkpoint, tmp_path / "cache", "cpu"), False))
    train_steps(model, 1)
    disk_layer = layerstream.get_runtime(model).disk.tiers.disk[0]
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        model.base_model.model.model.layers[disk_layer].input_layernorm.weight.mul_(2)
    with pytest.raises(StreamingError, match="changed between its forward and its backward"):
        loss.backward()


def test_without_the_cast_on_the_streamed_side_the_runs_differ_negative_control(checkpoint, tmp_path):
    """The parity above sees the norms' dtype: the streamed model left in bfloat16 differs."""
    streamed = _peft(_streamed(checkpoint, tmp_path / "cache", "cpu"))
    resident = _peft(prepare_model_for_kbit_training(_plain(checkpoint, "cpu"), False))
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))


def test_a_cast_of_a_large_disk_layer_weight_is_refused_naming_it(tmp_path):
    """A bfloat16 load cast whole would move its disk layers to the device: a weight past
    the share a layer may keep there is refused, naming that weight (not a smaller cast
    before it, here Qwen2's query bias) and both dtypes."""
    directory = save_tiny(tmp_path / "qwen2", family="qwen2", layers=LAYERS, dtype=torch.bfloat16, wide=True)
    model = _streamed(directory, None, "cpu", quantization=None)
    disk_layer = layerstream.get_runtime(model).disk.tiers.disk[0]
    layer = model.model.layers[disk_layer]
    for tensor in (layer.self_attn.q_proj.bias, layer.mlp.up_proj.weight):
        tensor.data = tensor.data.float()
    with pytest.raises(StreamingError, match="read from disk each time") as refused:
        model(torch.tensor([[3, 4, 5]]))
    said = str(refused.value)
    assert f"a cast of model.layers.{disk_layer}.mlp.up_proj.weight from torch.bfloat16 to torch.float32" in said
    assert "Keep the layers in host RAM" in said


def test_a_changed_quant_state_of_a_disk_layer_is_refused_with_its_norms_cast(checkpoint, tmp_path):
    """A 4-bit weight's quantisation state changed beside a cast norm: the norm alone cannot
    be kept (the quant state would be taken as it is on disk), so the whole change is refused."""
    model = prepare_model_for_kbit_training(_streamed(checkpoint, tmp_path / "cache", "cpu"), False)
    disk_layer = layerstream.get_runtime(model).disk.tiers.disk[0]
    state = model.model.layers[disk_layer].self_attn.q_proj.weight.quant_state
    state.absmax.mul_(2)
    with pytest.raises(StreamingError, match="read from disk each time"):
        model(torch.tensor([[3, 4, 5]]))


def test_after_unstream_model_the_kept_norms_compute_as_the_plain_models(checkpoint, tmp_path):
    streamed = _peft(prepare_model_for_kbit_training(_streamed(checkpoint, tmp_path / "cache", "cpu"), False))
    resident = _peft(prepare_model_for_kbit_training(_plain(checkpoint, "cpu"), False))
    assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))
    disk_layer = layerstream.get_runtime(streamed).disk.tiers.disk[0]
    layerstream.unstream_model(streamed)
    norm = streamed.base_model.model.model.layers[disk_layer].input_layernorm.weight
    assert norm.dtype == torch.float32 and type(norm) is torch.nn.Parameter
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = resident.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(streamed.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)


def test_a_kept_norm_changed_during_a_forward_is_refused_naming_it(checkpoint, tmp_path):
    model = _peft(prepare_model_for_kbit_training(_streamed(checkpoint, tmp_path / "cache", "cpu"), False))
    train_steps(model, 1)
    disk = layerstream.get_runtime(model).disk.tiers.disk
    layers = model.base_model.model.model.layers

    def change_a_later_norm(module, args):
        with torch.no_grad():
            layers[disk[-1]].input_layernorm.weight.mul_(1.01)

    layers[disk[0]].register_forward_pre_hook(change_a_later_norm)
    with pytest.raises(StreamingError, match="could not be taken") as refused:
        train_steps(model, 1)
    said = str(refused.value)
    assert f"keeps on the device, model.layers.{disk[-1]}.input_layernorm.weight" in said
    assert "change them between passes" in said
