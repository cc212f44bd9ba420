"""TRL's own scripts, unchanged, on checkpoints larger than the GPU they get.

Writes random-weight checkpoints of a 3B and an 8B shape to disk (``checkpoints.py``) and a
small SFT and preference dataset, then runs ``python -m trl.scripts.sft`` and TRL's
``dpo.py`` (by its path) through ``layerstream run`` in fresh processes (and ``trl sft`` and
``accelerate launch -m layerstream run -m trl.scripts.sft``, which train in a process of their own), each under a per-process memory cap smaller
than the model's weights (``capped.py``): bf16 LoRA and ``--load_in_4bit`` QLoRA. Where the
model also fits its cap resident, the plain script runs too, for the losses and the speed.
Capped-only runs go several at a time (each has its own cap; their step times are not
compared); plain-versus-streamed pairs run alone.

    python benchmarks/zero_edit.py --work /tmp/zero-edit --out $OUT
    python benchmarks/zero_edit.py --part capped ...   # the capped-only runs (no timing: may share the GPU)
    python benchmarks/zero_edit.py --part pairs ...    # the plain-versus-streamed pairs (run alone)

A pair runs in ``--pair-rounds`` rounds (plain, streamed, plain, streamed, ...), so drift of
the machine over minutes falls on both sides. Its speed is the median over rounds and steps of
plain step time / streamed step time, step by step (both runs see the same batches in the
same order, so batch lengths cancel), from the third step on; each round's ratio and the ratio
of the pooled medians are kept too.

``--variant NAME`` adds a third run to each round, the streamed command with launcher flags
(``VARIANTS``), and a second verdict between the two streamed runs (its ``against`` says
which way), with the losses of all three runs:

- ``stream-embeddings``: ``layerstream run --stream-embeddings`` (the embedding and head on the
  host, the head fetched to the GPU for TRL's fused loss) against the streamed run without it;
- ``long-settings-off``: the streamed run as it comes (the long-sequence settings "auto")
  against the same with the three turned off, what "auto" costs a step that needs none.

    python benchmarks/zero_edit.py --part pairs --pair-tokens 2048 --full-determinism \
        --variant stream-embeddings --only sft-llama3-8b-4bit-16GiB --pair-rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXTRA: list = []  # arguments every run gets (the CPU dry run's --use_cpu)
# name: (launcher flags, whether the verdict is the default streamed run against the variant
# rather than the variant against it, what it compares)
VARIANTS = {
    "stream-embeddings": (
        ["--stream-embeddings"],
        False,
        "the streamed run with --stream-embeddings against the same without it",
    ),
    "long-settings-off": (
        ["--offload-activations", "false", "--mlp-tile-tokens", "0", "--loss-chunk-tokens", "0"],
        True,
        "the streamed run as it comes (long-sequence settings auto) against the same with the three off",
    ),
}
LOG_TAILS: list = []  # where each run's last lines go as it ends (the --out folder)

# (script, shape, quantization, cap, also run the plain script under the same cap);
# "trl-sft" is the ``trl sft`` command and "accelerate-sft" ``accelerate launch -m layerstream
# run -m trl.scripts.sft``: both start the training script in a new process; "qlora-script"
# is examples/train_qlora.py, a plain HfArgumentParser Trainer script (device_map="auto",
# BitsAndBytesConfig, prepare_model_for_kbit_training, get_peft_model)
CASES = [
    ("sft", "llama3-8b", "bf16", "12GiB", False),
    ("sft", "llama3-8b", "4bit", "4GiB", False),
    ("sft", "llama3.2-3b", "bf16", "4GiB", False),
    ("sft", "llama3.2-3b", "4bit", "2GiB", False),
    ("dpo", "llama3-8b", "bf16", "12GiB", False),
    ("dpo", "llama3-8b", "4bit", "4GiB", False),
    ("dpo", "llama3.2-3b", "bf16", "4GiB", False),
    ("dpo", "llama3.2-3b", "4bit", "2GiB", False),
    ("trl-sft", "llama3.2-3b", "bf16", "4GiB", False),
    ("accelerate-sft", "llama3-8b", "4bit", "4GiB", False),
    # the script casts the embeddings and head to float32 (prepare_model_for_kbit_training):
    # 3.9 GiB, more than its 6 GiB cap leaves beside a step (it ran out of memory in step 2),
    # so it streams them too (--stream-embeddings), as layerstream's advice then says
    ("qlora-script", "llama3-8b", "4bit", "6GiB", False),
    ("sft", "llama3.2-3b", "bf16", "24GiB", True),
    ("sft", "llama3-8b", "4bit", "16GiB", True),
]


def write_inputs(work: Path, shapes) -> dict:
    sys.path.insert(0, str(HERE))
    from layerstream import data as embedded

    import checkpoints  # noqa: E402  (the harness runs as a script)

    paths = {}
    for shape in shapes:
        target = work / shape
        if not (target / "model.safetensors.index.json").exists():
            start = time.perf_counter()
            checkpoints.write(shape, target)
            print(f"wrote {shape} in {time.perf_counter() - start:.1f} s", flush=True)
        paths[shape] = target
    rows = [json.loads(line) for line in embedded.data_path().read_text().splitlines() if line.strip()]
    for name, make in (
        ("sft", lambda r: {"text": f"Q: {r['instruction']}\nA: {r['response']}"}),
        (
            "dpo",
            lambda r: {
                "prompt": f"Q: {r['instruction']}\nA:",
                "chosen": " " + r["response"],
                "rejected": " I do not know.",
            },
        ),
    ):
        folder = work / f"data-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.jsonl").write_text("".join(json.dumps(make(r)) + "\n" for r in rows))
        paths[name] = folder
    if PAIR_TOKENS:  # the SFT rows repeated, so that packed sequences of a few thousand
        # tokens fill the timed steps (the embedded set holds about 17k tokens)
        folder = work / "data-sft-packed"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.jsonl").write_text((paths["sft"] / "train.jsonl").read_text() * PACKED_REPEATS)
        paths["sft-packed"] = folder
    return paths


def _script_path(script: str) -> str:
    import importlib.util

    return importlib.util.find_spec(f"trl.scripts.{script}").origin


def command(paths, script, shape, quantization, out: Path, steps: int, streamed: bool, variant: str = ""):
    """The run's command line; ``variant``: the streamed one with that variant's launcher flags."""
    line = _command(paths, script, shape, quantization, out, steps, streamed)
    if variant:
        at = line.index("run") + 1  # after ``layerstream run`` (or ``-m layerstream run``)
        line = line[:at] + VARIANTS[variant][0] + line[at:]
    return line


def _command(paths, script, shape, quantization, out: Path, steps: int, streamed: bool):
    if script == "qlora-script":
        args = [str(HERE.parent / "examples" / "train_qlora.py"), "--model_name_or_path", str(paths[shape])]
        args += ["--output_dir", str(out), "--max_steps", str(steps), "--logging_steps", "1"]
        args += ["--save_strategy", "steps", "--save_steps", str(steps), "--report_to", "none", "--lora_rank", "16"]
        args += ["--per_device_train_batch_size", "4", "--max_length", "256", "--bf16", "true", "--seed", "0"]
        args += ["--load_in_4bit"] * (quantization == "4bit") + EXTRA
        return ["layerstream", "run", "--stream-embeddings"] + args if streamed else [sys.executable] + args
    # SFT through ``-m``, DPO through the script's own path, and the two forms that start
    # a new process: TRL's console command and accelerate's launcher
    launch = {
        "sft": ["-m", "trl.scripts.sft"],
        "dpo": [_script_path("dpo")],
        "trl-sft": ["trl", "sft"],
        "accelerate-sft": ["-m", "trl.scripts.sft"],
    }[script]
    args = [
        *launch,
        "--model_name_or_path",
        str(paths[shape]),
        "--dataset_name",
        str(paths["dpo" if script == "dpo" else "sft"]),
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--logging_steps",
        "1",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(steps),
        "--report_to",
        "none",
        "--use_peft",
        "--lora_r",
        "16",
        "--lora_target_modules",
        "all-linear",
        "--per_device_train_batch_size",
        "4",
        "--max_length",
        "256",
        "--dtype",
        "bfloat16",
        "--bf16",
        "true",
        "--seed",
        "0",
    ]
    if quantization == "4bit":
        args.append("--load_in_4bit")
    if PAIR_TOKENS and script != "dpo":  # a compute-bound step instead of ~170 tokens
        args[args.index("--max_length") + 1] = str(PAIR_TOKENS[0])
        args[args.index("--dataset_name") + 1] = str(paths["sft-packed"])
        args += ["--packing", "true", "--packing_strategy", "wrapped"]
    args += EXTRA + PAIR_EXTRA
    if script == "accelerate-sft":
        accelerate = ["accelerate", "launch", "--num_processes", "1", "--mixed_precision", "bf16"]
        return accelerate + (["-m", "layerstream", "run"] if streamed else []) + args
    return ["layerstream", "run"] + args if streamed else [sys.executable] + args


PROFILE: list = []  # --profile: the folder each run's step profiles go under
PAIR_TOKENS: list = []  # --pair-tokens: the pairs' SFT runs pack sequences of this many tokens
PAIR_EXTRA: list = []  # --full-determinism: arguments both runs of a pair get
PACKED_REPEATS = 16


def run(paths, case, work: Path, steps: int, streamed: bool, tag: str = "", variant: str = "") -> dict:
    script, shape, quantization, cap, _ = case
    side = f"streamed-{variant}" if variant else "streamed" if streamed else "plain"
    name = f"{script}-{shape}-{quantization}-{cap}-{side}{tag}"
    out = work / "runs" / name
    (work / "runs").mkdir(parents=True, exist_ok=True)
    times = work / "runs" / f"{name}-times.json"
    argv = [sys.executable, str(HERE / "capped.py"), "--cap", cap, "--used-first", "--times", str(times)]
    argv += ["--profile", str(PROFILE[0] / name)] if PROFILE else []
    argv += ["--"]
    argv += command(paths, script, shape, quantization, out, steps, streamed, variant)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = done.stdout + done.stderr
    state = out / f"checkpoint-{steps}" / "trainer_state.json"
    history = json.loads(state.read_text())["log_history"] if state.exists() else []
    timing = json.loads(times.read_text()) if times.exists() else {}
    step_s = timing.get("step_s", [])
    row = {
        "name": name,
        "script": script,
        "shape": shape,
        "quantization": quantization,
        "cap": cap,
        "streamed": streamed,
        "variant": variant or None,
        "returncode": done.returncode,
        "wall_s": round(wall, 1),
        "out_of_memory": "out of memory" in log.lower(),
        "losses": [e["loss"] for e in history if "loss" in e],
        "stats_in_log_history": all(any(k.startswith("layerstream/") for k in e) for e in history if "loss" in e)
        if streamed and history
        else None,
        "window_layers": [e.get("layerstream/window_layers") for e in history if "loss" in e],
        "oom_retries": max([e.get("layerstream/oom_retries", 0) for e in history if "loss" in e], default=None),
        "step_s": step_s,
        "median_step_s": statistics.median(step_s[2:]) if len(step_s) > 2 else None,
        "peak_allocated_gib": timing.get("peak_allocated_gib"),
        "peak_reserved_gib": timing.get("peak_reserved_gib"),
    }
    (work / "runs" / f"{name}.log").write_text(log)
    for folder in LOG_TAILS:
        (folder / f"{name}.log").write_text(log[-6000:])
    print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default="/tmp/zero-edit")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--steps", type=int, default=8, help="steps of each capped-only run")
    parser.add_argument("--pair-steps", type=int, default=24, help="steps of each run of a timed pair")
    parser.add_argument(
        "--pair-rounds", type=int, default=3, help="plain, streamed, plain, ...: rounds of each timed pair"
    )
    parser.add_argument("--part", choices=("all", "capped", "pairs"), default="all")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--only", default=None, help="comma list of case names to run (script-shape-quant-cap)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    parser.add_argument("--profile", default=None, help="profile steps of each run (capped.py --profile) under here")
    parser.add_argument(
        "--pair-tokens",
        type=int,
        default=0,
        help="pairs only: SFT packs the (repeated) data into sequences of this many tokens (TRL's\n"
        "wrapped packing), so a step is bound by the GPU rather than by host work",
    )
    parser.add_argument(
        "--full-determinism",
        action="store_true",
        help="pairs only: both runs get the script's own --full_determinism (deterministic kernels,\n"
        "e.g. attention's backward), so two plain runs, and a plain and a streamed run, can agree bit for bit",
    )
    parser.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        default=None,
        help="pairs only: each round also runs the streamed command with this variant's launcher flags, "
        "judged against the streamed run without them",
    )
    args = parser.parse_args()
    if args.variant and args.part != "pairs":
        raise SystemExit("--variant applies to the timed pairs: give --part pairs")
    if args.full_determinism:
        if args.part != "pairs":
            raise SystemExit("--full-determinism applies to the timed pairs: give --part pairs")
        PAIR_EXTRA.extend(["--full_determinism", "true"])
    if args.profile:
        PROFILE.append(Path(args.profile))
    if args.pair_tokens:
        if args.part != "pairs":
            raise SystemExit("--pair-tokens applies to the timed pairs: give --part pairs")
        PAIR_TOKENS.append(args.pair_tokens)
    work = Path(args.work)
    cases = [c for c in CASES if args.only is None or "-".join(c[:4]) in args.only.split(",")]
    if args.dry_run:
        sys.path.insert(0, str(HERE))
        import checkpoints

        for shape in {c[1] for c in cases}:
            checkpoints.SHAPES[shape] = dict(
                model_type="llama",
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
            )
        global EXTRA
        EXTRA = ["--use_cpu"]
    paths = write_inputs(work, sorted({c[1] for c in cases}))
    capped_only = [c for c in cases if not c[4]]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    LOG_TAILS.append(Path(args.out) / "logs")
    LOG_TAILS[0].mkdir(exist_ok=True)

    name = {"all": "zero-edit.json", "capped": "zero-edit-capped.json", "pairs": "zero-edit-pairs.json"}[args.part]
    if args.pair_tokens:
        name = f"zero-edit-pairs-packed-{args.pair_tokens}.json"
    if args.full_determinism:
        name = name.replace(".json", "-deterministic.json")
    if args.variant:
        name = name.replace(".json", f"-{args.variant}.json")

    def save(rows, pairs=()):
        (Path(args.out) / name).write_text(
            json.dumps(
                {"steps": args.steps, "pair_steps": args.pair_steps, "rows": rows, "pairs": list(pairs)}, indent=1
            )
        )

    rows = []
    if args.part in ("all", "capped"):
        with ThreadPoolExecutor(args.parallel) as pool:
            rows = list(pool.map(lambda c: run(paths, c, work, args.steps, True), capped_only))
        save(rows)
    pairs = []
    for case in (c for c in cases if c[4] and args.part in ("all", "pairs")):
        # alternated, so that the machine's drift over minutes falls on both sides alike
        plains, streameds, variants = [], [], []
        sides = [(False, "", plains), (True, "", streameds)]
        sides += [(True, args.variant, variants)] if args.variant else []
        for round_index in range(args.pair_rounds):
            tag = f"-round{round_index + 1}" if args.pair_rounds > 1 else ""
            for streamed, variant, runs in sides:
                runs.append(run(paths, case, work, args.pair_steps, streamed, tag, variant))
                rows.append(runs[-1])
                save(rows, pairs)
        pairs.append(dict(compare(case, plains, streameds), against="the streamed run against the plain script"))
        if variants:
            _, default_first, against = VARIANTS[args.variant]
            verdict = compare(case, variants, streameds) if default_first else compare(case, streameds, variants)
            verdict.update(case=f"{verdict['case']}-{args.variant}", against=against)
            verdict["losses_equal_to_plain"] = bool(plains[0]["losses"]) and all(
                r["losses"] == plains[0]["losses"] for r in plains + streameds + variants
            )
            pairs.append(verdict)
        save(rows, pairs)
    print(json.dumps(pairs), flush=True)


def compare(case, plains: list, streameds: list) -> dict:
    """A pair's verdict over its rounds: equal losses in every run, and the streamed speed
    as a fraction of the plain one: the median over rounds and steps (from the third) of
    plain step / streamed step, each streamed run against the plain run just before it
    (the same batches in the same order)."""
    ratios, per_round = [], []
    for plain, streamed in zip(plains, streameds):
        these = [p / s for p, s in zip(plain["step_s"][2:], streamed["step_s"][2:]) if s > 0]
        ratios += these
        per_round.append(statistics.median(these) if these else None)
    pooled = {
        kind: [t for r in runs for t in r["step_s"][2:]] for kind, runs in (("plain", plains), ("streamed", streameds))
    }
    losses = [r["losses"] for r in plains + streameds]
    plain_losses = [r["losses"] for r in plains]
    return {
        "case": "-".join(case[:4]),
        "losses_equal": bool(losses[0]) and all(loss == losses[0] for loss in losses),
        "plain_runs_equal": bool(plain_losses[0]) and all(loss == plain_losses[0] for loss in plain_losses),
        "max_loss_difference": max((abs(a - b) for run in losses[1:] for a, b in zip(losses[0], run)), default=0.0),
        "speed_vs_plain": statistics.median(ratios) if ratios else None,
        "speed_vs_plain_by_round": per_round,
        "speed_vs_plain_of_medians": statistics.median(pooled["plain"]) / statistics.median(pooled["streamed"])
        if pooled["plain"] and pooled["streamed"]
        else None,
        "steps_compared": len(ratios),
    }


if __name__ == "__main__":
    main()
