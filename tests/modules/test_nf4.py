"""Streamed NF4 (bitsandbytes 4-bit) layers agree bit for bit with an unpatched resident
bitsandbytes model, and never reach MatMul4Bit."""

import bitsandbytes as bnb
import pytest
import torch

import layerstream
from layerstream.decisions.schedule import PrefetchSchedule
from layerstream.modules import cpu_repacking, nf4

from tiny import (
    assert_traces_equal,
    nearest_valid_victim,
    nf4_pair,
    portable_cpu_nf4,
    save_tiny,
    stream,
    train_steps,
)

STEPS = 10


def _lora_linear4bit(model):
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    return [m for m in model.modules() if isinstance(m, LoraLinear4bit)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "single-quant"])
def test_nf4_training_matches_resident_bitsandbytes(tmp_path, dtype, nested):
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5, dtype=dtype, nested=nested)
    assert _lora_linear4bit(streamed) and _lora_linear4bit(resident), "PEFT must pick lora.Linear4bit"
    stream(streamed, "cpu", slots=2, prefetch=1)
    assert_traces_equal(train_steps(streamed, STEPS), train_steps(resident, STEPS))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_dequant_calls"] > 0 and stats["layer_loads"] > 5


def test_weights_quantised_from_bf16_computed_in_fp16_train_as_bitsandbytes_does(tmp_path):
    """bitsandbytes' backward dequantises a weight to the dtype it was quantised from
    (bfloat16) and casts that to the gradient's (float16): the streamed projections take
    the checkpoint-visible Function there, so every gradient equals the resident model's."""
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5, compute_dtype=torch.float16)
    stream(streamed, "cpu", slots=2, prefetch=1)
    assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_function_calls"] > 0 and stats["nf4_dequant_calls"] == 0


def test_a_bf16_weight_dequantised_straight_to_fp16_is_caught(tmp_path, monkeypatch):
    """Negative control: dequantise + linear in float16 for those weights (the route taken
    before) gives other input gradients than bitsandbytes' backward."""
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5, compute_dtype=torch.float16)
    stream(streamed, "cpu", slots=2, prefetch=1)
    original = nf4.streamed_nf4_forward

    def computed_as_stored(module, x, owner=None, counters=None):
        state = module.weight.quant_state
        kept, state.dtype = state.dtype, torch.float16
        try:
            return original(module, x, owner, counters)
        finally:
            state.dtype = kept

    monkeypatch.setattr(nf4, "streamed_nf4_forward", computed_as_stored)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))


def test_nf4_packed_weights_and_quant_state_stream(tmp_path):
    streamed, _ = nf4_pair(tmp_path, "qwen2", layers=3)
    stream(streamed, "cpu", slots=2)
    runtime = layerstream.get_runtime(streamed)
    record = runtime.records[0]
    names = {
        e.qualified_name.split("self_attn.q_proj.")[-1]
        for e in record.entries
        if "self_attn.q_proj." in e.qualified_name
    }
    assert {
        "base_layer.weight",
        "base_layer.bias",
        "base_layer.weight.quant_state.absmax",
        "base_layer.weight.quant_state.code",
        "base_layer.weight.quant_state.offset",
        "base_layer.weight.quant_state.state2.absmax",
        "base_layer.weight.quant_state.state2.code",
    } <= names
    weight = streamed.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert weight.dtype == torch.uint8 and weight.quant_state.absmax.dtype == torch.uint8


def test_forced_function_in_a_recycling_stream_matches_resident(tmp_path, monkeypatch):
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5)
    stream(streamed, "cpu", slots=2, prefetch=1)
    monkeypatch.setattr(nf4, "fused_kernel_would_run", lambda *a, **k: True)
    assert_traces_equal(train_steps(streamed, STEPS), train_steps(resident, STEPS))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_function_calls"] > 0 and stats["nf4_dequant_calls"] == 0


def test_streamed_weights_never_reach_matmul4bit(tmp_path, monkeypatch):
    from bitsandbytes.autograd import _functions

    calls = []
    original = _functions.MatMul4Bit.apply
    monkeypatch.setattr(_functions.MatMul4Bit, "apply", lambda *a, **k: calls.append(1) or original(*a, **k))
    original_matmul = bnb.matmul_4bit
    monkeypatch.setattr(bnb, "matmul_4bit", lambda *a, **k: calls.append(2) or original_matmul(*a, **k))
    streamed, resident = nf4_pair(tmp_path, "llama", layers=4)
    stream(streamed, "cpu", slots=2)
    train_steps(streamed, 2)
    for fused in (True, False):
        monkeypatch.setattr(nf4, "fused_kernel_would_run", lambda *a, fused=fused, **k: fused)
        train_steps(streamed, 1)
    assert calls == []
    train_steps(resident, 1)
    assert calls, "the counter must see the resident model's calls (the test can fail)"


