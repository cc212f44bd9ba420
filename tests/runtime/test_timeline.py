"""The residency timeline of a step that generates (TRL's GRPO and RLOO call ``generate``
inside their training step): the ``generate`` call is one span, nothing in it is marked,
and the slots' holds start again after it from what the slots then hold, so every layer
call drawn still sits inside its own layer's residency."""

import torch

import layerstream
from layerstream.runtime import timeline

from tiny import peft_pair, stream, train_steps

LAYERS = 5  # through 2 slots: every layer is copied in at each visit


def _generate(model):
    prompt = torch.arange(3, 11).reshape(2, 4)
    return model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _recorded(model, between):
    """A training step, ``between(model)``, a training step, all in one recording."""
    runtime = layerstream.get_runtime(model)
    runtime.start_timeline()
    try:
        train_steps(model, 1, seq=4)
        between(model)
        train_steps(model, 1, seq=4)
    finally:
        spans = runtime.finish_timeline()
    return spans


def _assert_each_compute_inside_its_layers_hold(spans):
    for compute in (s for s in spans if s.row == "compute" and s.layer >= 0):
        holding = [
            h
            for h in spans
            if h.kind == "hold" and h.slot == compute.slot and h.start_ms <= compute.start_ms <= h.end_ms
        ]
        assert holding and all(h.layer == compute.layer for h in holding), compute


def test_a_generate_call_in_a_recorded_step_is_one_span_and_the_slots_restart_after_it():
    model, _ = peft_pair("llama", layers=LAYERS)
    stream(model)
    train_steps(model, 1, seq=4)
    runtime = layerstream.get_runtime(model)
    before, after = [], []

    def generate(model):
        before.extend(runtime.pool.owner)
        _generate(model)
        after.extend(runtime.pool.owner)

    spans = _recorded(model, generate)
    generates = [s for s in spans if s.kind == "generate"]
    assert len(generates) == 1 and generates[0].row == "compute"
    layer_calls = [(s.kind, s.layer) for s in spans if s.row == "compute" and s.kind != "generate"]
    one_step = [("forward", i) for i in range(LAYERS)] + [("backward", i) for i in reversed(range(LAYERS))]
    assert layer_calls == one_step + one_step, "the two training steps' calls, none of the generation's"
    call = generates[0]
    assert not [s for s in spans if s.kind == "copy" and call.start_ms < s.start_ms < call.end_ms]
    holds = [s for s in spans if s.kind == "hold"]
    assert not [h for h in holds if h.start_ms < call.end_ms and h.end_ms > call.start_ms], "no hold across it"
    assert before != after, "the call leaves other layers in the slots than it found"
    restarted = {h.slot: h.layer for h in holds if h.start_ms == call.end_ms}
    assert restarted == {slot: layer for slot, layer in enumerate(after) if layer is not None}
    _assert_each_compute_inside_its_layers_hold(spans)


def test_an_inference_forward_in_a_recorded_step_is_drawn_layer_by_layer():
    """The control: only ``generate`` is summarised; a plain forward without grad (TRL's
    log-probabilities of the completions) is drawn layer by layer."""
    model, _ = peft_pair("llama", layers=LAYERS)
    stream(model)
    train_steps(model, 1, seq=4)

    def forward(model):
        with torch.no_grad():
            model(input_ids=torch.arange(3, 11).reshape(2, 4))

    spans = _recorded(model, forward)
    assert not [s for s in spans if s.kind == "generate"]
    assert [s.layer for s in spans if s.kind == "inference"] == list(range(LAYERS))
    _assert_each_compute_inside_its_layers_hold(spans)


def test_generate_outside_a_recording_records_nothing_and_gives_the_same_tokens():
    model, resident = peft_pair("llama", layers=LAYERS)
    stream(model)
    runtime = layerstream.get_runtime(model)
    assert torch.equal(_generate(model), _generate(resident))
    assert not runtime.timeline_active
    runtime.start_timeline()
    try:
        recorded_tokens = _generate(model)
        assert runtime.timeline_active, "the recording goes on after the call"
    finally:
        spans = runtime.finish_timeline()
    assert torch.equal(recorded_tokens, _generate(resident))
    assert [s.kind for s in spans if s.row == "compute"] == ["generate"]


def test_the_trace_and_plot_name_the_generate_span(tmp_path):
    model, _ = peft_pair("llama", layers=LAYERS)
    stream(model)
    runtime = layerstream.get_runtime(model)
    with runtime.timeline(str(tmp_path)) as spans:
        _generate(model)
        train_steps(model, 1, seq=4)
    trace = timeline.chrome_trace(spans, runtime.slot_rows)
    names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "generate"]
    assert names == ["generate (token steps not drawn)"]
    assert (tmp_path / timeline.TRACE_NAME).exists()
