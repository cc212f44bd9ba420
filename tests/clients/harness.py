"""Run one real client plainly and under ``layerstream run`` in this process, and compare
what the two runs logged and saved.

The clients: TRL's shipped scripts (``-m trl.scripts.<name>``), the ``trl`` command (which
starts its script in a new process through ``accelerate launch``), and ``client.py`` (a
user's script around a TRL trainer or the plain Trainer), each plain and under the
launcher; ``api_client.py`` (a Trainer script that knows layerstream), plain and with
``--layer_stream`` or a layerstream load; and ``layerstream train`` of ``train.yaml``
against ``train_client.py``, the plain script the YAML stands for. Each writes a
checkpoint at its last step, whose ``trainer_state.json`` holds ``log_history``.
"""

from __future__ import annotations

import json
import runpy
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import List

import torch
from safetensors.torch import load_file

from layerstream.commands import cli

CLIENT = Path(__file__).with_name("client.py")
API_CLIENT = Path(__file__).with_name("api_client.py")
TRAIN_CLIENT = Path(__file__).with_name("train_client.py")
TRAIN_CONFIG = Path(__file__).with_name("train.yaml")
STEPS = 3
LAUNCHER = ["run", "--slots", "2", "--vram-budget", "none"]  # two slots for four layers: every layer streams
FLAGS = ["--layer_stream", "--layer_stream_slots", "2", "--layer_stream_vram_budget", "none"]  # the same, as flags
# values that time the run; everything else a run logs must be equal
WALL_CLOCK = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}
STREAMING_ONLY = {"layerstream-trace.json", "layerstream-timeline.png"}  # what the streamed run adds
# TRL's preference and online scripts read these data kinds
SCRIPT_DATA = {"sft": "sft", "dpo": "preference", "kto": "unpaired", "grpo": "prompt", "rloo": "prompt"}


@dataclass(frozen=True)
class Client:
    """How a client is started: ``script`` (``-m trl.scripts.<name>``), ``command``
    (``trl <name>``) or ``client`` (``client.py --trainer <name>``), each streamed by the
    launcher; ``flag`` (``api_client.py``, streamed by ``--layer_stream``), ``api``
    (``api_client.py --load <name>``, plain with ``--load transformers``) or ``train``
    (``layerstream train``, plain: ``train_client.py``)."""

    kind: str
    name: str

    def argv(self, model: Path, data: Path, out: Path, peft: str, options, device: str) -> List[str]:
        if self.kind == "train":
            if peft != "lora" or options:
                raise ValueError(f"layerstream train trains LoRA as train.yaml gives it, not {peft} {options}")
            values = dict(model=model, data=data / "sft.jsonl", out=out, steps=STEPS, device=device)
            sets = "model.name={model} data.path={data} training.output_dir={out} training.max_steps={steps}"
            sets += " training.save_steps={steps} stream.device={device}"
            return [str(TRAIN_CONFIG)] + [a for s in sets.format(**values).split() for a in ("--set", s)]
        if self.kind in ("flag", "api"):
            argv = ["--model", str(model), "--data", str(data), "--peft", peft, "--output_dir", str(out)]
            argv += ["--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--logging_steps", "1"]
            argv += ["--save_strategy", "steps", "--save_steps", str(STEPS), "--report_to", "none", *options]
            return argv + (["--use_cpu"] if device == "cpu" else [])
        if self.kind == "client":
            argv = ["--trainer", self.name, "--peft", peft, "--model", str(model), "--data", str(data)]
            argv += ["--output_dir", str(out), "--steps", str(STEPS), *options]
            return argv + (["--use_cpu"] if device == "cpu" else [])
        if peft != "lora" or options:
            raise ValueError(f"TRL's {self.name} script takes LoRA as its flags give it, not {peft} {options}")
        argv = ["--model_name_or_path", str(model), "--dataset_name", str(data / SCRIPT_DATA[self.name])]
        argv += ["--output_dir", str(out), "--max_steps", str(STEPS), "--save_strategy", "steps"]
        argv += ["--save_steps", str(STEPS), "--logging_steps", "1", "--report_to", "none"]
        argv += ["--per_device_train_batch_size", "2", "--use_peft", "--lora_target_modules", "all-linear"]
        if self.name in ("grpo", "rloo"):
            argv += ["--reward_funcs", "clients.client.variety_reward", "--num_generations", "2"]
            argv += ["--max_completion_length", "8"]
        else:
            argv += ["--max_length", "48"]
        return argv + (["--use_cpu"] if device == "cpu" else [])

    def run_plain(self, argv: List[str]) -> None:
        saved = sys.argv
        try:
            if self.kind == "script":
                sys.argv = [f"trl.scripts.{self.name}"] + argv
                runpy.run_module(f"trl.scripts.{self.name}", run_name="__main__", alter_sys=True)
            elif self.kind == "command":
                sys.argv = ["trl", self.name] + argv
                (entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "trl"]
                assert entry.load()() in (0, None), "the plain trl command failed"
            elif self.kind in ("flag", "api", "train"):
                script = TRAIN_CLIENT if self.kind == "train" else API_CLIENT
                sys.argv = [str(script)] + argv
                runpy.run_path(str(script), run_name="__main__")
            else:
                sys.argv = [str(CLIENT)] + argv
                runpy.run_path(str(CLIENT), run_name="__main__")
        finally:
            sys.argv = saved

    def run_streamed(self, argv: List[str]) -> None:
        if self.kind == "train":
            assert cli.main(["train"] + argv) == 0, "layerstream train exited with an error"
            return
        if self.kind in ("flag", "api"):
            self.run_plain(argv + (FLAGS if self.kind == "flag" else ["--load", self.name]))
            return
        if self.kind == "script":
            target = ["-m", f"trl.scripts.{self.name}"]
        elif self.kind == "command":
            target = ["trl", self.name]
        else:
            target = [str(CLIENT)]
        assert cli.main(LAUNCHER + target + argv) == 0, "the streamed run exited with an error"


