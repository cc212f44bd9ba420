"""stream_embeddings left at "auto" (the default): the last resort after the three
long-sequence settings. Where they leave a step's plan over the limit, the embedding and
head move to host memory at that step, and come back once a measured step leaves room for
them; training equals the resident model
bit for bit across the move (non-zero LoRA B, more layers than slots, with a negative
control); ends that cannot stream stay, said once; every surface takes the setting."""

import argparse
import logging

import pytest
import torch
from transformers import HfArgumentParser

import layerstream
from layerstream.commands import flags
from layerstream.config import OFFLOAD_AUTO_MARGIN, StreamConfig
from layerstream.long import chunked_loss, tiled_mlp
from layerstream.plan import advice, plan_for_model
from layerstream.plan.long_settings import AUTO_ORDER, ENDS, LONG_ORDER, decide

from tiny import assert_traces_equal, peft_pair, train_steps, trainer_losses

EVERY = dict(offload_activations=True, loss_chunk_tokens=16, mlp_tile_tokens=16)
CANDIDATES = {"loss_chunk_tokens": 512, "mlp_tile_tokens": 4096, "offload_activations": True, ENDS: True}
# a made-up plan: 100 bytes that do not grow and 15 a token, of which the chunked loss frees 6,
# the tiled MLP 2 and offloading 3; the ends free 600 bytes whatever the length
FREES_PER_TOKEN = {"loss_chunk_tokens": 6, "mlp_tile_tokens": 2, "offload_activations": 3}


def _made_up_plan(tokens):
    return lambda on: 100 + tokens * (15 - sum(FREES_PER_TOKEN.get(n, 0) for n in on)) - (600 if ENDS in on else 0)


@pytest.mark.parametrize(
    "tokens, expected, fits",
    [
        (51, ("loss_chunk_tokens",), True),  # the three suffice: the ends stay
        (150, LONG_ORDER, True),  # the three bring 2350 to 700, under the 850 allowed
        (190, ("loss_chunk_tokens", "mlp_tile_tokens", ENDS), True),  # three 860; with the ends 260, and
        # 830 without offloading, which goes again
        (300, AUTO_ORDER, True),  # three 1300, all four 700, without offloading 1600
        (400, AUTO_ORDER, False),  # all four still 1100: each stays on
    ],
)
def test_the_ends_are_the_last_resort_after_the_three(tokens, expected, fits):
    decision = decide(tokens, 1000, CANDIDATES, _made_up_plan(tokens))
    assert decision.names == expected
    assert decision.fits == fits
    assert decision.on == tuple((name, CANDIDATES[name]) for name in expected)


# -- the runtime -----------------------------------------------------------------------------
@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(advice, "DEFAULT_LONG_TOKENS", 16)
    monkeypatch.setattr(advice, "MIN_LOSS_CHUNK_TOKENS", 8)


def _pair():
    return peft_pair(layers=5, vocab_size=400)  # the loss outweighs a layer, as in Llama-3


def _budget(resident) -> int:
    """What a step of 2 x 48 tokens needs with the three on: within the budget, over the
    margin, so "auto" turns the ends on too."""
    return plan_for_model(resident, 48, 2, slots=2, **EVERY).needed_bytes


def _stream(model, budget, **settings):
    layerstream.stream_model(model, device="cpu", slots=2, prefetch=1, vram_budget=budget, **settings)
    return layerstream.get_runtime(model)


def _resident_as_streamed(resident):
    chunked_loss.apply(resident, 16)
    tiled_mlp.apply(resident, 16)
    return resident


