"""loss_chunk_tokens, mlp_tile_tokens and offload_activations left at "auto" (the default):
which of them a step of a token count needs under a budget (cheapest first, with the
margin offloading keeps), the runtime that applies the decision once per token count, and
what it says; and what an out-of-memory explanation says of them. Parity tests use non-zero LoRA B and more layers than slots; each has a
negative control that proves the comparison can fail."""

import argparse
import contextlib
import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser

import layerstream
from layerstream.commands import cli, flags, train_config
from layerstream.config import OFFLOAD_AUTO_MARGIN, StreamConfig, parse_setting
from layerstream.decisions.disk import size_text
from layerstream.integrations import trainer as trainer_integration
from layerstream.long import chunked_loss, tiled_mlp
from layerstream.modules import swap
from layerstream.plan import PlanRequest, advice, load_config, make_plan, plan_for_model
from layerstream.plan.long_settings import LONG_ORDER, OFF, LongDecision, decide, decide_for, describe, limit_for
from layerstream.plan.longest import oom_advice
from layerstream.plan.memory import _build
from layerstream.plan.request import plan_flags
from layerstream.units import GiB

from tiny import assert_traces_equal, batch, peft_pair, tiny_model, train_steps

LLAMA3_8B = Path(__file__).resolve().parents[2] / "configs" / "shapes" / "llama-3.1-8b.json"
AUTO = {name: "auto" for name in LONG_ORDER}
CANDIDATES = {"loss_chunk_tokens": 512, "mlp_tile_tokens": 4096, "offload_activations": True}
# a plan made up for the table: 100 bytes that do not grow, and per token 15 bytes of which
# the chunked loss frees 6, the tiled MLP 2 and offloading 3
FREES_PER_TOKEN = {"loss_chunk_tokens": 6, "mlp_tile_tokens": 2, "offload_activations": 3}


def _made_up_plan(tokens):
    return lambda on: 100 + tokens * (15 - sum(FREES_PER_TOKEN[name] for name in on))


CHUNK, TILE = "loss_chunk_tokens", "mlp_tile_tokens"
OFFLOAD = "offload_activations"


@pytest.mark.parametrize(
    "tokens, budget, expected",
    [
        (50, 1000, ()),  # needs 850, the limit itself: off
        (51, 1000, (CHUNK,)),  # 865: the loss chunks alone bring it to 559
        (80, 965, (CHUNK,)),  # chunked, 820: the limit of 965 is 820
        (80, 964, (CHUNK, TILE)),  # ... and of 964, 819: the MLP tiles too
        (120, 1000, (CHUNK, OFFLOAD)),  # all three reach 580; without the tiles 820: turned off again
        (200, 1000, (CHUNK, TILE, OFFLOAD)),  # all three still need 900: each stays on
        (1000, 10**6, ()),
    ],
)
def test_auto_turns_on_the_cheapest_settings_that_bring_the_plan_under_the_margin(tokens, budget, expected):
    assert (limit_for(1000), limit_for(965), limit_for(964)) == (850, 820, 819)
    decision = decide(tokens, budget, CANDIDATES, _made_up_plan(tokens))
    assert decision.names == expected
    assert decision.on == tuple((name, CANDIDATES[name]) for name in expected)
    assert decision.frees == tuple(FREES_PER_TOKEN[name] * tokens for name in expected)
    assert decision.needed_without == _made_up_plan(tokens)(())
    assert decision.fits == (tokens != 200)


def test_a_setting_not_left_at_auto_is_not_turned_on_and_offload_for_the_margin_is_said():
    needed = _made_up_plan(120)
    assert decide(120, 1000, {TILE: 4096, OFFLOAD: True}, needed).names == (TILE, OFFLOAD)
    only_offload = {OFFLOAD: True}
    within_budget = decide(60, 1000, only_offload, _made_up_plan(60))  # 1000: fits the budget, not the margin
    beyond = decide(61, 1000, only_offload, _made_up_plan(61))
    assert within_budget.names == beyond.names == (OFFLOAD,)
    assert within_budget.offload_for_margin_only and not beyond.offload_for_margin_only


