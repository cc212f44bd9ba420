"""Backward slots left to "auto": how many the runtime takes, that they never raise the
step's peak, and that the guard stops borrowing when the loss does not hold the memory."""

import pytest
import torch

import layerstream
from layerstream import config as config_mod
from layerstream.runtime import backward_slots as backward_mod

from tiny import assert_traces_equal, peft_pair, stream, train_steps

# a loss-dominated shape: tiny layers, a vocabulary whose fp32 logits dwarf them
LOSS_HEAVY = dict(vocab_size=32000, hidden_size=64, intermediate_size=128)


def _peak_over_steps(model, steps, seq):
    train_steps(model, 1, "cuda", seq=seq)  # warm up: slots and backward slots in use
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trace = train_steps(model, steps, "cuda", seq=seq)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), trace


def test_auto_takes_no_backward_slots_on_the_host():
    streamed, _ = peft_pair("llama", layers=5)
    stream(streamed, "cpu", slots=2, prefetch=1)
    runtime = layerstream.get_runtime(streamed)
    train_steps(streamed, 2)
    assert runtime.stats()["backward_slots"] == 0
    assert "backward     none (auto: none on the host)" in runtime.summary()


def test_expandable_segments_are_read_from_the_allocator_settings_or_the_environment(monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert config_mod.expandable_segments()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not config_mod.expandable_segments()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert not config_mod.expandable_segments()
    monkeypatch.setattr(
        torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True", raising=False
    )
    assert config_mod.expandable_segments()


@pytest.fixture
def expandable(monkeypatch):
    """As if the allocator used expandable segments (they can only be chosen before CUDA
    starts; what is tested here is the borrowing, not the allocator)."""
    monkeypatch.setattr(backward_mod, "expandable_segments", lambda: True)


@pytest.mark.gpu
def test_auto_takes_no_backward_slots_without_expandable_segments(monkeypatch, caplog):
    monkeypatch.setattr(backward_mod, "expandable_segments", lambda: False)
    streamed, _ = peft_pair("llama", layers=8, attn="eager", **LOSS_HEAVY)
    stream(streamed, "cuda", slots=2, prefetch=1)
    with caplog.at_level("INFO", logger="layerstream"):
        train_steps(streamed, 2, "cuda", seq=256)
    assert layerstream.get_runtime(streamed).stats()["backward_slots"] == 0
    assert caplog.text.count("no backward slots: backward_slots='auto' needs") == 1


@pytest.mark.gpu
def test_auto_backward_slots_borrow_the_loss_memory_without_raising_the_peak(expandable):
    seq = 256
    # 16 layers: enough for the backward slots to take the backward's first copies too
    # (layers 13 down to 11) before their own (2-5)
    streamed, resident = peft_pair("llama", layers=16, attn="eager", **LOSS_HEAVY)
    plain, _ = peft_pair("llama", layers=16, attn="eager", **LOSS_HEAVY)
    stream(streamed, "cuda", slots=2, prefetch=1)  # backward_slots="auto"
    peak_auto, trace = _peak_over_steps(streamed, 3, seq)
    runtime = layerstream.get_runtime(streamed)
    stats = runtime.stats()
    assert stats["backward_slots"] == 4 and stats["backward_slot_peak_bytes"] == 4 * runtime.pool.slot_bytes
    layerstream.unstream_model(streamed, device="cpu")
    stream(plain, "cuda", slots=2, prefetch=1, backward_slots=0)
    peak_plain, _ = _peak_over_steps(plain, 3, seq)
    # the borrowed memory comes from the loss phase: the step's peak is the same
    assert peak_auto <= peak_plain, (peak_auto, peak_plain)
    # four steps each; every step after the first keeps 4 more layers across its boundary
    assert layerstream.get_runtime(plain).stats()["layer_loads"] - stats["layer_loads"] == 3 * 4
    resident.to("cuda")
    train_steps(resident, 1, "cuda", seq=seq)
    assert_traces_equal(trace, train_steps(resident, 3, "cuda", seq=seq))


@pytest.mark.gpu
def test_auto_backward_slots_stop_borrowing_when_the_memory_is_not_below_the_peak(expandable, caplog):
    """As if the loss held no logits (a fused loss): the planner predicts room, the
    measured peak does not have it, so no slot is allocated and the run says so once."""
    streamed, resident = peft_pair("llama", layers=8, attn="eager", **LOSS_HEAVY)
    stream(streamed, "cuda", slots=2, prefetch=1)
    runtime = layerstream.get_runtime(streamed)
    original = runtime.backward.decide

    def decide(*args):
        count = original(*args)
        runtime.backward._margin = 1 << 40  # nothing fits below the peak with this margin
        return count

    runtime.backward.decide = decide
    with caplog.at_level("WARNING", logger="layerstream"):
        trace = train_steps(streamed, 3, "cuda", seq=256)
    assert caplog.text.count("not used:") == 1 and "would pass this run's peak" in caplog.text
    assert runtime.pool.borrowed_peak_bytes == 0
    resident.to("cuda")
    assert_traces_equal(trace, train_steps(resident, 3, "cuda", seq=256))


@pytest.mark.gpu
def test_auto_takes_no_backward_slots_under_a_vram_budget(expandable, caplog):
    streamed, _ = peft_pair("llama", layers=8, attn="eager", **LOSS_HEAVY)
    stream(streamed, "cuda", slots=2, prefetch=1, vram_budget="8GiB")
    with caplog.at_level("INFO", logger="layerstream"):
        train_steps(streamed, 2, "cuda", seq=256)
    assert layerstream.get_runtime(streamed).stats()["backward_slots"] == 0
    assert "no backward slots: under vram_budget" in caplog.text


def test_a_backward_slot_without_memory_is_dropped_once_loudly_and_training_stays_exact(monkeypatch, caplog):
    """The allocation of a backward slot fails (no room on the GPU): the planner stops
    using that slot, the run warns once, and the layers it would have kept load into
    the ring instead, bit for bit the same."""
    streamed, resident = peft_pair("llama", layers=8)
    stream(streamed, "cpu", slots=2, prefetch=1, backward_slots=2)
    pool = layerstream.get_runtime(streamed).pool
    original = pool.allocate

    def allocate(slot):
        if slot == pool.ring_slots:  # the first backward slot never gets memory
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        original(slot)

    monkeypatch.setattr(pool, "allocate", allocate)
    with caplog.at_level("WARNING", logger="layerstream"):
        trace = train_steps(streamed, 4)
    assert_traces_equal(trace, train_steps(resident, 4))
    assert caplog.text.count("not used: the GPU has no room for it") == 1
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["backward_slots"] == 1 and stats["backward_slot_peak_bytes"] == pool.slot_bytes


def test_the_summary_says_why_auto_takes_no_backward_slots(monkeypatch):
    from layerstream.config import StreamConfig
    from layerstream.runtime.backward_slots import BackwardSlots

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(backward_mod, "expandable_segments", lambda: False)
    assert "needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in BackwardSlots(
        StreamConfig(device="cuda:0", vram_budget=None)
    ).note(0, cuda=True)
    monkeypatch.setattr(backward_mod, "expandable_segments", lambda: True)
    assert "decided at the first training step" in BackwardSlots(StreamConfig(device="cuda:0", vram_budget=None)).note(
        0, cuda=True
    )
    assert "resident window" in BackwardSlots(StreamConfig(device="cuda:0", vram_budget="8GiB")).note(0, cuda=True)
    assert "resident window" in BackwardSlots(StreamConfig(device="cuda:0")).note(0, cuda=True), (
        "the default budget, auto, leaves the memory to the window"
    )
    assert (
        BackwardSlots(StreamConfig(device="cuda:0", backward_slots=2)).note(2, cuda=True)
        == "2 backward slot(s), allocated outside the loss"
    )