@pytest.mark.parametrize(
    "loss_chunk_tokens", ["auto", 16], ids=["decided-before-the-embedding", "decided-after-the-embedding"]
)
def test_a_step_the_three_leave_over_moves_the_ends_and_trains_as_resident(small_tiles, caplog, loss_chunk_tokens):
    """Decided before the embedding runs (the loss chunk's hook on the model asks first), or
    after it (the first streamed layer asks): the ends move at the step's start, after the
    embedding ran on the weights where they were, and stay on the host; every step equals
    the resident model's."""
    streamed, resident = _pair()
    runtime = _stream(streamed, _budget(resident), loss_chunk_tokens=loss_chunk_tokens)
    assert runtime.embeddings is None and runtime.config.stream_embeddings == "auto"
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        got = train_steps(streamed, 3, seq=48)
    assert_traces_equal(got, train_steps(_resident_as_streamed(resident), 3, seq=48))
    assert runtime.embeddings is not None, "the ends moved"
    assert runtime.long_settings.plan_request(2, 12).stream_embeddings is True, "later steps plan them streamed"
    inner = streamed.get_base_model()
    assert inner.lm_head.weight.data_ptr() == runtime.embeddings._host[id(inner.lm_head.weight)][1]
    assert runtime.stats()["head_copies"] == 3, "once a step: the chunked loss keeps its copy for the gradient"
    moved = [r.getMessage() for r in caplog.records if "moved the embedding and head to host memory" in r.getMessage()]
    assert len(moved) == 1
    said = [r.getMessage() for r in caplog.records if "stream_embeddings='auto' is on" in r.getMessage()]
    assert len(said) == 1 and "stay in host memory until a measured step leaves them room" in said[0]
    assert "embeddings   streamed" in runtime.summary()


def test_the_comparison_across_the_move_fails_when_the_host_copy_differs(small_tiles):
    """Negative control: the same runs, with one value of the head's host copy changed as
    the ends move: the streamed logits and gradients come from the host copy."""
    from layerstream.runtime import ends_on_demand

    streamed, resident = _pair()
    runtime = _stream(streamed, _budget(resident))
    real = ends_on_demand.EndsOnDemand.move

    def move_then_change(self, tokens):
        real(self, tokens)
        with torch.no_grad():
            streamed.get_base_model().lm_head.weight[0, 0] += 1.0

    ends_on_demand.EndsOnDemand.move = move_then_change
    try:
        got = train_steps(streamed, 1, seq=48)
    finally:
        ends_on_demand.EndsOnDemand.move = real
    assert runtime.embeddings is not None
    with pytest.raises(AssertionError):
        assert_traces_equal(got, train_steps(_resident_as_streamed(resident), 1, seq=48))


def test_a_step_the_three_bring_under_keeps_the_ends_where_they_are(small_tiles):
    streamed, resident = _pair()
    budget = int(plan_for_model(resident, 48, 2, slots=2, **EVERY).needed_bytes / (1 - OFFLOAD_AUTO_MARGIN)) + 2
    runtime = _stream(streamed, budget)
    train_steps(streamed, 1, seq=48)
    assert runtime.embeddings is None
    assert runtime.long_settings.decision(96).names and ENDS not in runtime.long_settings.decision(96).names


def test_stream_embeddings_false_keeps_the_ends_on_the_device_under_any_budget(small_tiles):
    streamed, resident = _pair()
    runtime = _stream(streamed, _budget(resident), stream_embeddings=False)
    train_steps(streamed, 1, seq=48)
    assert runtime.embeddings is None
    assert runtime.long_settings.decision(96).names == LONG_ORDER


def test_ends_that_train_stay_and_the_step_is_planned_without_them(small_tiles, caplog):
    streamed, resident = peft_pair(layers=5, vocab_size=400, lora={"modules_to_save": ["lm_head"]})
    runtime = _stream(streamed, _budget(resident))
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        train_steps(streamed, 2, seq=48)
    assert runtime.embeddings is None
    refused = [r.getMessage() for r in caplog.records if "stream_embeddings='auto' would move" in r.getMessage()]
    assert len(refused) == 1 and "they stay where they are" in refused[0]
    assert ENDS not in runtime.long_settings.decision(96).names


def test_a_step_refused_before_it_runs_moves_nothing(small_tiles):
    """A budget the step misses even with all four on: the budget check refuses it before
    any layer runs, and the ends stay where they were (the decision only planned them)."""
    streamed, resident = _pair()
    every = plan_for_model(resident, 48, 2, slots=2, stream_embeddings=True, **EVERY).needed_bytes
    runtime = _stream(streamed, every - 1024)
    head = streamed.get_base_model().lm_head.weight
    where = head.data_ptr()
    with pytest.raises(layerstream.StreamingError, match="does not fit vram_budget"):
        train_steps(streamed, 1, seq=48)
    assert ENDS in runtime.long_settings.decision(96).names, "the decision counted on them"
    assert runtime.embeddings is None and head.data_ptr() == where


