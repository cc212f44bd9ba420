"""Under auto-streaming, the from_pretrained calls scripts make load through layerstream's
loader: decoder layers straight into the host store, NF4 per layer when the script's
BitsAndBytesConfig asks for 4-bit, the resident part where the script's device_map says,
and a model that behaves as the plain one for what the script does next."""

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, GptOssForCausalLM, LlamaForCausalLM

import layerstream
from layerstream import data as embedded
from layerstream.commands import cli
from layerstream.integrations import autoload, launch

from tiny import assert_traces_equal, batch, lora_config, portable_cpu_nf4, save_mxfp4_gpt_oss, train_steps

NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.fixture
def checkpoint(tmp_path):
    return embedded.write_checkpoint(tmp_path / "ckpt", layers=4, hidden_size=64)


@pytest.fixture
def streaming():
    launch.enable({"slots": 2, "device": "cpu"})
    yield
    launch.disable()


@pytest.fixture
def transformers_never_loads(monkeypatch):
    """Fails the test if transformers' own loader materialises the model."""

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' own from_pretrained loaded the whole model")

    monkeypatch.setattr(autoload, "_plain", refuse)


def _plain(path, cls=LlamaForCausalLM, **kwargs):
    """The model as transformers alone loads it (the reference)."""
    from transformers import PreTrainedModel

    original = autoload._original or PreTrainedModel.__dict__["from_pretrained"]
    return original.__func__(cls, path, **kwargs)


def _logits(model):
    ids = batch(259)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("device_map", [None, "cpu", "auto", {"": "cpu"}])
def test_a_device_map_load_becomes_a_streamed_model(checkpoint, streaming, transformers_never_loads, device_map):
    plain_reference = _plain(checkpoint, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device_map=device_map)
    assert layerstream.is_streamed(model) and type(model).__name__ == "LlamaForCausalLM"
    if device_map is None:
        assert not hasattr(model, "hf_device_map")
    else:
        assert model.hf_device_map == {"": "cpu"}
    assert torch.equal(_logits(model), _logits(plain_reference))


def test_the_architecture_class_of_the_config_is_what_loads(checkpoint, streaming, transformers_never_loads):
    from trl.trainer.utils import create_model_from_path

    model = create_model_from_path(str(checkpoint))  # what TRL's trainers call with a model name
    assert layerstream.is_streamed(model) and model.dtype == torch.float32


def test_a_4bit_bitsandbytes_config_loads_nf4_per_layer_like_transformers(
    checkpoint, streaming, transformers_never_loads
):
    from peft import get_peft_model
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=NF4, dtype=torch.bfloat16, device_map={"": "cpu"}
    )
    assert layerstream.is_streamed(model) and model.is_loaded_in_4bit
    reference = portable_cpu_nf4(_plain(checkpoint, quantization_config=NF4, dtype=torch.bfloat16, device_map="cpu"))
    streamed_state, reference_state = model.state_dict(), reference.state_dict()
    assert streamed_state.keys() == reference_state.keys()
    for name, value in reference_state.items():
        assert torch.equal(streamed_state[name], value), name
    peft_model = get_peft_model(model, lora_config())
    assert any(isinstance(m, LoraLinear4bit) for m in peft_model.modules())
    resident = get_peft_model(reference, lora_config())
    resident.load_state_dict({k: v for k, v in peft_model.state_dict().items() if "lora_" in k}, strict=False)
    assert_traces_equal(train_steps(peft_model, 2), train_steps(resident, 2))


@pytest.mark.parametrize(
    "quantization,match",
    [
        (BitsAndBytesConfig(load_in_8bit=True), "not 8-bit"),
        (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"), "NF4 only"),
        ({"quant_method": "gptq", "bits": 4}, "GPTQ|gptq|streams unquantised weights"),
    ],
)
def test_quantisers_other_than_nf4_are_refused_by_name(checkpoint, streaming, quantization, match):
    with pytest.raises((layerstream.LoadingError, ValueError), match=match):
        AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization)


def test_a_saved_adapter_loads_on_the_streamed_base(checkpoint, tmp_path, streaming):
    from peft import AutoPeftModelForCausalLM, get_peft_model

    adapter_dir = tmp_path / "adapter"
    plain = _plain(checkpoint, dtype=torch.float32)
    get_peft_model(plain, lora_config()).save_pretrained(adapter_dir)
    streamed = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32)
    assert layerstream.is_streamed(streamed)
    launch.disable()
    resident = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32)
    assert torch.equal(_logits(streamed), _logits(resident))


@pytest.mark.parametrize("kind", ["pickle-only", "pre-quantised"])
def test_what_the_loader_cannot_read_loads_through_transformers_on_the_host(checkpoint, tmp_path, kind, caplog):
    other = tmp_path / kind
    cls = LlamaForCausalLM
    if kind == "pickle-only":
        import shutil

        other.mkdir()
        shutil.copy(checkpoint / "config.json", other / "config.json")
        torch.save(_plain(checkpoint, dtype=torch.float32).state_dict(), other / "pytorch_model.bin")
    else:
        _plain(checkpoint, quantization_config=NF4, dtype=torch.bfloat16, device_map="cpu").save_pretrained(other)
    launch.enable({"slots": 2, "device": "cpu"})
    try:
        with caplog.at_level("WARNING", logger="layerstream"):
            model = AutoModelForCausalLM.from_pretrained(other, device_map="auto")
    finally:
        launch.disable()
    assert layerstream.is_streamed(model) and model.hf_device_map == {"": "cpu"}
    assert "transformers loads it into host memory" in caplog.text
    reference = _plain(other, cls, device_map="cpu")
    if kind == "pre-quantised":
        portable_cpu_nf4(reference)
    assert torch.equal(_logits(model), _logits(reference))


