"""Run a command line as ``layerstream``/``python -m`` would, on a GPU made smaller with
``torch.cuda.set_per_process_memory_fraction``, optionally after this process used the
GPU for something else first, and record each Trainer's step times. Harness only: the
script it runs is unchanged.

    python benchmarks/capped.py --cap 12GiB --used-first --times t.json -- layerstream run -m trl.scripts.sft ...
    python benchmarks/capped.py --cap 12GiB --times t.json -- python -m trl.scripts.sft ...
    python benchmarks/capped.py --cap whole --times t.json -- python -m trl.scripts.grpo ...   # no cap

The times file holds each step's time, each Trainer log (what the script logged, with
layerstream's figures when it streams) and each ``generate`` call's time.

Before CUDA starts, the allocator gets what ``layerstream run`` gives it (expandable
segments, unless configured), so the plain and streamed runs share an allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time

WHOLE = "whole"  # --cap whole: the whole GPU, no per-process fraction


def _use_the_gpu_first() -> None:
    """What a process did before training: a resident model loaded, evaluated, used to
    generate, and freed (its blocks stay in the caching allocator unless emptied)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 32000, (2, 256), device="cuda")
    with torch.no_grad():
        model(input_ids=ids)
        model.generate(input_ids=ids[:, :16], max_new_tokens=16, do_sample=False, pad_token_id=0)
    del model, ids
    print(f"capped: used the GPU first; {torch.cuda.memory_reserved() / 2**30:.2f} GiB stays reserved", flush=True)


def _add_to_every_trainer(make_callback) -> None:
    """Each Trainer made in this process gets a ``make_callback()`` (the script is unchanged)."""
    from transformers import Trainer

    original = Trainer.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(make_callback())

    Trainer.__init__ = __init__


# the streaming runtime's counters kept after each step of a streamed model (cumulative;
# None where this layerstream does not count it)
STREAM_COUNTERS = ("h2d_bytes", "layer_loads", "window_layers", "experts_copied", "expert_visits")


def _stream_counters(model):
    """The runtime's counters now, or None for a model that does not stream."""
    import layerstream

    if model is None or not layerstream.is_streamed(model):
        return None
    stats = layerstream.get_runtime(model).stats()
    return {name: stats.get(name) for name in STREAM_COUNTERS}


def _time_generate_calls(calls: list) -> None:
    """Each ``generate`` call's wall time (the device synchronised at both ends) goes into
    ``calls``: an online trainer's step generates, and this times it alike plain or streamed."""
    import functools

    import torch
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate
    timing = {"depth": 0}

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        timing["depth"] += 1
        outermost = timing["depth"] == 1
        if outermost and torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            timing["depth"] -= 1
            if outermost:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                calls.append(time.perf_counter() - start)

    GenerationMixin.generate = generate


