"""NF4 streaming on CUDA: bit-exact with resident bitsandbytes at a fused M (bitsandbytes
picks its fused gemm_4bit kernel) and at a training M (it falls back to dequantise +
linear), and each way of getting the routing wrong turns a check red."""

import bitsandbytes as bnb
import pytest
import torch

import layerstream
from layerstream.decisions.schedule import PrefetchSchedule
from layerstream.modules import nf4

from tiny import assert_traces_equal, batch, corrupt_copies, nearest_valid_victim, nf4_pair, stream, train_steps

pytestmark = pytest.mark.gpu

FUSED_SEQ = 4  # batch 1 x 4 tokens: M = 4, at or below bitsandbytes' floor -> fused
TRAINING_SEQ = 1600  # batch 2 x 1600 tokens: M = 3200 > 1536 -> dequantise + linear
LONG = dict(max_position_embeddings=4096)


def _train(model, seq, steps=10, batch_size=1):
    return train_steps(model, steps, "cuda", seq=seq, batch_size=batch_size)


def _pair(tmp_path, dtype=torch.bfloat16, nested=True, slots=2):
    streamed, resident = nf4_pair(
        tmp_path, "llama", layers=5, dtype=dtype, nested=nested, device="cuda", attn="eager", **LONG
    )
    stream(streamed, "cuda", slots=slots, prefetch=1)
    return streamed, resident


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "single-quant"])
def test_parity_at_a_fused_m(tmp_path, dtype, nested):
    streamed, resident = _pair(tmp_path, dtype, nested)
    assert_traces_equal(_train(streamed, FUSED_SEQ), _train(resident, FUSED_SEQ))
    assert layerstream.get_runtime(streamed).stats()["nf4_function_calls"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "single-quant"])
def test_parity_at_a_training_m(tmp_path, dtype, nested):
    streamed, resident = _pair(tmp_path, dtype, nested)
    assert_traces_equal(
        _train(streamed, TRAINING_SEQ, steps=3, batch_size=2), _train(resident, TRAINING_SEQ, steps=3, batch_size=2)
    )
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_dequant_calls"] > 0


def test_parity_with_weights_quantised_from_bf16_computed_in_fp16(tmp_path):
    """bitsandbytes' backward dequantises to the stored dtype (bfloat16) and casts to the
    gradient's (float16): the streamed projections take the checkpoint-visible Function
    there, at a fused M and at a training M alike."""
    streamed, resident = nf4_pair(
        tmp_path, "llama", layers=5, device="cuda", attn="eager", compute_dtype=torch.float16, **LONG
    )
    stream(streamed, "cuda", slots=2, prefetch=1)
    for seq, size in ((FUSED_SEQ, 1), (TRAINING_SEQ, 2)):
        assert_traces_equal(
            _train(streamed, seq, steps=2, batch_size=size), _train(resident, seq, steps=2, batch_size=size)
        )
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_function_calls"] > 0 and stats["nf4_dequant_calls"] == 0


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("size", [1, 8])
def test_greedy_generation_matches_resident_token_for_token(tmp_path, size, use_cache):
    """32 greedy tokens through bitsandbytes' own gemm_4bit call (its fused inference kernel
    at these small M) equal resident bitsandbytes', batch 1 and 8, with the KV cache and
    without it (every token step then runs the whole sequence again)."""
    streamed, resident = _pair(tmp_path)
    ids = batch(96, size=size, seq=4, device="cuda")
    kwargs = dict(
        max_new_tokens=32, do_sample=False, use_cache=use_cache, attention_mask=torch.ones_like(ids), pad_token_id=0
    )
    expected = resident.generate(input_ids=ids, **kwargs)
    assert torch.equal(expected, resident.generate(input_ids=ids, **kwargs)), "the resident run is not repeatable"
    assert torch.equal(streamed.generate(input_ids=ids, **kwargs), expected)
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_inference_calls"] > 0 and stats["nf4_function_calls"] == stats["nf4_dequant_calls"] == 0


