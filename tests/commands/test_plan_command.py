"""`layerstream plan`: its flags (the same settings as StreamConfig's), parsing sizes and
configs, what it prints and how it refuses bad input.

Expected numbers are derived by hand in the comments (or counted from real objects:
the engine's own host-store layout, PEFT's adapters, bitsandbytes' quant state), never
by calling the function under test.
"""

import re

import pytest
from model_shapes import LLAMA3_8B, config_of, write_config

from layerstream.commands import cli
from layerstream.commands import plan as plan_command
from layerstream.commands import run as run_command
from layerstream.plan import (
    GiB,
    load_config,
    make_plan,
    parse_bytes,
)


def test_cli_plan_stream_embeddings(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    code = cli.main(
        ["plan", "--model", str(tmp_path), "--vram-budget", "16GiB", "--seq", "2048", "--stream-embeddings"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "final norm (embeddings and head stream)" in out and "head weight copied in for the loss" in out
    # (6,461,333,504 - 1,050,673,152 + 3 x 436,224,000) / 2^30 = 6.26
    assert "predicted peak VRAM" in out and "6.26 GiB" in out
    assert "embeddings and head (--stream-embeddings)" in out and "1.96 GiB" in out
    assert "2 head copies (forward, backward), embedding rows" in out and "all copies" in out


def test_cli_plan_backward_slots(tmp_path, capsys):
    """--backward-slots N plans N; auto (the default) plans what a run's auto takes under
    its vram_budget: none (the budget goes to the resident window), and the speed hint
    says how many auto would take without a budget."""
    write_config(tmp_path, LLAMA3_8B)
    argv = ["plan", "--model", str(tmp_path), "--vram-budget", "16GiB", "--seq", "2048", "--slots", "3"]
    assert cli.main(argv + ["--backward-slots", "4"]) == 0
    out = capsys.readouterr().out
    assert "backward slots: 4 x 0.41 GiB (not at the peak)" in out and "54 layer copies" in out
    assert cli.main(argv + ["--backward-slots", "2"]) == 0
    assert "56 layer copies (32 - 5 + 32 - 3)" in capsys.readouterr().out
    for given in (["--backward-slots", "auto"], []):
        assert cli.main(argv + given) == 0
        out = capsys.readouterr().out
        assert "backward slots:" not in out and "58 layer copies" in out
        assert "4 backward slots\n       (StreamConfig(backward_slots='auto') with vram_budget=None)" in out


def _setting_flag_mismatches(parser, names) -> list:
    """Each StreamConfig setting of ``names`` whose flag on ``parser`` is not the setting's:
    missing, or with another destination, default or help."""
    from layerstream.config import argparse_help, setting_default_text, settings

    actions = {option: action for action in parser._actions for option in action.option_strings}
    problems = []
    for setting in settings():
        if setting.name not in names:
            continue
        flag = "--" + setting.name.replace("_", "-")
        action = actions.get(flag)
        if action is None:
            problems.append(f"{flag}: missing")
            continue
        if action.dest != setting.name:
            problems.append(f"{flag}: dest {action.dest}")
        if action.default != setting_default_text(setting):
            problems.append(f"{flag}: default {action.default!r}")
        if argparse_help(setting) not in (action.help or ""):
            problems.append(f"{flag}: help")
    return problems


def _command_parser(name: str):
    import argparse

    sub = argparse.ArgumentParser(prog="layerstream").add_subparsers()
    parser = {"plan": plan_command.add_parser, "run": run_command.add_parser}[name](sub)
    {"plan": plan_command.add_arguments, "run": run_command.add_arguments}[name](parser)
    return parser


def test_the_plan_commands_setting_flags_are_stream_configs():
    """`layerstream plan`'s flags for StreamConfig settings have the settings' names, help
    and defaults, as `layerstream run`'s have; every setting a plan request takes has one."""
    import argparse

    from layerstream.plan.request import PLAN_SETTINGS, REQUEST_SETTINGS

    plan_parser, run_parser = _command_parser("plan"), _command_parser("run")
    assert set(REQUEST_SETTINGS) <= set(PLAN_SETTINGS)
    assert _setting_flag_mismatches(plan_parser, PLAN_SETTINGS) == []
    assert _setting_flag_mismatches(run_parser, PLAN_SETTINGS) == []
    # negative control: flags spelled by hand, with names and defaults of their own
    by_hand = argparse.ArgumentParser()
    by_hand.add_argument("--vram", help="GPU memory budget")
    by_hand.add_argument("--backward-slots", default=0, help="extra slots used only outside the loss")
    by_hand.add_argument("--slots", type=int, default=None, help="GPU slots")
    problems = _setting_flag_mismatches(by_hand, PLAN_SETTINGS)
    assert {"--vram-budget: missing", "--backward-slots: default 0", "--slots: default None"} <= set(problems)
    assert "--slots: help" in problems and "--host-budget: missing" in problems


def test_a_runs_settings_are_planned_as_the_run_takes_them():
    """request_for: "auto" stays for the plan to decide as the run does, but backward slots,
    which a run under a vram_budget does not take; values given are planned as given."""
    from layerstream.config import StreamConfig
    from layerstream.plan import request_for, settings_of

    shape = dict(config=config_of(LLAMA3_8B), seq=8192, batch=1)
    request = request_for(settings_of(StreamConfig(device="cpu")), 16 * GiB, **shape)
    assert (request.slots, request.backward_slots, request.loss_chunk_tokens) == ("auto", 0, "auto")
    assert request.stream_embeddings == "auto"
    plan = make_plan(request)
    assert plan.fits and plan.slots_auto and plan.backward_slots == 0 and plan.loss_chunk_tokens == 512
    assert not plan.stream_embeddings, "the loss chunk sufficed: the ends stay"
    unchunked = request.replace(loss_chunk_tokens=None, slots=3)
    assert not make_plan(unchunked.replace(stream_embeddings=False)).fits, "auto made it fit"
    assert make_plan(unchunked).stream_embeddings, "without the chunk, auto streams the ends"
    given = StreamConfig(device="cpu", slots=4, backward_slots=2, loss_chunk_tokens=0, offload_activations=True)
    request = request_for(settings_of(given), 16 * GiB, **shape)
    assert (request.slots, request.backward_slots, request.loss_chunk_tokens) == (4, 2, None)
    assert request.offload_activations is True and request.vram_bytes == 16 * GiB


def test_the_plan_command_takes_a_size_for_the_vram_budget(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    for budget in ([], ["--vram-budget", "auto"], ["--vram-budget", "none"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["plan", "--model", str(tmp_path), "--seq", "2048"] + budget)
        assert exit_info.value.code == 2 and "give the GPU memory to plan for" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(tmp_path), "--seq", "2048", "--vram-budget", "16GiB"]) == 0


# -- parsing ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GiB", 16 * 2**30),
        ("24GB", 24 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("16000000000", 16 * 10**9),
        ("512 MiB", 512 * 2**20),
        ("2tib", 2 * 2**40),
        ("80gb", 80 * 10**9),
        (".5GiB", 2**29),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "not a size"),
        ("abc", "not a size"),
        ("GiB", "not a size"),
        ("-1GiB", "not a size"),
        ("16G", "ambiguous"),
        ("16 furlongs", "unknown unit"),
        ("1.5", "whole number"),
        (-5, "negative"),
        ("1,5GiB", "not a size"),
    ],
)
def test_parse_bytes_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)


