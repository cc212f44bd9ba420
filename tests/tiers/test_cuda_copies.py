"""On CUDA, copies race compute: delayed copies must still give bit-exact results.

A sleep kernel queued on the copy stream before every copy makes each copy land long
after the compute stream reaches the layer; only the ready-event wait keeps the result
exact. The negative control drops that wait and must see wrong numbers.
"""

import pytest
import torch

import layerstream

from tiny import assert_traces_equal, batch, peft_pair, stream, train_steps

pytestmark = pytest.mark.gpu

DELAY_CYCLES = 2_000_000  # ~1 ms on an H200: far longer than a tiny layer's compute


def _delay_copies(runtime, monkeypatch, cycles=DELAY_CYCLES):
    pool = runtime.pool
    original = pool.load

    def delayed(record, slot, compute=None, source=None):
        with torch.cuda.stream(pool.copy_stream):
            pool.copy_stream.wait_stream(torch.cuda.current_stream(pool.device))
            torch.cuda._sleep(cycles)
        return original(record, slot, compute, source)

    monkeypatch.setattr(pool, "load", delayed)


def _race_pair(dtype, monkeypatch, layers=8, route="direct", delay=DELAY_CYCLES):
    streamed, resident = peft_pair(
        "llama", layers=layers, dtype=dtype, attn="eager", hidden_size=256, intermediate_size=1024, head_dim=64
    )
    stream(streamed, "cuda", slots=2, prefetch=1)
    resident.to("cuda")
    runtime = layerstream.get_runtime(streamed)
    if route == "torch":  # the path taken where no shared CUDA runtime can be called
        runtime.pool._rt = None
    _delay_copies(runtime, monkeypatch, delay)
    return streamed, resident


def test_copies_call_the_cuda_runtime_directly():
    streamed, _ = peft_pair("llama", layers=3)
    stream(streamed, "cuda", slots=2, prefetch=1)
    assert layerstream.get_runtime(streamed).pool._direct(), (
        "no shared libcudart found: copies fall back to the slower torch calls"
    )


