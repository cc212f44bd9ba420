"""The longest sequence TRL's own ``sft.py``, unchanged, trains behind ``layerstream run``
with no layerstream flag, under a GPU memory cap, for an 8B-shaped QLoRA model (GPU).

``long_context.py`` answers the question with the project's own training loop and its
long-sequence settings set by hand; this asks it of a real client: ``python -m
trl.scripts.sft`` as a user runs it, under ``layerstream run`` and nothing else, so whatever
long-sequence settings run are the ones layerstream's "auto" turns on by itself. The model
is a random-weight checkpoint of Llama-3.1-8B's shape written to disk once (``checkpoints.py``,
through ``rl.write_checkpoint``, in a process of its own so this one never holds the GPU), the
flags ``--load_in_4bit --use_peft --lora_r 32 --lora_alpha 16 --lora_target_modules
all-linear`` (Unsloth's table's rank), batch 1, ``--max_length N`` over rows of random words
that each tokenise to more than N tokens (TRL truncates them to N), ``--dtype bfloat16``
(TRL's default float32 keeps the unquantised parts and the 4-bit compute in float32, which no
QLoRA user runs), warm-up 1 + 2 timed steps, ``--save_strategy no``, ``--report_to none``,
``--logging_steps 1``; the rest at TRL's defaults (gradient checkpointing on, LoRA dropout 0.05,
TRL's fused log-prob head computing the loss). Every attempt is a fresh process under
``capped.py`` (the cap by ``set_per_process_memory_fraction``; each step's time, the Trainer's
logs and the peaks), and keeps the lines layerstream printed: the start-up summary (which head
computes the loss, the long-sequence settings) and what "auto" turned on.

    python benchmarks/long_context_client.py --cells 12:36864,16:61440 --work /tmp/lcc
    python benchmarks/long_context_client.py --client train --cells 12:36864 --baseline --work /tmp/lcc
    python benchmarks/long_context_client.py --client trainer --cells 12:36864 --baseline --work /tmp/lcc
    python benchmarks/long_context_client.py --client trainer-ends --cap 12 --from-plan --baseline --work /tmp/lcc
    python benchmarks/long_context_client.py --cap 12 --lo 32768 --hi 49152 --granularity 2048 --work /tmp/lcc
    python benchmarks/long_context_client.py --cap 12 --from-plan --baseline --work /tmp/lcc  # from the plan
    python benchmarks/long_context_client.py --cells 12:36864 --baseline --rounds 2 --work /tmp/lcc \\
        --merge benchmarks/results/long-context/long-context-client.json
    python benchmarks/long_context_client.py --cells 12:36864 --memory-trace --work /tmp/lcc  # where the peak is
    python benchmarks/long_context_client.py --client trainer --cells 12:24576 --baseline --work /tmp/lcc \
        --streamed-flags '--layer_stream_embeddings false'    # an ablation: what one setting costs
    python benchmarks/long_context_client.py --dry-run --work /tmp/lcc-dry    # tiny llama on the CPU

``--client`` picks the user's command: ``sft`` (the above), ``train`` (``layerstream train`` with
the long recipe ``configs/llama-3.1-8b-qlora-long-24gb.yaml`` as shipped, its model, data,
length and steps set to the run's and ``stream.vram_budget=auto``, so the cap is its budget;
baseline: TRL's plain script, the same SFTTrainer loss) or ``trainer`` (``long_trainer_script.py``,
a plain QLoRA Trainer script with ``--layer_stream`` and no other layerstream flag; baseline:
the script without it) or ``trainer-ends`` (the same script with ``--layer_stream_embeddings``
too: its float32 embedding and head, which ``prepare_model_for_kbit_training`` leaves, in host
memory; the row's options say so). Each client's rows are its own.

``--cells CAP:N,...`` tries each length under its cap (GiB); ``--cap C --lo A --hi B`` bisects
for the longest N (a multiple of ``--granularity``) that trains its steps without running out
of memory, A known to train (0: none), B taken not to, tightened by the attempts already known;
``--cap C --from-plan`` starts at the memory plan's longest for this client and steps by the
granularity, up while a length trains, down while it runs out of memory.
``--baseline`` alternates, at the cell's length (or the length the search found), the streamed
run and the same command as plain ``python -m trl.scripts.sft`` with the whole GPU (streamed,
resident, streamed, resident for ``--rounds 2``); the resident run may run out of memory, which
is recorded. ``--same-loss-baseline`` (the Trainer script's clients, whose streamed run computes
layerstream's chunked loss where the plain script computes the full logits') makes the baseline
the script with ``--layer_stream`` on the whole GPU (its window keeps every layer that fits:
all of an 8B's), given the streamed run's ``loss_chunk_tokens`` and every other long-sequence
setting off (left at "auto" they turn on where the plan nears the whole GPU): the same loss,
layers and activations resident; a row divides by it where it trained, and says whose run. ``--deadline`` (seconds) starts no
run it cannot finish and always writes what was measured. A step near ten minutes (80 GiB at
400,000 tokens) leaves no room for writing the checkpoint and data in its command:
``--prepare-only`` writes them in ``--work`` in an earlier command on the same warm machine,
and the run's command reuses them.

Each attempt records the commit its code was at (``COMMIT=<sha>`` in the environment, as
``scripts/gpu-suite.sh`` takes it, where the GPU machine's copy of the tree carries an older
``.git``): the memory plan checks a run against the plan of the code that ran it. It records a
hash of its code too (``common.code_hash``: the package, the Trainer script, configs/): a row
pools the rounds of its last round's code, divided by the baselines that ran beside them, and
names later runs at its length or shorter that ran out of memory (``failed_since``).

Output: every attempt in ``long-context-client.json`` ($OUT, else
benchmarks/results/long-context/) with the end of each log beside it (``long-context-client-logs/``;
whole logs under ``--work``/runs), and one row per cap in ``long-context.json`` ($OUT, else
benchmarks/results/), merged into the committed rows, whose harness rows stay: ``client`` names
TRL's script, ``command`` this benchmark's command line. ``--merge FILE`` (repeatable) takes an
earlier command's attempts file (its attempts count, later rounds numbered on) or a
long-context.json (its rows are kept). Rows are recomputed from every attempt known, so a search
in one command and its baseline in another make one row.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from long_context_clients import (  # noqa: E402
    CLIENT_OPTIONS,
    CLIENTS,
    LONG_SETTINGS,
    LORAS,
    OOM,
    SAME_LOSS_BASELINE,
    TRAINED,
    attempt_name,
    baseline_for,
    baseline_label,
    baseline_runs,
    client_command,
    client_label,
    client_of,
    followed,
    latest_streamed,
    layerstream_lines,
    long_settings_seen,
    median_of,
    planned_longest,
    recipe_options,
    same_card,
    verdict,
    write_checkpoint,
    write_dataset,
)

import rl  # noqa: E402  (the harness runs as a script)
from common import code_hash, commit, keep_by_card, same_code  # noqa: E402
from zero_edit import compare  # noqa: E402

RESULTS = HERE / "results"
SHAPE = "llama3-8b"  # benchmarks' name for configs/shapes/llama-3.1-8b.json
MODELS = {"llama3-8b": "Llama-3.1-8B shape, random weights", "tiny": "tiny-llama, random weights"}
MIN_RUN_S = 150  # an 8B attempt given less than this before --deadline is not started
WRITE_RESERVE_S = 10  # kept back from the last attempt for writing the results
ATTEMPTS_FILE, ROWS_FILE, LOGS = "long-context-client.json", "long-context.json", "long-context-client-logs"


def attempt(ctx, streamed: bool, cap: str, tokens: int, matching: Optional[dict] = None):
    """One run of the script at ``tokens`` under ``cap`` ('12GiB' or capped.WHOLE); its record,
    saved; None when --deadline leaves no time for it. ``matching``: the streamed run a
    baseline is for (a same-loss baseline takes its loss chunk)."""
    kind = "streamed" if streamed else "resident"
    client, loss_flags = (ctx.args.client, []) if streamed else baseline_for(ctx.args, matching)
    flags = shlex.split(ctx.args.streamed_flags) if streamed else []
    name, round_ = attempt_name(ctx.results.attempts, kind, cap, tokens, client, flags, loss_flags)
    record = {"name": name, "kind": kind, "streamed": streamed, "cap": cap, "tokens": tokens, "round": round_}
    record["client"] = client
    record["streamed_flags"] = flags
    if matching is not None:  # a baseline: the streamed run it follows (a row pairs their losses)
        record["follows"] = matching["name"]
    if loss_flags:  # a same-loss baseline: the streamed run's loss chunk, given to this one
        record.update(baseline_flags=loss_flags, same_loss_for=matching["name"])
    record["shape"] = ctx.shape
    record["vram_gib"] = None if cap == rl.WHOLE else float(cap[: -len("GiB")])
    record.update(bench_command=ctx.command, warmup_steps=ctx.args.warmup, timed_steps=ctx.args.steps)
    record["commit"] = commit()  # the code that ran: the plan of a run is made as its code was
    record["code"] = code_hash()  # and its files' hash: rows pool one code's rounds, git or not
    from layerstream.system.versions import versions

    record["versions"] = versions()  # and the releases: a merge elsewhere must not restamp its row
    if ctx.args.dry_run and tokens > ctx.args.dry_run_limit:  # no GPU to run out of: a stand-in
        record.update(verdict=OOM, dry_run_stand_in=f"{tokens} > --dry-run-limit {ctx.args.dry_run_limit}")
        record.update(step_s=[], losses=[], logs=[])
        return ctx.results.add(record)
    left = ctx.deadline - time.monotonic()
    if left < ctx.args.min_run_s:
        print(f"long-context-client: {left:.0f} s left of --deadline: {name} is not run", flush=True)
        return None
    runs = ctx.work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    times = runs / f"{name}-times.json"
    times.unlink(missing_ok=True)
    target = client_command(ctx, client, tokens, runs / name, streamed) + flags + loss_flags
    argv = [sys.executable, str(HERE / "capped.py"), "--cap", cap, "--times", str(times)]
    ctx.logs.mkdir(parents=True, exist_ok=True)
    memory = ctx.logs / f"{name}-memory.json" if ctx.args.memory_trace else None
    argv += ["--memory-trace", str(memory)] if memory else []
    argv += ["--", *target]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # everything is on disk
    if ctx.args.dry_run:  # OpenMP's spinning workers and the copy thread share the CPU badly
        env["OMP_NUM_THREADS"] = "1"
    print(f"long-context-client: {name}: {shlex.join(target)}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=left - WRITE_RESERVE_S)
        returncode, log, timed_out = done.returncode, done.stdout + done.stderr, False
    except subprocess.TimeoutExpired as expired:
        returncode, log, timed_out = None, rl._text(expired.stdout) + rl._text(expired.stderr), True
    (runs / f"{name}.log").write_text(log)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    (ctx.logs / f"{name}.log").write_text(log[-8000:])
    timing = json.loads(times.read_text()) if times.exists() else {}
    steps, logs = timing.get("step_s", []), [entry for entry in timing.get("logs", []) if "loss" in entry]
    lines = layerstream_lines(log)
    record.update(
        verdict=verdict(returncode, timed_out, len(steps), ctx.args.warmup + ctx.args.steps, log),
        returncode=returncode,
        wall_s=round(time.perf_counter() - start, 1),
        step_s=steps,
        median_timed_s=statistics.median(steps[ctx.args.warmup :]) if steps[ctx.args.warmup :] else None,
        losses=[entry["loss"] for entry in logs],
        peak_allocated_gib=timing.get("peak_allocated_gib"),
        peak_reserved_gib=timing.get("peak_reserved_gib"),
        peak_host_rss_gib=timing.get("peak_host_rss_gib"),
        alloc_retries=timing.get("alloc_retries"),  # the allocator's, cumulative after each step
        trainer_peak_vram_gib=max(
            (e["layerstream/peak_vram_gib"] for e in logs if "layerstream/peak_vram_gib" in e), default=None
        ),
        window_shrank=sum("the resident window shrank" in line for line in lines),
        long_settings=long_settings_seen(logs, lines) if streamed or loss_flags else None,
        layerstream_lines=lines,
        logs=logs,
        gpu=timing.get("gpu"),
        memory_trace=str(memory.relative_to(ctx.logs.parent)) if memory and memory.exists() else None,
        client_command=shlex.join(["python" if part == sys.executable else part for part in target]),
        command=shlex.join(argv),
        log=f"{LOGS}/{name}.log",
    )
    if record["verdict"] != TRAINED:
        record["error"] = [line for line in log.splitlines() if "Error" in line or "error:" in line][-3:]
    return ctx.results.add(record)


# -- the attempts and the rows made from them -------------------------------------------------
def rows_from(attempts: list) -> list:
    """One row per client and cap: the longest length a streamed attempt trained, its median
    timed step, and the client's plain baseline at that length (or why there is none)."""
    rows = []
    attempts = [a for a in attempts if not a.get("streamed_flags")]  # a row is the client's command as is
    streamed = sorted({(CLIENTS.index(client_of(a)), a["vram_gib"]) for a in attempts if a["streamed"]})
    for client, cap in ((CLIENTS[index], cap) for index, cap in streamed):
        runs = [a for a in attempts if a["streamed"] and a["vram_gib"] == cap and client_of(a) == client]
        trained = [a for a in runs if a["verdict"] == TRAINED]
        if not trained:
            continue
        tokens = max(a["tokens"] for a in trained)
        at = sorted((a for a in trained if a["tokens"] == tokens), key=lambda a: a["round"])
        # one card's runs, of one code: the last round's (rounds of older code describe that code)
        at = [a for a in at if same_card(a, at[-1]) and same_code(a, at[-1])]
        failing = [a["tokens"] for a in runs if a["verdict"] == OOM and a["tokens"] > tokens]
        residents, base_runs, baseline = baseline_runs(attempts, client, tokens, at[-1])
        paired, _ = followed(base_runs, at)
        unpaired = bool(base_runs) and not paired
        if paired:  # the baselines that ran beside the row's rounds, where any did
            base_runs = paired
            residents = [a for a in residents if a in paired or a["verdict"] != TRAINED]
        later = runs[runs.index(at[-1]) + 1 :]  # attempts are kept in the order they ran
        failed_since = [a["name"] for a in later if a["verdict"] == OOM and a["tokens"] <= tokens]
        step, base = median_of(at), median_of(base_runs)
        row = {
            "model": MODELS[at[0].get("shape", SHAPE)],
            "quantization": "nf4",
            "vram_gib": cap,
            "max_tokens": tokens,
            "step_s": step,
            "tokens_per_s": tokens / step,
            "baseline_step_s": base,
            "options": recipe_options() if client == "train" else CLIENT_OPTIONS.get(client, {}),  # else "auto"
            "lora": LORAS[client],
            "batch": 1,
            "client": client_label(client),
            "command": at[0]["bench_command"],
            "commands": sorted({a["bench_command"] for a in at + residents}),
            "client_command": at[0]["client_command"],
            "baseline_command": base_runs[0]["client_command"] if base_runs else None,
            "baseline_client": baseline_label(baseline, base_runs[0]) if base_runs else None,
            "known_not_to_fit": min(failing) if failing else None,
            "bound": f"{min(failing)} tokens ran out of memory" if failing else "no longer length tried",
            "speed_vs_resident": base / step if base else None,
            "peak_allocated_gib": max(a["peak_allocated_gib"] or 0 for a in at) or None,
            "peak_reserved_gib": max(a["peak_reserved_gib"] or 0 for a in at) or None,
            "peak_host_rss_gib": max(a.get("peak_host_rss_gib") or 0 for a in at) or None,
            "long_settings": at[-1]["long_settings"],
            "timed_steps": sum(len(a["step_s"]) - a["warmup_steps"] for a in at),
            "warmup_steps": at[0]["warmup_steps"],
            "attempts": [a["name"] for a in at + residents],
            "result_file": f"long-context/{ATTEMPTS_FILE}",
            "gpu": at[0].get("gpu"),
            "versions": at[-1].get("versions"),  # None for attempts from before they kept theirs
        }
        if failed_since:  # a later run at this length or shorter did not fit: the row says so
            row["failed_since"] = failed_since
        if unpaired:
            row["baseline_note"] = "no baseline ran beside these rounds: the baselines are earlier runs"
        if not base_runs:
            why = [f"{a['name']}: {a['verdict']}" for a in residents]
            row["baseline_note"] = "; ".join(why) if why else "no resident run at this length (--baseline)"
        elif residents and at and LORAS[baseline] == LORAS[client]:  # the same script and LoRA
            pairs = [
                compare(("sft", "llama3-8b", "nf4", f"{cap:g}GiB"), [b], [s]) for b, s in zip(*followed(base_runs, at))
            ]
            if pairs:  # each baseline against the run it followed, not against another pair's
                row["losses_equal"] = all(pair["losses_equal"] for pair in pairs)
                row["max_loss_difference"] = max(pair["max_loss_difference"] for pair in pairs)
        rows.append(row)
    return rows


