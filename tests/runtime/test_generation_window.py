"""The resident window around generation, in a process that has not trained yet: the first
``generate`` streams every layer and is measured, later calls keep as many layers on the
device as fit beside what a call of their size caches, and training takes the sizing over
once it begins. Tokens equal the resident model's whatever the window."""

import copy

import pytest
import torch
from peft import get_peft_model

import layerstream
from layerstream.decisions.window import MARGIN_BYTES, GenerationSizer, Reading

from tiny import lora_config, stream, tiny_model

LAYERS = 6
PER_TOKEN = 1 << 20  # what the fake device allocates per cached token during a call


class FakeMeter:
    """A device whose memory is the window's layers between calls, and PER_TOKEN per cached
    token during a call; its limit leaves room for ``room_layers`` layers beside a call of
    ``tokens`` tokens."""

    def __init__(self, runtime, tokens: int, room_layers: float):
        self.runtime = runtime
        self.layer = runtime.store.largest_layer_bytes
        self._limit = MARGIN_BYTES + PER_TOKEN * tokens + int(room_layers * self.layer)
        self.start = 0
        self.begun = 0

    def limit(self):
        return self._limit

    def allocated(self):
        return len(self.runtime.window) * self.layer

    def begin(self, reset, inputs=0, grads=False):
        self.start, self.begun = self.allocated(), self.begun + 1

    def read(self, window, tokens, next_inputs=0, grads=False):
        peak = self.start + PER_TOKEN * tokens
        return Reading(window, tokens, peak, self.start, peak, 0)

    def release_cache(self):
        pass


def _generate(model, batch: int):
    prompt = torch.arange(3, 3 + 4 * batch).reshape(batch, 4)
    return model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)


def _streamed_pair(adapters: bool = False):
    model = tiny_model("llama", layers=LAYERS)
    if adapters:
        model = get_peft_model(model, lora_config())
    resident = copy.deepcopy(model)
    stream(model)
    runtime = layerstream.get_runtime(model)
    runtime.resident_window.meter = FakeMeter(runtime, tokens=10, room_layers=3.5)
    return model, resident, runtime


def test_the_first_call_streams_every_layer_and_later_ones_keep_what_fits_beside_the_cache():
    model, resident, runtime = _streamed_pair()
    assert torch.equal(_generate(model, 1), _generate(resident, 1))  # caches 1 x (4 + 6) tokens
    assert runtime.window == []
    assert torch.equal(_generate(model, 1), _generate(resident, 1))
    assert len(runtime.window) == 3, "3.5 layers of room beside a 10-token call"
    assert layerstream.get_runtime(model).stats()["window_layers"] == 3


def test_a_call_that_caches_more_tokens_shrinks_the_window_first():
    model, resident, runtime = _streamed_pair()
    _generate(model, 1)
    _generate(model, 1)
    assert len(runtime.window) == 3
    assert torch.equal(_generate(model, 4), _generate(resident, 4))  # 40 tokens: 30 MiB more
    assert runtime.window == []


def test_once_training_begins_its_steps_size_the_window():
    model, resident, runtime = _streamed_pair(adapters=True)
    _generate(model, 1)
    ids = torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()  # training's first step is being measured
    window = runtime.resident_window
    begun, readings = window.meter.begun, window.sizer.readings
    # the step ran its backward: the call sizes the window for the next step, as its training
    # pass would (an online RL step generates first), from the step's reading
    assert torch.equal(_generate(model, 1), _generate(resident, 1))
    assert window.sizer.readings == readings + 1 and window.meter.begun == begun + 1
    assert torch.equal(_generate(model, 1), _generate(resident, 1))
    assert window.meter.begun == begun + 1, "no backward since: the step goes on, measured from then"