def test_an_end_unfrozen_after_auto_moved_it_is_refused_naming_the_setting_to_change(small_tiles):
    streamed, resident = _pair()
    runtime = _stream(streamed, _budget(resident))
    train_steps(streamed, 1, seq=48)
    assert runtime.embeddings is not None
    streamed.get_base_model().model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(layerstream.StreamingError, match=r"stream with stream_embeddings=False") as error:
        train_steps(streamed, 1, seq=48)
    assert "stream_embeddings=True" not in str(error.value)


# -- coming back ------------------------------------------------------------------------------
@pytest.fixture
def no_window_margin(monkeypatch):
    """The window's margin (384 MiB) dwarfs a tiny model: without it, the measured room
    decides, as it does for an 8B model under 12 GiB."""
    from layerstream.decisions import window

    monkeypatch.setattr(window, "MARGIN_BYTES", 0)


def _roomy_budget(resident) -> int:
    """Over the plan with the three on (so the ends move at the first step), but not by the
    15% margin "auto" keeps: the measured steps then leave room for the ends."""
    return int(plan_for_model(resident, 48, 2, slots=2, **EVERY).needed_bytes * 1.1)


def test_a_measured_step_with_room_brings_the_ends_back_and_trains_as_resident(small_tiles, no_window_margin, caplog):
    """The first step moves the ends (the plan is over its margin); the window, reading that
    step, finds room for them and they come back before it takes layers; every step, across
    both moves, equals the resident model's; later steps of that length keep them."""
    streamed, resident = _pair()
    runtime = _stream(streamed, _roomy_budget(resident))
    head = streamed.get_base_model().lm_head.weight
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        got = train_steps(streamed, 4, seq=48)
    assert_traces_equal(got, train_steps(_resident_as_streamed(resident), 4, seq=48))
    assert runtime.embeddings is None, "the ends came back"
    assert "_layerstream_ends" not in streamed.get_base_model().lm_head.__dict__ and not head.is_pinned()
    assert runtime.resident_window.layers, "the window took the room left after them"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("moved the embedding and head to host memory" in m for m in messages) == 1
    back = [m for m in messages if "brought the embedding and head back to the GPU" in m]
    assert len(back) == 1 and "up to 96 tokens" in back[0]
    ends = runtime.long_settings.ends
    assert not ends.possible(96) and ends.possible(97), "a longer step is planned with them movable again"
    assert runtime.long_settings.plan_request(2, 48).stream_embeddings is False


def test_the_comparison_across_the_return_fails_when_the_copy_back_differs(small_tiles, no_window_margin):
    """Negative control: the same runs, with one value of the head's copy changed as the
    ends come back: the later steps' logits come from that copy."""
    from layerstream.runtime import embeddings

    streamed, resident = _pair()
    runtime = _stream(streamed, _roomy_budget(resident))
    real = embeddings.StreamedEnds.copies_out

    def copies_then_change(self, target):
        copies = real(self, target)
        copies[-1][0, 0] += 1.0
        return copies

    embeddings.StreamedEnds.copies_out = copies_then_change
    try:
        got = train_steps(streamed, 3, seq=48)
    finally:
        embeddings.StreamedEnds.copies_out = real
    assert runtime.embeddings is None and runtime.long_settings.ends.returns == 1
    with pytest.raises(AssertionError):
        assert_traces_equal(got, train_steps(_resident_as_streamed(resident), 3, seq=48))


def test_a_longer_step_after_the_return_moves_the_ends_again(small_tiles, no_window_margin, caplog):
    streamed, resident = _pair()
    runtime = _stream(streamed, _roomy_budget(resident))
    train_steps(streamed, 2, seq=48)
    assert runtime.embeddings is None
    with caplog.at_level(logging.INFO, logger="layerstream"):
        train_steps(streamed, 1, seq=56)
        assert runtime.embeddings is not None, "a step longer than any measured is planned again"
        train_steps(streamed, 2, seq=56)
    assert runtime.embeddings is None, "and measured: back again"
    ends = runtime.long_settings.ends
    assert ends.returns == 2 and ends.back_up_to == 112
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, m in messages if "moved the embedding and head to host memory again" in m] == [
        logging.INFO
    ]
    back = [level for level, m in messages if "brought the embedding and head back" in m]
    assert back == [logging.WARNING, logging.INFO], "said loudly only the first time"