class Results:
    """Every attempt known (earlier commands' from --merge attempts files and this output's own
    file, then this command's), written with the rows after each; the rows merged into the
    committed long-context.json's (and --merge'd rows files'), a row of the same model,
    quantization, cap and client replaced."""

    def __init__(self, attempts_path: Path, rows_path: Path, merge: list, keep: bool):
        self.attempts_path, self.rows_path = attempts_path, rows_path
        self.attempts: dict = {}
        self.base_rows: list = []
        sources = [RESULTS / ROWS_FILE, *merge, rows_path] + ([attempts_path] if keep else [])
        for path in dict.fromkeys(Path(p) for p in sources):
            if not path.exists():
                continue
            loaded = json.loads(path.read_text())
            if isinstance(loaded, list):  # a long-context.json: rows
                self.base_rows = merge_rows(self.base_rows, loaded)
            else:
                for record in loaded.get("attempts", []):
                    self.keep(record)

    def keep(self, record: dict) -> None:
        """Add an attempt; one of the same name from another GPU stays beside it under its
        card's name (the attempt added last keeps the plain one), since a row pairs one card."""
        keep_by_card(self.attempts, record)

    def add(self, record: dict) -> dict:
        self.keep(record)
        shown = {k: record.get(k) for k in ("name", "verdict", "wall_s", "step_s", "peak_allocated_gib")}
        print(json.dumps(shown), flush=True)
        self.save()
        return record

    def rows(self) -> list:
        return rows_from(list(self.attempts.values()))

    def save(self) -> None:
        from layerstream.system.versions import versions

        mine = [self._stamped(row, versions) for row in self.rows()]
        for path in (self.attempts_path, self.rows_path):
            path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"attempts": list(self.attempts.values()), "rows": mine, "versions": versions()}
        self.attempts_path.write_text(json.dumps(payload, indent=1))
        self.rows_path.write_text(json.dumps(merge_rows(self.base_rows, mine), indent=1))

    def _stamped(self, row: dict, versions) -> dict:
        """The row with the versions its runs ran with: their own, else (attempts from before
        they kept them) the committed row's made from the same attempts, else this machine's
        (the command that ran them is this one)."""
        if row.get("versions"):
            return row
        same = [b for b in self.base_rows if row_key(b) == row_key(row) and b.get("attempts") == row["attempts"]]
        kept = same[0].get("versions") if same else None
        return dict(row, versions=kept or versions())


