"""`layerstream run` with the launchers people use: a script path, ``-m MODULE`` (TRL's
shipped scripts), an installed command (``trl sft``), and ``python -m layerstream``; each
run streamed gives the plain run's losses, with the stats in log_history."""

import argparse
import json
import logging
import runpy
import sys
from pathlib import Path

import pytest

import layerstream
from layerstream import data as embedded
from layerstream.commands import cli, flags
from layerstream.commands import run as run_command
from layerstream.integrations import launch
from layerstream.long import tiled_mlp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _auto_streaming_off():
    yield
    launch.disable()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny checkpoint with its tokenizer, an SFT and a preference dataset, on disk."""
    root = tmp_path_factory.mktemp("files")
    checkpoint = embedded.write_checkpoint(root / "model", layers=4, hidden_size=64)
    rows = [json.loads(line) for line in embedded.data_path().read_text().splitlines() if line.strip()][:48]
    sft = root / "sft"
    sft.mkdir()
    (sft / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"Q: {r['instruction']}\nA: {r['response']}"}) + "\n" for r in rows)
    )
    dpo = root / "dpo"
    dpo.mkdir()
    (dpo / "train.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"Q: {r['instruction']}\nA:", "chosen": " " + r["response"], "rejected": " no."})
            + "\n"
            for r in rows
        )
    )
    return {"model": checkpoint, "sft": sft, "dpo": dpo}


def _history(out):
    """log_history from trainer_state.json (TRL's scripts write it with the last checkpoint)."""
    state = Path(out) / "trainer_state.json"
    if not state.exists():
        state = Path(out) / "checkpoint-3" / "trainer_state.json"
    return json.loads(state.read_text())["log_history"]


def _losses(out):
    return [e["loss"] for e in _history(out) if "loss" in e]


def _trainer_args(files, out):
    """TrainingArguments every client here runs with: three logged steps on the CPU."""
    return [
        "--model_name_or_path",
        str(files["model"]),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--use_cpu",
        "--per_device_train_batch_size",
        "4",
    ]


def _common(files, out, data="sft"):
    return _trainer_args(files, out) + [
        "--dataset_name",
        str(files[data]),
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
        "--use_peft",
        "--lora_r",
        "4",
        "--lora_target_modules",
        "all-linear",
        "--max_length",
        "64",
        "--seed",
        "0",
    ]


def _plain_module(module, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module] + argv)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@pytest.fixture(scope="module")
def plain_sft(files, tmp_path_factory):
    """TRL's sft.py run plainly with _common's arguments, once for the launcher's forms."""
    out = tmp_path_factory.mktemp("plain-sft")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _plain_module("trl.scripts.sft", _common(files, out), monkeypatch)
    return out


@pytest.mark.parametrize("form", ["module", "command", "python-m-layerstream"])
def test_trl_sft_unchanged_under_the_launcher_matches_the_plain_run(files, plain_sft, tmp_path, monkeypatch, form):
    streamed = _common(files, tmp_path / "streamed")
    if form == "module":
        assert cli.main(["run", "--slots", "2", "-m", "trl.scripts.sft"] + streamed) == 0
    elif form == "command":
        assert cli.main(["run", "--slots", "2", "trl", "sft"] + streamed) == 0
    else:
        monkeypatch.setattr(sys, "argv", ["layerstream", "run", "--slots", "2", "-m", "trl.scripts.sft"] + streamed)
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_module("layerstream", run_name="__main__")
        assert exit_info.value.code == 0
    plain, got = _losses(plain_sft), _losses(tmp_path / "streamed")
    assert len(plain) == 3 and got == plain
    logged = [e for e in _history(tmp_path / "streamed") if "loss" in e]
    assert all("layerstream/layer_loads" in e for e in logged)
    assert (tmp_path / "streamed" / "adapter_model.safetensors").exists()


def test_trl_sft_qlora_under_the_launcher_matches_the_plain_run(files, tmp_path, monkeypatch):
    args = ["--load_in_4bit", "--dtype", "bfloat16"]
    _plain_module("trl.scripts.sft", _common(files, tmp_path / "plain") + args, monkeypatch)
    assert (
        cli.main(["run", "--slots", "2", "-m", "trl.scripts.sft"] + _common(files, tmp_path / "streamed") + args) == 0
    )
    plain, got = _losses(tmp_path / "plain"), _losses(tmp_path / "streamed")
    assert len(plain) == 3 and got == plain


