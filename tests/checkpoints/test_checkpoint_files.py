"""Which weights a load reads, and in which dtypes, are transformers' choices: a directory
with more than one set of weights, a config that names its file, "auto" on a config without
a dtype, a tied config over a checkpoint whose head differs, float16 with weights transformers
keeps in float32, and launcher arguments that pick other files. Each case compares every
tensor (name, dtype, bytes) of layerstream's load, directly and through the launcher, with
transformers' own load of the same directory; each is a case the loader once got wrong."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import layerstream
from layerstream.integrations import autoload, launch

from tiny import save_tiny, tiny_config, tiny_model

CPU = layerstream.StreamConfig(device="cpu", slots=2)


def _transformers(path, **kwargs):
    """transformers' own load, whatever the launcher has installed."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, PreTrainedModel

    original = autoload._original or PreTrainedModel.__dict__["from_pretrained"]
    return original.__func__(MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path))], path, **kwargs)


def _launcher(path, **kwargs):
    launch.enable({"slots": 2, "device": "cpu"})
    try:
        return AutoModelForCausalLM.from_pretrained(path, device_map="auto", **kwargs)
    finally:
        launch.disable()


def _tensors(model) -> dict:
    """name -> tensor of every parameter and persistent buffer (a streamed layer's read from
    its host store by unstreaming first)."""
    if layerstream.is_streamed(model):
        layerstream.unstream_model(model)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _differences(model, reference) -> list:
    ours, theirs = _tensors(model), _tensors(reference)
    if ours.keys() != theirs.keys():
        return [f"names: {sorted(ours.keys() ^ theirs.keys())}"]
    return [
        name for name in theirs if ours[name].dtype != theirs[name].dtype or not torch.equal(ours[name], theirs[name])
    ]


def _both_equal_transformers(path, **kwargs):
    reference = _transformers(path, **kwargs)
    direct = layerstream.from_pretrained(path, stream=CPU, **kwargs)
    assert _differences(direct, reference) == []
    assert _differences(_launcher(path, **kwargs), reference) == []
    return reference


def _save(model, directory, **kwargs):
    model.save_pretrained(directory, **kwargs)
    return directory


def test_a_stale_index_beside_model_safetensors_is_passed_over_as_transformers_does(tmp_path):
    """save_pretrained of an unsharded model over a sharded one leaves the old index and
    shards; transformers reads model.safetensors first."""
    directory = _save(tiny_model(layers=3, seed=1), tmp_path / "m", max_shard_size="20KB")
    _save(tiny_model(layers=3, seed=2), directory)
    assert (directory / "model.safetensors.index.json").exists() and (directory / "model.safetensors").exists()
    reference = _both_equal_transformers(directory, dtype=torch.float32)
    # control: the index's weights are other weights
    assert _differences(layerstream.from_pretrained(tmp_path / "m", stream=CPU, dtype=torch.float32), reference) == []
    sharded = _transformers(_save(tiny_model(layers=3, seed=1), tmp_path / "s", max_shard_size="20KB"))
    assert _differences(sharded, _transformers(directory, dtype=torch.float32)) != []


def test_the_file_the_config_names_is_the_one_read(tmp_path):
    directory = _save(tiny_model(layers=3, seed=1), tmp_path / "m")
    save_file(
        {k: v.contiguous() for k, v in tiny_model(layers=3, seed=2).state_dict().items()},
        directory / "other.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, transformers_weights="other.safetensors")))
    reference = _both_equal_transformers(directory, dtype=torch.float32)
    default = load_file(directory / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(reference.model.embed_tokens.weight, default)  # control: the named file was read


def test_a_named_file_that_is_a_symlink_as_in_the_hubs_cache_is_read(tmp_path):
    """The hub's snapshots hold symlinks to blobs outside the snapshot directory."""
    directory = _save(tiny_model(layers=2, seed=1), tmp_path / "m")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (directory / "model.safetensors").rename(blobs / "abc123")
    (directory / "model.safetensors").symlink_to(blobs / "abc123")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, transformers_weights="model.safetensors")))
    _both_equal_transformers(directory, dtype=torch.float32)