def test_the_window_counts_the_ends_once_however_often_they_come_back(small_tiles, no_window_margin):
    """Each longer step moves the ends to host memory again and a measured one brings them
    back: the memory the window is sized from holds them once, not once per return (that
    took the room of more layers at each return, then kept the ends from coming back)."""
    streamed, resident = _pair()
    runtime = _stream(streamed, _roomy_budget(resident))
    sizer, ends = runtime.resident_window.sizer, runtime.long_settings.ends
    held = []
    for seq in (48, 56, 64):  # each longer than any measured: planned again, moved, back
        train_steps(streamed, 3, seq=seq)
        assert runtime.embeddings is None
        held.append(sizer.held)
    assert ends.returns == 3
    assert held == [held[0]] * 3, "the ends were counted again at each return"


def _measured_below_the_plan(runtime, nbytes: int) -> None:
    """The window's readings show ``nbytes`` less held than the plan predicts, as a GPU
    measures less than the plan's cautious reserve."""
    import dataclasses

    meter = runtime.resident_window.meter
    read = meter.read

    def less(*args, **kwargs):
        reading = read(*args, **kwargs)
        return dataclasses.replace(
            reading,
            peak_reserved=reading.peak_reserved - nbytes,
            peak_allocated=reading.peak_allocated - nbytes,
            start_allocated=reading.start_allocated - nbytes,
        )

    meter.read = less


def test_a_new_shape_no_longer_than_the_steps_that_brought_the_ends_back_is_not_refused(small_tiles, no_window_margin):
    """An explicit vram_budget is checked against the plan at each new step shape. Under one
    the plan meets only with the ends streamed, measured steps that leave room for them
    bring them back; a new shape with no more tokens than those (a shorter batch of longer
    rows) is then planned as before they came back, with the ends streamed as its plan
    needs, not refused for their bytes: it runs, and they stay on the GPU as measured."""
    streamed, resident = _pair()
    budget = plan_for_model(resident, 48, 2, slots=2, **EVERY).needed_bytes - 1024  # all four needed
    runtime = _stream(streamed, budget)
    _measured_below_the_plan(runtime, 40 << 20)
    train_steps(streamed, 3, seq=48)
    assert runtime.embeddings is None and runtime.long_settings.ends.back_up_to == 96
    train_steps(streamed, 1, seq=96, batch_size=1)
    assert runtime.embeddings is None, "no more tokens than measured: they stay"
    with pytest.raises(layerstream.StreamingError, match="does not fit vram_budget"):
        train_steps(streamed, 1, seq=64, batch_size=4)  # more tokens, over even with the ends streamed


def test_out_of_memory_with_the_ends_back_and_no_window_sends_them_away_and_runs_again(
    tmp_path, small_tiles, no_window_margin, caplog
):
    """The ends came back on a measurement and no window layer is left to give up: a step
    that runs out of memory then sends them to host memory again, for good, and runs again
    from where it started; the losses are the uninterrupted resident run's."""
    streamed, resident = _pair()
    plain = trainer_losses(_resident_as_streamed(resident), tmp_path / "plain", seq=48, vocab=390)
    runtime = _stream(streamed, _roomy_budget(resident))
    runtime.resident_window.sizer.max_window = 0  # the room goes to the ends alone
    ends, raised = runtime.long_settings.ends, []

    def out_of_memory(module, args):
        if ends.device_bytes and not raised and torch.is_grad_enabled():
            raised.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    streamed.get_base_model().model.layers[2].register_forward_pre_hook(out_of_memory)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        got = trainer_losses(streamed, tmp_path / "streamed", seq=48, vocab=390)
    assert raised and runtime.stats()["oom_retries"] == 1 and runtime.window == []
    assert runtime.embeddings is not None and ends.returns == 1, "sent away, and never back"
    assert "moved them to host memory again, for the rest of the run" in caplog.text
    assert got == plain


