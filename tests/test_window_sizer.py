"""The resident window's size from measured memory (window.WindowSizer): pure logic."""

import dataclasses

from layerstream.window import Reading, WindowSizer, margin_bytes

GiB = 1 << 30
LAYER = GiB // 2


def _reading(window=0, tokens=2048, allocated=5 * GiB, reserved=None, start=4 * GiB):
    return Reading(
        window=window,
        tokens=tokens,
        peak_reserved=reserved if reserved is not None else allocated + GiB // 4,
        start_allocated=start,
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
