"""layerstream.from_pretrained loads local safetensors one layer at a time and gives the
same model transformers loads (4-bit or not), already streamed."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import layerstream

from tiny import assert_traces_equal, lora_config, portable_cpu_nf4, save_tiny, tiny_model, train_steps

CPU = layerstream.StreamConfig(device="cpu", slots=2)


def _reference_nf4(directory, nested):
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=nested,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return portable_cpu_nf4(
        AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
        )
    )


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "single-quant"])
def test_nf4_load_equals_transformers_4bit_load(sharded_checkpoint, nested):
    streamed = layerstream.from_pretrained(
        sharded_checkpoint, quantization="nf4", stream=CPU, bnb_4bit_use_double_quant=nested
    )
    reference = _reference_nf4(sharded_checkpoint, nested)
    assert layerstream.is_streamed(streamed) and streamed.is_loaded_in_4bit
    _same_state(streamed, reference)
    ids = torch.randint(3, 90, (2, 8))
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_nf4_load_keeps_projection_biases_in_the_load_dtype_as_transformers(tmp_path):
    """Qwen2's attention projections have biases: transformers' 4-bit load keeps them in the
    load dtype (bf16), not in the fp32 of bitsandbytes' Linear4bit skeleton."""
    directory = save_tiny(tmp_path, "qwen2", layers=2, dtype=torch.bfloat16, wide=True)
    streamed = layerstream.from_pretrained(directory, quantization="nf4", dtype=torch.bfloat16, stream=CPU)
    assert streamed.model.layers[0].self_attn.q_proj.bias.dtype == torch.bfloat16
    reference = _reference_nf4(directory, True)
    sa, sb = streamed.state_dict(), reference.state_dict()
    assert list(sa) == list(sb)
    assert [k for k in sb if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])] == []


def test_qlora_on_a_loaded_model_matches_resident(sharded_checkpoint):
    streamed = get_peft_model(
        layerstream.from_pretrained(sharded_checkpoint, quantization="nf4", stream=CPU), lora_config()
    )
    resident = get_peft_model(_reference_nf4(sharded_checkpoint, True), lora_config())
    streamed.load_state_dict({k: v for k, v in resident.state_dict().items() if "lora_" in k}, strict=False)
    assert any(type(m).__name__ == "Linear4bit" and hasattr(m, "lora_A") for m in streamed.modules())
    assert_traces_equal(train_steps(streamed, 10), train_steps(resident, 10))


def test_unquantised_load_equals_transformers_load(sharded_checkpoint):
    streamed = layerstream.from_pretrained(sharded_checkpoint, torch_dtype=torch.bfloat16, stream=CPU)
    reference = AutoModelForCausalLM.from_pretrained(sharded_checkpoint, dtype=torch.bfloat16)
    _same_state(streamed, reference)
    ids = torch.randint(3, 90, (2, 8))
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_pickle_only_checkpoints_are_refused(tmp_path):
    model = tiny_model("llama", layers=2)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(layerstream.LoadingError, match="pickle weights.*safetensors by default.*allow_pickle=True"):
        layerstream.from_pretrained(tmp_path, stream=CPU)


def test_pickle_checkpoints_load_when_the_user_opts_in(tmp_path, caplog):
    model = tiny_model("llama", layers=3, dtype=torch.bfloat16)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with caplog.at_level("WARNING", logger="layerstream"):
        streamed = layerstream.from_pretrained(tmp_path, stream=CPU, allow_pickle=True)
    assert "allow_pickle=True" in caplog.text and "weights_only=True" in caplog.text
    _same_state(streamed, model)