MXFP4_SCRIPT = """
import sys

import torch
from transformers import AutoModelForCausalLM, Mxfp4Config

import layerstream

extra = {"quantization_config": Mxfp4Config(dequantize=True)} if sys.argv[3] == "mxfp4-config" else {}
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="auto", **extra)
with torch.no_grad():
    logits = model(input_ids=torch.arange(3, 15).reshape(1, 12)).logits
torch.save({"streamed": layerstream.is_streamed(model), "logits": logits}, sys.argv[2])
"""


@pytest.mark.parametrize("script_passes", ["nothing", "mxfp4-config"])
def test_layerstream_run_loads_an_mxfp4_checkpoint_through_its_loader(
    tmp_path, transformers_never_loads, caplog, script_passes
):
    """gpt-oss as published, under `layerstream run`: the script's from_pretrained (with no
    quantization_config, or the Mxfp4Config(dequantize=True) gpt-oss recipes pass) is
    answered by layerstream's loader, layer by layer, never by transformers on the host, and
    the model gives transformers' dequantised model's logits."""
    checkpoint = save_mxfp4_gpt_oss(tmp_path / "gpt-oss")
    script, out = tmp_path / "load.py", tmp_path / "out.pt"
    script.write_text(MXFP4_SCRIPT)
    try:
        with caplog.at_level("WARNING", logger="layerstream"):
            assert (
                cli.main(
                    ["run", "--slots", "2", "--device", "cpu", str(script), str(checkpoint), str(out), script_passes]
                )
                == 0
            )
    finally:
        launch.disable()
    got = torch.load(out)
    assert got["streamed"]
    assert "stores its experts in MXFP4" in caplog.text
    assert "transformers loads it into host memory" not in caplog.text
    reference = _plain(checkpoint, GptOssForCausalLM, dtype=torch.bfloat16)  # dequantised by transformers
    with torch.no_grad():
        expected = reference(input_ids=torch.arange(3, 15).reshape(1, 12)).logits
    assert torch.equal(got["logits"], expected)


def test_an_experts_implementation_the_script_asks_for_loads_through_the_loader(
    tmp_path, streaming, transformers_never_loads
):
    """``experts_implementation``, which transformers' from_pretrained takes, is the loader's
    to pass on as well: the script's model is streamed, computes with what it asked for, and
    gives the logits transformers' model with the same setting gives."""
    checkpoint = save_mxfp4_gpt_oss(tmp_path / "gpt-oss")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, experts_implementation="eager")
    assert layerstream.is_streamed(model) and model.config._experts_implementation == "eager"
    reference = _plain(checkpoint, GptOssForCausalLM, dtype=torch.bfloat16, experts_implementation="eager")
    ids = torch.arange(3, 15).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_models_other_than_causal_lms_and_calls_without_auto_streaming_load_plainly(checkpoint, streaming):
    from transformers import AutoModel

    assert not layerstream.is_streamed(AutoModel.from_pretrained(checkpoint))
    launch.disable()
    assert not layerstream.is_streamed(AutoModelForCausalLM.from_pretrained(checkpoint))


def test_from_pretrained_takes_dtype_as_transformers_spells_it(checkpoint):
    stream = layerstream.StreamConfig(device="cpu", slots=2)
    by_dtype = layerstream.from_pretrained(checkpoint, dtype=torch.float16, stream=stream)
    by_alias = layerstream.from_pretrained(checkpoint, torch_dtype=torch.float16, stream=stream)
    auto = layerstream.from_pretrained(checkpoint, dtype="auto", stream=stream)
    assert by_dtype.dtype == by_alias.dtype == torch.float16 and auto.dtype == torch.float32
    with pytest.raises(layerstream.LoadingError, match="disagree"):
        layerstream.from_pretrained(checkpoint, dtype=torch.float16, torch_dtype=torch.bfloat16, stream=stream)


@pytest.mark.gpu
@pytest.mark.parametrize("device_map", ["auto", {"": 0}, "cuda:0"])
@pytest.mark.parametrize("quantization", [None, NF4], ids=["bf16", "nf4"])
def test_on_a_gpu_the_resident_part_lands_where_the_device_map_says(checkpoint, device_map, quantization):
    launch.enable({"slots": 2})
    try:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, device_map=device_map, dtype=torch.bfloat16, quantization_config=quantization
        )
    finally:
        launch.disable()
    runtime = layerstream.get_runtime(model)
    assert runtime.device == torch.device("cuda", 0) and model.hf_device_map == {"": 0}
    assert model.get_input_embeddings().weight.device == torch.device("cuda", 0)
    assert all(v.device.type == "cpu" for r in runtime.records for v in r.host_values)
    reference = _plain(checkpoint, device_map={"": 0}, dtype=torch.bfloat16, quantization_config=quantization)
    ids = batch(259, device="cuda")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_the_device_a_map_asks_for_carries_its_index():
    """The Trainer reads hf_device_map and calls torch.device on it: a device without an
    index (Accelerate's own ``cuda``) must come back with one."""
    assert launch.device_of_map({"": 0}) == torch.device("cuda", 0)
    assert launch.device_of_map("cuda:1") == torch.device("cuda", 1)
    assert launch._as_device(torch.device("cuda")).index is not None
    assert launch.device_of_map(None) is None and launch.device_of_map("cpu") == torch.device("cpu")