def test_any_valid_slot_placement_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(PrefetchSchedule, "_victim", nearest_valid_victim)
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5)
    stream(streamed, "cpu", slots=3, prefetch=1)
    for fused in (False, True):
        monkeypatch.setattr(nf4, "fused_kernel_would_run", lambda *a, fused=fused, **k: fused)
        assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))


def test_matmul4bit_under_checkpointing_with_recycled_slots_is_caught(tmp_path, monkeypatch):
    """Negative control: route streamed weights through bitsandbytes' MatMul4Bit. It keeps
    the packed weight on ctx, outside checkpointing's reach: once a layer comes back into
    another slot for backward than it used in forward, its gradients read another layer."""
    monkeypatch.setattr(PrefetchSchedule, "_victim", nearest_valid_victim)
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5)
    stream(streamed, "cpu", slots=3, prefetch=1)

    def via_matmul4bit(module, x, owner=None, counters=None):
        state = module.weight.quant_state
        x = x.to(module.compute_dtype)
        return bnb.matmul_4bit(x, module.weight.t(), bias=None, quant_state=state).to(x.dtype)

    monkeypatch.setattr(nf4, "streamed_nf4_forward", via_matmul4bit)
    with pytest.raises(AssertionError, match="gradient|logits|loss"):
        assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))


def test_backward_owner_check_finds_the_slot_from_the_tensor(tmp_path):
    streamed, _ = nf4_pair(tmp_path, "llama", layers=3)
    stream(streamed, "cpu", slots=2)
    runtime = layerstream.get_runtime(streamed)
    train_steps(streamed, 1)
    slot = runtime.prefetch.slot_of[next(iter(runtime.prefetch.slot_of))]
    owner = runtime.pool.owner[slot]
    inside = runtime.pool.buffers[slot][8:]
    runtime._owner_check(owner)(inside)  # the owner: passes
    with pytest.raises(layerstream.SlotOwnerError, match="holds layer"):
        runtime._owner_check((owner + 1) % 3)(inside)
    with pytest.raises(layerstream.SlotOwnerError, match="slot None"):
        runtime._owner_check(owner)(torch.zeros(4))


def test_nf4_generation_matches_resident(tmp_path):
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5)
    portable_cpu_nf4(resident)
    stream(streamed, "cpu", slots=2, prefetch=1)
    ids = torch.randint(3, 90, (2, 6))
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert torch.equal(streamed.generate(input_ids=ids, **kwargs), resident.generate(input_ids=ids, **kwargs))


def test_inference_calls_bitsandbytes_gemm_4bit_as_a_resident_layer_does(tmp_path, monkeypatch):
    """Without grad (generation), a streamed projection makes the call bitsandbytes'
    matmul_4bit makes: its gemm_4bit op, which chooses the kernel, never the Function or
    layerstream's own dequantise + linear; training still routes through those."""
    from bitsandbytes.autograd import _functions

    streamed, _ = nf4_pair(tmp_path, "llama", layers=4)
    stream(streamed, "cpu", slots=2, prefetch=1)
    ops, around = [], []
    original = nf4._gemm_4bit
    monkeypatch.setattr(nf4, "_gemm_4bit", lambda *a: ops.append(1) or original(*a))
    monkeypatch.setattr(_functions.MatMul4Bit, "apply", lambda *a, **k: around.append(1))
    monkeypatch.setattr(bnb, "matmul_4bit", lambda *a, **k: around.append(2))
    ids = torch.randint(3, 90, (2, 5))
    kwargs = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    streamed.generate(input_ids=ids, **kwargs)
    stats = layerstream.get_runtime(streamed).stats()
    assert ops and not around and stats["nf4_inference_calls"] == len(ops)
    assert stats["nf4_function_calls"] == stats["nf4_dequant_calls"] == 0
    train_steps(streamed, 1)
    assert layerstream.get_runtime(streamed).stats()["nf4_dequant_calls"] > 0, "training takes its own route"


def test_nf4_state_dict_is_unchanged(tmp_path):
    streamed, resident = nf4_pair(tmp_path, "qwen2", layers=3)
    stream(streamed, "cpu", slots=2)
    got, expected = streamed.state_dict(), resident.state_dict()
    assert list(got) == list(expected)
    for key in got:
        assert torch.equal(got[key], expected[key]), key


