"""layerstream.from_pretrained checks the whole checkpoint before it loads any layer: a
missing or damaged shard, a tensor of the wrong shape or kind, a pre-quantised checkpoint
and a local path that does not exist are refused with the file (and tensor) named, and
nothing has been loaded or quantised by then."""

import json
import re
import struct

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import layerstream
from layerstream import loading
from layerstream.checkpoints import files as checkpoint_files
from layerstream.checkpoints import reader as tensor_reader
from layerstream.checkpoints import stored as checkpoint

from tiny import save_tiny, tiny_model

CPU = layerstream.StreamConfig(device="cpu", slots=2)
LAST_LAYER_TENSOR = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture
def loads(monkeypatch):
    """Every module load and layer quantisation from_pretrained starts, in order."""
    calls = []
    real_load, real_quantise = loading._load_module, loading.nf4.quantise_layer

    def load(module, prefix, *args, **kwargs):
        calls.append(prefix)
        return real_load(module, prefix, *args, **kwargs)

    def quantise(*args, **kwargs):
        calls.append("quantise")
        return real_quantise(*args, **kwargs)

    monkeypatch.setattr(loading, "_load_module", load)
    monkeypatch.setattr(loading.nf4, "quantise_layer", quantise)
    return calls


def _shard_of(directory, name):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def _split(path):
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _join(path, header, data):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _replace_tensor(directory, name, value):
    shard = _shard_of(directory, name)
    tensors = load_file(shard)
    tensors[name] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _refused(directory, loads, match, **kwargs):
    with pytest.raises(layerstream.LoadingError, match=match) as refusal:
        layerstream.from_pretrained(directory, stream=CPU, **kwargs)
    assert loads == [], f"modules were loaded before the refusal: {loads}"
    return str(refusal.value)


def test_a_missing_shard_is_refused_before_any_layer_loads(sharded_checkpoint, loads):
    shard = _shard_of(sharded_checkpoint, LAST_LAYER_TENSOR)
    shard.unlink()
    _refused(
        sharded_checkpoint, loads, rf"{shard.name} holds \d+ tensors .* but is not in .*download the missing shard"
    )


def test_a_truncated_shard_is_refused_before_any_layer_loads(sharded_checkpoint, loads):
    shard = _shard_of(sharded_checkpoint, LAST_LAYER_TENSOR)
    shard.write_bytes(shard.read_bytes()[:-10])
    _refused(sharded_checkpoint, loads, rf"{shard.name} is truncated: .*download or save the checkpoint again")


def test_a_shard_cut_inside_its_header_is_refused(sharded_checkpoint, loads):
    shard = _shard_of(sharded_checkpoint, LAST_LAYER_TENSOR)
    shard.write_bytes(shard.read_bytes()[:40])
    _refused(sharded_checkpoint, loads, rf"{shard.name} is truncated or not a safetensors file")


def test_a_shard_header_that_is_not_json_is_refused_before_any_layer_loads(sharded_checkpoint, loads):
    shard = _shard_of(sharded_checkpoint, LAST_LAYER_TENSOR)
    raw = bytearray(shard.read_bytes())
    raw[8] = ord("#")  # the header's opening brace
    shard.write_bytes(bytes(raw))
    _refused(sharded_checkpoint, loads, rf"{shard.name}: the safetensors header is not valid JSON")


def test_data_offsets_that_disagree_with_dtype_and_shape_are_refused_naming_the_tensor(sharded_checkpoint, loads):
    shard = _shard_of(sharded_checkpoint, LAST_LAYER_TENSOR)
    header, data = _split(shard)
    header[LAST_LAYER_TENSOR]["shape"] = [64, 64]  # stored [64, 128] bf16: half the bytes the offsets span
    _join(shard, header, data)
    _refused(
        sharded_checkpoint,
        loads,
        rf"{shard.name}: tensor {LAST_LAYER_TENSOR} has data_offsets .* BF16 x \[64, 64\] "
        r"needs 8192 bytes",
    )


def test_a_shard_with_bytes_after_its_last_tensor_is_refused_as_safetensors_would(sharded_checkpoint, loads):
    shard = _shard_of(sharded_checkpoint, LAST_LAYER_TENSOR)
    shard.write_bytes(shard.read_bytes() + b"\0" * 16)
    _refused(sharded_checkpoint, loads, rf"{shard.name} has 16 bytes after its last tensor")


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_refused(sharded_checkpoint, loads):
    index_path = sharded_checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    right = index["weight_map"][LAST_LAYER_TENSOR]
    wrong = next(file for file in index["weight_map"].values() if file != right)
    index["weight_map"][LAST_LAYER_TENSOR] = wrong
    index_path.write_text(json.dumps(index))
    _refused(sharded_checkpoint, loads, rf"the index puts {LAST_LAYER_TENSOR} in .*{wrong}, which does not hold it")


