"""The resident window's size from measured memory (window.WindowSizer): pure logic."""

from layerstream.window import Reading, WindowSizer, margin_bytes

GiB = 1 << 30
LAYER = GiB // 2


def _reading(window=0, tokens=2048, peak=6 * GiB, start=4 * GiB, peak_allocated=5 * GiB, retries=0):
    return Reading(window=window, tokens=tokens, peak_reserved=peak, start_allocated=start,
                   peak_allocated=peak_allocated, retries=retries)


def test_no_window_before_a_step_was_measured():
    assert WindowSizer(32, LAYER).size(24 * GiB, 2048, 0) == 0


def test_the_window_takes_the_whole_layers_between_the_measured_peak_and_the_limit_less_the_margin():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(peak=6 * GiB))
    limit = 12 * GiB
    expected = (limit - margin_bytes(limit) - 6 * GiB) // LAYER
    assert sizer.size(limit, 2048, 0) == expected == 11
    assert sizer.size(1000 * GiB, 2048, 0) == 32, "never more than the stack"


def test_a_measurement_with_the_window_in_place_is_the_new_reference():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(peak=6 * GiB))
    sizer.record(_reading(window=11, peak=6 * GiB + 11 * LAYER + GiB))  # a GiB more than the layers explain
    assert sizer.size(12 * GiB, 2048, 11) == 9


def test_a_step_at_the_allocators_limit_gives_a_layer_back():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(window=4, peak=8 * GiB, retries=3))
    assert sizer.size(20 * GiB, 2048, 4) == 3


def test_more_tokens_than_measured_shrink_the_window_before_the_step():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(window=10, tokens=2048, peak=11 * GiB, start=8 * GiB, peak_allocated=10 * GiB))
    # twice the tokens: the 2 GiB the step allocated on top grows to 4 GiB, a 13 GiB peak;
    # under 12 GiB less the 384 MiB margin that is 1.375 GiB too much: 3 layers fewer
    limit = 12 * GiB
    assert margin_bytes(limit) == 384 * 2**20
    assert sizer.size(limit, 4096, 10) == 7
    assert sizer.size(limit, 2048, 10) == 10 + (limit - margin_bytes(limit) - 11 * GiB) // LAYER == 11
    assert sizer.size(limit, 1024, 10) == sizer.size(limit, 2048, 10), "fewer tokens never grow it"


def test_a_shorter_step_that_used_more_than_predicted_raises_the_prediction():
    sizer = WindowSizer(32, LAYER)
    sizer.record(_reading(tokens=2048, peak=6 * GiB))
    before = sizer.size(12 * GiB, 2048, 0)
    sizer.record(_reading(tokens=1024, peak=7 * GiB))
    assert sizer.size(12 * GiB, 2048, 0) == before - 2


def test_after_running_out_of_memory_the_window_frees_the_allocation_and_the_margin_and_stays_below():
    sizer = WindowSizer(32, LAYER)
    limit = 12 * GiB
    shrunk = sizer.shrink_after_oom(10, GiB, limit)
    assert shrunk == 10 - -(-(GiB + margin_bytes(limit)) // LAYER)
    sizer.max_window = shrunk
    sizer.record(_reading(peak=GiB))
    assert sizer.size(limit, 2048, 0) == shrunk, "never back to a size that ran out of memory"
    assert sizer.shrink_after_oom(1, 1, limit) == 0