def logged(out: Path, streamed: bool) -> dict:
    """The run's trainer_state.json with its log_history as compared: wall-clock values
    dropped, and in a streamed run the ``layerstream/*`` figures, after checking that every
    training log has them (the run streamed)."""
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    history = state["log_history"]
    training_logs = [entry for entry in history if "loss" in entry]
    assert len(training_logs) == STEPS, f"expected {STEPS} training logs, found {len(training_logs)}"
    if streamed:
        assert all(entry.get("layerstream/layer_loads", 0) > 0 for entry in training_logs), (
            "the streamed run logged no layer loads: it did not stream"
        )
    else:
        assert not any(key.startswith("layerstream/") for entry in history for key in entry), "the plain run streamed"
        # the reference: with no gradient, the runs would compare equal whatever streaming did
        assert any(entry.get("grad_norm", 0) > 0 for entry in training_logs), "the plain run had no gradient"
    state["log_history"] = [
        {k: v for k, v in entry.items() if k not in WALL_CLOCK and not k.startswith("layerstream/")}
        for entry in history
    ]
    return state


def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}", out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}[{index}]", out)
    elif hasattr(value, "__array__") and not isinstance(value, torch.Tensor):
        out[prefix] = torch.as_tensor(value.__array__())
    else:
        out[prefix] = value


def saved_tensors(out: Path) -> dict:
    """Every tensor the run saved (adapters, optimizer and scheduler state, random states),
    by file and key. ``training_args.bin`` is the pickled arguments (its output_dir differs)."""
    found: dict = {}
    for path in sorted(out.rglob("*")):
        name = str(path.relative_to(out))
        if path.suffix == ".safetensors":
            for key, tensor in load_file(path).items():
                found[f"{name}:{key}"] = tensor
        elif path.suffix in (".pt", ".pth"):
            _flatten(torch.load(path, weights_only=False), name, found)
    return found


def files(out: Path) -> set:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name not in STREAMING_ONLY}


def assert_same_runs(plain: Path, streamed: Path) -> None:
    """Every logged value and every saved tensor equal, bit for bit."""
    assert_same_logs(plain, streamed)
    assert_same_saved_tensors(plain, streamed)


def assert_same_logs(plain: Path, streamed: Path) -> None:
    want, got = logged(plain, streamed=False), logged(streamed, streamed=True)
    for step, (a, b) in enumerate(zip(want["log_history"], got["log_history"])):
        differing = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        assert not differing, f"log entry {step} differs (plain, streamed): {differing}"
    assert want == got, "trainer_state.json differs beyond its log_history"


def assert_same_saved_tensors(plain: Path, streamed: Path) -> None:
    assert files(plain) == files(streamed), f"saved files differ: {files(plain) ^ files(streamed)}"
    want_tensors, got_tensors = saved_tensors(plain), saved_tensors(streamed)
    assert want_tensors.keys() == got_tensors.keys(), (
        f"saved tensors differ: {want_tensors.keys() ^ got_tensors.keys()}"
    )
    assert want_tensors, "the runs saved no tensors"
    for key, want_value in want_tensors.items():
        got_value = got_tensors[key]
        if isinstance(want_value, torch.Tensor):
            assert isinstance(got_value, torch.Tensor) and want_value.dtype == got_value.dtype, key
            assert want_value.shape == got_value.shape and torch.equal(want_value, got_value), f"{key} differs"
        else:
            assert want_value == got_value, f"{key} differs: {want_value!r} vs {got_value!r}"
