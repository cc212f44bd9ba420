"""mlp_tile_tokens (the MLP in tiles of tokens): the tiled backward reads the slot its
recompute bound, the recompute skips tiles whose output it discards (and a wrong skip is
caught), a tiled step costs the FLOPs of an untiled one, and NF4 and fused-MLP families
match resident bit for bit."""

import pytest
import torch
from long_pairs import CHUNK, SEQ, STEPS, TILE, long_pair, step_flops

import layerstream
from layerstream.long import chunked_loss, tiled_mlp
from layerstream.modules import nf4, nf4_dense

from tiny import (
    assert_traces_equal,
    batch,
    corrupt_copies,
    nf4_pair,
    peft_pair,
    portable_cpu_nf4,
    scale_mlp_outputs,
    stream,
    train_steps,
)


def test_the_tiled_backward_reads_the_slot_its_recompute_bound():
    """On the CPU a host weight and its slot copy hold the same values, so read from where
    the tiles' backward takes its frozen weights: the slot memory, never the host store."""
    streamed, _ = long_pair(chunk=None)
    runtime = layerstream.get_runtime(streamed)
    seen = []
    original = tiled_mlp._plain

    def spy(module, x):
        if torch.is_grad_enabled():
            seen.append(module.gate_proj.base_layer.weight.data_ptr())
        return original(module, x)

    tiled_mlp._plain = spy
    try:
        ids = batch(96, size=2, seq=SEQ)
        streamed(input_ids=ids, labels=ids).loss.backward()
    finally:
        tiled_mlp._plain = original
    slots = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in runtime.pool.buffers]
    assert len(seen) == 5 * 4, "every layer's four tiles recomputed in backward"
    assert all(any(lo <= ptr < hi for lo, hi in slots) for ptr in seen)


def _tile_calls(model, steps=1) -> dict:
    """How often the tiles ran, by grad mode, over ``steps`` training steps."""
    calls = {"no_grad": 0, "grad": 0}
    original = tiled_mlp._plain

    def counting(module, x):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return original(module, x)

    tiled_mlp._plain = counting
    try:
        train_steps(model, steps, seq=SEQ)
    finally:
        tiled_mlp._plain = original
    return calls


def test_the_recompute_skips_the_tiled_mlp_whose_output_it_discards():
    """Five layers of four tiles: the forward runs each tile once and the backward once; the
    checkpoint's recompute stops before the MLP (its output is not needed), so the MLP's
    forward does not run a third time."""
    streamed, resident = long_pair(chunk=None)
    assert _tile_calls(streamed) == {"no_grad": 5 * 4, "grad": 5 * 4}


def test_an_op_saving_the_mlp_output_makes_the_recompute_run_the_tiles():
    """Where something after the MLP saves its output, the recompute must compute it: the
    tiles run again there, and the gradients stay equal to the resident model's."""
    streamed, resident = long_pair(chunk=None)
    for model in (streamed, resident):
        scale_mlp_outputs(model)
    assert _tile_calls(streamed) == {"no_grad": 2 * 5 * 4, "grad": 5 * 4}
    streamed, resident = long_pair(chunk=None)
    for model in (streamed, resident):
        scale_mlp_outputs(model)
    got, expected = train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ)
    assert any(".out_scale" in name for name in got.grads[0]), "the scale must be trained"
    assert_traces_equal(got, expected)


def test_a_recompute_that_skipped_a_needed_mlp_output_is_caught(monkeypatch):
    """Negative control: a tiled forward that returned zeros inside backward (a recompute
    that skipped the MLP although its output is saved) breaks the parity above."""
    streamed, resident = long_pair(chunk=None)
    for model in (streamed, resident):
        scale_mlp_outputs(model)
    forward = tiled_mlp.TiledFunction.forward

    def skipping(ctx, x, *args):
        out = forward(ctx, x, *args)
        return torch.zeros_like(out) if torch._C._current_graph_task_id() != -1 else out

    monkeypatch.setattr(tiled_mlp.TiledFunction, "forward", staticmethod(skipping))
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ))


def test_a_tiled_mlp_step_costs_the_matmul_flops_of_an_untiled_one():
    """Tiles split the MLP's rows, so a step's matrix products add up to the FLOPs of the
    untiled step: the tiles' forward in backward replaces the recompute's, it does not come
    on top (as it did when the recompute ran the MLP too: 20% more here). Within 1%: the
    tiles' forward also runs down_proj's LoRA B product, which the untiled recompute's
    early stop skips (a rank-4 product here, 0.35%)."""
    tiled, _ = long_pair(tile=TILE)
    untiled, _ = long_pair(tile=None)
    tiled_flops, untiled_flops = step_flops(tiled), step_flops(untiled)
    assert untiled_flops <= tiled_flops < 1.01 * untiled_flops