@pytest.mark.parametrize("route", ["direct", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delayed_copies_stay_exact_in_training(dtype, route, monkeypatch):
    streamed, resident = _race_pair(dtype, monkeypatch, route=route)
    assert_traces_equal(train_steps(streamed, 10, "cuda", seq=4), train_steps(resident, 10, "cuda", seq=4))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["stalls"] > 0 and stats["stall_seconds"] > 0, "the race must have been real"
    assert stats["h2d_seconds"] > 0 and stats["h2d_gbps"] > 0


@pytest.mark.parametrize("route", ["direct", "torch"])
def test_delayed_copies_stay_exact_in_inference(route, monkeypatch):
    streamed, resident = _race_pair(torch.bfloat16, monkeypatch, route=route)
    ids = batch(96, seq=4, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)


def test_skipping_the_ready_wait_is_caught(monkeypatch):
    # ten times the delay: with another process sharing the GPU (a suite run in parallel),
    # the compute stream can stall long enough for a short delayed copy to land in time
    streamed, resident = _race_pair(torch.bfloat16, monkeypatch, delay=10 * DELAY_CYCLES)
    pool = layerstream.get_runtime(streamed).pool

    def acquire_without_wait(slot, layer, compute=None):
        assert pool.owner[slot] == layer

    monkeypatch.setattr(pool, "acquire", acquire_without_wait)
    ids = batch(96, seq=4, device="cuda")
    with torch.no_grad():
        mismatches = sum(
            not torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits) for _ in range(5)
        )
    assert mismatches > 0


def test_streamed_host_store_is_pinned():
    streamed, _ = peft_pair("llama", layers=3)
    stream(streamed, "cuda", slots=2, prefetch=1)
    runtime = layerstream.get_runtime(streamed)
    assert runtime.stats()["pinned"] is True
    assert all(v.is_pinned() for r in runtime.records for v in r.host_values)


def test_refused_pinning_falls_back_loudly_and_clears_the_cuda_error(monkeypatch, caplog):
    from layerstream.system import cudart

    original = cudart.register_host

    def refuse(tensor, **kwargs):
        # a real CUDA refusal: registering the same pages twice fails
        original(tensor, **kwargs)
        try:
            original(tensor, **kwargs)
        finally:
            cudart.unregister_host(tensor)

    monkeypatch.setattr(cudart, "register_host", refuse)
    streamed, resident = peft_pair("llama", layers=4, attn="eager")
    with caplog.at_level("WARNING", logger="layerstream"):
        stream(streamed, "cuda", slots=2, prefetch=1)
    assert "could not page-lock" in caplog.text and "8x slower" in caplog.text
    assert layerstream.get_runtime(streamed).stats()["pinned"] is False
    resident.to("cuda")
    torch.cuda.synchronize()  # no stale CUDA error surfaces here or in the steps below
    assert_traces_equal(train_steps(streamed, 3, "cuda"), train_steps(resident, 3, "cuda"))


def test_timeline_on_cuda_places_every_compute_inside_its_layers_residency(tmp_path):
    streamed, _ = peft_pair("llama", layers=6, attn="eager", hidden_size=256, intermediate_size=1024, head_dim=64)
    stream(streamed, "cuda", slots=2, prefetch=1)
    train_steps(streamed, 1, "cuda", seq=4)
    runtime = layerstream.get_runtime(streamed)
    with runtime.timeline(str(tmp_path)) as spans:
        train_steps(streamed, 1, "cuda", seq=4)
    copies = [s for s in spans if s.kind == "copy"]
    computes = [s for s in spans if s.row == "compute"]
    assert len(copies) == 2 * (6 - 2) and all(s.end_ms > s.start_ms for s in copies)
    assert len(computes) == 12
    for span in computes:
        holding = [
            h
            for h in spans
            if h.kind == "hold" and h.slot == span.slot and h.start_ms <= span.start_ms and span.end_ms <= h.end_ms
        ]
        assert [h.layer for h in holding] == [span.layer], span
    assert (tmp_path / "layerstream-trace.json").exists()


def test_timeline_on_cuda_draws_a_generate_call_as_one_span():
    """A step that generates (TRL's GRPO and RLOO): the call is one span with no marks in it,
    and the training step after it still computes each layer inside that layer's residency."""
    streamed, _ = peft_pair("llama", layers=6, attn="eager", hidden_size=256, intermediate_size=1024, head_dim=64)
    stream(streamed, "cuda", slots=2, prefetch=1)
    train_steps(streamed, 1, "cuda", seq=4)
    runtime = layerstream.get_runtime(streamed)
    prompt = torch.arange(3, 11, device="cuda").reshape(2, 4)
    with runtime.timeline() as spans:
        streamed.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        train_steps(streamed, 1, "cuda", seq=4)
    (call,) = [s for s in spans if s.kind == "generate"]
    computes = [s for s in spans if s.row == "compute" and s.kind != "generate"]
    assert len(computes) == 12 and all(s.start_ms >= call.end_ms for s in computes)
    assert not [s for s in spans if s.kind == "copy" and call.start_ms < s.start_ms < call.end_ms]
    for span in computes:
        holding = [
            h
            for h in spans
            if h.kind == "hold" and h.slot == span.slot and h.start_ms <= span.start_ms and span.end_ms <= h.end_ms
        ]
        assert [h.layer for h in holding] == [span.layer], span


def test_timeline_records_each_compute_mark_once(monkeypatch):
    """A recorded step brackets every layer call with two events; each is recorded once
    (a new event's first record makes its handle, so taking one already recorded doubles it)."""
    streamed, _ = peft_pair("llama", layers=6, attn="eager", hidden_size=256, intermediate_size=1024, head_dim=64)
    stream(streamed, "cuda", slots=2, prefetch=1)
    train_steps(streamed, 1, "cuda", seq=4)
    runtime = layerstream.get_runtime(streamed)
    records = {}
    original = torch.cuda.Event.record

    def counted(event, stream=None):
        records[id(event)] = records.get(id(event), 0) + 1
        return original(event, stream)

    runtime.start_timeline()
    recording = runtime._recording
    monkeypatch.setattr(torch.cuda.Event, "record", counted)
    try:
        train_steps(streamed, 1, "cuda", seq=4)
    finally:
        monkeypatch.undo()
        runtime.finish_timeline()
    marks = [mark for *_, begin, end in recording.computes for mark in (begin, end)]
    assert len(marks) == 24
    assert [records.get(id(mark)) for mark in marks] == [1] * len(marks)


# ~20 ms: longer than the host takes to issue a tiny layer (1-2 ms on the GPU machine),
# so the compute stream falls far behind the host and an unguarded copy really races
SLOW_READER_CYCLES = 40_000_000


def _delay_compute(monkeypatch, backward_too=False):
    """Queue a sleep before every layer's kernels (and, optionally, before its backward
    kernels), so the kernels reading a slot run long after the host issued them."""
    from layerstream.modules import layer as layer_mod

    original = layer_mod.call_unstreamed

    def delayed(layer, args, kwargs):
        torch.cuda._sleep(SLOW_READER_CYCLES)
        out = original(layer, args, kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        if backward_too and hidden.requires_grad:
            hidden.register_hook(lambda grad: (torch.cuda._sleep(SLOW_READER_CYCLES), grad)[1])
        return out

    monkeypatch.setattr(layer_mod, "call_unstreamed", delayed)


def _slow_compute_pair(monkeypatch, backward_too=False):
    streamed, resident = peft_pair(
        "llama", layers=8, dtype=torch.bfloat16, attn="eager", hidden_size=256, intermediate_size=1024, head_dim=64
    )
    stream(streamed, "cuda", slots=2, prefetch=1)
    resident.to("cuda")
    _delay_compute(monkeypatch, backward_too)
    return streamed, resident


def test_copies_wait_for_slow_readers_of_the_slot_they_overwrite(monkeypatch):
    streamed, resident = _slow_compute_pair(monkeypatch, backward_too=True)
    assert_traces_equal(train_steps(streamed, 4, "cuda", seq=4), train_steps(resident, 4, "cuda", seq=4))


def test_skipping_the_released_wait_is_caught(monkeypatch):
    streamed, resident = _slow_compute_pair(monkeypatch)
    pool = layerstream.get_runtime(streamed).pool
    monkeypatch.setattr(pool, "mark_released", lambda slot, compute=None: None)
    ids = batch(96, seq=4, device="cuda")
    with torch.no_grad():
        mismatches = sum(
            not torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits) for _ in range(5)
        )
    assert mismatches > 0


def test_releasing_a_slot_when_its_call_returns_is_too_early_for_backward(monkeypatch):
    """Backward kernels that read a slot are queued after the recompute returns; a release
    at the end of the call (instead of at the next visit) must give wrong gradients."""
    from layerstream.modules import layer as layer_mod

    streamed, resident = _slow_compute_pair(monkeypatch, backward_too=True)
    runtime = layerstream.get_runtime(streamed)
    pool = runtime.pool
    release = pool.mark_released
    monkeypatch.setattr(pool, "mark_released", lambda slot, compute=None: None)
    inner = layer_mod.call_unstreamed

    def release_at_return(layer, args, kwargs):
        out = inner(layer, args, kwargs)
        release(pool.owner.index(layer._layerstream_index))
        return out

    monkeypatch.setattr(layer_mod, "call_unstreamed", release_at_return)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 3, "cuda", seq=4), train_steps(resident, 3, "cuda", seq=4))