def test_ends_streamed_by_request_never_come_back(small_tiles, no_window_margin):
    streamed, resident = _pair()
    runtime = _stream(streamed, _roomy_budget(resident), stream_embeddings=True)
    train_steps(streamed, 3, seq=48)
    assert runtime.embeddings is not None and runtime.long_settings.ends.returns == 0


# -- the surfaces ----------------------------------------------------------------------------
def test_every_surface_defaults_to_auto_and_the_flag_alone_is_true():
    assert StreamConfig(device="cpu").stream_embeddings == "auto"
    parser = argparse.ArgumentParser()
    flags.add_setting_flags(parser)
    assert parser.parse_args([]).stream_embeddings == "auto"
    assert parser.parse_args(["--stream-embeddings"]).stream_embeddings == "true"
    assert parser.parse_args(["--stream-embeddings", "false"]).stream_embeddings == "false"
    arguments = HfArgumentParser(layerstream.StreamingArguments)
    for argv, expected in (
        ([], "auto"),
        (["--layer_stream_embeddings"], True),
        (["--layer_stream_embeddings", "no"], False),
    ):
        (parsed,) = arguments.parse_args_into_dataclasses(argv + ["--layer_stream_device", "cpu"])
        assert parsed.to_config().stream_embeddings == expected, argv


# -- CUDA ------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_on_cuda_ends_left_on_the_gpu_move_at_the_step_that_needs_it_and_train_as_resident(small_tiles):
    """A device_map script's model: everything on the GPU, the ends float32 as PEFT's k-bit
    preparation leaves them. Streamed with "auto" under a budget the three settings leave
    over, the ends move to pinned host memory at the first step and every step equals the
    resident model's on the same GPU (the vocabulary as _pair()'s, so all four are on, as on
    the resident side)."""
    streamed, resident = peft_pair(layers=5, vocab_size=400, attn="eager")  # as _pair(): all four on
    for model in (streamed, resident):
        for end in (model.get_input_embeddings(), model.get_output_embeddings()):
            end.weight.data = end.weight.data.float()
        model.to("cuda")
    layerstream.stream_model(streamed, device="cuda", slots=2, prefetch=1, vram_budget=_budget(resident))
    runtime = layerstream.get_runtime(streamed)
    head = streamed.get_output_embeddings()
    assert head.weight.device.type == "cuda", "nothing moves before a step needs it"
    got = train_steps(streamed, 1, "cuda", seq=48)  # the next step's start may bring them back (below)
    assert head.weight.device.type == "cpu" and head.weight.is_pinned(), "the ends moved"
    assert runtime.embeddings is not None
    assert_traces_equal(got, train_steps(_resident_as_streamed(resident), 1, "cuda", seq=48))


@pytest.mark.gpu
def test_on_cuda_ends_come_back_when_the_measured_steps_leave_room(small_tiles, no_window_margin):
    """As above, with the CUDA meter: the plan's reserve keeps the first step over "auto"'s
    margin, so the ends move; the measured steps of a tiny model leave the room, so they come
    back to the GPU at the next step, and every step equals the resident model's."""
    streamed, resident = peft_pair(layers=5, vocab_size=400, attn="eager")
    for model in (streamed, resident):
        for end in (model.get_input_embeddings(), model.get_output_embeddings()):
            end.weight.data = end.weight.data.float()
        model.to("cuda")
    layerstream.stream_model(streamed, device="cuda", slots=2, prefetch=1, vram_budget=_roomy_budget(resident))
    runtime = layerstream.get_runtime(streamed)
    head = streamed.get_output_embeddings()
    got = train_steps(streamed, 4, "cuda", seq=48)
    ends = runtime.long_settings.ends
    assert ends.returns == 1 and ends.back_up_to == 96, "moved at the first step, back at the second"
    assert head.weight.device.type == "cuda" and not head.weight.is_pinned() and runtime.embeddings is None
    assert_traces_equal(got, train_steps(_resident_as_streamed(resident), 4, "cuda", seq=48))
