"""The longest trainable sequence per GPU memory cap, and its speed (GPU).

For each cell (shape:quantization:vram_gib), a QLoRA model of a real shape with random
weights (LoRA r=32 on every linear layer, batch 1) is trained under
``torch.cuda.set_per_process_memory_fraction`` at that cap, streamed with the long-context
settings (``--stream-option``; by default mlp_tile_tokens at the planner's 4096,
offload_activations where this version has it, and loss_chunk_tokens at the planner's
default for the shape's vocabulary, ``default_loss_chunk_tokens``: 512 tokens for
Llama-3's 128,256). A binary search over the sequence length finds the longest that
trains; every probe runs in a fresh subprocess, so one out-of-memory leaves nothing
behind, with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in its environment (as
``layerstream run`` sets it) unless torch's allocator is configured already; each row
records the setting under ``alloc_conf``. A step that runs out of memory with layers in
the resident window shrinks it and runs again, as the Trainer integration does for users
(``steps_retried``). Then a few steps at that length are timed
(median), and so is the baseline: the best configuration without those settings at the
same length in the GPU's full memory (resident with checkpointing, else streamed with the
resident window).

The search's bounds are kept in ``--state`` after every probe, so a search cut short by a
time limit continues where it stopped when run again. Rows go to
benchmarks/results/long-context.json (one per cell, replaced when measured again).

    python benchmarks/long_context.py --cells llama3-8b:nf4:24 --budget-s 540
    python benchmarks/long_context.py --dry-run        # the whole harness on the CPU, tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from layerstream.config import ALLOCATOR_ENV, set_default_allocator
from layerstream.plan.advice import DEFAULT_LONG_TOKENS, default_loss_chunk_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "long-context.json")
STATE = os.path.join(HERE, "results", "long-context-search.json")
AT_RESULTS = os.path.join(HERE, "results", "long-context-at.json")
DEFAULT_CELLS = [f"llama3-8b:nf4:{v}" for v in (12, 16, 24, 80)] + [f"llama3-70b:nf4:{v}" for v in (24, 80)]
NAMES = {"llama3-8b": "Llama-3.1-8B", "llama3-70b": "Llama-3-70B", "tiny": "tiny-llama"}
# the tile `layerstream plan` tries (4096), and loss_chunk_tokens per shape: cell_options
DEFAULT_OPTIONS = {"mlp_tile_tokens": str(DEFAULT_LONG_TOKENS)}
TINY_LOSS_CHUNK_TOKENS = 128  # the dry run's tiny model: a few chunks per probe (its lengths are <= 512)
GiB = 1 << 30


def parse_cell(text: str) -> dict:
    fields = text.split(":")
    if len(fields) != 3 or fields[1] not in ("nf4", "none"):
        raise ValueError(f"cell {text!r}: write shape:quantization:vram_gib, e.g. llama3-8b:nf4:24")
    return {"shape": fields[0], "quantization": fields[1], "vram_gib": float(fields[2])}


def gpu_total_memory() -> int:
    """The GPU's memory in bytes (0: no GPU), asked in a process of its own: this one starts
    no CUDA context beside the probes."""
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def refuse_caps_above_the_gpu(cells) -> None:
    """Before any search: a cell whose cap is more than the GPU has is refused (each probe would
    refuse it, and the search would take that for "does not fit" and keep it)."""
    total = gpu_total_memory()
    if total:
        from common import cap_fraction

        for cell in cells:
            cap_fraction(int(parse_cell(cell)["vram_gib"] * GiB), total)


def stream_options(pairs) -> dict:
    """The long-context settings but the per-shape loss chunk (``cell_options``): the
    defaults, offload_activations where StreamConfig has it, then each --stream-option
    key=value (checked against StreamConfig before any probe)."""
    from layerstream.config import config_from_settings, settings

    options = dict(DEFAULT_OPTIONS)
    if "offload_activations" in {s.name for s in settings()}:
        options["offload_activations"] = "true"
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--stream-option {pair!r}: write key=value, e.g. loss_chunk_tokens=4096")
        options[key.strip()] = value.strip()
    config_from_settings(options, lambda name: f"--stream-option {name}", device="cpu")  # raises on a bad one
    return options


def default_loss_chunk(shape: str) -> int:
    """The memory planner's default loss chunk for the shape's vocabulary (the tiny dry-run
    model, which has no shape config: a small chunk, so its probes run several)."""
    if shape == "tiny":
        return TINY_LOSS_CHUNK_TOKENS
    from common import shape_config

    return default_loss_chunk_tokens(int(shape_config(shape).vocab_size))


def cell_options(cell: str, options: dict) -> dict:
    """The settings of one cell: ``options`` with the shape's default loss chunk unless
    --stream-option gave one."""
    if "loss_chunk_tokens" in options:
        return dict(options)
    return {**options, "loss_chunk_tokens": str(default_loss_chunk(parse_cell(cell)["shape"]))}


def alloc_env() -> dict:
    """The probes' environment: this one, with the allocator setting `layerstream run` makes
    unless torch's allocator is configured already."""
    env = dict(os.environ)
    set_default_allocator(env)
    return env