def _peak_rss_gib() -> float:
    """This process's peak resident host memory (page-locked store and offloaded inputs
    included), from getrusage: what a long sequence's host arithmetic is checked against."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def step_times_class():
    """The Trainer callback class that times each step (the device synchronised at both
    ends) and keeps, step by step, the streaming counters and each log; given a ``path``,
    it writes them there as JSON after each, with the peaks and ``generate_s``."""
    import torch
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self, path=None, generate_s=None):
            self.path, self.generate_s = path, [] if generate_s is None else generate_s
            self.times, self.start, self.counters, self.logs = [], None, [], []
            self.alloc_retries = []  # the caching allocator's free-and-retry count after each step

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)
            self.counters.append(_stream_counters(kwargs.get("model")))
            if torch.cuda.is_available():
                self.alloc_retries.append(torch.cuda.memory_stats().get("num_alloc_retries", 0))
            self.write()

        def on_log(self, args, state, control, logs=None, **kwargs):
            numbers = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
            self.logs.append(dict(numbers, step=state.global_step))
            self.write()

        def write(self):
            if self.path is None:
                return
            cuda = torch.cuda.is_available()
            with open(self.path, "w") as handle:
                json.dump(
                    {
                        "step_s": self.times,
                        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
                        "peak_host_rss_gib": _peak_rss_gib(),
                        "stream_counters": self.counters,
                        "alloc_retries": self.alloc_retries,
                        "logs": self.logs,
                        "generate_s": self.generate_s,
                        "gpu": torch.cuda.get_device_name() if cuda else None,
                    },
                    handle,
                )

    return StepTimes


def _time_trainer_steps(path: str) -> None:
    generate_s: list = []
    _time_generate_calls(generate_s)
    step_times = step_times_class()
    _add_to_every_trainer(lambda: step_times(path, generate_s))


PROFILE_STEPS = (8, 8, 2)  # --profile: Python's profiler over steps 8-15 (from 0), torch's over 16-17


def _profile_trainer_steps(folder: str, first: int, count: int, torch_steps: int = 2) -> None:
    """Where the host's time goes in steady steps: Python's profiler over ``count`` steps
    from step ``first`` (by own time and by cumulative time), then torch's profiler over
    ``torch_steps`` more (operators by host time, kernel launches, device time; none where
    0: a GRPO step's hundreds of decode steps take torch's summary minutes). Written to
    ``folder``; for comparing a plain and a streamed run of the same script."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    os.makedirs(folder, exist_ok=True)

    class StepProfile(TrainerCallback):
        def __init__(self):
            self.python, self.torch_prof, self.seen = cProfile.Profile(), None, 0

        def on_step_begin(self, args, state, control, **kwargs):
            if self.seen == first:
                self.python.enable()
            elif self.seen == first + count and torch_steps:
                activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
                self.torch_prof = profile(activities=activities)
                self.torch_prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            self.seen += 1
            if self.seen == first + count:
                self.python.disable()
                text = io.StringIO()
                stats = pstats.Stats(self.python, stream=text)
                stats.sort_stats("tottime").print_stats(60)
                stats.sort_stats("cumulative").print_stats(80)
                with open(os.path.join(folder, "python-profile.txt"), "w") as handle:
                    handle.write(f"{count} steps from step {first}\n" + text.getvalue())
            elif self.seen == first + count + torch_steps and self.torch_prof is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.torch_prof.__exit__(None, None, None)
                averages = self.torch_prof.key_averages()
                with open(os.path.join(folder, "torch-profile.txt"), "w") as handle:
                    handle.write(f"{torch_steps} steps\n")
                    handle.write(averages.table(sort_by="self_cpu_time_total", row_limit=60))
                    handle.write(averages.table(sort_by="self_device_time_total", row_limit=30))
                self.torch_prof = None

    _add_to_every_trainer(StepProfile)


def _trace_first_step_memory(path: str) -> None:
    """The tensors alive at the first training step's allocated peak, by the source line that
    allocated them (``step_insight.live_at_peak``), written to ``path``: where a long step's
    memory goes, to hold the memory plan's terms against (GPU only)."""
    import step_insight
    import torch
    from transformers import TrainerCallback

    class FirstStepMemory(TrainerCallback):
        def __init__(self):
            self.start = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0 and torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.start = step_insight.begin_memory_trace(max_entries=1_000_000)

        def on_step_end(self, args, state, control, **kwargs):
            if self.start is not None:
                step_insight.end_memory_trace(path, self.start, sources=60)
                self.start = None

    _add_to_every_trainer(FirstStepMemory)