def test_a_longer_step_than_the_generation_sized_the_window_for_shrinks_it_first():
    """The window sized at a generation after a step's backward is for a step as long as
    that one; the training pass that follows with more tokens takes layers off first."""
    model, resident, runtime = _streamed_pair(adapters=True)
    for seq in (8, 8):  # two steps, their gradients freed: the window may grow after them
        ids = torch.randint(3, 90, (1, seq), generator=torch.Generator().manual_seed(seq))
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    assert torch.equal(_generate(model, 1), _generate(resident, 1))
    assert runtime.window, "sized at the generation for an 8-token step"
    longer = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(40))
    model(input_ids=longer, labels=longer).loss.backward()  # 40 MiB more than 8 tokens' rise
    assert runtime.window == []
    assert runtime.resident_window.window_changes[-1] == (40, 0)


def test_without_a_budget_generation_keeps_no_window():
    model = tiny_model("llama", layers=LAYERS)
    stream(model)
    for _ in range(2):
        _generate(model, 1)
    assert layerstream.get_runtime(model).window == []


def test_the_generation_sizer_scales_the_measured_rise_with_the_cached_tokens():
    sizer = GenerationSizer(num_layers=10, layer_bytes=1_000)
    limit = MARGIN_BYTES + 10_000  # 10,000 bytes above the margin
    assert sizer.size(limit, held=0, tokens=10) == 0, "nothing measured yet"
    sizer.record(Reading(window=0, tokens=10, peak_reserved=1_000, start_allocated=0, peak_allocated=1_000, retries=0))
    assert sizer.size(limit, held=0, tokens=10) == 9  # a 1,000-byte rise
    assert sizer.size(limit, held=0, tokens=50) == 5  # 100 bytes per token: 5,000
    assert sizer.size(limit, held=4_000, tokens=50) == 1
    assert sizer.size(limit, held=0, tokens=5) == 9, "fewer tokens never predict less than measured"


def test_a_larger_call_sized_from_a_smaller_ones_rise_gets_its_own_measurement_next_time():
    """A call's KV cache and activations grow with its tokens, plus a part that does not: a
    batch-64 call sized from batch 8's rise per token is sized cautiously at first (every
    fixed byte scaled up 8x), then from what calls of its own size rose."""
    sizer = GenerationSizer(num_layers=32, layer_bytes=1_000)
    limit = MARGIN_BYTES + 40_000
    reading = lambda tokens, rise: Reading(  # noqa: E731
        window=0, tokens=tokens, peak_reserved=rise, start_allocated=0, peak_allocated=rise, retries=0
    )
    sizer.record(reading(100, 3_000))  # 1,000 fixed + 20 a token
    assert sizer.size(limit, held=0, tokens=800) == 16  # scaled: 24,000 predicted
    sizer.record(reading(800, 17_000))  # what it rose: 1,000 + 16,000
    assert sizer.size(limit, held=0, tokens=800) == 23  # its own: 17,000
    assert sizer.size(limit, held=0, tokens=100) == 32, "a size measured before takes its own rise (3,000)"
    sizer.record(reading(800, 18_000))  # a call of that size that rose more: the most counts
    assert sizer.size(limit, held=0, tokens=800) == 22
    # an unmeasured size as before: the most any call rose, or the most per token scaled
    assert sizer.size(limit, held=0, tokens=400) == 22


class _OutOfMemoryOnce:
    """A pre-hook on the first layer that runs out of memory at its ``at``-th call, once:
    some tokens were drawn by then, so a run again from anywhere but the call's start
    draws others."""

    def __init__(self, at: int):
        self.calls, self.at = 0, at

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def _sample(model, seed: int = 5):
    torch.manual_seed(seed)
    prompt = torch.arange(3, 7).reshape(1, 4)
    return model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)


def test_a_call_out_of_memory_with_a_window_shrinks_it_and_draws_the_tokens_of_a_call_that_never_failed():
    model, resident, runtime = _streamed_pair()
    _generate(model, 1)
    _generate(model, 1)
    assert len(runtime.window) == 3
    failing = _OutOfMemoryOnce(at=4)  # the prompt, then three token steps
    handle = model.model.layers[0].register_forward_pre_hook(failing)
    try:
        sampled = _sample(model)
    finally:
        handle.remove()
    assert failing.calls > 4, "the call ran again"
    assert len(runtime.window) < 3 and runtime.stats()["oom_retries"] == 1
    assert torch.equal(sampled, _sample(resident))