@pytest.mark.parametrize("gib", [12, 24, 80])
@pytest.mark.parametrize("seq", [2048, 16384, 65536])
def test_each_setting_auto_turns_on_for_llama3_8b_is_needed_and_short_steps_need_none(gib, seq):
    args = PlanRequest(load_config(LLAMA3_8B), seq, 1, gib * GiB, "nf4", lora_rank=32, slots=3, **AUTO)
    decision = decide_for(args, gib * GiB)
    planned = args.replace(**OFF)

    def needed(on):
        settings = {name: decision.value(name) or CANDIDATES[name] for name in on}
        return make_plan(planned.replace(vram_bytes=1 << 50, **settings)).needed_bytes

    assert bool(decision.names) == (needed(()) > decision.limit)
    if seq == 2048:
        assert decision.names == (), "a short step needs none of them"
    if (seq, gib) == (65536, 12):
        assert decision.names == LONG_ORDER
    if decision.fits:
        for name in decision.names:
            assert needed([n for n in decision.names if n != name]) > decision.limit, f"{name} was not needed"
    else:
        assert decision.names == LONG_ORDER
    assert decision.value(CHUNK) in (None, advice.default_loss_chunk_tokens(128_256))


# -- the settings on every surface --------------------------------------------------------------
def test_the_three_default_to_auto_on_every_surface_and_zero_or_false_is_off():
    config = StreamConfig(device="cpu")
    assert all(getattr(config, name) == "auto" for name in LONG_ORDER)
    (arguments,) = HfArgumentParser(layerstream.StreamingArguments).parse_args_into_dataclasses([])
    assert all(arguments.settings()[name] == "auto" for name in LONG_ORDER)
    parser = argparse.ArgumentParser()
    flags.add_setting_flags(parser)
    assert all(getattr(parser.parse_args([]), name) == "auto" for name in LONG_ORDER)
    assert all(train_config.SECTIONS["stream"][name] == "auto" for name in LONG_ORDER)
    for off in (0, False, None, "0", "false", "none"):
        value = parse_setting(CHUNK, off)
        assert StreamConfig(device="cpu", loss_chunk_tokens=value, mlp_tile_tokens=value).loss_chunk_tokens is None
    assert StreamConfig(device="cpu", mlp_tile_tokens=parse_setting(TILE, "8192")).mlp_tile_tokens == 8192


# -- the runtime ---------------------------------------------------------------------------------
@pytest.fixture
def small_tiles(monkeypatch):
    """Chunks and tiles of 16 tokens when "auto" turns them on (a tiny model's steps are
    shorter than the defaults, which would free nothing)."""
    monkeypatch.setattr(advice, "DEFAULT_LONG_TOKENS", 16)
    monkeypatch.setattr(advice, "MIN_LOSS_CHUNK_TOKENS", 8)


def _pair():
    return peft_pair(layers=5, vocab_size=400)  # the loss outweighs a layer, as in Llama-3


def _needed(model, seq, **settings):
    return plan_for_model(model, seq, 2, slots=2, **settings).needed_bytes


def _stream(model, budget, **settings):
    settings.setdefault("stream_embeddings", False)  # the three alone; the ends' "auto": test_ends_on_demand
    layerstream.stream_model(model, device="cpu", slots=2, prefetch=1, vram_budget=budget, **settings)
    return layerstream.get_runtime(model)


def test_a_short_step_runs_with_all_three_off_and_equals_the_plain_model_bit_for_bit(small_tiles):
    streamed, resident = _pair()
    budget = int(_needed(resident, 12) / (1 - OFFLOAD_AUTO_MARGIN)) + 1
    runtime = _stream(streamed, budget)
    assert all(getattr(runtime.config, name) == "auto" for name in LONG_ORDER)
    assert_traces_equal(train_steps(streamed, 3, seq=12), train_steps(resident, 3, seq=12))
    assert runtime.long_settings.settings_for(24) == OFF
    stats = runtime.stats()
    assert stats["activations_offloaded"] == 0 and stats["layer_loads"] > stats["layers"]
    inner = streamed.get_base_model()
    assert swap.behaviours(inner), "the chunked loss is in place, and stayed off"
    assert not any(swap.has(mlp, tiled_mlp.TiledMLP) for mlp in tiled_mlp.mlps(inner)), "no MLP was tiled"


