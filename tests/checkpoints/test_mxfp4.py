"""gpt-oss's published checkpoints are MXFP4. Asked to dequantise (``Mxfp4Config(dequantize=True)``),
layerstream's loader reads them layer by layer, dequantising each layer's experts with
transformers' own operation (one expert at a time), and gives the model transformers gives
when it dequantises (on a machine without its MXFP4 kernels, as this one), tensor for tensor
and logit for logit. By default it keeps them packed: ``tests/modules/test_packed_experts.py``."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Mxfp4Config
from transformers.integrations import mxfp4 as transformers_mxfp4

import layerstream
from layerstream import loading

from tiny import batch, portable_cpu_nf4, save_mxfp4_gpt_oss

CPU = layerstream.StreamConfig(device="cpu", slots=2)
LAYERS, EXPERTS = 3, 4
DEQUANTISE = Mxfp4Config(dequantize=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4") / "gpt-oss", layers=LAYERS)


@pytest.fixture(scope="module")
def dequantised_by_transformers(checkpoint):
    """The reference: transformers' own load, which dequantises MXFP4 to bf16 without its kernels."""
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=batch(96, seq=12)).logits


def _differences(model, reference):
    """Names of the parameters and buffers (with their dtypes) where ``model`` is not
    ``reference``; logits compared apart."""
    ours, theirs = dict(model.state_dict()), dict(reference.state_dict())
    ours.update(model.named_buffers())
    theirs.update(reference.named_buffers())
    assert list(ours) == list(theirs)
    return [n for n in theirs if ours[n].dtype != theirs[n].dtype or not torch.equal(ours[n], theirs[n])]


@pytest.fixture
def dequantisations(monkeypatch):
    """Every call of transformers' MXFP4 dequantisation on data, by the layer being loaded
    then and the leading (expert) size of its blocks (the checkpoint's validation calls it on
    meta tensors first, for their shapes)."""
    calls, loading_now = [], []
    real_dequantise, real_load = transformers_mxfp4.dequantize_convertops, loading._load_module

    def dequantise(blocks, scales, *args, **kwargs):
        if blocks.device.type != "meta":
            calls.append((loading_now[-1], blocks.shape[0]))
        return real_dequantise(blocks, scales, *args, **kwargs)

    def load(module, prefix, *args, **kwargs):
        loading_now.append(prefix)
        return real_load(module, prefix, *args, **kwargs)

    monkeypatch.setattr(transformers_mxfp4, "dequantize_convertops", dequantise)
    monkeypatch.setattr(loading, "_load_module", load)
    return calls


def test_an_mxfp4_checkpoint_asked_dequantised_loads_as_transformers_dequantises_it(
    checkpoint, dequantised_by_transformers, dequantisations, caplog
):
    reference = dequantised_by_transformers
    assert reference.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    with caplog.at_level("WARNING", logger="layerstream"):
        model = layerstream.from_pretrained(
            checkpoint, dtype=torch.bfloat16, device="cpu", quantization_config=DEQUANTISE
        )
    assert layerstream.is_streamed(model)
    assert _differences(model, reference) == []
    assert torch.equal(_logits(model), _logits(reference))
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(reference.config, "quantization_config", None) is None
    # transformers' operation, called one expert at a time while each layer is read
    expected = [(f"model.layers.{i}.", 1) for i in range(LAYERS) for _ in range(2 * EXPERTS)]
    assert dequantisations == expected
    said = [r.getMessage() for r in caplog.records if "MXFP4" in r.getMessage()]
    assert len(said) == 1
    assert "dequantised to bfloat16" in said[0] and "192.00 KiB of host memory per layer" in said[0]
    assert "the files hold 51.00 KiB" in said[0]


@pytest.mark.parametrize("damage", ["one-scale-changed", "nibbles-swapped"])
def test_the_comparison_catches_a_wrong_dequantisation(
    checkpoint, dequantised_by_transformers, tmp_path, monkeypatch, damage
):
    """Negative control: one block's scale changed in the files, or the two FP4 values of each
    byte read in the other order, gives other tensors (and other logits where it moves many
    values), so the comparison above would fail."""
    target = checkpoint
    if damage == "one-scale-changed":
        target = tmp_path / "changed"
        target.mkdir()
        for item in checkpoint.iterdir():
            (target / item.name).write_bytes(item.read_bytes())
        tensors = load_file(target / "model.safetensors")
        tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 1] += 1
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    else:
        real = transformers_mxfp4.dequantize_convertops

        def swapped(blocks, scales, *args, **kwargs):
            if blocks.device.type != "meta":  # not the validation's shapes-only call
                blocks = (blocks << 4) | (blocks >> 4)
            return real(blocks, scales, *args, **kwargs)

        monkeypatch.setattr(transformers_mxfp4, "dequantize_convertops", swapped)
    model = layerstream.from_pretrained(target, dtype=torch.bfloat16, device="cpu", quantization_config=DEQUANTISE)
    differ = _differences(model, dequantised_by_transformers)
    if damage == "one-scale-changed":
        assert differ == ["model.layers.1.mlp.experts.down_proj"]
        ours = model.model.layers[1].mlp.experts.down_proj
        theirs = dequantised_by_transformers.model.layers[1].mlp.experts.down_proj
        changed = (ours != theirs).nonzero().tolist()
        assert changed and {(e, o) for e, _, o in changed} == {(2, 5)}  # one expert, one output row
        assert {i // 32 for _, i, _ in changed} == {1}  # of the one block
        assert torch.equal(ours[ours != theirs], 2 * theirs[ours != theirs])  # an exponent one higher
    else:
        assert differ == [
            f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS) for p in ("gate_up_proj", "down_proj")
        ]
        assert not torch.equal(_logits(model), _logits(dequantised_by_transformers))