def test_nf4_unstream_restores_bitsandbytes_layers(tmp_path):
    streamed, resident = nf4_pair(tmp_path, "llama", layers=4)
    stream(streamed, "cpu", slots=2)
    train_steps(streamed, 2)
    train_steps(resident, 2)
    layerstream.unstream_model(streamed)
    kinds = {type(m) for m in streamed.modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert kinds == {bnb.nn.Linear4bit}
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))


def test_slot_weights_are_built_once_per_slot_and_layer(tmp_path):
    streamed, _ = nf4_pair(tmp_path, "llama", layers=4)
    stream(streamed, "cpu", slots=2)
    runtime = layerstream.get_runtime(streamed)
    train_steps(streamed, 1)
    first = {key: [id(t) for _, _, t in binding] for key, binding in runtime._bindings.items()}
    train_steps(streamed, 2)
    assert {key: [id(t) for _, _, t in binding] for key, binding in runtime._bindings.items()} == first
    assert len(first) <= 2 * 4
    weights = [t for binding in runtime._bindings.values() for _, _, t in binding if isinstance(t, bnb.nn.Params4bit)]
    assert weights and all(w.quant_state.absmax.data_ptr() != 0 for w in weights)


def test_nf4_model_streams_again_after_unstreaming(tmp_path):
    streamed, resident = nf4_pair(tmp_path, "llama", layers=4)
    for slots in (2, 3):
        stream(streamed, "cpu", slots=slots, prefetch=1)
        assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))
        layerstream.unstream_model(streamed, device="cpu")


def test_a_too_old_bitsandbytes_is_named_with_the_upgrade_command(tmp_path, monkeypatch):
    import bitsandbytes

    streamed, _ = nf4_pair(tmp_path, layers=3)
    monkeypatch.setattr(bitsandbytes, "__version__", "0.45.5")
    with pytest.raises(
        layerstream.StreamingError, match=r"needs bitsandbytes >= 0.50.2 .* found 0.45.5: pip install -U"
    ):
        layerstream.stream_model(streamed, device="cpu", slots=2)
    assert not layerstream.is_streamed(streamed)
    checkpoint = save_tiny(tmp_path / "plain", layers=2, dtype=torch.bfloat16)
    with pytest.raises(layerstream.LoadingError, match=r"found 0.45.5"):
        layerstream.from_pretrained(
            checkpoint, quantization="nf4", stream=layerstream.StreamConfig(device="cpu", slots=2)
        )


def test_missing_bitsandbytes_is_named_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(nf4, "bnb_available", lambda: False)
    checkpoint = save_tiny(tmp_path / "plain", layers=2, dtype=torch.bfloat16)
    with pytest.raises(layerstream.LoadingError, match=r"needs bitsandbytes: pip install"):
        layerstream.from_pretrained(
            checkpoint, quantization="nf4", stream=layerstream.StreamConfig(device="cpu", slots=2)
        )


