"""Harness only: where a few decode token steps of an online trainer's generation spend the
host's and the GPU's time, on either side of a pair (``capped.py --trace-decode DIR``).

Decoding at batch 8 is bound by the host's launches, so a gap between a plain and a
streamed run of TRL's GRPO or RLOO shows in the host's time per token step, in the kernels
a step launches, or in a call that waits for the GPU; Python's call counts alone showed
none. In the first ``generate`` call of Trainer step ``step`` (counted from 0: the second
step, whose window is already sized, and which the rows do not time), each forward of the
model ``generate`` runs on gets its host time (entry to return) and the interval from the
one before, and torch's profiler runs over ``count`` token steps from forward ``start``
(from its entry to the next one's). Written to DIR: ``decode-trace.json`` (``rl_trace.
summarise`` of the Chrome trace, per token step, and the host's times) and
``decode-ops.txt`` (the operators by host time and by device time). The Chrome trace itself
(tens of MB for an 8B model: more than the GPU machine sends back) is deleted once
summarised, unless DECODE_TRACE_KEEP=1 keeps it as ``decode-trace.json.gz``.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import statistics
import time

from rl_trace import STOP, summarise

STEP, START, COUNT = 1, 32, 16
TRACE_NAME, SUMMARY_NAME, OPS_NAME = "decode-trace.json.gz", "decode-trace.json", "decode-ops.txt"


class Tracer:
    """Forward hooks for one ``generate`` call: host times of every forward, torch's
    profiler over forwards ``start`` to ``start + count - 1`` and what follows each."""

    def __init__(self, folder: str, start: int = START, count: int = COUNT, trainer_step=None):
        self.folder, self.start, self.count, self.trainer_step = folder, start, count, trainer_step
        self.forwards, self.entered = 0, None
        self.host_ms: list = []  # each forward, entry to return
        self.interval_ms: list = []  # each forward's entry from the one before's
        self.profiler, self.profiled = None, 0

    def before(self, module, args):
        import torch

        now = time.perf_counter()
        if self.entered is not None:
            self.interval_ms.append((now - self.entered) * 1e3)
        self.forwards += 1
        if self.forwards == self.start + self.count and self.profiler is not None:
            self._stop(self.count)
        if self.forwards == self.start:
            from torch.profiler import ProfilerActivity, profile

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
        self.entered = time.perf_counter()

    def after(self, module, args, output):
        self.host_ms.append((time.perf_counter() - self.entered) * 1e3)

    def _stop(self, profiled: int) -> None:
        """Stop after ``profiled`` token steps; the wait for the GPU is marked (``STOP``), so
        the summary leaves this harness's own wait out of the steps' figures."""
        import torch

        with torch.profiler.record_function(STOP):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.profiled = profiled
        averages = self.profiler.key_averages()
        sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, OPS_NAME), "w") as handle:
            handle.write(f"{profiled} token steps\n")
            handle.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
            handle.write(averages.table(sort_by=sort, row_limit=25))
        self.profiler.export_chrome_trace(self._exported())
        self.profiler = None

    def _exported(self) -> str:
        return os.path.join(self.folder, "decode-trace.json.tmp")

    def _outside_trace(self, values: list) -> list:
        """Each forward's figure but the prefill's (the first) and the profiled ones'."""
        first = self.start - 1
        return [value for i, value in enumerate(values) if i >= 1 and not first <= i < first + self.count]

    def close(self) -> dict:
        """Stop the profiler if the call ended inside its token steps (forwards ``start`` to
        the last, each a token step); write the summary."""
        if self.profiler is not None:
            self._stop(self.forwards - self.start + 1)
        untraced, gaps = self._outside_trace(self.host_ms), self._outside_trace(self.interval_ms)
        summary = {
            "trainer_step": self.trainer_step,
            "forwards": self.forwards,
            "traced_forwards": [self.start, self.start + self.profiled - 1] if self.profiled else None,
            "host_ms_per_forward_median": statistics.median(untraced) if untraced else None,
            "token_step_ms_median": statistics.median(gaps) if gaps else None,
            "host_ms_per_forward": [round(ms, 3) for ms in self.host_ms],
            "token_step_ms": [round(ms, 3) for ms in self.interval_ms],
        }
        exported = self._exported()
        if self.profiled and os.path.exists(exported):
            summary["trace"] = summarise(exported, token_steps=self.profiled)
            summary["trace"]["trace"] = None  # deleted once summarised, unless DECODE_TRACE_KEEP=1 keeps it
            if os.environ.get("DECODE_TRACE_KEEP") == "1":
                summary["trace"]["trace"] = os.path.join(self.folder, TRACE_NAME)
                with open(exported, "rb") as source, gzip.open(summary["trace"]["trace"], "wb") as target:
                    shutil.copyfileobj(source, target)
            os.remove(exported)
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, SUMMARY_NAME), "w") as handle:
            json.dump(summary, handle, indent=1)
        return summary


def summary_of(folder) -> dict:
    """A traced run's summary without its per-forward lists (they stay in ``folder``), or None."""
    path = os.path.join(folder, SUMMARY_NAME)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        summary = json.load(handle)
    return {key: value for key, value in summary.items() if key not in ("host_ms_per_forward", "token_step_ms")}


def arm(folder: str, step: int = STEP, start: int = START, count: int = COUNT, add_callback=None) -> None:
    """Trace the first ``generate`` call of Trainer step ``step`` or, where that step does not
    generate (a trainer generating every few steps), of the first later step that does, in
    every Trainer of this process (``add_callback``: capped's way of giving each Trainer a
    callback class). The summary names the step traced."""
    from transformers import TrainerCallback
    from transformers.generation.utils import GenerationMixin

    state = {"seen": 0, "armed": False, "done": False}

    class ArmForStep(TrainerCallback):
        def on_step_begin(self, args, trainer_state, control, **kwargs):
            state["armed"] = state["seen"] >= step and not state["done"]

        def on_step_end(self, args, trainer_state, control, **kwargs):
            state["seen"] += 1

    add_callback(ArmForStep)
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if not state["armed"] or state["done"]:
            return original(self, *args, **kwargs)
        state["done"] = True  # this call only, and not the calls it makes
        tracer = Tracer(folder, start, count, trainer_step=state["seen"])
        handles = [self.register_forward_pre_hook(tracer.before), self.register_forward_hook(tracer.after)]
        failed = True
        try:
            result = original(self, *args, **kwargs)
            failed = False
            return result
        finally:
            for handle in handles:
                handle.remove()
            try:
                tracer.close()
            except Exception as exc:  # noqa: BLE001 - never hide the call's own error
                if not failed:
                    raise
                print(f"decode_trace: the trace of a failed call was not written: {exc!r}", flush=True)

    GenerationMixin.generate = generate