def test_trl_sft_with_its_lora_dropout_trains_under_the_tiled_mlp_as_the_plain_run(files, tmp_path, monkeypatch):
    """TRL's default lora_dropout (0.05) with --mlp-tile-tokens: the tiles' backward replays
    the forward's masks, and the launcher's run gives the losses of the plain script whose
    resident model has the same tiles (tiles draw their own masks: not an untiled run's);
    the attention adapters, which draw their masks again in the launcher's run, add nothing
    to the difference."""
    from transformers import PreTrainedModel

    from layerstream.long import adapter_inputs, tiles

    loading = PreTrainedModel.__dict__["from_pretrained"].__func__
    replays, adapter_replays = [], []

    def counting(into):
        class Counting(tiles.ForwardRandomState):
            def replayed(self):
                into.append(1)
                return super().replayed()

        return Counting

    monkeypatch.setattr(tiled_mlp, "ForwardRandomState", counting(replays))
    monkeypatch.setattr(adapter_inputs, "ForwardRandomState", counting(adapter_replays))
    with monkeypatch.context() as plain:
        tiled = classmethod(lambda cls, *a, **k: tiled_mlp.apply(loading(cls, *a, **k), 16))
        plain.setattr(PreTrainedModel, "from_pretrained", tiled)
        _plain_module("trl.scripts.sft", _common(files, tmp_path / "plain"), monkeypatch)
    plain_replays = len(replays)
    streamed = ["run", "--slots", "2", "--mlp-tile-tokens", "16", "-m", "trl.scripts.sft"]
    assert cli.main(streamed + _common(files, tmp_path / "streamed")) == 0
    assert plain_replays > 0 and len(replays) == 2 * plain_replays, "each run's tiles replayed their masks"
    # TRL injects the adapters after the model streamed: their dropout is drawn again from the
    # first step (the plain run's tiles were applied before TRL's injection: its adapters keep
    # their inputs), and the losses are the same
    assert adapter_replays, "the attention adapters drew their masks again"
    plain, got = _losses(tmp_path / "plain"), _losses(tmp_path / "streamed")
    assert len(plain) == 3 and got == plain


def test_trl_dpo_unchanged_under_the_launcher_matches_the_plain_run(files, tmp_path, monkeypatch):
    def args(out):
        return _common(files, out, data="dpo")

    _plain_module("trl.scripts.dpo", args(tmp_path / "plain"), monkeypatch)
    assert cli.main(["run", "--slots", "2", "-m", "trl.scripts.dpo"] + args(tmp_path / "streamed")) == 0
    plain, got = _losses(tmp_path / "plain"), _losses(tmp_path / "streamed")
    assert len(plain) == 3 and got == plain


QLORA_SCRIPT = str(ROOT / "examples" / "train_qlora.py")


def _qlora_script_losses(files, tmp_path, monkeypatch, launcher_flags):
    """The plain QLoRA script's losses, and the same script's behind `layerstream run`."""

    def args(out):
        return _trainer_args(files, out) + ["--load_in_4bit", "--save_strategy", "no"]

    monkeypatch.setattr(sys, "argv", [QLORA_SCRIPT] + args(tmp_path / "plain"))
    runpy.run_path(QLORA_SCRIPT, run_name="__main__")
    assert cli.main(["run", "--slots", "2", *launcher_flags, QLORA_SCRIPT] + args(tmp_path / "streamed")) == 0
    return _losses(tmp_path / "plain"), _losses(tmp_path / "streamed")


def test_a_plain_trainer_script_with_device_map_and_a_4bit_config_matches_the_plain_run(files, tmp_path, monkeypatch):
    plain, got = _qlora_script_losses(files, tmp_path, monkeypatch, [])
    assert len(plain) == 3 and got == plain


def test_the_plain_qlora_script_with_layers_on_disk_matches_the_plain_run(files, tmp_path, monkeypatch, caplog):
    """The script calls peft's prepare_model_for_kbit_training, which casts the norms of
    every layer, those the disk tier reads too (a host_budget below the model)."""
    loaded = layerstream.from_pretrained(
        files["model"], quantization="nf4", stream=layerstream.StreamConfig(device="cpu")
    )
    budget = str(3 * layerstream.get_runtime(loaded).store.largest_layer_bytes)  # the ring and one layer
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        flags = ["--host-budget", budget, "--disk-cache-dir", str(tmp_path / "cache")]
        plain, got = _qlora_script_losses(files, tmp_path, monkeypatch, flags)
    assert any("of layers the disk tier reads were changed" in r.getMessage() for r in caplog.records)
    assert len(plain) == 3 and got == plain


def test_layer_stream_flags_of_an_hfargumentparser_script_stream_what_it_loads(files):
    from transformers import AutoModelForCausalLM, HfArgumentParser

    (streaming,) = HfArgumentParser((layerstream.StreamingArguments,)).parse_args_into_dataclasses(
        ["--layer_stream", "--layer_stream_slots", "2", "--layer_stream_vram_budget", "none"]
    )
    model = AutoModelForCausalLM.from_pretrained(files["model"], device_map="auto")
    assert layerstream.is_streamed(model)
    assert layerstream.get_runtime(model).config.vram_budget is None


