"""The resident window under a GPU as large as its budget, in a process that used the GPU
before: does the automatic window ever run out of memory, and how close is its step time
to the best window found by hand?

Each cell runs in a fresh process. It caps the process at the budget
(``set_per_process_memory_fraction``), uses the GPU for something else first (a resident
model loaded, evaluated, used to generate, freed), builds a real-shape random-weight model
(LoRA r16 on every linear layer), streams it with ``vram_budget`` equal to the cap and
trains (AdamW, one 2048-token sequence per step): the automatic window decides over the
first steps and the median of the last steps is its time. Then the window is set by hand,
from the automatic size up until a step runs out of memory, and each size is timed the same
way; the best of those is the reference.

    python benchmarks/window_matrix.py --cells llama3-8b:none:12GiB,llama3-8b:nf4:6GiB --out $OUT

A cell is ``shape:quantization:budget``, optionally followed by ``:key=value+key=value``
StreamConfig settings the run needs at that size (8B NF4 at 6 GiB needs the chunked loss:
its full fp32 logits alone take 2.9 GiB). The hand sweep stops at the first size that
runs out of memory, or after ``--hand-sizes`` sizes; the sizes that fitted are then timed
in ``--rounds`` passes of alternating direction, each visit ``--settle`` untimed steps
after the window changes, then ``--timed`` timed steps. A size's time is the median of all its steps;
``noise`` says how far one size's passes lie apart. Where the host drifts by more than the
differences between sizes (an 8B step is host-bound, and this machine's host moves its step
time by 10-70% over a minute), only paired figures rank sizes: each pass visits every size
within a few seconds, so ``auto_size_vs_best_paired`` is the best size's median, over
passes, of its time divided by the automatic size's time in the same pass (1.0 when the
automatic size is the best), with ``paired_quartiles`` giving that ratio's spread. Many short
passes (``--rounds 15 --timed 1``) make it tight. The ratio ``auto_vs_best`` is the automatic
run's own last steps against the best hand size (they are the process's first, where a
shared machine is still settling). Each hand size also records the most memory reserved
over its runs and its allocator retries: how near the cap a larger window than the
automatic one came.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CELLS = (
    "llama3-8b:none:12GiB,llama3-8b:none:16GiB,llama3-8b:none:24GiB,llama3-8b:nf4:6GiB:loss_chunk_tokens=512,"
    "llama3-8b:nf4:8GiB,llama3-70b:nf4:16GiB,llama3-70b:nf4:24GiB"
)


def cell_options(text: str) -> dict:
    """``key=value+key=value`` -> StreamConfig keyword arguments, parsed as every surface does."""
    from layerstream.config import parse_setting

    options = {}
    for pair in filter(None, text.split("+")):
        key, _, value = pair.partition("=")
        options[key] = parse_setting(key, value)
    return options


def _steps(model, optimizer, ids, count):
    import torch

    times = []
    for _ in range(count):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def sweep(timed_at, auto_window: int, layers: int, sizes: int, out_of_memory=MemoryError, rounds: int = 2) -> dict:
    """The hand sweep: ``timed_at(size)`` gives a size's timed steps or raises
    ``out_of_memory``. Round 1 goes up from just below the automatic size until a size runs
    out of memory (or ``sizes`` were tried); each further round times the sizes that fitted
    again, in the other direction from the last, so drift over the run cancels. A size's
    time is the median of all its steps. ``noise`` is how far one size's round medians lie
    apart (the median over sizes of max / min - 1): a difference between sizes smaller than
    that cannot rank them on this machine."""
    import statistics

    hand, size = [], max(0, auto_window - 1)
    while size <= layers and len(hand) < sizes:
        entry = {"window": size}
        try:
            entry.update(times=list(timed_at(size)), out_of_memory=False)
        except out_of_memory:
            entry.update(out_of_memory=True)
        hand.append(entry)
        print(json.dumps(entry), flush=True)
        if entry["out_of_memory"]:
            break
        size += 1
    fits = [h for h in hand if not h["out_of_memory"]]
    for entry in fits:
        entry["round_medians"] = [statistics.median(entry["times"])]
    for round_index in range(1, rounds):
        for entry in reversed(fits) if round_index % 2 else fits:
            times = list(timed_at(entry["window"]))
            entry["times"] += times
            entry["round_medians"].append(statistics.median(times))
    for entry in fits:
        entry["step_s"] = statistics.median(entry["times"])
    result = {"hand": hand, "rounds": rounds}
    if fits:
        best = min(fits, key=lambda h: h["step_s"])
        at_auto = [h for h in fits if h["window"] == auto_window]
        result.update(
            best_hand_window=best["window"],
            best_hand_step_s=best["step_s"],
            # the size the automatic window chose, timed as every hand size was
            auto_size_vs_best=best["step_s"] / at_auto[0]["step_s"] if at_auto else None,
            noise=statistics.median(max(h["round_medians"]) / min(h["round_medians"]) - 1 for h in fits),
        )
        if at_auto:
            result.update(paired(fits, at_auto[0]))
    return result


def paired(fits: list, at_auto: dict) -> dict:
    """Each size against the automatic size pass by pass: the median over passes of its
    time over the automatic size's time in the same pass. A pass visits every size within
    seconds, so drift of the host over the run cancels out of each ratio."""
    import statistics

    ratios = {
        h["window"]: [mine / theirs for mine, theirs in zip(h["round_medians"], at_auto["round_medians"])] for h in fits
    }
    for entry in fits:
        entry["paired_vs_auto"] = statistics.median(ratios[entry["window"]])
    best = min(fits, key=lambda h: h["paired_vs_auto"])
    spread = sorted(ratios[best["window"]])
    quartiles = statistics.quantiles(spread, n=4) if len(spread) > 1 else spread * 3
    return {
        "paired_best_window": best["window"],
        "auto_size_vs_best_paired": best["paired_vs_auto"],
        "paired_quartiles": [quartiles[0], quartiles[2]],
    }


def cell(
    shape: str,
    quantization: str,
    budget_text: str,
    seq: int,
    auto_steps: int,
    timed: int,
    options: dict,
    sizes: int,
    rounds: int = 2,
    settle: int = 2,
) -> dict:
    import statistics

    import torch
    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, str(HERE))
    import layerstream
    from layerstream.commands.run import allocator_defaults
    from layerstream.decisions.schedule import spread_resident
    from layerstream.units import parse_bytes

    from capped import _use_the_gpu_first
    from common import build_random, build_random_nf4, cap_gpu

    allocator_defaults()
    budget = parse_bytes(budget_text)
    cap_gpu(budget)
    _use_the_gpu_first()
    model = build_random_nf4(shape) if quantization == "nf4" else build_random(shape)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    layerstream.stream_model(model, vram_budget=budget, **options)
    model.cuda()
    runtime = layerstream.get_runtime(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
    row = {
        "shape": shape,
        "quantization": quantization,
        "budget_gib": budget / 2**30,
        "seq": seq,
        "layers": len(runtime.records),
        "options": {k: str(v) for k, v in options.items()},
    }
    try:
        times = _steps(model, optimizer, ids, auto_steps)
        row.update(
            auto_out_of_memory=False,
            auto_window=len(runtime.window),
            auto_times=times,
            auto_step_s=statistics.median(times[-timed:]),
            window_changes=runtime.resident_window.window_changes,
            auto_peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            # retries cap the window at its size (a step that reached the limit)
            auto_alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0),
            auto_window_cap=runtime.resident_window.sizer.max_window
            if runtime.resident_window.meter is not None
            else None,
        )
    except torch.OutOfMemoryError as exc:
        row.update(auto_out_of_memory=True, auto_error=str(exc).splitlines()[0], auto_window=len(runtime.window))
        return row
    print(json.dumps({k: v for k, v in row.items() if k != "auto_times"}), flush=True)
    runtime.resident_window.meter = None  # the window is set by hand from here on

    memory = {}  # size -> (most reserved GiB, allocator retries) over its runs: how near the cap it came

    def timed_at(size: int) -> list:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        runtime.set_window(spread_resident(len(runtime.records), size))
        try:
            return _steps(model, optimizer, ids, settle + timed)[-timed:]
        finally:
            seen = memory.get(size, (0.0, 0))
            memory[size] = (
                max(seen[0], torch.cuda.max_memory_reserved() / 2**30),
                seen[1] + torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
            )

    row.update(sweep(timed_at, row["auto_window"], len(runtime.records), sizes, torch.OutOfMemoryError, rounds))
    for entry in row["hand"]:
        entry["peak_reserved_gib"], entry["alloc_retries"] = memory.get(entry["window"], (None, None))
    if "best_hand_step_s" in row:  # the automatic run's own last steps (the process's first)
        row["auto_vs_best"] = row["best_hand_step_s"] / row["auto_step_s"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", default=CELLS, help="shape:quantization:budget list")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--auto-steps", type=int, default=10)
    parser.add_argument("--timed", type=int, default=4)
    parser.add_argument("--hand-sizes", type=int, default=6, help="window sizes timed by hand at most")
    parser.add_argument("--rounds", type=int, default=4, help="passes over the hand sizes, alternating direction")
    parser.add_argument("--settle", type=int, default=2, help="untimed steps after each window change")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # one cell, in this process
    args = parser.parse_args()
    if args.cell:
        shape, quantization, budget, *extra = args.cell.split(":", 3)
        options = cell_options(extra[0] if extra else "")
        row = cell(
            shape,
            quantization,
            budget,
            args.seq,
            args.auto_steps,
            args.timed,
            options,
            args.hand_sizes,
            args.rounds,
            args.settle,
        )
        print("RESULT " + json.dumps(row))
        return
    rows = []
    for spec in args.cells.split(","):
        start = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--cell",
                spec,
                "--seq",
                str(args.seq),
                "--auto-steps",
                str(args.auto_steps),
                "--timed",
                str(args.timed),
                "--hand-sizes",
                str(args.hand_sizes),
                "--rounds",
                str(args.rounds),
                "--settle",
                str(args.settle),
            ],
            capture_output=True,
            text=True,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        row = (
            json.loads(lines[-1][7:])
            if lines
            else {"cell": spec, "failed": True, "tail": (done.stdout + done.stderr)[-3000:]}
        )
        row["cell_wall_s"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("auto_times", "hand", "tail")}), flush=True)
        if row.get("failed"):
            print(row["tail"], flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        from layerstream.system.versions import versions

        (Path(args.out) / "window-matrix.json").write_text(json.dumps({"rows": rows, "versions": versions()}, indent=1))


if __name__ == "__main__":
    main()