def test_load_config_from_file_directory_and_errors(tmp_path):
    path = write_config(tmp_path / "a", LLAMA3_8B, name="llama3-8b.json")  # any file name
    config = load_config(path)
    assert (config.model_type, config.num_key_value_heads, config.vocab_size) == ("llama", 8, 128256)
    write_config(tmp_path / "b", LLAMA3_8B)
    assert load_config(tmp_path / "b").intermediate_size == 14336
    assert load_config(str(tmp_path / "b" / "config.json")).hidden_size == 4096
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing" / "config.json")
    with pytest.raises(ValueError, match="model_type"):
        load_config(write_config(tmp_path / "c", {"hidden_size": 8}))
    with pytest.raises(ValueError, match="no config.json"):
        load_config(tmp_path / "a")


# -- the command --------------------------------------------------------------------------
def test_cli_plan_fits(tmp_path, capsys):
    path = write_config(tmp_path, LLAMA3_8B)
    code = cli.main(["plan", "--model", str(path), "--vram-budget", "16GiB", "--seq", "2048"])
    out = capsys.readouterr().out
    assert code == 0
    assert "32 layers" in out
    assert "slots: 3 x 0.41 GiB (auto)" in out  # as StreamConfig(slots="auto") takes them
    assert "predicted peak VRAM" in out and "7.24 GiB" in out  # (6,461,333,504 + 3 x 436,224,000) / 2^30
    assert "host RAM needed" in out and "15.52 GiB" in out
    assert "fits" in out and "To make it fit" not in out