def test_the_short_step_comparison_fails_once_auto_chunks_the_loss(small_tiles):
    """Negative control: the same comparison, under a budget whose margin the step passes."""
    streamed, resident = _pair()
    _stream(streamed, int(_needed(resident, 12) / (1 - OFFLOAD_AUTO_MARGIN)) - 4096)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 1, seq=12), train_steps(resident, 1, seq=12))


def test_a_long_step_under_a_small_budget_turns_all_three_on_and_matches_them_set_by_hand(small_tiles, caplog):
    streamed, resident = _pair()
    every = dict(offload_activations=True, loss_chunk_tokens=16, mlp_tile_tokens=16)
    runtime = _stream(streamed, _needed(resident, 48, **every))  # fits the budget, not the margin
    chunked_loss.apply(resident, 16)
    tiled_mlp.apply(resident, 16)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        got = train_steps(streamed, 2, seq=48)
    assert runtime.long_settings.settings_for(96) == every
    assert_traces_equal(got, train_steps(resident, 2, seq=48))
    assert got.logits[0] is None, "the loss was chunked"
    assert runtime.stats()["activations_offloaded"] > 0
    assert all(swap.has(mlp, tiled_mlp.TiledMLP) for mlp in tiled_mlp.mlps(streamed))
    said = [r.message for r in caplog.records if "'auto' is on" in r.message]
    assert len(said) == 1 and all(f"{name}='auto' is on" in said[0] for name in LONG_ORDER)
    assert "still over the 85% but within vram_budget: the step should fit" in said[0]


def test_a_decision_over_the_budget_itself_says_the_step_may_run_out_of_memory():
    over = LongDecision(
        tokens=96, budget=100, limit=85, needed_without=300, needed=120, on=(("mlp_tile_tokens", 16),), frees=(180,)
    )
    within = dataclasses.replace(over, needed=95)
    assert "still over vram_budget: the step may run out of memory" in describe(over, 1, 96)
    assert "within vram_budget" not in describe(over, 1, 96)
    assert "still over the 85% but within vram_budget" in describe(within, 1, 96)
    assert "may run out of memory" not in describe(within, 1, 96)


def _gradients_after_a_switch_mid_pass(streamed, resident, value):
    """One forward of 2 x 48 tokens on each, offload_activations switched on the streamed
    model before its backward: every LoRA gradient of the two."""
    ids = batch(400, seq=48, seed=5)
    torch.manual_seed(7)  # LoRA dropout: the same masks on both
    loss = streamed(input_ids=ids, labels=ids).loss
    layerstream.get_runtime(streamed).set_offload_activations(value)
    loss.backward()
    torch.manual_seed(7)
    resident(input_ids=ids, labels=ids).loss.backward()
    return [
        (name, a.grad, b.grad)
        for (name, a), (_, b) in zip(streamed.named_parameters(), resident.named_parameters())
        if a.requires_grad
    ]


@pytest.mark.parametrize("value", [False, True, "auto"])
def test_a_switch_between_a_forward_and_its_backward_recomputes_with_the_forwards_tiles(small_tiles, value):
    """set_offload_activations makes "auto" decide again from the next pass; the pass under
    way recomputes its layers with the MLP and norm tiles its forward took."""
    streamed, resident = _pair()
    every = dict(offload_activations=True, loss_chunk_tokens=16, mlp_tile_tokens=16)
    _stream(streamed, _needed(resident, 48, **every))
    chunked_loss.apply(resident, 16)
    tiled_mlp.apply(resident, 16)
    gradients = _gradients_after_a_switch_mid_pass(streamed, resident, value)
    assert gradients and all(torch.equal(a, b) for _, a, b in gradients)


