"""Streamed and resident runs of the same model agree bit for bit.

Every test uses non-zero LoRA B, more layers than slots (so slots recycle), and at
least ten optimizer steps; the negative controls below prove the comparison can fail.
"""

import pytest
import torch

import layerstream
from layerstream.decisions.schedule import PrefetchSchedule

from tiny import (
    FAMILIES,
    assert_traces_equal,
    batch,
    corrupt_copies,
    nearest_valid_victim,
    peft_pair,
    stream,
    train_steps,
)

STEPS = 10


def _attn(device):
    # memory-efficient attention's CUDA backward accumulates with atomics; eager is exact
    return "eager" if device == "cuda" else None


@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_resident_for_every_family(family, device):
    streamed, resident = peft_pair(family, layers=5, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["layer_loads"] > stats["layers"], "slots must have recycled"


@pytest.mark.parametrize("slots,prefetch", [(2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (4, 3)])
def test_training_matches_resident_across_slots_and_prefetch(slots, prefetch, device):
    streamed, resident = peft_pair("llama", layers=6, attn=_attn(device))
    stream(streamed, device, slots=slots, prefetch=prefetch)
    resident.to(device)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_matches_resident_in_each_dtype(dtype, device):
    streamed, resident = peft_pair("qwen3", layers=5, dtype=dtype, attn=_attn(device))
    stream(streamed, device, slots=3, prefetch=2)
    resident.to(device)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))


def test_layers_of_different_sizes_share_the_slots(device):
    # qwen3_moe with dense MLPs in layers 1 and 3: two layer sizes in one stack
    streamed, resident = peft_pair("qwen3_moe", layers=6, attn=_attn(device), mlp_only_layers=[1, 3])
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    sizes = {r.nbytes for r in layerstream.get_runtime(streamed).records}
    assert len(sizes) == 2
    assert layerstream.get_runtime(streamed).pool.slot_bytes == max(sizes)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))


def test_any_valid_slot_placement_stays_exact(device, monkeypatch):
    monkeypatch.setattr(PrefetchSchedule, "_victim", nearest_valid_victim)
    streamed, resident = peft_pair("llama", layers=6, attn=_attn(device))
    stream(streamed, device, slots=3, prefetch=1)
    resident.to(device)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))


def test_gradient_accumulation_matches_resident(device):
    streamed, resident = peft_pair("llama", layers=5, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    assert_traces_equal(
        train_steps(streamed, STEPS, device, accumulation=3), train_steps(resident, STEPS, device, accumulation=3)
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("slots,prefetch", [(2, 1), (4, 3)])
def test_greedy_generation_matches_resident(family, slots, prefetch, device):
    streamed, resident = peft_pair(family, layers=5, attn=_attn(device))
    stream(streamed, device, slots=slots, prefetch=prefetch)
    resident.to(device)
    ids = batch(96, size=2, seq=6, device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=mask, pad_token_id=0)
    expected = resident.generate(input_ids=ids, **kwargs)
    got = streamed.generate(input_ids=ids, **kwargs)
    assert torch.equal(got, expected)


def test_eval_and_train_switches_stay_exact(device):
    streamed, resident = peft_pair("llama", layers=5, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    ids = batch(96, device=device)
    for model in (streamed, resident):
        model.eval()
    with torch.no_grad():
        before = [m(input_ids=ids).logits for m in (streamed, resident)]
    assert torch.equal(*before)
    assert_traces_equal(train_steps(streamed, 3, device), train_steps(resident, 3, device))
    for model in (streamed, resident):
        model.eval()
    with torch.no_grad():
        after = [m(input_ids=ids).logits for m in (streamed, resident)]
    assert torch.equal(*after)
    assert not torch.equal(before[0], after[0]), "training must have changed the model"


# 12 layers with 2: the backward slots also take the backward's first copies (9, 8)
@pytest.mark.parametrize("layers,backward_slots", [(7, 1), (7, 3), (12, 2)])
def test_training_with_backward_slots_matches_resident_and_copies_less(layers, backward_slots, device):
    streamed, resident = peft_pair("llama", layers=layers, attn=_attn(device))
    plain, _ = peft_pair("llama", layers=layers, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1, backward_slots=backward_slots)
    stream(plain, device, slots=2, prefetch=1, backward_slots=0)
    resident.to(device)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))
    train_steps(plain, STEPS, device)
    with_slots, without = (layerstream.get_runtime(m).stats() for m in (streamed, plain))
    assert with_slots["backward_slots"] == backward_slots and without["backward_slots"] == 0
    # each step after the first keeps backward_slots more layers across the step boundary
    assert without["layer_loads"] - with_slots["layer_loads"] == (STEPS - 1) * backward_slots
    assert with_slots["backward_slot_peak_bytes"] == backward_slots * layerstream.get_runtime(streamed).pool.slot_bytes


def test_backward_slots_hold_no_memory_while_the_loss_is_computed(device):
    streamed, resident = peft_pair("llama", layers=6, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1, backward_slots=2)
    resident.to(device)
    pool = layerstream.get_runtime(streamed).pool
    at_loss, seen = [], []
    streamed.base_model.model.lm_head.register_forward_hook(
        lambda *_: at_loss.append(pool.total_bytes - pool.ring_bytes)
    )
    for layer in streamed.base_model.model.model.layers:
        layer.register_forward_hook(lambda *_: seen.append(pool.total_bytes - pool.ring_bytes))
    assert_traces_equal(
        train_steps(streamed, 3, device, accumulation=2), train_steps(resident, 3, device, accumulation=2)
    )
    assert at_loss and set(at_loss) == {0}, "backward slots must be freed before the head and loss run"
    assert max(seen) == 2 * pool.slot_bytes, "backward slots were used"


# -- negative controls: the comparisons above can fail -------------------------------


def test_wrong_backward_slot_contents_are_caught_by_parity(device):
    """Layers copied into backward slots are the ones computed with: wrong bytes there
    must turn the parity check red."""
    streamed, resident = peft_pair("llama", layers=7, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1, backward_slots=2)
    resident.to(device)
    runtime = layerstream.get_runtime(streamed)
    records = runtime.records
    corrupt_copies(
        runtime,
        lambda layer, slot: (
            records[(layer + 1) % len(records)].host_region if slot >= runtime.pool.ring_slots else None
        ),
    )
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 3, device), train_steps(resident, 3, device))


