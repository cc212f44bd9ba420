"""The resident window's size from measured memory (window.WindowSizer): pure logic."""

import dataclasses

from layerstream.decisions.window import Reading, WindowSizer, margin_bytes

GiB = 1 << 30
LAYER = GiB // 2


def _reading(window=0, tokens=2048, allocated=5 * GiB, reserved=None, start=None):
    """A step's reading; by default it began with 4 GiB held and its window's layers."""
    return Reading(
        window=window,
        tokens=tokens,
        peak_reserved=reserved if reserved is not None else allocated + GiB // 4,
        start_allocated=start if start is not None else 4 * GiB + window * LAYER,
        peak_allocated=allocated,
        retries=0,
    )


def test_no_window_before_a_step_was_measured():
    assert WindowSizer(32, LAYER).size(24 * GiB, 2048, 0) == 0


def test_the_window_takes_the_whole_layers_between_the_first_steps_reserved_peak_and_the_limit():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(allocated=5 * GiB, reserved=6 * GiB))  # 1 GiB of the allocator's own
    limit = 12 * GiB
    assert sizer.overhead == GiB
    assert sizer.size(limit, 2048, 0) == (limit - margin_bytes(limit) - 6 * GiB) // LAYER == 11
    assert sizer.size(1000 * GiB, 2048, 0) == 32, "never more than the stack"


def test_a_step_that_touched_the_limit_caps_the_window_at_what_it_ran_with():
    """Allocator retries mean the step reached the limit: fragmentation, not the allocated
    bytes, decided there, so no prediction from those bytes may grow the window past it."""
    limit = 12 * GiB
    at_edge = dataclasses.replace(_reading(allocated=5 * GiB, reserved=6 * GiB), retries=3)
    sizer = WindowSizer(32, LAYER)
    sizer.record(at_edge)
    assert sizer.size(limit, 2048, 0) == 0
    calm = WindowSizer(32, LAYER)
    calm.record(dataclasses.replace(at_edge, retries=0))
    assert calm.size(limit, 2048, 0) == 11, "the same step without retries grows it"
    calm.record(dataclasses.replace(_reading(window=4, allocated=5 * GiB + 4 * LAYER), retries=1))
    assert calm.size(limit, 2048, 4) == 4, "nor past a later size that touched the limit"
    assert calm.size(limit, 16384, 4) < 4, "shrinking for longer steps still happens"


def test_later_steps_count_their_allocated_peak_and_the_overhead_not_their_reserved_peak():
    """Under a cap the allocator reserves up to the cap and recycles: a step's reserved peak
    says nothing about its need once a window is in place."""
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(allocated=5 * GiB, reserved=6 * GiB))
    sizer.record(_reading(window=11, allocated=5 * GiB + 11 * LAYER, reserved=12 * GiB))
    assert sizer.size(12 * GiB, 2048, 11) == 11, "the window holds: it measured as predicted"
    sizer.record(_reading(window=11, allocated=5 * GiB + 11 * LAYER + GiB, reserved=12 * GiB))
    assert sizer.size(12 * GiB, 2048, 11) == 9, "a GiB more than the layers explain: two layers fewer"


def test_more_tokens_than_measured_shrink_the_window_before_the_step():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(window=10, tokens=2048, allocated=10 * GiB, reserved=10 * GiB, start=8 * GiB))
    # twice the tokens: the 2 GiB the step allocated on top grows to 4 GiB, a 12 GiB peak;
    # under 12 GiB less the 384 MiB margin that is 0.375 GiB too much: one layer fewer
    limit = 12 * GiB
    assert margin_bytes(limit) == 384 * 2**20
    assert sizer.size(limit, 4096, 10) == 9
    assert sizer.size(limit, 2048, 10) == 10 + (limit - margin_bytes(limit) - 10 * GiB) // LAYER == 13
    assert sizer.size(limit, 1024, 10) == sizer.size(limit, 2048, 10), "fewer tokens never grow it"


