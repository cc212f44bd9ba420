"""Checkpoints stored in another layout than the model holds (transformers converts them while
loading: one tensor per expert, renamed keys, a vision-language checkpoint's text model) stream
layer by layer through transformers' own conversion mapping, and give transformers' model."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import layerstream
from layerstream import loading
from layerstream.errors import LoadingError
from layerstream.integrations import launch

from tiny import _COMMON, batch, save_tiny, tiny_model


def _per_expert(family):
    def write(path: Path):
        save_tiny(path, family, layers=3)  # transformers writes one tensor per expert

    return write


def _fused_in_memory_layout(path: Path):
    """The layout the model holds (fused experts), saved as it is in memory."""
    model = tiny_model("qwen3_moe", layers=3)
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))


def _vision_language(path: Path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8
    )
    text = dict(_COMMON, num_hidden_layers=3, sliding_window=8)
    torch.manual_seed(0)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    Gemma3ForConditionalGeneration(config).save_pretrained(path)


LAYOUTS = {
    "mixtral-per-expert": _per_expert("mixtral"),
    "qwen3_moe-per-expert": _per_expert("qwen3_moe"),
    "qwen3_moe-fused": _fused_in_memory_layout,
    "gemma3-vision-language": _vision_language,
}


def _keys(path: Path):
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        return list(handle.keys())


def _logits(model):
    with torch.no_grad():
        return model(input_ids=batch(96, seq=12)).logits


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_each_layout_streams_layer_by_layer_and_equals_transformers_load(layout, tmp_path, caplog):
    LAYOUTS[layout](tmp_path)
    if "per-expert" in layout:
        assert any(".experts.0." in k for k in _keys(tmp_path)), "the checkpoint holds one tensor per expert"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    launch.enable({"slots": 2, "device": "cpu"})
    try:
        with caplog.at_level("WARNING", logger="layerstream"):
            launched = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto")
    finally:
        launch.disable()
    assert layerstream.is_streamed(launched)
    assert "transformers loads it into host memory" not in caplog.text, "read by layerstream's loader, per layer"
    direct = layerstream.from_pretrained(tmp_path, stream=layerstream.StreamConfig(device="cpu", slots=2))
    assert torch.equal(_logits(launched), _logits(plain))
    assert torch.equal(_logits(direct), _logits(plain))


def _rewrite(path: Path, change):
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_the_comparison_catches_two_experts_swapped_in_the_files(tmp_path):
    """Negative control: the loader reads the experts where the files put them, so experts
    swapped on disk give other logits than the model they were saved from."""
    _per_expert("mixtral")(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)

    def swap(tensors):
        for proj in ("w1", "w2", "w3"):
            a, b = (f"model.layers.1.block_sparse_moe.experts.{i}.{proj}.weight" for i in (0, 1))
            tensors[a], tensors[b] = tensors[b], tensors[a]

    _rewrite(tmp_path, swap)
    streamed = layerstream.from_pretrained(tmp_path, stream=layerstream.StreamConfig(device="cpu", slots=2))
    assert not torch.equal(_logits(streamed), _logits(plain))


@pytest.mark.parametrize("damage", ["an-expert-missing", "an-expert-of-another-size"])
def test_a_damaged_per_expert_checkpoint_is_refused_before_a_layer_is_read(tmp_path, monkeypatch, damage):
    _per_expert("qwen3_moe")(tmp_path)
    name = "model.layers.2.mlp.experts.3.up_proj.weight"

    def change(tensors):
        if damage == "an-expert-missing":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:-1].clone()

    _rewrite(tmp_path, change)
    monkeypatch.setattr(loading, "_load_module", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(LoadingError, match="experts"):
        layerstream.from_pretrained(tmp_path, stream=layerstream.StreamConfig(device="cpu", slots=2))


def test_a_layer_stored_both_fused_and_per_expert_is_refused_before_a_layer_is_read(tmp_path, monkeypatch):
    """Both layouts of one layer's experts, with other values: which one the model should
    hold is a guess (transformers fails on it), so the load is refused."""
    _per_expert("qwen3_moe")(tmp_path)
    fused = tiny_model("qwen3_moe", layers=3, seed=5).state_dict()

    def add_fused(tensors):
        for proj in ("gate_up_proj", "down_proj"):
            tensors[f"model.layers.0.mlp.experts.{proj}"] = fused[f"model.layers.0.mlp.experts.{proj}"].contiguous()

    _rewrite(tmp_path, add_fused)
    monkeypatch.setattr(loading, "_load_module", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(LoadingError, match=r"model.layers.0.mlp.experts.down_proj \(2 such tensors in all\) twice"):
        layerstream.from_pretrained(tmp_path, stream=layerstream.StreamConfig(device="cpu", slots=2))


def test_the_disk_tier_refuses_a_converted_layout_clearly(tmp_path):
    _per_expert("mixtral")(tmp_path)
    with pytest.raises(LoadingError, match="another layout.*Raise host_budget"):
        layerstream.from_pretrained(
            tmp_path, stream=layerstream.StreamConfig(device="cpu", slots=2, host_budget="300KiB")
        )


def test_a_checkpoint_in_the_models_own_names_converts_nothing(tmp_path):
    from layerstream.checkpoints.conversion import for_checkpoint

    model = tiny_model("llama", layers=2)
    model.save_pretrained(tmp_path)
    assert for_checkpoint(model, _keys(tmp_path)) is None


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_nf4_says_once_which_weights_stay_unquantised(family, tmp_path, caplog):
    """bitsandbytes quantises nn.Linear weights only (as transformers applies it): fused
    experts stay in the compute dtype, said once with their share; a dense model says nothing."""
    save_tiny(tmp_path, family, layers=2, wide=True)
    with caplog.at_level("WARNING", logger="layerstream"):
        layerstream.from_pretrained(
            tmp_path, quantization="nf4", stream=layerstream.StreamConfig(device="cpu", slots=2)
        )
    said = [r.getMessage() for r in caplog.records if "plain Parameters" in r.getMessage()]
    if family == "llama":
        assert not said
        return
    assert len(said) == 1
    assert "model.layers.0.mlp.experts.gate_up_proj and 2 more per layer" in said[0] and "stay in float32" in said[0]