def test_the_switch_comparison_fails_when_the_recompute_reads_the_tiles_decided_since(small_tiles, monkeypatch):
    """Negative control: a recompute that reads the live table (emptied by the switch) runs
    its MLPs untiled, and the checkpoint finds other tensors than its forward saved."""
    from layerstream.runtime.long_settings import LongSettingsPolicy

    monkeypatch.setattr(LongSettingsPolicy, "replaying", lambda self, tiles: contextlib.nullcontext())
    streamed, resident = _pair()
    every = dict(offload_activations=True, loss_chunk_tokens=16, mlp_tile_tokens=16)
    _stream(streamed, _needed(resident, 48, **every))
    chunked_loss.apply(resident, 16)
    tiled_mlp.apply(resident, 16)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        _gradients_after_a_switch_mid_pass(streamed, resident, True)


def _a_pass_from_before_the_first_tile(streamed, resident):
    """Pass 1 of 2 x 48 tokens with offloading on and no MLP tile; offloading switched off;
    pass 2 of the same length, which "auto" tiles; both backwards, the first pass's last:
    every LoRA gradient of the two models."""
    ids = batch(400, seq=48, seed=5)
    torch.manual_seed(7)
    first = streamed(input_ids=ids, labels=ids).loss
    assert not layerstream.get_runtime(streamed).long_settings.settings_for(96).get(TILE)
    layerstream.get_runtime(streamed).set_offload_activations(False)
    second = streamed(input_ids=ids, labels=ids).loss
    assert layerstream.get_runtime(streamed).long_settings.settings_for(96)[TILE] == 16
    second.backward()
    first.backward()
    torch.manual_seed(7)
    first = resident(input_ids=ids, labels=ids).loss
    tiled_mlp.apply(resident, 16)
    resident(input_ids=ids, labels=ids).loss.backward()
    first.backward()
    return [(a.grad, b.grad) for a, b in zip(streamed.parameters(), resident.parameters()) if a.requires_grad]


def _untiled_then_tiled():
    streamed, resident = _pair()
    budget = _needed(resident, 48, offload_activations=True, loss_chunk_tokens=16) / (1 - OFFLOAD_AUTO_MARGIN)
    _stream(streamed, int(budget) + 1, offload_activations=True)
    chunked_loss.apply(resident, 16)
    return streamed, resident


def test_a_pass_begun_before_any_tile_recomputes_untiled_after_a_later_pass_tiles(small_tiles):
    gradients = _a_pass_from_before_the_first_tile(*_untiled_then_tiled())
    assert gradients and all(torch.equal(a, b) for a, b in gradients)


def test_the_comparison_fails_when_a_pass_without_tiles_replays_none(small_tiles, monkeypatch):
    """Negative control: a first pass that replays nothing reads the table the later pass
    filled, and its recompute tiles where its forward did not."""
    from layerstream.runtime.long_settings import LongSettingsPolicy

    monkeypatch.setattr(LongSettingsPolicy, "tiles_of_pass", lambda self: None)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        _a_pass_from_before_the_first_tile(*_untiled_then_tiled())


def test_an_explicit_value_wins_over_what_auto_would_decide(small_tiles):
    streamed, resident = _pair()
    given = dict(offload_activations=True, loss_chunk_tokens=None, mlp_tile_tokens=7)
    runtime = _stream(streamed, _needed(resident, 48, **given), loss_chunk_tokens=0, mlp_tile_tokens=7)
    out = train_steps(streamed, 1, seq=48)
    assert runtime.long_settings.settings_for(96) == given
    assert out.logits[0] is not None, "loss_chunk_tokens=0: the model's own loss"
    assert runtime.long_settings.decision(96).names == (OFFLOAD,)