def row_key(row: dict) -> tuple:
    """What a row is of: a row of the same key replaces it."""
    return row["model"], row["quantization"], row["vram_gib"], row.get("client")


def merge_rows(rows: list, new: list) -> list:
    """``rows`` with each of ``new`` in place of the row of its key (else after them)."""
    out = list(rows)
    for row in new:
        same = [i for i, old in enumerate(out) if row_key(old) == row_key(row)]
        if same:
            out[same[0]] = row
        else:
            out.append(row)
    return out


# -- what a command runs ------------------------------------------------------------------------
@dataclass
class Context:
    args: argparse.Namespace
    work: Path
    logs: Path
    command: str
    results: Results
    deadline: float
    checkpoint: Path = None
    data: Path = None
    shape: str = SHAPE
    stopped: list = field(default_factory=list)


def alternate(ctx: Context, cap: str, tokens: int, streamed_done: bool = False) -> None:
    """--rounds of (streamed under ``cap``, then resident with the whole GPU when --baseline);
    ``streamed_done``: the first round's streamed run has just run (the search's)."""
    for index in range(ctx.args.rounds):
        if index == 0 and streamed_done:
            streamed = latest_streamed(ctx.results.attempts.values(), ctx.args.client, cap, tokens)
        else:
            streamed = attempt(ctx, True, cap, tokens)
            if streamed is None:
                return
        if ctx.args.baseline and attempt(ctx, False, rl.WHOLE, tokens, matching=streamed) is None:
            return