def test_wrong_slot_contents_are_caught_by_parity(device):
    """Copy the neighbour layer's bytes into the slot: the parity check must go red."""
    streamed, resident = peft_pair("llama", layers=5, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    runtime = layerstream.get_runtime(streamed)
    records = runtime.records
    corrupt_copies(runtime, lambda layer, slot: records[(layer + 1) % len(records)].host_region)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


def test_binding_of_another_slot_is_caught_by_the_owner_check(device):
    streamed, _ = peft_pair("llama", layers=5, attn=_attn(device))
    stream(streamed, device, slots=3, prefetch=1)
    runtime = layerstream.get_runtime(streamed)
    original = runtime._enter
    runtime._enter = lambda index, phase: (original(index, phase) + 1) % 3
    with pytest.raises(AssertionError):  # wrong slot: values differ...
        streamed_out, _ = _forward_pair(streamed, device)
    runtime._enter = original
    slot = runtime.prefetch.slot_of[next(iter(runtime.prefetch.slot_of))]
    wrong_layer = (runtime.pool.owner[slot] + 1) % len(runtime.records)
    with pytest.raises(layerstream.SlotOwnerError, match="holds layer"):  # ...and owners disagree
        runtime.pool.acquire(slot, wrong_layer)


def _forward_pair(streamed, device):
    ids = batch(96, device=device)
    with torch.no_grad():
        got = streamed(input_ids=ids).logits
    runtime = layerstream.get_runtime(streamed)
    runtime._enter = type(runtime)._enter.__get__(runtime)
    runtime.reset_slots()
    with torch.no_grad():
        expected = streamed(input_ids=ids).logits
    assert torch.equal(got, expected), "wrong slot binding changed the logits"
    return got, expected


def test_training_without_checkpointing_is_caught_by_parity(device, monkeypatch):
    """Without recompute, autograd keeps slot views that later loads overwrite: either the
    gradients differ or autograd's version check on the slot buffer raises."""

    def no_checkpoint(fn, *args, use_reentrant=None, preserve_rng_state=None, **kwargs):
        return fn(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", no_checkpoint)
    streamed, resident = peft_pair("llama", layers=5, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    with pytest.raises((AssertionError, RuntimeError), match="gradient|inplace operation"):
        assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))