def test_what_was_turned_on_is_said_once_per_decision(small_tiles, caplog):
    """48 and 56 tokens need the loss chunks, 96 the MLP tiles as well: two messages, one
    summary line and one set of Trainer figures each, however often each length comes back."""
    streamed, resident = _pair()
    chunked = _needed(resident, 28, loss_chunk_tokens=16)
    budget = int((chunked + 1) / (1 - OFFLOAD_AUTO_MARGIN)) + 1
    runtime = _stream(streamed, budget, offload_activations=False)
    window = trainer_integration._LogWindow(runtime)
    logged = []
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        for seq in (24, 28, 24, 48, 28, 48):
            train_steps(streamed, 1, seq=seq)
            logged.append(window._new_decision())
    assert [runtime.long_settings.decision(2 * seq).names for seq in (24, 28, 48)] == [
        (CHUNK,),
        (CHUNK,),
        (CHUNK, TILE),
    ]
    said = [r.message for r in caplog.records if "'auto' is on" in r.message]
    assert len(said) == 2 and "batch 2 x 24 tokens" in said[0] and "batch 2 x 48 tokens" in said[1]
    assert [bool(figures) for figures in logged] == [True, False, False, True, False, False]
    assert logged[3]["layerstream/mlp_tile_tokens"] == 16 and logged[0]["layerstream/mlp_tile_tokens"] == 0
    summary = runtime.summary()
    assert (
        summary.count("auto turned on") == 2 and "loss_chunk_tokens=16, mlp_tile_tokens=16 at batch 2 x 48" in summary
    )


def test_a_trainer_that_calls_the_model_without_labels_gets_no_loss_chunk_planned_or_said(small_tiles, caplog):
    """Label smoothing, a compute_loss of the trainer's own, ORPO and CPO call the model
    without labels and compute the loss from its full logits: there is no loss to chunk.
    "auto" decides again without loss chunks, so the plan counts the full logits, and the
    summary does not name the chunked loss."""
    streamed, resident = _pair()
    chunked = _needed(resident, 28, loss_chunk_tokens=16)
    runtime = _stream(streamed, int((chunked + 1) / (1 - OFFLOAD_AUTO_MARGIN)) + 1, offload_activations=False)
    train_steps(streamed, 1, seq=24)  # with labels: the loss is chunked
    assert runtime.long_settings.decision(48).names == (CHUNK,)
    ids = batch(400, seq=24, seed=3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        for _ in range(2):
            logits = streamed(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), label_smoothing=0.1
            )
            loss.backward()
    said = [r.message for r in caplog.records if "called without labels" in r.message]
    assert len(said) == 1 and "loss_chunk_tokens='auto' stays off" in said[0]
    assert not [r.message for r in caplog.records if "loss_chunk_tokens='auto' is on" in r.message]
    assert CHUNK not in runtime.long_settings.decision(48).names
    assert runtime.long_settings.settings_for(48)[CHUNK] is None
    assert "called without labels" in runtime.summary() and "layerstream's chunked loss" not in runtime.summary()


# -- out of memory -------------------------------------------------------------------------------
def _step(seq, **settings):
    """The plan request of an 8B QLoRA step as it ran: the settings off unless given."""
    request = PlanRequest(load_config(LLAMA3_8B), seq, 1, 1 << 50, "nf4", lora_rank=32, slots=3, **OFF)
    return request.replace(**settings)


def _assert_advice_carries_the_plans_numbers(text, args, budget):
    """Each setting with what it frees at the step's length, and the longest lengths that
    fit under the budget, as the planner gives them (found here without oom_advice)."""
    now = _build(args).needed_bytes
    for name in LONG_ORDER:
        lines = [line for line in text.splitlines() if line.startswith((f"turn on StreamConfig({name}=", name))]
        assert len(lines) == 1, name
        other = args.replace(**{name: OFF[name] if getattr(args, name) else CANDIDATES[name]})
        frees = abs(_build(other).needed_bytes - now)
        assert f"frees {size_text(frees)} at batch 1 x {args.seq} tokens" in lines[0]
    longest = [int(n) for n in re.search(r"fits up to (\d+) tokens .* and (\d+) with all three", text).groups()]
    for n, settings in zip(longest, ({}, CANDIDATES)):
        at = args.replace(vram_bytes=budget, **settings)
        assert _build(at.replace(seq=n)).fits and not _build(at.replace(seq=n + 1)).fits