def test_without_a_window_a_call_out_of_memory_is_explained_not_run_again():
    model, _, runtime = _streamed_pair()
    handle = model.model.layers[0].register_forward_pre_hook(_OutOfMemoryOnce(at=2))
    try:
        with pytest.raises(torch.OutOfMemoryError):
            _sample(model)
    finally:
        handle.remove()
    assert runtime.stats()["oom_retries"] == 0


def _continue_from(model, cache):
    """Greedy tokens after a prompt of 6 whose first 3 tokens ``cache`` holds already (the
    call caches 10 tokens, as the window was sized for)."""
    prompt = torch.arange(3, 9).reshape(1, 6)
    with torch.no_grad():
        model(input_ids=prompt[:, :3], past_key_values=cache, use_cache=True)
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
    return model.generate(prompt, past_key_values=cache, **kwargs)


def test_a_call_out_of_memory_with_a_cache_of_its_callers_is_explained_not_run_again():
    """The failed attempt added tokens to the cache the caller passed: run again, the call
    would decode after them and give other tokens than the resident model, without a word.
    Control: run again anyway (the check switched off), the tokens differ."""
    from transformers import DynamicCache

    from layerstream.integrations import generation

    model, resident, runtime = _streamed_pair()
    _generate(model, 1)
    _generate(model, 1)
    assert len(runtime.window) == 3
    handle = model.model.layers[0].register_forward_pre_hook(_OutOfMemoryOnce(at=4))
    try:
        with pytest.raises(
            torch.OutOfMemoryError, match="not run again with a smaller window: the past_key_values it was given"
        ):
            _continue_from(model, DynamicCache(config=model.config))
    finally:
        handle.remove()
    assert runtime.stats()["oom_retries"] == 0 and len(runtime.window) == 3
    expected = _continue_from(resident, DynamicCache(config=resident.config))
    assert torch.equal(_continue_from(model, DynamicCache(config=model.config)), expected), "a fresh cache fits"

    original = generation._not_run_again
    generation._not_run_again = lambda args, kwargs: ""
    handle = model.model.layers[0].register_forward_pre_hook(_OutOfMemoryOnce(at=4))
    try:
        again = _continue_from(model, DynamicCache(config=model.config))
    finally:
        handle.remove()
        generation._not_run_again = original
    assert runtime.stats()["oom_retries"] == 1
    assert not torch.equal(again, expected), "run again on the extended cache, the tokens differ"


@pytest.mark.parametrize("passed", ["by name", "by position"])
def test_a_call_out_of_memory_with_a_streamer_is_explained_not_run_again(passed):
    """Its streamer has shown the first tokens already: a second attempt would show them twice."""
    from transformers.generation.streamers import BaseStreamer

    class Shown(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value)

        def end(self):
            pass

    model, _, runtime = _streamed_pair()
    _generate(model, 1)
    _generate(model, 1)
    shown = Shown()
    handle = model.model.layers[0].register_forward_pre_hook(_OutOfMemoryOnce(at=4))
    try:
        with pytest.raises(torch.OutOfMemoryError, match="not run again with a smaller window: its streamer"):
            prompt, settings = torch.arange(3, 7).reshape(1, 4), dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
            if passed == "by name":
                model.generate(prompt, streamer=shown, **settings)
            else:  # generate(inputs, generation_config, logits_processor, ..., assistant_model, streamer)
                model.generate(prompt, None, None, None, None, None, None, shown, **settings)
    finally:
        handle.remove()
    assert shown.tokens and runtime.stats()["oom_retries"] == 0