def test_every_flag_surface_prints_its_help(capsys):
    """`layerstream run --help` and a script's HfArgumentParser with StreamingArguments
    render every setting's help, a literal % included (argparse formats help with %)."""
    from transformers import HfArgumentParser

    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "--help"])
    assert exited.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "layer i over directory i % n" in printed
    script_help = " ".join(HfArgumentParser((layerstream.StreamingArguments,)).format_help().split())
    assert "layer i over directory i % n" in script_help


def test_the_settings_are_one_definition_on_every_surface():
    """Every StreamConfig setting is a `layerstream run` flag, a StreamingArguments field
    and a YAML stream key, with the same default."""
    import dataclasses

    from layerstream.commands.train_config import SECTIONS
    from layerstream.config import argparse_help, setting_default_text, settings
    from layerstream.integrations.trainer import argument_name

    parser = argparse.ArgumentParser()
    flags.add_setting_flags(parser)
    options = {action.dest: action for action in parser._actions}
    fields = {f.name: f for f in dataclasses.fields(layerstream.StreamingArguments)}
    for setting in settings():
        default = setting_default_text(setting)
        assert options[setting.name].default == default, setting.name
        assert options[setting.name].help.startswith(argparse_help(setting))
        assert fields[argument_name(setting.name)].default == default, setting.name
        if setting.name != "device":  # YAML spells the default device "auto": CUDA when there is one
            assert SECTIONS["stream"][setting.name] == default, setting.name
    assert layerstream.StreamConfig(device="cpu").vram_budget is None  # auto on the host: no budget
    assert options["vram_budget"].default == "auto"


@pytest.mark.parametrize(
    "argv,ours,theirs",
    [
        (["--slots", "2", "train.py", "--slots", "9"], ["--slots", "2", "train.py"], ["--slots", "9"]),
        (
            ["--stream-embeddings", "-m", "trl.scripts.sft", "--x"],
            ["--stream-embeddings", "-m", "trl.scripts.sft"],
            ["--x"],
        ),
        (["--vram-budget=8GiB", "trl", "sft", "--lr", "1"], ["--vram-budget=8GiB", "trl"], ["sft", "--lr", "1"]),
        (["--no-pin", "--device", "cpu", "a.py"], ["--no-pin", "--device", "cpu", "a.py"], []),
    ],
)
def test_launcher_options_end_where_the_target_begins(argv, ours, theirs):
    run_parser = argparse.ArgumentParser()
    flags.add_setting_flags(run_parser)
    assert run_command.split_run_arguments(run_parser, argv) == (ours, theirs)


def test_a_script_after_a_switch_alone_is_the_target_not_the_switchs_value(tmp_path, capsys):
    """``--offload-activations train.py``: the switch alone means true, and train.py runs."""
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os, sys\n"
        "settings = json.loads(os.environ['LAYERSTREAM_AUTOSTREAM'])\n"
        "print('offload', settings['offload_activations'], 'argv', sys.argv[1:], 'file', __file__)\n"
    )
    assert cli.main(["run", "--offload-activations", str(script), "--lr", "1"]) == 0
    said = capsys.readouterr().out
    assert "offload True argv ['--lr', '1']" in said and f"file {script}" in said


def test_a_relative_script_path_gives_the_script_an_absolute_file_as_python_does(tmp_path, monkeypatch, capsys):
    (tmp_path / "where.py").write_text("print('file', __file__)\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "where.py"]) == 0
    assert f"file {tmp_path / 'where.py'}" in capsys.readouterr().out


def test_a_script_exiting_with_a_message_prints_it_and_exits_1_as_python_does(tmp_path, capsys):
    script = tmp_path / "stop.py"
    script.write_text("import sys\nsys.exit('fatal: the data is missing')\n")
    assert cli.main(["run", str(script)]) == 1
    assert "fatal: the data is missing" in capsys.readouterr().err


def test_an_unknown_target_is_refused_with_the_forms_the_launcher_takes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--slots", "2", "no-such-command-anywhere"])
    assert exit_info.value.code == 2 and "SCRIPT.py, -m MODULE, or a command" in capsys.readouterr().err


def test_accelerate_launch_of_the_launcher_streams_in_the_process_it_starts(files, tmp_path):
    """``accelerate launch -m layerstream run SCRIPT``: accelerate starts a new Python process
    for the launcher, which streams the script's Trainer there."""
    import subprocess

    script = str(ROOT / "examples" / "train_trainer.py")
    args = [
        "--output_dir",
        str(tmp_path / "{}"),
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--use_cpu",
        "--per_device_train_batch_size",
        "4",
        "--save_strategy",
        "no",
    ]

    def run(prefix, out):
        argv = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--cpu",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ] + prefix
        argv += [script] + [a.format(out) for a in args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]

    run([], "plain")
    run(["-m", "layerstream", "run", "--slots", "2"], "streamed")
    assert _losses(tmp_path / "streamed") == _losses(tmp_path / "plain") and len(_losses(tmp_path / "plain")) == 3
    assert all("layerstream/layer_loads" in e for e in _history(tmp_path / "streamed") if "loss" in e)