# -- offloaded activations: copies back race the recompute that reads them -----------------


def _offload_race_pair(monkeypatch, delay_copies=True, attn="eager", **model):
    from layerstream.long import offload

    shape = dict(hidden_size=256, intermediate_size=1024, head_dim=64) | model
    streamed, resident = peft_pair("llama", layers=8, dtype=torch.bfloat16, attn=attn, **shape)
    stream(streamed, "cuda", slots=2, prefetch=1, offload_activations=True)
    resident.to("cuda")
    offloader = layerstream.get_runtime(streamed).offload_policy.offloader
    if delay_copies:
        fetch = offload.ActivationOffloader._fetch

        def delayed(self, saved):
            if saved.device_copy is None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    torch.cuda._sleep(SLOW_READER_CYCLES)
            return fetch(self, saved)

        monkeypatch.setattr(offloader, "_fetch", delayed.__get__(offloader))
    return streamed, resident, offloader


def test_offloaded_inputs_copied_back_late_stay_exact(monkeypatch):
    """Each copy back lands ~20 ms after it is issued and every backward runs late, so the
    host frees and re-allocates copies far ahead of the GPU: only the stream ordering keeps
    the recompute reading its own input."""
    streamed, resident, offloader = _offload_race_pair(monkeypatch)
    _delay_compute(monkeypatch, backward_too=True)
    assert_traces_equal(train_steps(streamed, 3, "cuda", seq=16), train_steps(resident, 3, "cuda", seq=16))
    assert offloader.restored > 0