def test_remote_code_needs_trust(tmp_path, sharded_checkpoint):
    config = json.loads((sharded_checkpoint / "config.json").read_text())
    config["model_type"] = "layerstream_test_custom"  # unknown to transformers: only remote code has it
    config["auto_map"] = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomModel",
    }
    (sharded_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        layerstream.from_pretrained(sharded_checkpoint, stream=CPU)


def test_missing_tensors_are_reported(sharded_checkpoint):
    index = json.loads((sharded_checkpoint / "model.safetensors.index.json").read_text())
    dropped = next(k for k in index["weight_map"] if "layers.3.mlp" in k)
    del index["weight_map"][dropped]
    (sharded_checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(layerstream.LoadingError, match="not found"):
        layerstream.from_pretrained(sharded_checkpoint, stream=CPU)


PEAK_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time, torch, layerstream
    import transformers, peft, bitsandbytes  # imports are not loading
    page = os.sysconf("SC_PAGE_SIZE")
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20
    peak, done = [0.0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.002)
    # warm up on a small checkpoint: lazy imports and allocator pools are not loading
    layerstream.from_pretrained(sys.argv[2], quantization="nf4",
                                stream=layerstream.StreamConfig(device="cpu", slots=2))
    before = rss_mib()
    sampler = threading.Thread(target=sample); sampler.start()
    model = layerstream.from_pretrained(sys.argv[1], quantization="nf4",
                                        stream=layerstream.StreamConfig(device="cpu", slots=2))
    done.set(); sampler.join()
    store = layerstream.get_runtime(model).store.host_bytes / 2**20
    print(before, max(peak[0], rss_mib()), store)
""")


def test_loading_holds_about_one_unquantised_layer(tmp_path):
    """Peak RSS while loading a 24-layer model stays near the packed store plus one bf16
    layer, far below the whole unquantised model (measured in a fresh process)."""
    directory = tmp_path / "big"
    layers, hidden, intermediate = 24, 1024, 2816
    save_tiny(
        directory,
        layers=layers,
        dtype=torch.bfloat16,
        hidden_size=hidden,
        intermediate_size=intermediate,
        head_dim=64,
        num_attention_heads=16,
        num_key_value_heads=16,
    )
    layer_mib = (4 * hidden * hidden + 3 * hidden * intermediate) * 2 / 2**20
    whole_mib = layers * layer_mib
    warm = tmp_path / "warm"
    save_tiny(warm, layers=2, dtype=torch.bfloat16, wide=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(directory), str(warm)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, peak, store = (float(x) for x in out.stdout.split()[-3:])
    grown = peak - before
    # the store, one layer and its quantisation scratch, and slack for the host allocator:
    # RSS growth of the same load varies by about 40 MiB from run to run
    bound = store + 3 * layer_mib + 128
    assert bound < 0.75 * whole_mib, "the model must be large enough for the bound to mean something"
    print(f"grew {grown:.0f} MiB, bound {bound:.0f}, store {store:.0f}, whole {whole_mib:.0f}")
    assert grown < bound, f"loading grew RSS by {grown:.0f} MiB; bound {bound:.0f} MiB (whole model {whole_mib:.0f})"


def test_trainer_accepts_a_loaded_4bit_model_with_adapters(sharded_checkpoint, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(
        layerstream.from_pretrained(sharded_checkpoint, quantization="nf4", stream=CPU), lora_config()
    )
    rows = [{"input_ids": list(range(3, 13)), "labels": list(range(3, 13))} for _ in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_equal_layers_fill_their_arenas_without_gaps(sharded_checkpoint):
    store = layerstream.get_runtime(
        layerstream.from_pretrained(
            sharded_checkpoint, stream=layerstream.StreamConfig(device="cpu", slots=2, arena_bytes=1 << 20)
        )
    ).store
    assert store.host_bytes == sum(r.nbytes for r in store.records)


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "single-quant"])
def test_nf4_load_on_the_gpu_equals_transformers_4bit_load(tmp_path, nested):
    """With a GPU the loader quantises there, one layer at a time: the packed bytes equal
    what transformers loads onto the GPU, and the device never holds the whole model."""
    directory = tmp_path / "gpu-ckpt"
    layers, hidden, intermediate = 8, 512, 1408
    save_tiny(
        directory,
        layers=layers,
        dtype=torch.bfloat16,
        hidden_size=hidden,
        intermediate_size=intermediate,
        head_dim=64,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    streamed = layerstream.from_pretrained(
        directory,
        quantization="nf4",
        bnb_4bit_use_double_quant=nested,
        stream=layerstream.StreamConfig(device="cuda", slots=2),
    )
    peak = torch.cuda.max_memory_allocated() - base
    layer_bytes = (4 * hidden * hidden + 3 * hidden * intermediate) * 2
    # one bf16 layer being quantised, its packed result, and the slots
    assert peak < 3 * layer_bytes < layers * layer_bytes / 2, (
        f"loading peaked at {peak / 2**20:.1f} MiB on the GPU; one bf16 layer is {layer_bytes / 2**20:.1f} MiB"
    )
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=nested,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    reference = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=quant, dtype=torch.bfloat16, device_map="cuda:0"
    )
    sa, sb = streamed.state_dict(), reference.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key].cpu(), sb[key].cpu()), key
    streamed.to("cuda")
    ids = torch.randint(3, 90, (2, 8), device="cuda")
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, reference(input_ids=ids).logits)


# families whose checkpoints lack some buffer values (Gemma's embedding scale, rotary
# frequencies under other names) beside families that hold all of theirs
COMPUTED_BUFFER_FAMILIES = [
    "llama",
    "gemma",
    "gemma2",
    "gemma3_text",
    "vaultgemma",
    "phi3",
    "qwen3",
    "olmo2",
    "granite",
    "smollm3",
]


def _buffers_and_logits(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
    return {name: buffer.clone() for name, buffer in model.named_buffers()}, logits


@pytest.mark.parametrize("family", COMPUTED_BUFFER_FAMILIES)
def test_buffers_no_checkpoint_holds_get_the_values_transformers_gives_them(tmp_path, family):
    save_tiny(tmp_path, family, layers=3)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    streamed = layerstream.from_pretrained(tmp_path, stream=CPU)
    ids = torch.randint(3, 90, (2, 8))
    want, want_logits = _buffers_and_logits(reference, ids)
    got, got_logits = _buffers_and_logits(streamed, ids)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert torch.equal(got_logits, want_logits)


def test_a_loader_that_leaves_computed_buffers_unset_is_caught(tmp_path, monkeypatch):
    save_tiny(tmp_path, "gemma2", layers=3)

    def zeroed(modules, owners):
        for module in modules:
            for name in module._non_persistent_buffers_set:
                module._buffers[name].zero_()

    monkeypatch.setattr(layerstream.loading, "compute_buffers", zeroed)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    streamed = layerstream.from_pretrained(tmp_path, stream=CPU)
    ids = torch.randint(3, 90, (2, 8))
    want, want_logits = _buffers_and_logits(reference, ids)
    got, got_logits = _buffers_and_logits(streamed, ids)
    assert not torch.equal(got["model.embed_tokens.embed_scale"], want["model.embed_tokens.embed_scale"])
    assert not torch.equal(got_logits, want_logits)


def test_computing_buffers_never_writes_a_loaded_tensor():
    """An ``_init_weights`` that writes weights in place, unguarded, meets stand-ins."""
    from transformers import PreTrainedModel

    from layerstream.checkpoints.computed_buffers import compute_buffers

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.register_buffer("stats", torch.ones(4))
            self.register_buffer("scale", torch.zeros(()), persistent=False)

    class Owner(PreTrainedModel):
        def _init_weights(self, module):
            module.weight.data.fill_(7.0)
            module.stats.fill_(7.0)
            module.scale.fill_(2.0)

    module = Scaled()
    compute_buffers([module], {id(module): Owner.__new__(Owner)})
    assert torch.equal(module.weight.data, torch.ones(4)) and torch.equal(module.stats, torch.ones(4))
    assert module.scale.item() == 2.0 and not hasattr(module.scale, "_is_hf_initialized")


def test_from_pretrained_loads_the_checkpoints_own_dtype_by_default(tmp_path):
    save_tiny(tmp_path, layers=3, dtype=torch.float32)
    assert layerstream.from_pretrained(tmp_path, stream=CPU).dtype == torch.float32
    assert AutoModelForCausalLM.from_pretrained(tmp_path).dtype == torch.float32
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))  # no dtype in the config: the weights' own
    save_tiny(tmp_path / "half", layers=3, dtype=torch.float16)
    half = json.loads((tmp_path / "half" / "config.json").read_text())
    half.pop("dtype", None), half.pop("torch_dtype", None)
    (tmp_path / "half" / "config.json").write_text(json.dumps(half))
    assert layerstream.from_pretrained(tmp_path / "half", stream=CPU).dtype == torch.float16
    assert layerstream.from_pretrained(tmp_path / "half", stream=CPU, dtype=torch.bfloat16).dtype == torch.bfloat16


def _load_with_progress(checkpoint, capsys, **kwargs):
    capsys.readouterr()
    layerstream.from_pretrained(checkpoint, dtype=torch.float32, device="cpu", **kwargs)
    return capsys.readouterr().err


def test_loading_shows_one_bar_counting_layers_and_bytes(sharded_checkpoint, capsys):
    bar = _load_with_progress(sharded_checkpoint, capsys)
    assert "layerstream: loading layers" in bar
    assert "4/4" in bar and "MiB" in bar
    nf4 = _load_with_progress(sharded_checkpoint, capsys, quantization="nf4")
    assert "layerstream: loading and quantising layers to NF4" in nf4 and "4/4" in nf4


def test_the_bar_follows_transformers_switch_and_shows_on_the_main_process_only(
    sharded_checkpoint, capsys, monkeypatch
):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        assert "layerstream: loading layers" not in _load_with_progress(sharded_checkpoint, capsys)
    finally:
        hf_logging.enable_progress_bar()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert "layerstream: loading layers" not in _load_with_progress(sharded_checkpoint, capsys)
    monkeypatch.setenv("RANK", "0")
    assert "layerstream: loading layers" in _load_with_progress(sharded_checkpoint, capsys), "rank 0 shows it"