@pytest.mark.parametrize(
    "content, problem",
    [("{not json", "is not valid JSON"), ('{"metadata": {}}', "has no weight_map")],
    ids=["not-json", "no-weight-map"],
)
def test_a_broken_index_is_refused_naming_the_index(sharded_checkpoint, loads, content, problem):
    (sharded_checkpoint / "model.safetensors.index.json").write_text(content)
    _refused(
        sharded_checkpoint, loads, rf"model.safetensors.index.json {problem}.*download or save the checkpoint again"
    )


@pytest.mark.parametrize("quantization", [None, "nf4"])
@pytest.mark.parametrize(
    "name, stored",
    [("model.layers.3.self_attn.q_proj.weight", [1, 64]), ("model.layers.3.input_layernorm.weight", [1])],
    ids=["projection-1x64", "norm-1"],
)
def test_a_broadcastable_wrong_shape_is_refused_before_any_layer_loads(
    sharded_checkpoint, loads, name, stored, quantization
):
    """copy_ would broadcast these into every row; transformers refuses the same files.
    With NF4 the meta model's Linear4bit weights keep the unquantised [out, in] shape."""
    expected = list(load_file(_shard_of(sharded_checkpoint, name))[name].shape)
    shard = _replace_tensor(sharded_checkpoint, name, torch.ones(stored, dtype=torch.bfloat16))
    _refused(
        sharded_checkpoint,
        loads,
        re.escape(f"{name} in {shard.name} has shape {stored}, the model expects {expected}") + ".*config.json",
        quantization=quantization,
    )


def test_copy_into_refuses_a_shape_it_would_broadcast():
    target = torch.zeros(4, 4)
    with pytest.raises(
        layerstream.LoadingError,
        match=r"q.weight in shard.safetensors has shape \[1, 4\], "
        r"the model expects \[4, 4\]",
    ):
        tensor_reader.copy_into(target, torch.ones(1, 4), "q.weight", "shard.safetensors")
    assert not target.any(), "nothing may have been copied"


def test_floating_tensors_stored_in_another_floating_dtype_are_cast_as_transformers_does(tmp_path, loads):
    save_tiny(tmp_path, layers=2, dtype=torch.float32)
    streamed = layerstream.from_pretrained(tmp_path, torch_dtype=torch.bfloat16, stream=CPU)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loads, "the load went through from_pretrained's module loads"
    for name, value in reference.state_dict().items():
        assert torch.equal(streamed.state_dict()[name], value), name


def test_an_integer_tensor_for_a_floating_parameter_is_refused_naming_both_dtypes(sharded_checkpoint, loads):
    name = "model.layers.3.post_attention_layernorm.weight"
    shard = _replace_tensor(sharded_checkpoint, name, torch.ones(64, dtype=torch.int64))
    _refused(
        sharded_checkpoint,
        loads,
        rf"{name} in {shard.name} is stored as I64, the model expects a floating-point "
        r"tensor \(bfloat16\)",
    )


def test_a_floating_tensor_for_an_integer_buffer_is_refused(tmp_path):
    shard = tmp_path / "model.safetensors"
    save_file({"step": torch.zeros(3)}, shard)
    expected = {"step": torch.empty(3, dtype=torch.int64, device="meta")}
    with pytest.raises(
        layerstream.LoadingError,
        match=r"step in model.safetensors is stored as F32, the model "
        r"expects a non-floating tensor \(int64\)",
    ):
        checkpoint.validate_checkpoint(tmp_path, {"step": shard}, expected)


@pytest.mark.parametrize("stored", [torch.int8, torch.int32])
def test_an_integer_tensor_of_a_dtype_the_models_cannot_hold_is_refused(tmp_path, stored):
    """An MXFP4 scale is an unsigned exponent: stored signed (or wider) and copied into the
    model's uint8 buffer it would mean another exponent than transformers reads from it.
    Control: the same tensor as uint8 is accepted."""
    shard = tmp_path / "model.safetensors"
    expected = {"scales": torch.empty(3, dtype=torch.uint8, device="meta")}
    save_file({"scales": torch.tensor([120, 128, 130]).to(stored)}, shard)
    name = {torch.int8: "I8", torch.int32: "I32"}[stored]
    with pytest.raises(
        layerstream.LoadingError, match=rf"scales in model.safetensors is stored as {name}, the model expects uint8"
    ):
        checkpoint.validate_checkpoint(tmp_path, {"scales": shard}, expected)
    save_file({"scales": torch.tensor([120, 128, 130], dtype=torch.uint8)}, shard)
    checkpoint.validate_checkpoint(tmp_path, {"scales": shard}, expected)