def walk_from_plan(ctx: Context, cap: str) -> int:
    """The longest length that trains, found by starting at the memory plan's longest
    (rounded down to --granularity) and stepping by --granularity: up while a length trains,
    down while it runs out of memory. The plan is within a few percent of the measured peak,
    so this takes two or three attempts where a bisection over a wide range takes five."""
    step = ctx.args.granularity
    planned = planned_longest(ctx.checkpoint, ctx.args.client, ctx.args.cap)
    tokens = max(step, planned // step * step)
    print(f"long-context-client: {cap}: the plan fits {planned} tokens; starting at {tokens}", flush=True)
    lo, hi = 0, None
    while hi is None or hi - lo > step:
        record = attempt(ctx, True, cap, tokens)
        if record is None or record["verdict"] not in (TRAINED, OOM):
            why = "out of time" if record is None else record["verdict"]
            print(f"long-context-client: {cap}: {why} at {tokens} tokens; the walk stops", flush=True)
            ctx.stopped.append(cap)
            return lo
        if record["verdict"] == TRAINED:
            lo, tokens = tokens, tokens + step
        else:
            hi, tokens = tokens, tokens - step
        if tokens <= 0 or (hi is not None and tokens <= lo):
            break
        print(f"long-context-client: {cap}: trains {lo or '-'}, not {hi or '-'} tokens", flush=True)
    return lo


def search(ctx: Context, cap: str, lo: int, hi: int) -> int:
    """Bisect between ``lo`` (trains; 0: none known) and ``hi`` (taken not to) to --granularity,
    the bounds first tightened by the attempts already known; the longest length found to train."""
    step = ctx.args.granularity
    for a in ctx.results.attempts.values():
        if a["streamed"] and a["cap"] == cap and a["verdict"] == TRAINED and a["tokens"] < hi:
            lo = max(lo, a["tokens"])
        elif a["streamed"] and a["cap"] == cap and a["verdict"] == OOM and a["tokens"] > lo:
            hi = min(hi, a["tokens"])
    while hi - lo > step:
        tokens = max(step, (lo + hi) // 2 // step * step)
        tokens = tokens if tokens > lo else lo + step
        record = attempt(ctx, True, cap, tokens)
        if record is None:
            print(f"long-context-client: out of time between {lo} and {hi} tokens under {cap}; run again", flush=True)
            ctx.stopped.append(cap)
            return lo
        if record["verdict"] == TRAINED:
            lo = tokens
        elif record["verdict"] == OOM:
            hi = tokens
        else:  # neither a fit nor out of memory: the search cannot go on from it
            print(f"long-context-client: {record['name']}: {record['verdict']}; the search stops", flush=True)
            ctx.stopped.append(cap)
            return lo
        print(f"long-context-client: {cap}: trains {lo}, not {hi} tokens", flush=True)
    return lo


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default=None, help="CAP_GIB:TOKENS,... e.g. 12:36864,16:61440")
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="sft",
        help="sft: TRL's sft.py behind layerstream run; train: layerstream train with the long recipe; "
        "trainer: a plain Trainer script with --layer_stream; trainer-ends: the same with "
        "--layer_stream_embeddings",
    )
    parser.add_argument("--cap", type=float, default=None, help="search mode: the cap in GiB")
    parser.add_argument("--lo", type=int, default=0, help="search: a length known to train (0: none)")
    parser.add_argument("--hi", type=int, default=131072, help="search: a length taken not to train")
    parser.add_argument("--granularity", type=int, default=2048, help="search: to this many tokens")
    parser.add_argument(
        "--from-plan",
        action="store_true",
        help="search mode: start at the memory plan's longest and step by --granularity (no --lo/--hi)",
    )
    parser.add_argument("--baseline", action="store_true", help="also plain `python -m trl.scripts.sft`, whole GPU")
    parser.add_argument(
        "--same-loss-baseline",
        action="store_true",
        help="trainer clients: the baseline is the script with --layer_stream on the whole GPU (every layer "
        "resident) and the streamed run's loss_chunk_tokens, the same loss, instead of the plain script",
    )
    parser.add_argument("--rounds", type=int, default=1, help="streamed (, resident) rounds at each length")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each run, after --warmup")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", help="the script's --dtype (TRL's default: float32)")
    parser.add_argument("--work", default="/tmp/long-context-client", help="checkpoint, data, runs, whole logs")
    parser.add_argument("--out", default=None, help="default $OUT, else benchmarks/results(/long-context)")
    parser.add_argument("--merge", action="append", default=[], help="an earlier attempts file or long-context.json")
    parser.add_argument("--deadline", type=float, default=570, help="seconds this command may take, writing included")
    parser.add_argument(
        "--min-run-s", type=float, default=None, help=f"start no run with less left (default {MIN_RUN_S})"
    )
    parser.add_argument(
        "--streamed-flags",
        default="",
        help="an ablation: these arguments appended to the streamed run's command (the Trainer script's "
        "--layer_stream_* flags, TRL's script's own), e.g. '--layer_stream_embeddings false'; its attempts "
        "are named by them and make no row",
    )
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="write each run's first-step tensors alive at its peak, by source (GPU), beside its log",
    )
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="write the checkpoint and the data for --cells (or the search) in --work, run nothing: a "
        "step too long to share a ten-minute command with them then runs in the next command",
    )
    parser.add_argument("--dry-run", action="store_true", help="a tiny llama on the CPU: the harness only")
    parser.add_argument(
        "--dry-run-limit", type=int, default=384, help="dry run: longer attempts stand in for out of memory"
    )
    args = parser.parse_args(argv)
    if (args.cells is None) == (args.cap is None) and not args.dry_run:
        parser.error("give --cells CAP:TOKENS,... or --cap GIB (with --lo/--hi) to search")
    if args.dry_run and args.cells is None and args.cap is None:  # a search, a stand-in OOM, a baseline
        args.cap, args.lo, args.hi, args.granularity, args.baseline, args.rounds = 1, 0, 512, 64, True, 2
    if args.same_loss_baseline and args.client not in SAME_LOSS_BASELINE:
        parser.error(
            f"--same-loss-baseline is for the Trainer script's clients ({', '.join(SAME_LOSS_BASELINE)}); "
            f"{args.client}'s plain baseline computes the same loss already (TRL's fused head)"
        )
    if args.min_run_s is None:
        args.min_run_s = 5 if args.dry_run else MIN_RUN_S
    return args


