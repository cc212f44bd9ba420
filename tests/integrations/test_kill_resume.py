"""A streamed Trainer run killed with SIGKILL resumes from its last checkpoint and logs the
losses an uninterrupted run logs (subprocesses on the CPU)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_trainer.py"

# The example script, unchanged, under `layerstream run`; a callback slows each step down
# (LAYERSTREAM_TEST_STEP_SLEEP seconds) so the kill lands mid-run.
RUNNER = textwrap.dedent(f"""
    import os, sys, time
    from transformers import Trainer, TrainerCallback

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(float(os.environ.get("LAYERSTREAM_TEST_STEP_SLEEP", "0")))

    original = Trainer.__init__
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(Slow())
    Trainer.__init__ = __init__

    from layerstream.commands import cli
    sys.exit(cli.main(["run", "--slots", "2", "--device", "cpu", {str(SCRIPT)!r}] + sys.argv[1:]))
""")


def _command(out, *extra):
    return [
        sys.executable,
        "-c",
        RUNNER,
        "--output_dir",
        str(out),
        "--max_steps",
        "8",
        "--logging_steps",
        "1",
        "--save_steps",
        "2",
        "--report_to",
        "none",
        "--use_cpu",
        "--per_device_train_batch_size",
        "4",
        "--seed",
        "0",
        *extra,
    ]


def _env(sleep):
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), LAYERSTREAM_TEST_STEP_SLEEP=str(sleep))


def _losses(out):
    history = json.loads((Path(out) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def _complete_checkpoints(out):
    done = [p for p in Path(out).glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def test_a_run_killed_with_sigkill_resumes_with_the_uninterrupted_losses(tmp_path):
    whole = tmp_path / "whole"
    subprocess.run(_command(whole), env=_env(0), check=True, capture_output=True, timeout=300)
    expected = _losses(whole)
    assert sorted(expected) == list(range(1, 9))

    killed = tmp_path / "killed"
    process = subprocess.Popen(_command(killed), env=_env(0.5), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while not any(int(p.name.split("-")[1]) >= 4 for p in _complete_checkpoints(killed)):
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint-4 within 240 s"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not (killed / "trainer_state.json").exists(), "the killed run must not have finished"
    last = _complete_checkpoints(killed)[-1]
    resumed_from = int(last.name.split("-")[1])
    assert resumed_from < 8

    subprocess.run(
        _command(killed, "--resume_from_checkpoint", str(last)),
        env=_env(0),
        check=True,
        capture_output=True,
        timeout=300,
    )
    resumed = _losses(killed)
    after = [step for step in expected if step > resumed_from]
    assert after and all(resumed[step] == expected[step] for step in after), (resumed, expected)