def test_cli_plan_does_not_fit(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    argv = ["plan", "--model", str(tmp_path), "--vram-budget", "16GiB", "--seq", "8192", "--slots", "2"]
    off = ["--offload-activations", "false", "--loss-chunk-tokens", "none", "--mlp-tile-tokens", "none"]
    code = cli.main(argv + off + ["--stream-embeddings", "false", "--bandwidth", "7"])
    out = capsys.readouterr().out
    assert code == 1
    assert "DOES NOT FIT, short by 2.14 GiB" in out
    assert "--quantization nf4" in out and "reduce --seq to 6918" in out
    assert "at 7 GB/s" in out
    # the settings' default, auto, plans what a run turns on at this length: a chunked loss
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "chunks of 512 tokens" in out and "auto (a run's default) at batch 1 x 8192 tokens turns on" in out


def test_cli_plan_options_reach_the_plan(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    code = cli.main(
        [
            "plan",
            "--model",
            str(tmp_path),
            "--vram-budget",
            "80GB",
            "--seq",
            "1024",
            "--batch",
            "2",
            "--quantization",
            "nf4",
            "--dtype",
            "float16",
            "--lora-rank",
            "8",
            "--lora-targets",
            "q_proj,v_proj",
            "--slots",
            "4",
            "--reserve",
            "2GiB",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "seq 1024 x batch 2, float16, NF4, r=8 on q_proj,v_proj" in out
    assert "slots: 4 x 0.10 GiB (--slots)" in out
    assert "2.00 GiB" in out  # the reserve


def test_a_plain_qlora_scripts_float32_residual_stream_is_planned(tmp_path, capsys):
    """--residual-dtype float32 (peft's prepare_model_for_kbit_training) plans float32
    embeddings and head beside bf16 layers: more memory than the same step without it."""
    write_config(tmp_path, LLAMA3_8B)
    argv = ["plan", "--model", str(tmp_path), "--vram-budget", "80GB", "--seq", "8192", "--quantization", "nf4"]
    argv += ["--autocast", "--lora-dropout", "0.05"]
    peaks = {}
    for extra in ([], ["--residual-dtype", "float32"]):
        assert cli.main(argv + extra) == 0
        out = capsys.readouterr().out
        assert ("(float32 residual stream)" in out) == bool(extra)
        peaks[bool(extra)] = float(re.search(r"peak VRAM\s+([\d.]+) GiB", out).group(1))
    assert peaks[True] > peaks[False]


@pytest.mark.parametrize(
    "argv",
    [
        ["--vram-budget", "16G", "--seq", "2048"],
        ["--vram-budget", "16GiB", "--seq", "2048", "--slots", "1"],
        ["--vram-budget", "16GiB", "--seq", "2048", "--unknown"],
    ],
)
def test_cli_plan_bad_input_exits_2(tmp_path, capsys, argv):
    write_config(tmp_path, LLAMA3_8B)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", str(tmp_path)] + argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_demo_still_receives_its_arguments(monkeypatch):
    from layerstream.commands import demo

    seen = []
    monkeypatch.setattr(demo, "main", lambda argv: seen.append(argv))
    assert cli.main(["demo", "--steps", "3", "--device", "cpu"]) == 0
    assert seen == [["--steps", "3", "--device", "cpu"]]


@pytest.mark.parametrize(
    "fields",
    [
        # a plain QLoRA Trainer script (prepare_model_for_kbit_training, bf16)
        dict(quantization="nf4", residual_dtype="float32", lora_rank=32, lora_dropout=True, autocast=True),
        # TRL's sft.py with --load_in_4bit, its head in host memory
        dict(
            quantization="nf4",
            adapter_dtype="bfloat16",
            lora_dropout=True,
            autocast=True,
            trl_fused_head=True,
            lora_targets="q_proj,v_proj",
            stream_embeddings=True,
        ),
        dict(dtype="float16", lora_rank=8),
    ],
    ids=["trainer-script", "trl-sft", "fp16"],
)
def test_the_flags_an_advice_names_plan_the_same_request(tmp_path, monkeypatch, fields):
    """``plan_flags`` spells a request as `layerstream plan` flags (the out-of-memory advice
    names them); the command given them plans the request they came from."""
    import layerstream.plan as plan_package
    from layerstream.plan.request import PlanRequest, plan_flags
    from layerstream.plan.shapes import parse_dtype

    write_config(tmp_path, LLAMA3_8B)
    request = PlanRequest(load_config(tmp_path), 2048, 1, 16 * GiB, **fields)
    seen = []
    real = plan_package.make_plan
    monkeypatch.setattr(plan_package, "make_plan", lambda asked: seen.append(asked) or real(asked))
    argv = ["plan", "--model", str(tmp_path), "--vram-budget", "16GiB", "--seq", "2048"]
    assert cli.main(argv + plan_flags(request)) == 0
    planned = seen[0]
    for name in ("quantization", "lora_rank", "lora_targets", "lora_dropout", "autocast", "trl_fused_head"):
        assert getattr(planned, name) == getattr(request, name), name
    assert planned.stream_embeddings == request.stream_embeddings
    for name in ("dtype", "adapter_dtype"):
        assert parse_dtype(getattr(planned, name)) == parse_dtype(getattr(request, name)), name
    assert (planned.residual_dtype is None) == (request.residual_dtype is None)
    if request.residual_dtype is not None:
        assert parse_dtype(planned.residual_dtype) == parse_dtype(request.residual_dtype)


def test_a_request_the_command_cannot_spell_is_refused_not_planned_otherwise(tmp_path):
    """Adapted Parameters, a rank pattern and NF4 without double quantisation have no flags:
    ``plan_flags`` says so (the out-of-memory advice then names the command without flags)
    rather than spell a request the command would plan differently."""
    from layerstream.plan.request import PlanRequest, plan_flags

    write_config(tmp_path, LLAMA3_8B)
    request = PlanRequest(load_config(tmp_path), 2048, 1, 16 * GiB, "nf4", stream_embeddings="auto")
    assert plan_flags(request) == ["--quantization", "nf4"]
    assert plan_flags(request.replace(stream_embeddings=False))[-2:] == ["--stream-embeddings", "false"]
    for changes, named in (
        (dict(lora_targets="none", lora_parameters="mlp.experts.gate_up_proj"), "adapted Parameters"),
        (dict(lora_rank_pattern=((".*q_proj", 8),)), "rank pattern"),
        (dict(double_quant=False), "double quantisation"),
    ):
        with pytest.raises(ValueError, match=named):
            plan_flags(request.replace(**changes))
    same = request.replace(dtype="float32", residual_dtype="float32")
    assert plan_flags(same) == ["--quantization", "nf4", "--dtype", "float32"]