def outputs(args) -> tuple:
    """(attempts file, rows file, log tails folder): under $OUT or --out, else the committed
    places; a dry run never writes into benchmarks/results."""
    chosen = args.out or os.environ.get("OUT")
    if args.dry_run:
        chosen = Path(chosen or Path(args.work) / "out")
        if chosen.resolve() in (RESULTS.resolve(), (RESULTS / "long-context").resolve()):
            raise SystemExit("long-context-client: a dry run's rows are not results: give --out elsewhere")
    if chosen:
        return Path(chosen) / ATTEMPTS_FILE, Path(chosen) / ROWS_FILE, Path(chosen) / LOGS
    folder = RESULTS / "long-context"
    return folder / ATTEMPTS_FILE, RESULTS / ROWS_FILE, folder / LOGS


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    deadline = time.monotonic() + args.deadline
    cells = [(float(c.split(":")[0]), int(c.split(":")[1])) for c in args.cells.split(",")] if args.cells else []
    attempts_path, rows_path, logs = outputs(args)
    keep = not (args.out or os.environ.get("OUT") or args.dry_run)  # the committed attempts file
    results = Results(attempts_path, rows_path, args.merge, keep)
    command = shlex.join(["python", "benchmarks/long_context_client.py", *argv])
    ctx = Context(args, Path(args.work), logs, command, results, deadline, shape="tiny" if args.dry_run else SHAPE)
    ctx.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ctx.checkpoint = write_checkpoint(ctx.work, ctx.shape, deadline - time.monotonic())
    print(f"long-context-client: checkpoint {ctx.checkpoint} ready in {time.perf_counter() - start:.1f} s", flush=True)
    if args.cap is not None and args.from_plan:  # rows long enough for the walk's steps up
        args.hi = planned_longest(ctx.checkpoint, args.client, args.cap) + 8 * args.granularity
    longest = max([t for _, t in cells] + ([args.hi] if args.cap is not None else []))
    ctx.data = write_dataset(ctx.work, ctx.checkpoint, longest)
    if args.prepare_only:
        print(f"long-context-client: {ctx.checkpoint} and {ctx.data} ready; nothing run", flush=True)
        return 0
    for cap_gib, tokens in cells:
        alternate(ctx, f"{cap_gib:g}GiB", tokens)
    if args.cap is not None:
        cap = f"{args.cap:g}GiB"
        found = walk_from_plan(ctx, cap) if args.from_plan else search(ctx, cap, args.lo, args.hi)
        if found and cap not in ctx.stopped:
            just_ran = any(
                a["streamed"] and a["cap"] == cap and a["tokens"] == found and a["bench_command"] == command
                for a in results.attempts.values()
            )
            alternate(ctx, cap, found, streamed_done=just_ran)
    results.save()
    verdicts = Counter(a["verdict"] for a in results.attempts.values() if a["bench_command"] == command)
    print(f"long-context-client: this command's attempts: {dict(verdicts)}", flush=True)
    print(summary(results.rows()))
    for a in results.attempts.values():
        if a.get("streamed_flags") and a["bench_command"] == command:
            print(f"long-context-client: ablation {a['name']}: {a['verdict']}, median step {a['median_timed_s']} s")
    print(f"long-context-client: attempts in {attempts_path}; rows in {rows_path}", flush=True)
    return 0


def summary(rows: list) -> str:
    def number(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| cap GiB | max tokens | not to fit | step s | resident s | x resident | auto turned on | loss |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for row in rows:
        decided = (row.get("long_settings") or {}).get("auto_decided") or {}
        on = ", ".join(f"{k}={v}" for k, v in decided.items() if k in LONG_SETTINGS and v) or "-"
        head = ((row.get("long_settings") or {}).get("loss_head") or "-").split(",")[0]
        lines.append(
            f"| {row['vram_gib']:g} | {row['max_tokens']} | {row['known_not_to_fit'] or '-'} | {number(row['step_s'])} | "
            f"{number(row['baseline_step_s'])} | {number(row['speed_vs_resident'], 3)} | {on} | {head} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