def test_an_out_of_memory_explanation_names_what_each_setting_frees_and_the_longest_length_that_fits():
    budget = 12 * GiB
    off, chunked = _step(32768), _step(32768, loss_chunk_tokens=512)
    text = "\n".join(oom_advice(off, budget))
    _assert_advice_carries_the_plans_numbers(text, off, budget)
    assert text.count("turn on") == 3
    chunked_text = "\n".join(oom_advice(chunked, budget))
    _assert_advice_carries_the_plans_numbers(chunked_text, chunked, budget)
    assert "loss_chunk_tokens=512 is on: it frees" in chunked_text and chunked_text.count("turn on") == 2
    with pytest.raises(AssertionError):  # negative control: another length's numbers are not these
        _assert_advice_carries_the_plans_numbers("\n".join(oom_advice(_step(16384), budget)), off, budget)


def test_the_runtime_explains_out_of_memory_with_the_long_sequence_settings(small_tiles):
    streamed, resident = _pair()
    runtime = _stream(streamed, 2 * GiB, offload_activations=False, loss_chunk_tokens=0, mlp_tile_tokens=0)
    train_steps(streamed, 1, seq=48)
    text = str(runtime.explain_oom(torch.OutOfMemoryError("CUDA out of memory."), "in a training step"))
    for name in LONG_ORDER:
        assert f"turn on StreamConfig({name}=" in text and "frees" in text
    frees = _needed(resident, 48) - _needed(resident, 48, loss_chunk_tokens=16)
    assert f"(--loss-chunk-tokens 16, stream.loss_chunk_tokens: 16): frees {size_text(frees)} at batch 2 x 48" in text
    assert re.search(r"fits up to \d+ tokens a sequence at batch 2 under 2.00 GiB", text)
    # the plan command it names describes this run (quantization, adapters, rank, targets)
    command = re.search(r"`layerstream plan --model <model> --vram-budget <GPU memory> --seq <tokens>(.*)`", text)
    assert command.group(1).split() == plan_flags(runtime.long_settings.plan_request(1, 1))
    # the ends on the device: the way to move them, as each surface spells it
    spelled = "(--stream-embeddings, --layer_stream_embeddings true, stream.stream_embeddings: true) frees"
    assert "keep the input embedding and head in host memory" in text and spelled in text
    streamed_ends, _ = _pair()
    runtime = _stream(streamed_ends, 2 * GiB, stream_embeddings=True, loss_chunk_tokens=0, mlp_tile_tokens=0)
    train_steps(streamed_ends, 1, seq=48)
    text = str(runtime.explain_oom(torch.OutOfMemoryError("CUDA out of memory."), "in a training step"))
    assert "keep the input embedding and head in host memory" not in text, "they stream already"


def test_the_plan_command_says_what_a_runs_defaults_turn_on_at_this_length(capsys):
    argv = ["plan", "--model", str(LLAMA3_8B), "--vram-budget", "16GiB", "--quantization", "nf4", "--lora-rank", "32"]
    for seq in (2048, 32768):
        cli.main(argv + ["--slots", "3", "--seq", str(seq)])
        (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("auto (a run's default)")]
        args = PlanRequest(load_config(LLAMA3_8B), seq, 1, 16 * GiB, "nf4", lora_rank=32, slots=3, **AUTO)
        decision = decide_for(args, 16 * GiB)
        if seq == 2048:
            assert decision.names == () and "none of the long-sequence settings" in line
        else:
            assert decision.names == LONG_ORDER
            assert "turns on loss_chunk_tokens=512, mlp_tile_tokens=4096, offload_activations" in line
            assert f"{size_text(decision.needed_without)} without them, {size_text(decision.needed)} with them" in line


@pytest.mark.parametrize(
    "setting, said", [("auto", "loss_chunk_tokens auto: chunked once a step needs it"), (None, "loss_chunk_tokens off")]
)
def test_the_summarys_loss_line_tells_auto_from_off(setting, said):
    from layerstream.runtime import report

    model = tiny_model("llama", layers=2)
    layerstream.stream_model(model, StreamConfig(device="cpu", slots=2, loss_chunk_tokens=setting))
    assert report._loss_line(layerstream.get_runtime(model)).endswith(f"({said})")