def prepare(
    cap: str,
    used_first: bool,
    times,
    profile_dir=None,
    memory_trace=None,
    profile_steps=PROFILE_STEPS,
    trace_decode=None,
) -> None:
    """The cap, the earlier use of the GPU, the step timer, the profiler (``profile_steps``:
    the first step and the count Python's profiler takes), the first step's memory trace
    and the trace of a few decode token steps (``decode_trace``), in this process."""
    from layerstream.commands.run import allocator_defaults
    from layerstream.units import parse_bytes

    allocator_defaults()
    import torch

    from common import cap_gpu  # imports torch: after the allocator is set

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory if cap == WHOLE else cap_gpu(parse_bytes(cap))
        print(
            f"capped: {cap} of {total / 2**30:.1f} GiB in process {os.getpid()}; "
            f"allocator {os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}",
            flush=True,
        )
        if used_first:
            _use_the_gpu_first()
    else:
        print("capped: no GPU, no cap (a dry run of the harness)", flush=True)
    if times:
        _time_trainer_steps(times)
    if profile_dir:
        _profile_trainer_steps(profile_dir, *profile_steps)
    if memory_trace:
        _trace_first_step_memory(memory_trace)
    if trace_decode:
        import decode_trace

        folder, start, count = trace_decode
        decode_trace.arm(folder, start=start, count=count, add_callback=_add_to_every_trainer)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", required=True, help="GPU memory this process may use, e.g. 12GiB, or whole")
    parser.add_argument("--used-first", action="store_true", help="use and free the GPU before the command")
    parser.add_argument("--times", default=None, help="write each Trainer step's time here (JSON)")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="profile steps (--profile-steps: 8-15 Python, 16-17 torch) into DIR",
    )
    parser.add_argument(
        "--profile-steps",
        default=",".join(map(str, PROFILE_STEPS)),
        metavar="FIRST,COUNT[,TORCH]",
        help="--profile: Python's profiler over COUNT steps from step FIRST (counted from 0), torch's over the next "
        "TORCH (default 2; 0: none)",
    )
    parser.add_argument(
        "--memory-trace", default=None, metavar="FILE", help="the first step's tensors alive at its peak (JSON)"
    )
    parser.add_argument(
        "--trace-decode",
        default=None,
        metavar="DIR",
        help="torch's profiler over a few decode token steps of the second step's generation, and "
        "each forward's host time (decode_trace.py)",
    )
    parser.add_argument(
        "--trace-decode-steps",
        default=None,
        metavar="START,COUNT",
        help="--trace-decode: the token steps torch's profiler takes, COUNT from forward START (1: the prefill; "
        "default decode_trace.START, COUNT)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    profile_steps = tuple(int(v) for v in args.profile_steps.split(","))
    trace_decode = None
    if args.trace_decode:
        import decode_trace

        steps = args.trace_decode_steps or f"{decode_trace.START},{decode_trace.COUNT}"
        trace_decode = (args.trace_decode, *(int(v) for v in steps.split(",")))
    prepare(args.cap, args.used_first, args.times, args.profile, args.memory_trace, profile_steps, trace_decode)
    # processes the command starts (``trl sft``, ``accelerate launch``) get the same
    os.environ["CAPPED_CHILD"] = json.dumps(
        {
            "harness": os.path.dirname(os.path.abspath(__file__)),
            "cap": args.cap,
            "used_first": args.used_first,
            "times": args.times,
            "profile": args.profile,
            "profile_steps": profile_steps,
            "memory_trace": args.memory_trace,
            "trace_decode": trace_decode,
        }
    )
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capped_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    if command[:1] == ["layerstream"]:
        from layerstream.commands.cli import main as layerstream_main

        sys.exit(layerstream_main(command[1:]))
    if command[:1] in (["python"], [sys.executable]) and command[1:2] == ["-m"]:
        sys.argv = command[2:]
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        return
    if command[:1] in (["python"], [sys.executable]) and command[1:2] and command[1].endswith(".py"):
        sys.argv = command[1:]
        runpy.run_path(command[1], run_name="__main__")
        return
    if command[:1] == ["accelerate"]:
        from accelerate.commands.accelerate_cli import main as accelerate_main

        sys.argv = command
        accelerate_main()
        return
    raise SystemExit(
        f"capped: run `layerstream ...`, `python -m MODULE ...` or `python SCRIPT.py ...` or `accelerate ...`, got {command}"
    )


if __name__ == "__main__":
    main()