def _linear4bit(model) -> list:
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _repack_for_the_cpu_kernel(model, layer: int) -> list:
    """What bitsandbytes' Linear4bit.forward does, on its first eval-mode call on an
    AVX512-BF16 CPU, to each 4-bit weight of one layer (done directly, on any CPU)."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    names = []
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit) and f"layers.{layer}." in name:
            module.weight.data, _ = _convert_weight_packed_for_cpu(module.weight.data, module.weight.quant_state)
            names.append(name)
    return names


def test_weights_repacked_for_the_cpu_kernel_are_refused_before_streaming(tmp_path, monkeypatch):
    """A model that ran an eval-mode forward on an AVX512-BF16 CPU has its 4-bit weights
    repacked in place (another byte layout, bfloat16 scales). Streamed, they would be read in
    the standard layout: stream_model refuses, naming one, before anything changes.
    Control: with the refusal switched off, the streamed model computes other logits than
    the same model resident with its weights as loaded, by far more than rounding (the resident
    model is not repacked here: without an AVX512-BF16 CPU bitsandbytes has no kernel for the
    repacked layout and would itself read it as standard)."""
    from layerstream import api

    streamed, resident = nf4_pair(tmp_path, "llama", layers=3)
    names = _repack_for_the_cpu_kernel(streamed, 1)
    # not state_dict(): bitsandbytes undoes the repacking when it saves
    held = [(m.weight, m.weight.data.clone(), m.weight.quant_state.absmax.clone()) for m in _linear4bit(streamed)]
    with pytest.raises(layerstream.StreamingError, match=r"layers\.1\..*bitsandbytes repacked in place"):
        layerstream.stream_model(streamed, device="cpu", slots=2)
    assert not layerstream.is_streamed(streamed) and names
    for weight, data, absmax in held:
        assert torch.equal(weight.data, data) and torch.equal(weight.quant_state.absmax, absmax), "changed"

    monkeypatch.setattr(api, "_refuse_cpu_repacked", lambda layers, path: None)
    stream(streamed, "cpu", slots=2)
    ids = torch.randint(3, 90, (2, 6))
    with torch.no_grad():
        wrong, right = streamed(ids).logits, resident.eval()(ids).logits
    assert not torch.allclose(wrong, right, atol=0.1), "repacked weights streamed as if standard: other values"


def test_an_eval_forward_repacks_only_where_bitsandbytes_supports_its_kernel_and_is_then_refused(tmp_path):
    """On this machine's CPU: bitsandbytes repacks on an eval-mode forward where its CPU kernel
    is supported, and not otherwise; stream_model then refuses, or streams."""
    streamed, _ = nf4_pair(tmp_path, "llama", layers=2)
    module = _linear4bit(streamed)[0]
    streamed.eval()
    with torch.no_grad():
        streamed(torch.randint(3, 90, (1, 4)))
    assert cpu_repacking.repacked(module) == bool(module.support_avx512bf16_for_cpu)
    if cpu_repacking.repacked(module):
        with pytest.raises(layerstream.StreamingError, match="bitsandbytes repacked in place"):
            layerstream.stream_model(streamed, device="cpu", slots=2)
    else:
        stream(streamed, "cpu", slots=2)


def test_weights_repacked_and_converted_back_stream_as_the_resident_model_and_are_said(tmp_path, caplog):
    """bitsandbytes converts repacked weights back when it saves a state dict, with rounded
    block scales: they stream (nothing to refuse: streamed equals the same model resident, bit
    for bit), and stream_model says they are no longer the loaded weights. Control: the
    round trip did change the weights."""
    streamed, resident = nf4_pair(tmp_path, "llama", layers=3, nested=False)
    loaded = [m.weight.quant_state.absmax.clone() for m in _linear4bit(streamed)]
    for model in (streamed, resident):
        _repack_for_the_cpu_kernel(model, 1)
        model.state_dict()  # bitsandbytes converts back
    assert not any(cpu_repacking.repacked(m) for m in _linear4bit(streamed))
    changed = [m.weight.quant_state.absmax for m in _linear4bit(streamed)]
    assert any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(loaded, changed)), "a control"
    portable_cpu_nf4(resident)
    with caplog.at_level("WARNING", logger="layerstream"):
        stream(streamed, "cpu", slots=2)
    assert "converted them back" in caplog.text and "layers.1." in caplog.text
    ids = torch.randint(3, 90, (2, 6))
    with torch.no_grad():
        assert torch.equal(streamed.eval()(ids).logits, resident.eval()(ids).logits)


def test_streamed_inference_where_bitsandbytes_would_repack_is_said_once(tmp_path, caplog, monkeypatch):
    """Where bitsandbytes' own forward would repack (its CPU kernel supported: set here on any
    CPU; eval mode; an input that does not require grad), streamed layers run its portable
    path and say so once; train mode says nothing, and the weights stay in the standard layout."""
    monkeypatch.setattr(cpu_repacking, "_noted", False)
    streamed, _ = nf4_pair(tmp_path, "llama", layers=3)
    stream(streamed, "cpu", slots=2)
    for module in _linear4bit(streamed):
        module.support_avx512bf16_for_cpu = True
    ids = torch.randint(3, 90, (1, 5))
    with caplog.at_level("WARNING", logger="layerstream"):
        streamed.train()
        streamed(ids).logits.sum().backward()
        assert "portable CPU path" not in caplog.text, "train mode is not affected"
        streamed.eval()
        with torch.no_grad():
            streamed(ids)
            streamed(ids)
    assert caplog.text.count("portable CPU path") == 1
    assert not any(cpu_repacking.repacked(m) for m in _linear4bit(streamed))


def test_the_portable_path_note_follows_bitsandbytes_own_condition(monkeypatch, caplog):
    """bitsandbytes repacks in eval mode for an input that does not require grad, on a CPU
    whose kernel it supports: the note follows each of the three, not torch.no_grad."""
    module = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.bfloat16)
    plain, tracked = torch.randn(2, 64), torch.randn(2, 64, requires_grad=True)
    cases = [(True, False, plain, 0), (False, False, tracked, 0), (False, True, plain, 0), (False, False, plain, 1)]
    for training, unsupported, x, said in cases:
        monkeypatch.setattr(cpu_repacking, "_noted", False)
        module.train(training)
        module.support_avx512bf16_for_cpu = not unsupported
        caplog.clear()
        with caplog.at_level("WARNING", logger="layerstream"):
            cpu_repacking.note_portable_path(module, x)
        assert caplog.text.count("portable CPU path") == said, (training, unsupported, x.requires_grad)