def test_a_shorter_step_that_used_more_than_predicted_raises_the_prediction():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(tokens=2048, allocated=6 * GiB, reserved=6 * GiB))
    before = sizer.size(12 * GiB, 2048, 0)
    sizer.record(_reading(tokens=1024, allocated=7 * GiB))
    assert sizer.size(12 * GiB, 2048, 0) == before - 2


def test_after_running_out_of_memory_the_window_frees_the_allocation_and_the_margin_and_stays_below():
    sizer = WindowSizer(32, LAYER)
    limit = 12 * GiB
    shrunk = sizer.shrink_after_oom(10, GiB, limit)
    assert shrunk == 10 - -(-(GiB + margin_bytes(limit)) // LAYER)
    sizer.max_window = shrunk
    sizer.record(_reading(allocated=GiB, reserved=GiB))
    assert sizer.size(limit, 2048, 0) == shrunk, "never back to a size that ran out of memory"
    assert sizer.shrink_after_oom(1, 1, limit) == 0


def test_memory_a_step_left_allocated_is_room_the_next_step_does_not_have():
    """An optimizer creates its state at its first step(), after the first training step's
    peak: the second step runs that much higher than the first measured. A window filled to
    the margin from the first step alone runs the second out of memory when the state is
    larger than the margin; counted, the second step stays under the limit."""
    limit, state = 12 * GiB, 3 * GiB // 4  # AdamW state of LoRA r32 on an 8B model: ~0.7 GB
    first = _reading(allocated=8 * GiB, reserved=8 * GiB, start=4 * GiB)

    def second_step_peak(end_allocated):
        sizer = WindowSizer(32, LAYER // 4)
        sizer.record(dataclasses.replace(first, end_allocated=end_allocated))
        window = sizer.size(limit, 2048, 0)
        return first.peak_allocated + state + window * sizer.layer_bytes

    assert second_step_peak(first.start_allocated + state) <= limit - margin_bytes(limit) + LAYER // 4
    assert second_step_peak(None) > limit, "unmeasured, the state runs the second step out of memory"


def test_a_step_that_left_nothing_behind_gives_back_the_room_at_the_next_reading():
    sizer = WindowSizer(32, LAYER)
    sizer.record(
        dataclasses.replace(_reading(allocated=6 * GiB, reserved=6 * GiB, start=4 * GiB), end_allocated=5 * GiB)
    )
    held_back = sizer.size(12 * GiB, 2048, 0)
    sizer.record(
        dataclasses.replace(_reading(allocated=7 * GiB, reserved=7 * GiB, start=5 * GiB), end_allocated=5 * GiB)
    )
    assert sizer.size(12 * GiB, 2048, 0) == held_back, "the state, now inside the peak, is counted once"


# -- whole runs: a model of a training loop driving the sizer as the runtime does -------------
def _run(
    tokens,
    *,
    limit=12 * GiB,
    held=4 * GiB,
    layer=128 * 2**20,
    act=1 << 20,
    inputs=8704,
    grads,
    state,
    state_temps=0,
    accumulation=1,
    resets=3,
    set_to_none=True,
):
    """Device memory of a LoRA training loop, step by step: ``held`` bytes between steps, the
    window's layers, each step's inputs (``inputs`` per token, alive from the step's start)
    and activations (``act`` per token, at the backward peak); gradients created in backward
    and freed after the optimizer step (zeroed and kept with ``set_to_none=False``); the
    optimizer's ``state`` created at its first step
    (with ``state_temps`` more while it runs). Readings are taken as the runtime takes them:
    at the next step's start, the peak reset for ``resets`` steps after a window change.
    Returns (window, peak) per step."""
    sizer = WindowSizer(64, layer)
    current, peak, window, steps = held, held, 0, []
    measured = start = start_inputs = start_peak = grads_at_start = None
    resets_left, have_grads, have_state = resets, False, False
    for index, count in enumerate(tokens):
        current += count * inputs
        peak = max(peak, current)
        if measured is not None:
            sizer.record(
                Reading(
                    window=window,
                    tokens=measured,
                    peak_reserved=peak,
                    start_allocated=start,
                    peak_allocated=peak,
                    retries=0,
                    start_inputs=start_inputs,
                    end_allocated=current,
                    end_inputs=count * inputs,
                    own_peak=start_peak is None or peak > start_peak,
                    grads_at_start=grads_at_start,
                    grads_at_end=have_grads,
                )
            )
        target = sizer.size(limit, count, window)
        if target != window:
            current += (target - window) * layer
            window, resets_left = target, resets
        measured, start, start_inputs, grads_at_start = count, current, count * inputs, have_grads
        if resets_left > 0:
            peak, start_peak = current, None
        else:
            start_peak = peak
        resets_left -= 1
        step_peak = current + count * act + (0 if have_grads else grads)
        if not have_grads:
            current, have_grads = current + grads, True
        current -= count * inputs
        if (index + 1) % accumulation == 0:
            step_peak = max(step_peak, current + (0 if have_state else state) + state_temps)
            if not have_state:
                current, have_state = current + state, True
            if set_to_none:
                current, have_grads = current - grads, False
        peak = max(peak, step_peak)
        steps.append((window, step_peak))
    return steps


def _changes(steps):
    return sum(1 for (a, _), (b, _) in zip(steps, steps[1:]) if a != b)


def test_a_run_never_plans_past_the_limit_when_the_optimizers_state_comes_after_the_first_peak():
    limit = 12 * GiB
    for tokens in ([65536] * 4, [65536, 8192, 65536, 65536], [131072, 8192, 131072, 131072]):
        steps = _run(tokens, act=24 << 10, grads=3 * GiB // 8, state=3 * GiB // 4)
        assert max(peak for _, peak in steps) <= limit, tokens
        assert steps[-1][0] > 0, "the window still takes what is left"


def test_with_gradient_accumulation_the_window_settles_and_never_runs_out():
    limit = 12 * GiB
    for tokens in ([4096] * 48, [4096] + [4032] * 47):
        steps = _run(tokens, grads=GiB // 2, state=GiB, accumulation=4)
        assert max(peak for _, peak in steps) <= limit, tokens
        assert _changes(steps[8:]) == 0, "no window change once the first cycles are measured"


def test_an_optimizer_step_that_is_the_first_peak_holds_the_window_back_until_a_longer_step():
    """When the first step's peak is the optimizer's first step() (short batches, large
    trainable tensors), its new state is counted twice: in that peak and in the memory held
    afterwards. The window stays smaller by that much, never out of memory, until a step
    with more tokens is measured."""
    limit, layer = int(10.4 * GiB), 128 * 2**20
    run = dict(limit=limit, act=512 << 10, grads=GiB, state=2 * GiB, state_temps=GiB)
    held_back = _run([1024] + [512] * 7, **run)
    assert max(peak for _, peak in held_back) <= limit
    assert held_back[-1][0] >= 16 - 2 * GiB // layer, "held back by at most the state"
    recovered = _run([1024] + [512] * 3 + [2048] + [512] * 3, **run)
    assert max(peak for _, peak in recovered) <= limit
    assert recovered[-1][0] >= 14, "a longer step's reading, where nothing grew, gives the room back"


def test_a_reading_whose_peak_is_an_earlier_steps_is_not_used():
    """Once the window holds still the peak is no longer reset at each step: a step whose
    peak did not rise above the one standing says nothing about its own need."""
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(allocated=6 * GiB, reserved=6 * GiB))
    before = sizer.size(12 * GiB, 2048, 0)
    stale = dataclasses.replace(_reading(allocated=9 * GiB, reserved=9 * GiB, start=3 * GiB), own_peak=False)
    sizer.record(stale)
    assert sizer.size(12 * GiB, 2048, 0) == before
    sizer.record(dataclasses.replace(stale, own_peak=True))
    assert sizer.size(12 * GiB, 2048, 0) < before, "the same reading, its own peak, is used"


def test_a_shorter_step_that_rose_more_is_predicted_at_what_it_measured():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(tokens=4096, allocated=8 * GiB, reserved=8 * GiB))
    for peak in (9 * GiB, 9 * GiB, 10 * GiB):
        sizer.record(_reading(tokens=2048, allocated=peak, reserved=peak))
        assert sizer.predicted_peak(2048, 0) == peak, "the prediction catches up in one reading"


def test_the_cuda_meter_reads_a_steps_own_peak_and_what_it_left_allocated(monkeypatch):
    """CudaMeter over a stand-in for torch's allocator statistics: the step's start, its
    inputs, the next step's inputs, and whether the peak is the step's own."""
    import torch

    from layerstream.runtime.meter import CudaMeter

    stats = {"allocated_bytes.all.current": 4 * GiB, "allocated_bytes.all.peak": 4 * GiB}
    stats.update({"reserved_bytes.all.peak": 5 * GiB, "num_alloc_retries": 0})
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: stats.update({"allocated_bytes.all.peak": 0})
    )
    meter = CudaMeter(torch.device("cuda:0"), budget=12 * GiB)
    meter.begin(reset=True, inputs=GiB // 8)
    stats.update({"allocated_bytes.all.peak": 9 * GiB, "allocated_bytes.all.current": 5 * GiB})
    reading = meter.read(window=2, tokens=2048, next_inputs=GiB // 4)
    assert (reading.start_allocated, reading.peak_allocated, reading.end_allocated) == (4 * GiB, 9 * GiB, 5 * GiB)
    assert (reading.start_inputs, reading.end_inputs, reading.own_peak) == (GiB // 8, GiB // 4, True)
    meter.begin(reset=False)  # the window holds still: the 9 GiB peak stands
    stats["allocated_bytes.all.peak"] = 9 * GiB
    assert not meter.read(window=2, tokens=2048).own_peak, "the peak did not rise: an earlier step's"
    stats["allocated_bytes.all.peak"] = 10 * GiB
    assert meter.read(window=2, tokens=2048).own_peak


# 70B QLoRA-like: 450 MiB layers, fp32 LoRA gradients, AdamW state twice their size
_70B = dict(held=6 * GiB, layer=450 * 2**20, act=3 * 2**20, inputs=16384, grads=int(0.83e9), state=int(1.66e9))


def test_with_accumulation_the_window_waits_for_the_first_optimizer_step():
    """The first optimizer step() comes after several micro-steps and its state plus its
    buffers can exceed what the micro-steps used: the window stays as it is until a step
    whose gradients were freed has been read."""
    run = dict(_70B, limit=24 * GiB, grads=int(1.66e9), state=int(3.3e9), state_temps=int(1.66e9), accumulation=4)
    steps = _run([512] * 12, **run)
    assert max(peak for _, peak in steps) <= 24 * GiB
    assert [window for window, _ in steps[:4]] == [0] * 4 and steps[-1][0] > 0


def test_with_accumulation_and_random_lengths_no_micro_step_runs_out():
    import random

    for seed in range(40):
        rng = random.Random(seed)
        lengths = [rng.randint(512, 1024) for _ in range(48)]
        for accumulation in (2, 4, 8):
            steps = _run(lengths, **dict(_70B, limit=16 * GiB, accumulation=accumulation))
            assert max(peak for _, peak in steps) <= 16 * GiB, (seed, accumulation)
            assert _changes(steps[3 * accumulation + 8 :]) <= 3, (seed, accumulation)


def test_where_zero_grad_keeps_the_gradients_the_window_grows_after_the_state_appears():
    """zero_grad(set_to_none=False): gradients are never freed, so an optimizer step shows
    only as memory held with them growing by the new state."""
    for accumulation in (1, 4):
        steps = _run([2048] * 40, **dict(_70B, limit=24 * GiB, accumulation=accumulation, set_to_none=False))
        assert max(peak for _, peak in steps) <= 24 * GiB, accumulation
        if accumulation > 1:  # the state grows memory held with gradients: seen, the window grows
            assert steps[-1][0] > 0