def _save_dequantised(model, directory):
    """The dequantised model as a plain bf16 checkpoint: its state dict under its own names and
    its config without the MXFP4 quantization_config (transformers 5.17's save_pretrained of a
    dequantised gpt-oss writes the experts under bare names that its load then leaves out)."""
    import copy

    directory.mkdir(parents=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_nf4_of_an_mxfp4_checkpoint_is_nf4_of_its_dequantised_weights(
    checkpoint, dequantised_by_transformers, tmp_path
):
    """quantization='nf4' then treats the dequantised model as any bf16 checkpoint: attention
    in NF4, the expert stacks (plain Parameters) in bf16, as transformers' 4-bit load of the
    dequantised weights saved in bf16 gives (transformers refuses a BitsAndBytesConfig for an
    MXFP4 checkpoint itself)."""
    _save_dequantised(dequantised_by_transformers, tmp_path / "bf16")
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,  # quantization='nf4''s default
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    reference = portable_cpu_nf4(
        AutoModelForCausalLM.from_pretrained(
            tmp_path / "bf16", quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
        )
    )
    with pytest.raises(layerstream.LoadingError, match="give quantization='nf4' or quantization_config"):
        layerstream.from_pretrained(checkpoint, quantization="nf4", stream=CPU, quantization_config=DEQUANTISE)
    quant = dict(quantization="nf4", dtype=torch.bfloat16, stream=CPU)
    model = layerstream.from_pretrained(checkpoint, **quant, config=_dequantising_config(checkpoint))
    assert model.is_loaded_in_4bit and model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert _differences(model, reference) == []
    assert torch.equal(_logits(model), _logits(reference))
    packed = layerstream.from_pretrained(checkpoint, **quant)  # the default: experts kept in MXFP4
    assert "gate_up_proj" not in dict(packed.model.layers[0].mlp.experts.named_parameters())
    assert torch.equal(_logits(packed), _logits(reference))


def _dequantising_config(checkpoint):
    """The checkpoint's config with its quantization_config set to dequantise, as a user
    writes it to have transformers (and layerstream) dequantise with NF4 on top."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    config.quantization_config = {**config.quantization_config, "dequantize": True}
    return config


def test_an_mxfp4_config_from_a_script_chooses_dequantised_or_packed(checkpoint, dequantised_by_transformers):
    """Scripts for gpt-oss pass Mxfp4Config(dequantize=True) (transformers dequantises then on
    any machine): dequantised Parameters, as transformers'. Mxfp4Config() alone asks for
    MXFP4 kept: the experts stay packed. The logits are the same either way."""
    model = layerstream.from_pretrained(checkpoint, dtype=torch.bfloat16, stream=CPU, quantization_config=DEQUANTISE)
    assert _differences(model, dequantised_by_transformers) == []
    packed = layerstream.from_pretrained(
        checkpoint, dtype=torch.bfloat16, stream=CPU, quantization_config=Mxfp4Config()
    )
    assert sorted(n for n, _ in packed.model.layers[0].mlp.experts.named_buffers()) == [
        "down_proj_blocks",
        "down_proj_scales",
        "gate_up_proj_blocks",
        "gate_up_proj_scales",
    ]
    assert torch.equal(_logits(packed), _logits(dequantised_by_transformers))


def test_the_disk_tier_refuses_an_mxfp4_checkpoint_it_dequantises_clearly(checkpoint):
    with pytest.raises(layerstream.LoadingError, match="MXFP4 experts it dequantises.*Raise host_budget"):
        layerstream.from_pretrained(
            checkpoint,
            stream=layerstream.StreamConfig(device="cpu", slots=2, host_budget="460KiB"),
            quantization_config=DEQUANTISE,
        )