@pytest.mark.parametrize("stored", [torch.int32, torch.uint8, torch.bool])
def test_an_integer_tensor_widened_into_the_models_dtype_loads(tmp_path, stored):
    """A table stored as int32 for the model's int64 buffer (DeepSeek-V4's token-to-expert
    map, as ports write it) keeps every value when widened, as transformers loads it."""
    shard = tmp_path / "model.safetensors"
    save_file({"table": torch.tensor([0, 1, 1]).to(stored)}, shard)
    checkpoint.validate_checkpoint(
        tmp_path, {"table": shard}, {"table": torch.empty(3, dtype=torch.int64, device="meta")}
    )


def test_all_missing_tensors_are_listed_before_any_layer_loads(sharded_checkpoint, loads):
    index_path = sharded_checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = sorted(k for k in index["weight_map"] if k.startswith("model.layers.3."))
    assert len(dropped) > 5
    for name in dropped:
        del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    message = _refused(
        sharded_checkpoint, loads, rf"{len(dropped)} tensors were not found in .* and {len(dropped) - 5} more"
    )
    assert sum(name in message for name in dropped) == 5


def test_a_head_tied_to_the_embeddings_may_be_absent(tmp_path, loads):
    save_tiny(tmp_path, layers=2, dtype=torch.bfloat16, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = layerstream.from_pretrained(tmp_path, stream=CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture
def prequantized(tmp_path):
    base, quantised = tmp_path / "base", tmp_path / "nf4"
    save_tiny(base, layers=2, dtype=torch.bfloat16, wide=True)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(
        base, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
    ).save_pretrained(quantised)
    return quantised


@pytest.mark.parametrize("quantization", [None, "nf4"])
def test_a_prequantised_checkpoint_is_refused_with_what_to_load_instead(prequantized, loads, quantization):
    _refused(
        prequantized,
        loads,
        r"pre-quantised checkpoint \(config.json has a quantization_config "
        r"\(bitsandbytes\)\); pre-quantised checkpoints other than MXFP4 \(gpt-oss, kept packed or "
        r"dequantised\) are not read by layerstream's loader: load the unquantised checkpoint with quantization='nf4'",
        quantization=quantization,
    )


def test_a_checkpoint_quantised_otherwise_than_mxfp4_is_refused_with_the_route_through_transformers(tmp_path, loads):
    """MXFP4 alone is read (tests/checkpoints/test_mxfp4.py, tests/modules/test_packed_experts.py); a checkpoint
    quantised by another method (here transformers' FP8) is refused, naming the method and
    the way that loads it (transformers on the host, then streamed; the launcher's fallback)."""
    save_tiny(tmp_path, layers=2, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    match = r"quantization_config \(fp8\)\); pre-quantised checkpoints other than MXFP4"
    with pytest.raises(layerstream.LoadingError, match=match) as refusal:
        layerstream.from_pretrained(tmp_path, stream=CPU)
    assert loads == [], f"modules were loaded before the refusal: {loads}"
    said = str(refusal.value)
    assert "device_map='cpu'" in said and "layerstream.stream_model" in said and "layerstream run" in said
    assert refusal.value.transformers_can_load, "the launcher loads it through transformers on the host"


def test_quant_state_tensors_mark_a_checkpoint_prequantised_without_a_quantization_config(prequantized, loads):
    config = json.loads((prequantized / "config.json").read_text())
    del config["quantization_config"]
    (prequantized / "config.json").write_text(json.dumps(config))
    files = checkpoint_files.weight_files(prequantized)
    assert checkpoint.is_prequantized(prequantized, files)
    base = prequantized.parent / "base"
    assert not checkpoint.is_prequantized(base, checkpoint_files.weight_files(base))
    _refused(prequantized, loads, r"it holds quantisation state such as .*\.weight\.(absmax|quant_map|quant_state)")


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub.snapshot_download, recorded instead of called."""
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kwargs: calls.append(repo_id))
    return calls


@pytest.mark.parametrize(
    "model_id",
    [
        "/no/such/model",
        "./no-such-model",
        "../no-such-model",
        "~/no-such-model",
        "models\\llama",
        "org/name/extra",
        "models/no-such-model",
    ],
)
def test_a_local_looking_path_that_does_not_exist_is_not_sent_to_the_hub(tmp_path, monkeypatch, hub, model_id):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # a local directory: models/<name> is a path, not a hub id
    with pytest.raises(
        layerstream.LoadingError,
        match=r"no such directory: .*; pass a directory that holds "
        r"config.json and the weights, or a hub id like org/name",
    ):
        layerstream.from_pretrained(model_id, stream=CPU)
    assert hub == []


def test_a_path_object_that_does_not_exist_is_not_sent_to_the_hub(tmp_path, hub):
    with pytest.raises(layerstream.LoadingError, match="no such directory"):
        layerstream.from_pretrained(tmp_path / "org" / "name", stream=CPU)
    assert hub == []


def test_a_hub_id_is_still_resolved_on_the_hub(tmp_path, monkeypatch, hub):
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "snapshot"
    save_tiny(directory, layers=2, dtype=torch.bfloat16)
    import huggingface_hub

    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo_id, **kwargs: hub.append(repo_id) or str(directory)
    )
    assert layerstream.is_streamed(layerstream.from_pretrained("org/name", stream=CPU))
    assert hub == ["org/name"]


def test_a_tensor_that_fails_to_read_during_the_load_is_named_with_its_file(sharded_checkpoint, loads, monkeypatch):
    import safetensors

    real_open = safetensors.safe_open

    class FailingHandle:
        def __init__(self, path, **kwargs):
            self.handle = real_open(path, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            if name == LAST_LAYER_TENSOR:
                raise SafetensorError("simulated read failure")
            return self.handle.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", FailingHandle)
    shard = _shard_of(sharded_checkpoint, LAST_LAYER_TENSOR)
    with pytest.raises(
        layerstream.LoadingError,
        match=rf"{LAST_LAYER_TENSOR} in .*{shard.name} cannot be read "
        r"\(simulated read failure\)",
    ):
        layerstream.from_pretrained(sharded_checkpoint, stream=CPU)
    assert "model.layers.3." in loads, "the failure came while loading the last layer"


def test_validation_reads_each_header_once_and_no_tensor_data(sharded_checkpoint, monkeypatch):
    import safetensors

    def no_tensor_data(*args, **kwargs):
        raise AssertionError("validation opened a file for its tensor data")

    headers = []
    real_read_header = checkpoint.read_header
    monkeypatch.setattr(checkpoint, "read_header", lambda path: headers.append(path.name) or real_read_header(path))
    monkeypatch.setattr(safetensors, "safe_open", no_tensor_data)
    monkeypatch.setattr(torch, "load", no_tensor_data)

    class Validated(Exception):
        pass

    def stop(*args, **kwargs):  # the step right after validation
        raise Validated

    monkeypatch.setattr(loading, "_check_host_memory", stop)
    with pytest.raises(Validated):
        layerstream.from_pretrained(sharded_checkpoint, stream=CPU)
    assert sorted(headers) == sorted(p.name for p in sharded_checkpoint.glob("*.safetensors"))


def test_a_wrong_shape_in_a_pickle_checkpoint_is_refused_before_any_layer_loads(tmp_path, loads):
    model = tiny_model("llama", layers=3, dtype=torch.bfloat16)
    model.config.save_pretrained(tmp_path)
    state = model.state_dict()
    name = "model.layers.2.self_attn.k_proj.weight"
    state[name] = torch.ones(1, state[name].shape[1], dtype=torch.bfloat16)
    torch.save(state, tmp_path / "pytorch_model.bin")
    _refused(
        tmp_path,
        loads,
        rf"{name} in pytorch_model.bin has shape \[1, 32\], the model expects \[16, 32\]",
        allow_pickle=True,
    )


def test_a_hub_download_takes_the_top_level_weights_not_a_subfolders_copy(monkeypatch, tmp_path):
    """gpt-oss's repositories hold a second copy of the weights under original/: the loader
    reads the top level only, so the download leaves subfolders out (by the hub's own filter)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    asked = {}

    def record(repo_id, **kwargs):
        asked.update(kwargs)
        raise RuntimeError("recorded")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", record)
    with pytest.raises(RuntimeError, match="recorded"):
        checkpoint_files.resolve("some-org/some-model", None)
    files = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    subfolder = ["original/model.safetensors", "original/config.json", "metal/model.bin"]
    kept = list(
        filter_repo_objects(
            files + subfolder, allow_patterns=asked["allow_patterns"], ignore_patterns=asked["ignore_patterns"]
        )
    )
    assert kept == files
    everything = list(filter_repo_objects(files + subfolder, allow_patterns=asked["allow_patterns"]))
    assert "original/model.safetensors" in everything, "the control: the allow patterns alone take it"