@pytest.mark.parametrize("name", ["../elsewhere.safetensors", "weights.bin", "absent.safetensors.index.json"])
def test_a_config_naming_a_file_outside_the_directory_or_not_safetensors_is_refused(tmp_path, name):
    directory = save_tiny(tmp_path / "m", layers=2)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, transformers_weights=name)))
    with pytest.raises(layerstream.LoadingError, match="transformers_weights"):
        layerstream.from_pretrained(directory, stream=CPU)


def test_auto_on_a_config_without_a_dtype_takes_the_first_floating_tensor_by_name(tmp_path):
    """The file's header lists float32 norms first (safetensors orders by dtype width);
    transformers takes the first by name (lm_head, bfloat16)."""
    directory = save_tiny(tmp_path / "m", layers=2, dtype=torch.bfloat16)
    tensors = load_file(directory / "model.safetensors")
    tensors = {k: v.float() if "norm" in k else v for k, v in tensors.items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (directory / "config.json").write_text(json.dumps(config))
    reference = _both_equal_transformers(directory, dtype="auto")
    assert reference.lm_head.weight.dtype == torch.bfloat16
    assert layerstream.from_pretrained(directory, stream=CPU).lm_head.weight.dtype == torch.bfloat16


def test_a_tied_config_over_a_checkpoint_with_its_own_head_keeps_that_head(tmp_path, caplog):
    """transformers ties only a head the checkpoint lacks or holds equal to the embedding,
    and warns otherwise; a head the loader overwrote would train another model."""
    directory = _save(tiny_model(layers=2, tie_word_embeddings=True), tmp_path / "m")
    tensors = load_file(directory / "model.safetensors")
    torch.manual_seed(3)
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    reference = _both_equal_transformers(directory, dtype=torch.float32)
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight
    model = layerstream.from_pretrained(directory, stream=CPU, dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    # the usual case still ties: a checkpoint without the head
    tied = _save(tiny_model(layers=2, tie_word_embeddings=True), tmp_path / "tied")
    model = layerstream.from_pretrained(tied, stream=CPU, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_float16_keeps_the_weights_transformers_keeps_in_float32(tmp_path):
    """gpt-oss keeps its norms in float32 under float16 (``_keep_in_fp32_modules``)."""
    config = tiny_config("gpt_oss", 2, hidden_size=64, intermediate_size=64, head_dim=16, num_local_experts=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)  # not the ones that any dtype holds exactly
    directory = _save(model, tmp_path / "m")
    reference = _both_equal_transformers(directory, dtype=torch.float16)
    kept = {name for name, t in _tensors(reference).items() if t.dtype == torch.float32}
    assert kept and all("norm" in name for name in kept)


@pytest.mark.parametrize("argument", ["variant", "subfolder", "use_safetensors"])
def test_launcher_arguments_that_pick_other_files_load_those_through_transformers(tmp_path, argument, caplog):
    first, second = tiny_model(layers=2, seed=1), tiny_model(layers=2, seed=2)
    directory = _save(first, tmp_path / "m")
    if argument == "variant":
        _save(second, tmp_path / "v", variant="v2")
        (tmp_path / "v" / "model.v2.safetensors").rename(directory / "model.v2.safetensors")
        kwargs = {"variant": "v2"}
    elif argument == "subfolder":
        _save(second, directory / "sub")
        kwargs = {"subfolder": "sub"}
    else:
        torch.save(second.state_dict(), directory / "pytorch_model.bin")
        kwargs = {"use_safetensors": False}
    reference = _transformers(directory, dtype=torch.float32, **kwargs)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        model = _launcher(directory, dtype=torch.float32, **kwargs)
    assert _differences(model, reference) == []
    assert f"{argument}=" in caplog.text and "transformers loads it into host memory" in caplog.text
    # control: the default files hold other weights
    assert _differences(_transformers(directory, dtype=torch.float32), reference) != []


def test_the_fallback_names_the_whole_first_sentence_of_why():
    message = "/models/a.b holds only pickle weights (pytorch_model.bin). layerstream reads safetensors."
    assert autoload.first_sentence(message) == "/models/a.b holds only pickle weights (pytorch_model.bin)"