def test_reading_an_offloaded_input_before_its_copy_back_is_caught(monkeypatch):
    """Negative control: without the wait for the copy back, the late copies are read
    before they land and the gradients differ."""
    streamed, resident, offloader = _offload_race_pair(monkeypatch)
    fetch = offloader._fetch

    def unguarded(saved):
        fetch(saved)
        saved.ready = None  # the unpack then does not wait

    monkeypatch.setattr(offloader, "_fetch", unguarded)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 3, "cuda", seq=16), train_steps(resident, 3, "cuda", seq=16))


def _one_offloaded_input():
    from layerstream.long import offload

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached block of the same size elsewhere: reuse is then this block's
    offloader = offload.ActivationOffloader(torch.device("cuda"), num_layers=4, pin=True, verify=False)
    hidden = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    offloader.start_pass(hidden, store_bytes=0)
    saved = offloader._pack(hidden)
    torch.cuda.synchronize()
    with torch.cuda.stream(offloader.stream):  # the copy back then lands ~20 ms late
        torch.cuda._sleep(SLOW_READER_CYCLES)
    return offloader, hidden, saved


@pytest.mark.parametrize("tied", [False, True], ids=["own-stream", "negative-control-tied-to-copy-stream"])
def test_a_copy_backs_memory_is_reusable_once_read_even_while_the_copy_stream_is_behind(monkeypatch, tied):
    """The compute stream waited for the copy before reading it, so the memory is its own
    again once the reader frees it. Tied to the copy stream as well (record_stream, the
    control), the block stays unusable until that stream catches up: one more input held
    at the peak of every long backward."""
    offloader, hidden, saved = _one_offloaded_input()
    if tied:
        fetch = offloader._fetch

        def tied_to_copy_stream(saved):
            fetch(saved)
            saved.device_copy.record_stream(offloader.stream)

        monkeypatch.setattr(offloader, "_fetch", tied_to_copy_stream)
    out = offloader._unpack(saved)
    block = out.data_ptr()
    del out
    again = torch.empty_like(hidden)
    assert (again.data_ptr() == block) is not tied
    assert torch.equal(offloader._unpack(saved), hidden)  # a second backward (retain_graph) gets it again


@pytest.mark.parametrize("waits", [True, False], ids=["waits", "negative-control-without-wait"])
def test_a_copy_back_dropped_unread_cannot_land_in_reused_memory(monkeypatch, waits):
    """A copy back issued ahead and then dropped (the graph freed before its backward) frees
    memory the copy stream is still writing: the stream it belongs to waits for the copy
    first, or the late copy lands in whatever reused the memory."""
    from layerstream.long import offload

    if not waits:
        monkeypatch.setattr(offload._Saved, "__del__", lambda self: setattr(self.owner, "_live", self.owner._live - 1))
    offloader, hidden, saved = _one_offloaded_input()
    offloader._fetch(saved)
    block = saved.device_copy.data_ptr()
    del saved
    reused = torch.empty_like(hidden)
    assert reused.data_ptr() == block
    reused.fill_(7)
    torch.cuda.synchronize()
    assert torch.equal(reused, torch.full_like(hidden, 7)) is waits