@pytest.mark.gpu
def test_on_the_gpu_a_model_that_fits_keeps_every_layer_for_generation_and_copies_none():
    """The real device and its own memory readings: a model that fits the GPU generates
    from the window alone once a call was measured, with the resident model's tokens."""
    model = tiny_model("llama", layers=LAYERS)
    resident = copy.deepcopy(model).to("cuda")
    stream(model, "cuda", vram_budget="auto")
    runtime = layerstream.get_runtime(model)
    prompt = torch.arange(3, 11, device="cuda").reshape(2, 4)

    def generate(m):
        return m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)

    for _ in range(2):
        assert torch.equal(generate(model), generate(resident))
    assert len(runtime.window) == LAYERS
    loads = runtime.stats()["layer_loads"]
    assert torch.equal(generate(model), generate(resident))
    assert runtime.stats()["layer_loads"] == loads, "a layer was copied for a model held whole"


class StepMeter:
    """A device whose memory between calls is ``HELD`` plus the window's layers and whatever
    the ends brought back hold; a phase the test runs (``run``) allocates its bytes above
    that, and the peak since ``begin`` is what ``read`` reports."""

    HELD = 64 << 20

    def __init__(self, runtime, limit: int):
        self.runtime = runtime
        self.layer = runtime.store.largest_layer_bytes
        self._limit = limit
        self.extra = 0  # held by the ends brought back
        self.start = self.peak = 0

    def limit(self):
        return self._limit

    def allocated(self):
        return self.HELD + self.extra + len(self.runtime.window) * self.layer

    def begin(self, reset, inputs=0, grads=False):
        self.start = self.peak = self.allocated()

    def run(self, rise: int) -> int:
        """A phase that allocates ``rise`` bytes above what is held now; its peak."""
        self.peak = max(self.peak, self.allocated() + rise)
        return self.allocated() + rise

    def read(self, window, tokens, next_inputs=0, grads=False):
        peak = self.peak
        return Reading(window, tokens, peak, self.start, peak, 0, end_allocated=self.allocated(), grads_at_end=grads)

    def release_cache(self):
        pass


class _Ends:
    """Stands in for ``EndsOnDemand`` with ends of ``nbytes`` in host memory: they come back
    when the room offered holds them (the meter then holds them)."""

    def __init__(self, meter, nbytes: int):
        self.meter, self.nbytes, self.back = meter, nbytes, False

    @property
    def device_bytes(self):
        return self.meter.extra

    def bring_back(self, room, tokens):
        if not self.back and room >= self.nbytes:
            self.back, self.meter.extra = True, self.nbytes


def test_the_window_sized_at_a_generation_leaves_room_for_the_call_though_no_step_measured_one():
    """An online RL step generates, then trains. Its first generation comes before training
    begins (the generation sizer measures it), so the first training step's measurement
    holds no generation; a generation may rise more than a training pass (GRPO's caches
    the accumulated micro-batches' sequences). The window sized when the next step's
    generation starts, and the ends brought back then, leave room for the call as it was
    measured: a call out of memory with the ends back and no window left to give up could
    not run again."""
    model, _, runtime = _streamed_pair()
    window = runtime.resident_window
    layer = runtime.store.largest_layer_bytes
    train_rise, gen_rise = 2 * layer, 5 * layer
    limit = MARGIN_BYTES + StepMeter.HELD + train_rise + int(5.5 * layer)  # 5 layers beside training
    meter = window.meter = StepMeter(runtime, limit)
    ends = _Ends(meter, layer)

    def generation():
        window.before_generation(40)
        peak = meter.run(gen_rise)
        window.after_generation()
        return peak

    def training_pass():
        window.size_for_step(12, 0, ends)
        meter.run(train_rise)
        window.step_reached_backward()  # then the optimizer steps: no gradients are held

    assert generation() <= limit - MARGIN_BYTES  # before training: streamed whole, measured
    training_pass()
    for _ in range(3):
        assert generation() <= limit - MARGIN_BYTES, "sized from training steps, beside the call measured"
        training_pass()
    assert ends.back and runtime.window, "the room left beside the call went to the ends, then the window"