@pytest.mark.parametrize("seq", [FUSED_SEQ, TRAINING_SEQ], ids=["fused-m", "dequantise-m"])
def test_no_grad_logits_equal_resident_where_bitsandbytes_picks_either_kernel(tmp_path, seq):
    """A forward without grad at a fused M and at a dequantise M: logits equal the resident
    model's bit for bit (bitsandbytes' gemm_4bit op chooses the kernel on both sides)."""
    streamed, resident = _pair(tmp_path)
    ids = batch(96, size=1, seq=seq, device="cuda")
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)
    assert layerstream.get_runtime(streamed).stats()["nf4_inference_calls"] > 0


# -- mutations: each must turn a check red ------------------------------------------------


def test_generation_from_another_layers_packed_bytes_is_caught(tmp_path):
    """Negative control for the generation test: layer 3 computing with layer 0's packed
    bytes changes the greedy tokens."""
    streamed, resident = _pair(tmp_path)
    runtime = layerstream.get_runtime(streamed)
    corrupt_copies(runtime, lambda layer, slot: runtime.records[0].host_region if layer == 3 else None)
    ids = batch(96, size=8, seq=4, device="cuda")
    kwargs = dict(max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert not torch.equal(streamed.generate(input_ids=ids, **kwargs), resident.generate(input_ids=ids, **kwargs))


def test_inference_through_dequantise_at_a_fused_m_is_caught(tmp_path, monkeypatch):
    """Negative control for the no-grad logits: dequantise + linear where bitsandbytes runs
    its fused kernel (M = 4) changes the logits."""
    monkeypatch.setattr(
        nf4, "_gemm_4bit", lambda x, packed, state, bias: nf4.dequantized_linear(x, packed, state, bias)
    )
    streamed, resident = _pair(tmp_path)
    ids = batch(96, size=1, seq=FUSED_SEQ, device="cuda")
    with torch.no_grad():
        assert not torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)


def test_gate_always_off_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(nf4, "fused_kernel_would_run", lambda *a, **k: False)
    streamed, resident = _pair(tmp_path)
    with pytest.raises(AssertionError):
        assert_traces_equal(_train(streamed, FUSED_SEQ, steps=2), _train(resident, FUSED_SEQ, steps=2))


def test_fused_arm_through_matmul4bit_is_caught(tmp_path, monkeypatch):
    """MatMul4Bit keeps the packed weight on ctx: with layers coming back into other slots
    for backward, its gradients read another layer's weights."""
    monkeypatch.setattr(PrefetchSchedule, "_victim", nearest_valid_victim)

    def through_matmul4bit(module, x, owner=None, counters=None):
        x = x.to(module.compute_dtype)
        return bnb.matmul_4bit(x, module.weight.t(), bias=None, quant_state=module.weight.quant_state)

    monkeypatch.setattr(nf4, "streamed_nf4_forward", through_matmul4bit)
    streamed, resident = _pair(tmp_path, slots=3)
    with pytest.raises(AssertionError, match="gradient"):
        assert_traces_equal(_train(streamed, FUSED_SEQ, steps=2), _train(resident, FUSED_SEQ, steps=2))


def test_recompute_through_dequantise_at_a_fused_m_is_caught(tmp_path, monkeypatch):
    """Forward takes the fused kernel, the backward recompute the dequantise path: the
    recomputed tensors no longer match (checkpointing raises) or gradients differ."""

    def forward_only_fused(x, shape, blocksize, ops=None):
        return torch.is_grad_enabled() and not torch._C._current_graph_task_id() >= 0

    monkeypatch.setattr(nf4, "fused_kernel_would_run", forward_only_fused)
    streamed, resident = _pair(tmp_path)
    with pytest.raises((AssertionError, RuntimeError)):
        assert_traces_equal(_train(streamed, FUSED_SEQ, steps=2), _train(resident, FUSED_SEQ, steps=2))