def test_nf4_tiled_mlp_streamed_matches_resident(tmp_path, monkeypatch):
    """QLoRA: lora.Linear4bit over streamed NF4 weights, tiled, through the checkpoint-visible
    NF4 function (forced), whose saved slot tensors the tiles' backward must be given."""
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5)
    portable_cpu_nf4(resident)
    stream(streamed, "cpu", slots=2, prefetch=1, mlp_tile_tokens=TILE, loss_chunk_tokens=CHUNK)
    tiled_mlp.apply(resident, TILE)
    chunked_loss.apply(resident, CHUNK)
    monkeypatch.setattr(nf4, "fused_kernel_would_run", lambda *a, **k: True)
    assert_traces_equal(train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ))
    assert layerstream.get_runtime(streamed).stats()["nf4_function_calls"] > 0


def test_phi3_fused_mlp_tiled_streamed_matches_resident_bit_for_bit(monkeypatch):
    """Phi-3 fuses the gate and up projections (gate_up_proj): its MLP is per token, so it
    tiles like Llama's, streamed and resident alike (LoRA on the fused projection)."""
    streamed, resident = peft_pair("phi3", layers=3, lora={"target_modules": ["gate_up_proj", "down_proj"]})
    stream(streamed, "cpu", mlp_tile_tokens=TILE)
    tiled_mlp.apply(resident, TILE)
    tiles, plain = [], tiled_mlp._plain
    monkeypatch.setattr(
        tiled_mlp, "_plain", lambda module, x: tiles.append(torch.is_grad_enabled()) or plain(module, x)
    )
    got = train_steps(streamed, 2, seq=SEQ)
    assert tiles.count(True) == 2 * 3 * 4, "every layer's four tiles ran in each backward"
    assert_traces_equal(got, train_steps(resident, 2, seq=SEQ))
    runtime = layerstream.get_runtime(streamed)
    corrupt_copies(runtime, lambda layer, slot: runtime.records[0].host_region if layer == 2 else None)
    with pytest.raises(AssertionError):  # negative control: the same comparison sees a wrong layer
        assert_traces_equal(train_steps(streamed, 1, seq=SEQ), train_steps(resident, 1, seq=SEQ))


def _nf4_tiled_pair(tmp_path, **overrides):
    """A streamed and a resident QLoRA model, both with the MLP in tiles and the loss in
    chunks; bitsandbytes' CPU route for training-sized calls: dequantise + linear. With
    ``mlp_bias=True`` the MLP's projections get the same non-zero biases on both sides."""
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5, **overrides)
    if overrides.get("mlp_bias"):
        for model in (streamed, resident):
            for name, param in model.named_parameters():
                if ".mlp." in name and name.endswith("base_layer.bias"):
                    with torch.no_grad():
                        param.copy_(torch.linspace(-0.5, 0.5, param.numel()).to(param.dtype))
    portable_cpu_nf4(resident)
    stream(streamed, "cpu", slots=2, prefetch=1, mlp_tile_tokens=TILE, loss_chunk_tokens=CHUNK)
    tiled_mlp.apply(resident, TILE)
    chunked_loss.apply(resident, CHUNK)
    return streamed, resident


def test_nf4_tiles_dequantise_each_weight_once_per_call(tmp_path):
    """Five streamed NF4 layers, four tiles a call: each MLP weight is dequantised once for
    the forward's tiles and once for the backward's (3 weights x 2 x 5 layers a step), not
    at every tile, and every step equals the resident model's, which dequantises at every
    tile as bitsandbytes does."""
    streamed, resident = _nf4_tiled_pair(tmp_path)
    got = train_steps(streamed, STEPS, seq=SEQ)
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["nf4_dequantisations"] == STEPS * 5 * 3 * 2
    assert stats["nf4_dequant_calls"] >= STEPS * 5 * 3 * 2 * 4, "every tile's call took the kept weight"
    assert not nf4_dense.active(), "the kept weights go when the call ends"
    assert_traces_equal(got, train_steps(resident, STEPS, seq=SEQ))


def test_nf4_tiles_on_kept_weights_add_the_projections_biases(tmp_path):
    """An MLP with biases (non-zero, the same on both sides): the kept weight's product adds
    each projection's bias as bitsandbytes' call does, bit for bit the resident model's."""
    streamed, resident = _nf4_tiled_pair(tmp_path, mlp_bias=True)
    got = train_steps(streamed, 2, seq=SEQ)
    assert layerstream.get_runtime(streamed).stats()["nf4_dequantisations"] > 0
    assert_traces_equal(got, train_steps(resident, 2, seq=SEQ))


def test_a_kept_weight_served_to_another_projection_is_caught(tmp_path, monkeypatch):
    """Negative control: weights kept by shape alone (gate_proj's then serves up_proj, the
    same shape) break the parity above."""
    streamed, resident = _nf4_tiled_pair(tmp_path)
    table = {}

    def by_shape(module, packed, state, dtype, counters=None):
        key = (tuple(state.shape), dtype)
        if key not in table:
            table[key] = nf4_dense.dequantised_weight(packed, state, dtype)
        return table[key]

    monkeypatch.setattr(nf4_dense, "kept", by_shape)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 1, seq=SEQ), train_steps(resident, 1, seq=SEQ))
