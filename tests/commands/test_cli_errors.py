"""What a new user meets first on the command line: help and argument errors at once, a
mistyped path named as one, a missing module or a refused checkpoint said in one message."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from layerstream.checkpoints.paths import missing_directory_behind
from layerstream.commands import cli

from tiny import save_tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["no-such-command"]])
def test_help_and_a_mistyped_command_answer_without_importing_torch(argv):
    probe = textwrap.dedent(
        f"""
        import sys
        from layerstream.commands import cli
        try:
            cli.main({argv!r})
        except SystemExit:
            pass
        heavy = [name for name in ("torch", "transformers", "peft") if name in sys.modules]
        assert not heavy, heavy
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_the_import_probe_sees_a_heavy_import():
    """Negative control: the subcommand whose options need torch imports it."""
    probe = "import sys\nfrom layerstream.commands import cli\ntry:\n    cli.main(['run', '--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip().splitlines()[-1] == "True", done.stderr


def test_plan_names_a_mistyped_local_path_as_no_such_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["plan", "--model", "./models/llama", "--vram-budget", "12GiB", "--seq", "2048"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "no such directory: ./models/llama" in err
    assert "Repo id" not in err


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_script_under_run_names_a_mistyped_local_path_as_no_such_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = _script(
        tmp_path,
        """
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained("./models/llama")
        """,
    )
    assert cli.main(["run", "--device", "cpu", script]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "layerstream: error: no such directory: ./models/llama; pass a directory that holds config.json "
        "and the weights, or a hub id like org/name"
    ]


def test_a_hub_error_for_a_name_that_is_not_a_path_is_left_as_it_is():
    """Negative control: only a local-looking name that is missing becomes "no such directory"."""
    from huggingface_hub.errors import HFValidationError

    def error_for(name):
        try:
            raise OSError("wrapped") from HFValidationError(
                f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{name}'. Use `repo_type` argument"
            )
        except OSError as exc:
            return exc

    assert missing_directory_behind(error_for("./no-such-dir")).startswith("no such directory: ./no-such-dir")
    assert missing_directory_behind(error_for("bad name!")) is None
    assert missing_directory_behind(OSError("no hub involved")) is None


def test_run_of_a_module_that_is_not_installed_says_so_without_a_traceback(capsys):
    assert cli.main(["run", "--device", "cpu", "-m", "no_such_module_anywhere"]) == 2
    err = capsys.readouterr().err
    assert "no module named 'no_such_module_anywhere'" in err
    assert "Traceback" not in err


def test_a_truncated_checkpoint_under_run_prints_its_message_alone_and_fails(tmp_path, capsys):
    save_tiny(tmp_path / "model", layers=3)
    shard = tmp_path / "model" / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 1000)
    script = _script(
        tmp_path,
        f"""
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r})
        """,
    )
    capsys.readouterr()  # what saving printed
    assert cli.main(["run", "--device", "cpu", script]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerstream: error: "), lines
    assert "model.safetensors is truncated" in lines[0]


def test_an_error_that_is_not_a_refusal_keeps_its_traceback(tmp_path):
    """Negative control: a bug in the script is not turned into one line."""
    script = _script(tmp_path, "raise RuntimeError('a bug in the script')\n")
    with pytest.raises(RuntimeError, match="a bug in the script"):
        cli.main(["run", "--device", "cpu", script])


def test_from_pretrained_takes_the_device_its_advice_names(tmp_path):
    import layerstream

    save_tiny(tmp_path, layers=3)
    model = layerstream.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    assert layerstream.get_runtime(model).device == torch.device("cpu")
    slots = layerstream.StreamConfig(device="cpu", slots=2)
    model = layerstream.from_pretrained(tmp_path, dtype=torch.float32, stream=slots, device="cpu")
    assert layerstream.get_runtime(model).config.slots == 2, "device= keeps the rest of stream="