def alloc_conf(env: dict) -> str:
    """The allocator setting a probe with ``env`` runs under, as a row records it."""
    return ",".join(f"{key}={env[key]}" for key in ALLOCATOR_ENV if env.get(key))


# -- one probe, in its own process ------------------------------------------------------------
def _build(shape: str, quantization: str, layers):
    import torch
    from peft import LoraConfig, get_peft_model

    from common import build_random, build_random_nf4

    if shape == "tiny":
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model(
            "llama",
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
        model = AutoModelForCausalLM.from_config(config)
    elif quantization == "nf4":
        model = build_random_nf4(shape, layers=layers)  # layer by layer on the host
    else:
        model = build_random(shape, layers=layers)
    model.config.use_cache = False
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(model, lora)


def probe(args) -> dict:
    """Train ``args.steps`` steps at ``args.seq`` tokens; the step times, or the failure."""
    import torch

    from common import cap_gpu

    cell = parse_cell(args.probe)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cuda" and args.cap:
        cap_gpu(int(cell["vram_gib"] * GiB))
    if args.dry_run and args.seq > args.dry_run_limit:
        return {"ok": False, "why": f"dry run: {args.seq} > {args.dry_run_limit} tokens stands in for out of memory"}
    import layerstream

    model = _build(cell["shape"], cell["quantization"], args.layers)
    options = json.loads(args.options)
    what, times, retried = "streamed", [], 0
    try:
        if args.mode == "resident":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
            model.to(device)
            what = "resident"
            if "loss_chunk_tokens" in options:  # the chunked loss alone: neither offload nor tiling
                from layerstream.long import chunked_loss

                chunked_loss.apply(model, int(options["loss_chunk_tokens"]))
                what = f"resident, loss_chunk_tokens={options['loss_chunk_tokens']}"
        else:
            # under the cap, "auto" is the capped memory: the run measures what fits instead of
            # an explicit budget's up-front plan refusing what the planner predicts will not
            budget = None if device == "cpu" else "auto"
            layerstream.stream_model(model, device=device, vram_budget=budget, **_parsed(options))
            model.to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        ids = torch.randint(3, model.config.vocab_size, (1, args.seq), device=device)
        while len(times) < args.steps:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            if not _step_or_shrink(model, opt, ids):
                retried += 1
                continue  # the window shrank: the step runs again, as under the Trainer
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        if args.insight and device == "cuda":  # after the timed steps: one profiled, one traced
            _insight(model, opt, ids, args, f"{args.mode}-{cell['vram_gib']:g}GiB-{args.seq}")
    except torch.OutOfMemoryError as exc:
        why = f"out of memory at step {len(times) + 1}: {str(exc).splitlines()[0][:200]}"
        return {"ok": False, "why": why, "steps_retried": retried, **_window(model), **_allocator(device)}
    except layerstream.StreamingError as exc:  # refused before computing (e.g. host memory for offload)
        return {"ok": False, "why": f"refused at step {len(times) + 1}: {str(exc).splitlines()[0][:200]}"}
    peak = torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None
    alloc = alloc_conf(os.environ)  # what this process's allocator was started with
    return {
        "ok": True,
        "step_s": times,
        "peak_allocated_gib": peak,
        "config": what,
        "alloc_conf": alloc,
        "steps_retried": retried,
        **_window(model),
        **_allocator(device),
    }


def _step_or_shrink(model, opt, ids) -> bool:
    """One training step. If it runs out of memory with layers in the resident window, the
    window shrinks and False says to run the step again: what the Trainer integration does
    for every user, so a probe measures the length a Trainer run reaches. Out of memory with
    no window left to shrink propagates."""
    import torch

    import layerstream
    from layerstream.runtime.meter import wanted_bytes

    try:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return True
    except torch.OutOfMemoryError as exc:
        runtime = layerstream.get_runtime(model) if layerstream.is_streamed(model) else None
        if runtime is None or not runtime.window:
            raise
        wanted = wanted_bytes(exc) or 0
    opt.zero_grad(set_to_none=True)  # outside the except block: the failed step's tensors are gone
    if not runtime.resident_window.recover_from_oom(wanted):
        raise torch.OutOfMemoryError("the resident window cannot shrink further")
    return False


def _insight(model, opt, ids, args, name: str) -> None:
    """--insight: a kernel table and the tensors alive at the allocated peak, of one more
    step each (step_insight), written to the --insight folder."""
    import step_insight

    os.makedirs(args.insight, exist_ok=True)
    base = os.path.join(args.insight, name)
    step_insight.profile_table(lambda: _step_or_shrink(model, opt, ids), base + "-kernels.txt")
    step_insight.memory_at_peak(lambda: _step_or_shrink(model, opt, ids), base + "-peak.json")


def _allocator(device: str) -> dict:
    """The caching allocator's reserved peak and its retries (allocations that only succeeded
    after freeing cached memory): how close to the cap the probe ran, fragmentation included."""
    import torch

    if device != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    return {
        "peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GiB,
        "alloc_retries": stats.get("num_alloc_retries", 0),
    }


def _window(model) -> dict:
    """The resident window's changes (tokens, layers) in a streamed probe: what it chose."""
    import layerstream

    if not layerstream.is_streamed(model):
        return {}
    return {
        "window_changes": [list(change) for change in layerstream.get_runtime(model).resident_window.window_changes]
    }


def _parsed(options: dict) -> dict:
    from layerstream.config import parse_setting

    return {k: parse_setting(k, v, f"--stream-option {k}") for k, v in options.items()}


def run_probe(cell: str, seq: int, mode: str, options: dict, args, steps: int, cap: bool) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--probe", cell, "--seq", str(seq), "--mode", mode]
    command += ["--options", json.dumps(options), "--steps", str(steps)] + (["--cap"] if cap else [])
    if args.layers:
        command += ["--layers", str(args.layers)]
    if args.insight and steps > 2:  # timed runs only, not the search's two-step probes
        command += ["--insight", os.path.abspath(args.insight)]
    if args.dry_run:
        command += ["--dry-run", "--dry-run-limit", str(args.dry_run_limit)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.probe_timeout_s, env=alloc_env())
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"probe ran past {args.probe_timeout_s} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    if not lines:  # killed (host memory), or crashed: reported, counted as not fitting
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"ok": False, "why": f"exit {done.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1][len("PROBE ") :])


# -- the search and the table -----------------------------------------------------------------
@dataclasses.dataclass
class Bounds:
    fits: int  # the longest length known to train (0: none yet)
    fails: int  # the shortest length known not to


def next_length(bounds: Bounds, step: int, guess: int) -> int:
    """Where the search probes next: the planner's ``guess`` while it lies between the
    bounds, then strides of a quarter of it away from the side the guess fell on, then
    bisection. A good guess ends the search in a few probes instead of ~log2(hi / step)."""
    stride = max(step, guess // 4 // step * step)
    if guess:
        if bounds.fits < guess < bounds.fails:
            return guess
        if bounds.fits >= guess and bounds.fits + stride < bounds.fails:
            return bounds.fits + stride
        if bounds.fails <= guess and bounds.fails - stride > bounds.fits:
            return bounds.fails - stride
    return max(step, (bounds.fits + bounds.fails) // 2 // step * step)


def planned_tokens(cell: str, options: dict, step: int) -> int:
    """The memory planner's longest sequence for the cell with these settings, to the
    search's step (0 where it has no plan: the tiny dry-run model)."""
    from layerstream.plan import PlanRequest, max_seq

    from common import shape_config

    parsed = parse_cell(cell)
    if parsed["shape"] == "tiny":
        return 0
    config = shape_config(parsed["shape"])
    settings = _parsed(options)
    longest = max_seq(
        PlanRequest(
            config=config,
            seq=1,
            batch=1,
            vram_bytes=int(parsed["vram_gib"] * GiB),
            quantization=parsed["quantization"],
            lora_rank=32,
            offload_activations=bool(settings.get("offload_activations")),
            loss_chunk_tokens=settings.get("loss_chunk_tokens"),
            mlp_tile_tokens=settings.get("mlp_tile_tokens"),
        )
    )
    return longest // step * step


def search(cell: str, bounds: Bounds, options: dict, args, deadline: float, state: dict, guess: int = 0) -> Bounds:
    step = args.granularity
    while bounds.fails - bounds.fits > step and time.time() < deadline:
        seq = next_length(bounds, step, guess)
        # two steps: the first sizes the resident window and the optimizer creates its state
        # at its end, so a length trains only when a second step runs as well
        result = run_probe(cell, seq, "streamed", options, args, steps=2, cap=True)
        verdict = "fits" if result["ok"] else result["why"]
        extra = f"; reserved peak {result['peak_reserved_gib']:.2f} GiB" if "peak_reserved_gib" in result else ""
        extra += f", {result['alloc_retries']} allocator retries" if "alloc_retries" in result else ""
        print(f"{cell}: {seq} tokens -> {verdict}; window {result.get('window_changes')}{extra}", flush=True)
        if result["ok"]:
            bounds.fits = seq
        else:
            bounds.fails = seq
        state[cell] = dataclasses.asdict(bounds)
        _write(args.state, state)
    return bounds


def _write(path: str, payload) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)


def measure(cell: str, seq: int, options: dict, args, searched: bool = True) -> dict:
    """The timed row at ``seq`` tokens: the longest the search found, or (``searched``
    False, --at) a length given, whose row says ``tokens`` instead of ``max_tokens``."""
    parsed = parse_cell(cell)
    timed = run_probe(cell, seq, "streamed", options, args, steps=args.warmup + args.steps, cap=True)
    row = {
        "model": NAMES.get(parsed["shape"], parsed["shape"]) + " shape, random weights",
        "quantization": parsed["quantization"],
        "vram_gib": parsed["vram_gib"],
        ("max_tokens" if searched else "tokens"): seq,
        "step_s": None,
        "tokens_per_s": None,
        "baseline_step_s": None,
        "options": options,
        "lora": "r=32 all-linear",
        "batch": 1,
    }
    if not timed["ok"]:  # no row: the length did not train for the timed steps
        return {"timed_failure": timed["why"], "tokens": seq}
    step = statistics.median(timed["step_s"][args.warmup :])
    row.update(step_s=step, tokens_per_s=seq / step, peak_allocated_gib=timed["peak_allocated_gib"])
    row.update(timed_steps=args.steps, warmup_steps=args.warmup)  # one cold step is not a speed
    # the window takes what the length leaves: below the limit the peak is not the plan's
    row.update(
        {k: timed[k] for k in ("peak_reserved_gib", "alloc_retries", "window_changes", "steps_retried") if k in timed}
    )
    row["alloc_conf"] = timed.get("alloc_conf")  # the allocator setting the timed probe ran under
    baselines = [("resident", {}), ("streamed", {})]
    if args.baseline_loss_chunk:  # lengths whose full fp32 logits do not fit even the whole GPU
        baselines = [("resident", {"loss_chunk_tokens": options["loss_chunk_tokens"]})]
    for mode, settings in baselines if args.baseline else ():  # the best without them, full memory
        base = run_probe(cell, seq, mode, settings, args, steps=args.warmup + args.steps, cap=False)
        if base["ok"]:
            row.update(baseline_step_s=statistics.median(base["step_s"][args.warmup :]), baseline_config=base["config"])
            break
        row["baseline_note"] = f"{mode}: {base['why']}"
    return row


def _put_row(rows: list, row: dict, path: str) -> list:
    """``rows`` with ``row`` in place of the earlier one of its cell (and, for --at rows, of
    its length), written to ``path``."""

    def key(r):
        return r["model"], r["quantization"], r["vram_gib"], r.get("tokens")

    from layerstream.system.versions import versions

    rows = [r for r in rows if key(r) != key(row)] + [dict(row, versions=versions())]
    _write(path, rows)
    return rows


def time_at(cells, options: dict, args, rows: list) -> int:
    """--at: each cell timed at one given length against its baseline, no search."""
    for cell in cells:
        row = measure(cell, args.at, cell_options(cell, options), args, searched=False)
        if "timed_failure" in row:
            print(f"{cell}: {args.at} tokens failed when timed: {row['timed_failure']}", flush=True)
            continue
        rows = _put_row(rows, row, args.out)
        print(json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--cells", nargs="+", default=None, help=f"shape:quantization:vram_gib (default: {' '.join(DEFAULT_CELLS)})"
    )
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting probes after this many seconds")
    parser.add_argument(
        "--stream-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a StreamConfig setting for the capped runs (repeatable)",
    )
    parser.add_argument("--lo", type=int, default=0, help="a length known to fit (default: none)")
    parser.add_argument("--hi", type=int, default=524288, help="a length known not to fit")
    parser.add_argument("--granularity", type=int, default=1024, help="search to this many tokens")
    parser.add_argument(
        "--from-plan",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the search at the memory planner's longest sequence for the cell",
    )
    parser.add_argument(
        "--at",
        type=int,
        default=None,
        help="no search: time each cell at this many tokens (rows say tokens, not max_tokens;\n"
        "default --out results/long-context-at.json)",
    )
    parser.add_argument(
        "--insight",
        default=None,
        metavar="DIR",
        help="after each timed run (streamed and baseline), profile one more step and trace\n"
        "the memory alive at another's peak (benchmarks/step_insight.py), into DIR",
    )
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the same length in the GPU's full memory without the long-context settings\n"
        "(--no-baseline where it cannot fit or a step outlasts the time there is)",
    )
    parser.add_argument(
        "--baseline-loss-chunk",
        action="store_true",
        help="the baseline is resident with the cell's chunked loss (no offload, no tiled MLP): for\n"
        "lengths whose unchunked logits do not fit the whole GPU",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--probe-timeout-s", type=int, default=480)
    parser.add_argument("--state", default=STATE, help="search bounds kept between runs")
    parser.add_argument("--out", default=None, help="default results/long-context.json")
    parser.add_argument("--dry-run", action="store_true", help="run the whole harness on the CPU with a tiny model")
    parser.add_argument("--dry-run-limit", type=int, default=384, help=argparse.SUPPRESS)
    for hidden in ("--probe", "--seq", "--mode", "--options"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cap", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    if args.probe:
        args.seq = int(args.seq)
        print("PROBE " + json.dumps(probe(args)), flush=True)
        return 0
    if args.dry_run:
        out_dir = os.environ.get("OUT") or os.path.join(HERE, "results", "dry-run")
        args.cells = args.cells or ["tiny:none:1"]
        args.granularity, args.hi, args.steps, args.warmup = 64, 512, 2, 0
        args.state, args.out = (
            os.path.join(out_dir, "long-context-search.json"),
            os.path.join(out_dir, "long-context-at.json" if args.at else "long-context.json"),
        )
    args.out = args.out or (AT_RESULTS if args.at else RESULTS)
    options = stream_options(args.stream_option)
    cells = args.cells or DEFAULT_CELLS
    for cell in cells:
        parse_cell(cell)
    if not args.dry_run:
        refuse_caps_above_the_gpu(cells)
    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    if args.at:
        return time_at(cells, options, args, rows)
    state = json.load(open(args.state)) if os.path.exists(args.state) else {}
    deadline = time.time() + args.budget_s
    for cell in cells:
        settings = cell_options(cell, options)
        bounds = Bounds(**state.get(cell, {"fits": args.lo, "fails": args.hi}))
        guess = planned_tokens(cell, settings, args.granularity) if args.from_plan else 0
        if guess:
            print(f"{cell}: the planner predicts {guess} tokens; the search starts there", flush=True)
        bounds = search(cell, bounds, settings, args, deadline, state, guess)
        if bounds.fails - bounds.fits > args.granularity:
            print(f"{cell}: out of time between {bounds.fits} and {bounds.fails} tokens; run again to go on")
            continue
        if bounds.fits == 0:
            print(f"{cell}: not even {args.granularity} tokens fit")
            continue
        if time.time() > deadline:
            print(f"{cell}: searched ({bounds.fits} tokens); out of time before timing it; run again")
            continue
        row = measure(cell, bounds.fits, settings, args)
        if "timed_failure" in row:  # searched with fewer steps than timed: search below it again
            print(f"{cell}: {bounds.fits} tokens failed when timed: {row['timed_failure']}", flush=True)
            state[cell] = dataclasses.asdict(Bounds(fits=args.lo, fails=bounds.fits))
            _write(args.state, state)
            continue
        rows = _put_row(rows, row, args.out)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
