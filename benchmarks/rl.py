"""Online RL and generation with streamed layers: how fast a streamed model decodes and
how long a GRPO step takes, against the same work resident, and against the copy bound.

Three parts, each one command of under ten minutes on one H200 (``--deadline`` stops a
part in time to write what it measured):

    python benchmarks/rl.py --part generate --work /tmp/rl
    python benchmarks/rl.py --part grpo-8b --round 1 --work /tmp/rl --merge benchmarks/results/rl.json
    python benchmarks/rl.py --part grpo-8b --round 2 --work /tmp/rl --merge benchmarks/results/rl.json
    python benchmarks/rl.py --part grpo-8b --grpo-quantization bf16 --round 1 --work /tmp/rl ...
    python benchmarks/rl.py --part grpo-8b --grpo-trainer rloo --round 1 --work /tmp/rl ...
    python benchmarks/rl.py --part grpo-8b --full-determinism --round 1 ...  # adapters comparable
    python benchmarks/rl.py --part grpo-8b --profile-grpo DIR ...  # a steady step's host time
    python benchmarks/rl.py --part grpo-8b --trace-decode DIR ...  # 16 token steps, decode_trace.py
    python benchmarks/rl.py --part grpo-8b --grpo-cap whole ...  # streamed uncapped: the cap's cost
    python benchmarks/rl.py --rows-only --merge A.json --merge B.json --out DIR  # rows again
    python benchmarks/rl.py --part grpo-70b --work /tmp/rl --merge benchmarks/results/rl.json
    python benchmarks/rl.py --dry-run --work /tmp/rl-dry     # every part, tiny, on the CPU

On the GPU run one part per command: after the generation part this process keeps a CUDA
context, which would sit beside the GRPO runs of ``--part all``.

``generate``: ``model.generate`` (greedy, KV cache) on random weights at Llama-3.1-8B's shape
in NF4 (``common.build_random_nf4``), batch 8 and 64, 128 random prompt tokens, 128 new
tokens (``rl_generate.py``). One process holds the
bitsandbytes model resident and the same weights streamed (``stream_model``), and times them
in alternated rounds: streamed with the whole GPU, its window as the runtime leaves it and
with every layer set in it by hand (``set_window``); then the streamed model again under an
8 GiB cap (``set_per_process_memory_fraction``). A call with one new token (the prefill)
is timed beside each, so a token step of decoding is (full - prefill) / (new tokens - 1);
its copy bound is the planner's decode term (``plan.decode.decode_term``, what ``layerstream
plan`` prints) over the layers outside the resident window, at the host-to-device bandwidth
measured in the same process (``--tflops T`` adds its compute-bound batch); the layer loads
the runtime counted per token step are kept beside it.

``grpo-8b``: TRL's ``trl.scripts.grpo``, unchanged, on a random-weight Llama-3.1-8B checkpoint
written to disk (``checkpoints.py``), ``--load_in_4bit`` QLoRA (or, ``--grpo-quantization bf16``,
LoRA on the 16 GB bf16 checkpoint, larger than the cap; ``--grpo-trainer rloo``: TRL's rloo.py),
8 generations of 256 tokens per prompt: resident with the whole GPU (``python -m``) and
streamed under a 12 GiB cap (``layerstream run -m``), each in a fresh process under ``capped.py``, which times each step
and each ``generate`` call and keeps the Trainer's logs (layerstream's ``generate_*`` figures
among them). A round is one resident and one streamed run, resident first in odd rounds and
streamed first in even ones (``side_order``); the pair's speed is ``zero_edit.compare``'s,
over the rounds measured so far.

``grpo-70b``: ``grpo_client.py`` (GRPOTrainer on a model built in memory: a 70B-shaped
checkpoint does not fit the GPU machine's disk) under ``layerstream run`` and a 24 GiB cap,
8 generations of 128 tokens, three steps, streamed only: step times and where they go, from
layerstream's logged figures. Rows: ``rl_rows.py``.

``benchmarks/results/rl.json`` ($OUT/rl.json on the GPU machine) keeps every run measured
and the rows made from them (``rl/logs/`` beside it: the end of each GRPO run's log).
``--merge FILE`` carries the runs of an earlier command (a run measured again replaces its
earlier one), so the parts can run as separate commands.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import decode_trace  # noqa: E402  (the harness runs as a script)

from rl_rows import DEFAULT_GRPO_CAP, WHOLE, rows, summary  # noqa: E402

MODELS = {"llama3-8b": "llama-3.1-8b", "llama3-70b": "llama-3.1-70b", "tiny": "tiny"}  # configs/shapes names
TINY = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
PARTS = ("generate", "grpo-8b", "grpo-70b")
MIN_RUN_S = 60  # a GRPO run given less than this before --deadline is not started


@dataclass
class Settings:
    """What the parts measure; ``--dry-run`` shrinks it to a tiny model on the CPU."""

    shape: str = "llama3-8b"
    batches: tuple = (8, 64)
    new_tokens: int = 128
    prompt_tokens: int = 128
    generate_caps: tuple = ("8GiB",)
    rounds: int = 3  # of the generation part (the GRPO pair's are separate commands)
    slots: object = "auto"
    grpo_shape: str = "llama3-8b"
    # the streamed side's (``--grpo-cap``; "whole": no cap, to tell the cap's cost apart)
    grpo_cap: str = DEFAULT_GRPO_CAP
    grpo_quantization: str = "nf4"  # or "bf16": LoRA on the bf16 checkpoint, larger than the cap
    grpo_trainer: str = "grpo"  # or "rloo": TRL's rloo.py, the same arguments
    generations: int = 8
    completion_tokens: int = 256
    # the resident run, then the streamed one, in one ten-minute command: 5 steps of 256 tokens
    grpo_steps: int = 5
    # both runs with the script's own --full_determinism (deterministic kernels): without it
    # attention's backward may differ between two runs of the same script, and so the adapters
    full_determinism: bool = False
    profile_grpo: str = ""  # grpo-8b: a folder for each run's profile of steady steps (``--profile-grpo``)
    trace_decode: str = ""  # grpo-8b: a folder for each run's decode trace; START,COUNT forwards:
    trace_decode_steps: str = f"{decode_trace.START},{decode_trace.COUNT}"
    big_shape: str = "llama3-70b"
    big_cap: str = "24GiB"
    # under 24 GiB a 70B token step copies most of its 80 NF4 layers, so a step's generation
    # takes about its tokens times that copy: 128 tokens leave room for the load and three
    # steps in one ten-minute command (--big-completion-tokens changes it)
    big_completion_tokens: int = 128
    big_steps: int = 3
    dry_run: bool = False
    whole_gpu: bool = True  # generate: the whole-GPU rounds before the caps (``--capped-only``: not)
    profile: str = ""  # generate: a folder for one profiled call per capped batch (``--profile-generate``)
    extra: list = field(default_factory=list)  # arguments every GRPO run gets (--use_cpu)

    @property
    def model(self) -> str:
        return MODELS[self.shape]


def dry_settings() -> Settings:
    return Settings(
        shape="tiny",
        batches=(2, 4),
        new_tokens=8,
        prompt_tokens=8,
        rounds=1,
        slots=2,
        grpo_shape="tiny",
        generations=2,
        completion_tokens=8,
        grpo_steps=3,
        big_shape="tiny",
        big_completion_tokens=8,
        big_steps=2,
        dry_run=True,
        extra=["--use_cpu"],
    )


def shape_values(name: str) -> dict:
    from common import SHAPES

    return dict(TINY) if name == "tiny" else dict(SHAPES[name])


def mean_layer_bytes(shape: str, quantization: str = "nf4") -> float:
    """A decoder layer's bytes as the planner counts them (what a streamed copy moves)."""
    from layerstream.plan import layer_bytes

    from common import shape_config

    sizes = layer_bytes(shape_config(shape_values(shape)), "nf4" if quantization == "nf4" else "none")
    return sum(sizes) / len(sizes)


# -- GRPO, in fresh processes under capped.py -----------------------------------------------


def write_prompts(work: Path) -> Path:
    """The prompts as TRL's scripts read them (``--dataset_name DIR``: DIR/train.jsonl)."""
    from layerstream import data as embedded

    rows = [json.loads(line) for line in embedded.data_path().read_text().splitlines() if line.strip()]
    folder = work / "data-prompt"
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": f"Q: {row['instruction']}\nA:"}) + "\n" for row in rows]
    (folder / "train.jsonl").write_text("".join(lines))
    return folder


def write_checkpoint(work: Path, shape: str) -> Path:
    """A random-weight checkpoint of ``shape`` as a hub download leaves it (``checkpoints.py``)."""
    import checkpoints

    checkpoints.SHAPES["tiny"] = dict(TINY)
    target = work / shape
    if not (target / "model.safetensors.index.json").exists():
        start = time.perf_counter()
        checkpoints.write(shape, target)
        print(f"wrote {shape} in {time.perf_counter() - start:.1f} s", flush=True)
    return target


def script_command(checkpoint: Path, data: Path, settings: Settings, out: Path, streamed: bool) -> list:
    """TRL's grpo script as a user runs it, resident (``python -m``) or behind ``layerstream run``."""
    script = f"trl.scripts.{settings.grpo_trainer}"
    args = ["-m", script, "--model_name_or_path", str(checkpoint), "--dataset_name", str(data)]
    args += ["--output_dir", str(out), "--max_steps", str(settings.grpo_steps), "--logging_steps", "1"]
    args += ["--save_strategy", "steps", "--save_steps", str(settings.grpo_steps), "--report_to", "none"]
    args += ["--use_peft", "--lora_r", "16", "--lora_target_modules", "all-linear"]
    if settings.grpo_quantization == "nf4":
        args += ["--load_in_4bit", "--use_bnb_nested_quant", "true"]
    args += ["--dtype", "bfloat16", "--seed", "0", "--use_vllm", "false"]
    args += ["--bf16", "false" if settings.dry_run else "true"]
    args += ["--per_device_train_batch_size", str(settings.generations), "--num_generations", str(settings.generations)]
    args += ["--max_completion_length", str(settings.completion_tokens), "--reward_funcs", "grpo_client.variety_reward"]
    if settings.full_determinism:
        args += ["--full_determinism", "true"]
    return (["layerstream", "run"] if streamed else [sys.executable]) + args + settings.extra


def client_command(work: Path, data: Path, settings: Settings, out: Path) -> list:
    """grpo_client.py (GRPOTrainer on a model built in memory) behind ``layerstream run``."""
    shape = settings.big_shape
    if shape == "tiny":
        shape = str(work / "tiny.json")
        Path(shape).write_text(json.dumps(TINY))
    args = [str(HERE / "grpo_client.py"), "--shape", shape, "--data", str(data), "--output_dir", str(out)]
    args += ["--steps", str(settings.big_steps), "--generations", str(settings.generations)]
    args += ["--completion-tokens", str(settings.big_completion_tokens)]
    return ["layerstream", "run"] + args + settings.extra


def adapter_digest(output_dir: Path):
    """The adapter a run saved last (its highest ``checkpoint-N``): the step and a SHA-256 of
    every tensor's name, dtype, shape and bytes, so two runs' adapters compare bit for bit
    without keeping them; None when the run saved none (it stopped before saving)."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    saved = [
        (int(folder.name.split("-")[-1]), folder / "adapter_model.safetensors")
        for folder in output_dir.glob("checkpoint-*")
        if folder.name.split("-")[-1].isdigit() and (folder / "adapter_model.safetensors").exists()
    ]
    if not saved:
        return None
    step, path = max(saved)
    tensors = load_file(str(path))
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {"step": step, "sha256": digest.hexdigest(), "tensors": len(tensors)}


def _text(part) -> str:
    return part.decode(errors="replace") if isinstance(part, bytes) else part or ""


def run_capped(
    name: str, cap: str, target: list, work: Path, out: Path, timeout: float, dry_run: bool, profile: list = ()
) -> dict:
    """``target`` under ``capped.py`` in a fresh process (``profile``: its profiler's arguments):
    its step and generate times and its logs; stopped after ``timeout`` seconds (what it wrote
    by then is kept)."""
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    times = runs / f"{name}-times.json"
    times.unlink(missing_ok=True)
    argv = [sys.executable, str(HERE / "capped.py"), "--cap", cap, "--times", str(times), *profile, "--", *target]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    env.setdefault("HF_HUB_OFFLINE", "1")  # everything is on disk; the GPU machine reaches no hub
    env["PYTHONUNBUFFERED"] = "1"  # a run the deadline stops keeps the steps it logged
    if dry_run:  # OpenMP's spinning workers and the copy thread share the CPU badly
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=max(timeout, 1))
        returncode, log, timed_out = done.returncode, done.stdout + done.stderr, False
    except subprocess.TimeoutExpired as expired:
        returncode, log, timed_out = None, _text(expired.stdout) + _text(expired.stderr), True
    (runs / f"{name}.log").write_text(log)
    (out / "rl" / "logs").mkdir(parents=True, exist_ok=True)
    (out / "rl" / "logs" / f"{name}.log").write_text(log[-6000:])
    timing = json.loads(times.read_text()) if times.exists() else {}
    logs = [entry for entry in timing.get("logs", []) if "loss" in entry]
    figures = sorted({key for entry in logs for key in entry if key.startswith("layerstream/")})
    return {
        "name": name,
        "cap": cap,
        "returncode": returncode,
        "timed_out": timed_out,
        "out_of_memory": "out of memory" in log.lower(),
        "wall_s": round(time.perf_counter() - start, 1),
        "step_s": timing.get("step_s", []),
        "generate_s": timing.get("generate_s", []),
        "losses": [entry["loss"] for entry in logs],
        "grad_norms": [entry.get("grad_norm") for entry in logs],
        "completion_lengths": [entry.get("completions/max_length") for entry in logs],
        "layerstream": {key: [entry.get(key) for entry in logs] for key in figures},
        "peak_allocated_gib": timing.get("peak_allocated_gib"),
        "peak_reserved_gib": timing.get("peak_reserved_gib"),
        "alloc_retries": timing.get("alloc_retries"),
        "gpu": timing.get("gpu"),
        "command": shlex.join(argv),
    }


SIDES = ("resident", "streamed")


def side_order(round_index: int) -> tuple:
    """The order of a round's two runs: resident first in odd rounds, streamed first in even
    ones. The host's speed drifts between processes (by up to 2x within seconds, LOG.md), and
    a host-bound step such as decoding follows it: with one fixed order, a drift over the
    minutes of a round would fall on one side every time."""
    return SIDES if round_index % 2 else tuple(reversed(SIDES))


def measure_grpo_pair(settings: Settings, args, command: str, save, deadline: float) -> None:
    """One round: TRL's script resident with the whole GPU and streamed under the cap, in
    ``side_order`` (``--sides``: one of them, the other's run of this round kept from
    ``--merge``)."""
    work = Path(args.work)
    data, checkpoint = write_prompts(work), write_checkpoint(work, settings.grpo_shape)
    for side in (side for side in side_order(args.round) if side in args.sides.split(",")):
        if deadline - time.monotonic() < MIN_RUN_S:
            print(f"rl: under {MIN_RUN_S} s left of --deadline: the rest of round {args.round} is not run", flush=True)
            return
        variant = "" if settings.grpo_quantization == "nf4" else f"-{settings.grpo_quantization}"
        variant += "-deterministic" if settings.full_determinism else ""
        variant += "" if settings.grpo_cap == DEFAULT_GRPO_CAP else f"-cap-{settings.grpo_cap}"
        streamed = side == "streamed"
        name = f"{settings.grpo_trainer}-{settings.grpo_shape}{variant}-{side}-round{args.round}"
        shutil.rmtree(work / "runs" / name, ignore_errors=True)  # no adapter left by an earlier run
        target = script_command(checkpoint, data, settings, work / "runs" / name, streamed)
        if settings.trace_decode:  # nor a trace of an earlier run of this name
            shutil.rmtree(Path(settings.trace_decode) / name, ignore_errors=True)
        cap = settings.grpo_cap if streamed else WHOLE
        profile = profile_arguments(settings, name)
        run = run_capped(
            name, cap, target, work, Path(args.out), deadline - time.monotonic(), settings.dry_run, profile
        )
        used = {"generations": settings.generations, "completion_tokens": settings.completion_tokens}
        used["full_determinism"] = settings.full_determinism
        used["streamed_cap"] = settings.grpo_cap  # on both sides: the resident run pairs with this cap's
        run.update(kind="grpo-pair", model=MODELS[settings.grpo_shape], streamed=streamed, round=args.round)
        run.update(ran_first=side == side_order(args.round)[0])
        run.update(quantization=settings.grpo_quantization, trainer=settings.grpo_trainer)
        run.update(layer_bytes=mean_layer_bytes(settings.grpo_shape, settings.grpo_quantization))
        run.update(adapter=adapter_digest(work / "runs" / name))
        if settings.trace_decode:
            run.update(decode_trace=decode_trace.summary_of(Path(settings.trace_decode) / name))
        save([dict(run, settings_used=dict(used, steps=settings.grpo_steps), rl_command=command)])


def profile_arguments(settings: Settings, name: str) -> list:
    """``--trace-decode``: torch's profiler over a few token steps of the second step's
    generation (decode_trace.py). ``--profile-grpo``: Python's profiler on one steady step
    (from the third, as the rows time, where the run has steps enough); not torch's, whose
    summary of a GRPO step's hundreds of decode steps outlasted a command's deadline."""
    arguments = []
    if settings.trace_decode:  # the second step's generation: sized window, not timed by the rows
        arguments += ["--trace-decode", str(Path(settings.trace_decode) / name), "--trace-decode-steps"]
        arguments.append(settings.trace_decode_steps)
    if not settings.profile_grpo:
        return arguments
    first = max(0, min(2, settings.grpo_steps - 3))
    return arguments + ["--profile", str(Path(settings.profile_grpo) / name), "--profile-steps", f"{first},1,0"]


def measure_grpo_big(settings: Settings, args, command: str, save, deadline: float) -> None:
    """GRPOTrainer on the large shape under its cap, streamed only."""
    work = Path(args.work)
    name = f"grpo-{settings.big_shape}-streamed"
    target = client_command(work, write_prompts(work), settings, work / "runs" / name)
    run = run_capped(
        name, settings.big_cap, target, work, Path(args.out), deadline - time.monotonic(), settings.dry_run
    )
    used = {"generations": settings.generations, "completion_tokens": settings.big_completion_tokens}
    run.update(kind="grpo-big", model=MODELS[settings.big_shape], streamed=True)
    run.update(layer_bytes=mean_layer_bytes(settings.big_shape))
    save([dict(run, settings_used=dict(used, steps=settings.big_steps), rl_command=command)])


# -- rl.json: the runs of this and earlier commands, and the rows made from them -----------


class Results:
    """The runs measured so far, by name (an earlier command's, from ``--merge`` files and
    an rl.json already in the output folder), written with their rows after each ``add``."""

    def __init__(self, out: Path, merge: list, own: bool = True):
        self.out = out
        self.runs: dict = {}
        self.machine = None  # the last merged file's machine (``--rows-only`` keeps it)
        for path in [*merge, out / "rl.json"] if own else merge:  # own: the output folder's rl.json too
            if Path(path).exists():
                loaded = json.loads(Path(path).read_text())
                for run in loaded.get("runs", []):
                    self.keep(run)
                self.machine = loaded.get("machine", self.machine)

    def keep(self, run: dict) -> None:
        """Keep ``run`` (a run of its name from another card stays under the card's name)."""
        from common import keep_by_card

        keep_by_card(self.runs, run)

    def add(self, runs: list) -> None:
        from common import write_result

        for run in runs:
            self.keep(run)
        measured = list(self.runs.values())
        write_result("rl", {"rows": rows(measured), "runs": measured}, out_dir=str(self.out))

    def write_rows_only(self) -> None:
        """rl.json again from the merged runs, their rows made anew, nothing measured: the
        machine stays the one the runs were measured on (the last merged file's)."""
        from common import write_result

        measured = list(self.runs.values())
        write_result("rl", {"rows": rows(measured), "runs": measured}, str(self.out), self.machine)


def parse(argv):
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", *PARTS), default="all")
    parser.add_argument("--work", default="/tmp/rl", help="checkpoints, prompts, each run's output and full log")
    parser.add_argument(
        "--out", default=None, help="rl.json and the runs' log tails (default $OUT, else benchmarks/results)"
    )
    parser.add_argument(
        "--merge", action="append", default=[], help="an earlier rl.json: its runs are kept unless run again"
    )
    parser.add_argument("--round", type=int, default=1, help="grpo-8b: the alternated round this command runs")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help="grpo-8b: the runs of the round to measure, resident,streamed (one, where the other's "
        "run of this round is in a --merge file: a side a deadline stopped)",
    )
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="generate: timed rounds after a warm-up")
    parser.add_argument("--batches", default=",".join(map(str, defaults.batches)), help="generate: batch sizes")
    parser.add_argument("--caps", default=",".join(defaults.generate_caps), help="generate: caps after the whole GPU")
    parser.add_argument("--grpo-steps", type=int, default=defaults.grpo_steps)
    parser.add_argument(
        "--grpo-trainer",
        choices=("grpo", "rloo"),
        default=defaults.grpo_trainer,
        help="grpo-8b: TRL's grpo.py, or its rloo.py with the same arguments",
    )
    parser.add_argument(
        "--grpo-quantization",
        choices=("nf4", "bf16"),
        default=defaults.grpo_quantization,
        help="grpo-8b: QLoRA (--load_in_4bit) or LoRA on the bf16 checkpoint (16 GB: larger than the cap)",
    )
    parser.add_argument(
        "--grpo-cap",
        default=DEFAULT_GRPO_CAP,
        help=f"grpo-8b: the streamed run's cap (default {DEFAULT_GRPO_CAP}; {WHOLE}: the whole GPU, as the resident "
        "run has, to tell what the cap costs from what streaming costs)",
    )
    parser.add_argument(
        "--full-determinism",
        action="store_true",
        help="grpo-8b: both runs get the script's own --full_determinism (deterministic kernels), so "
        "two runs can save the same adapter bit for bit",
    )
    parser.add_argument(
        "--profile-grpo",
        default=None,
        metavar="DIR",
        help="grpo-8b: profile one steady step of each run (Python's profiler) into DIR/<run>: "
        "where a step's host time goes, resident against streamed",
    )
    parser.add_argument("--trace-decode", default=None, metavar="DIR", help="grpo-8b: see decode_trace.py")
    parser.add_argument("--big-steps", type=int, default=defaults.big_steps)
    parser.add_argument("--big-completion-tokens", type=int, default=defaults.big_completion_tokens)
    parser.add_argument("--tflops", type=float, default=None, help="the decode term's compute-bound batch at this rate")
    parser.add_argument(
        "--profile-generate",
        default=None,
        metavar="DIR",
        help="generate: after each capped batch's rounds, one call of 16 tokens under torch's profiler "
        "(a Chrome trace and a kernel table in DIR): where a streamed token step's time goes",
    )
    parser.add_argument(
        "--capped-only",
        action="store_true",
        help="generate: only the streamed model under --caps, with nothing else on the GPU (no resident rounds)",
    )
    parser.add_argument(
        "--rows-only",
        action="store_true",
        help="measure nothing: rl.json from the --merge files' runs, the rows made anew (on any machine)",
    )
    parser.add_argument("--deadline", type=float, default=570, help="seconds this command may take, writing included")
    parser.add_argument(
        "--dry-run", action="store_true", help="every part on a tiny model on the CPU (the harness only)"
    )
    args = parser.parse_args(argv)
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown:
        parser.error(f"--sides {args.sides}: {', '.join(sorted(unknown))} is not one of {', '.join(SIDES)}")
    return args


def settings_from(args) -> Settings:
    if args.dry_run:
        settings = dry_settings()
        settings.profile = args.profile_generate or ""
        settings.whole_gpu = not args.capped_only
        settings.grpo_quantization = args.grpo_quantization
        settings.grpo_trainer = args.grpo_trainer
        settings.full_determinism = args.full_determinism
        settings.profile_grpo = args.profile_grpo or ""
        settings.trace_decode = args.trace_decode or ""
        settings.trace_decode_steps = "2,3"  # of the dry run's 8 completion tokens
        settings.grpo_cap = args.grpo_cap
        return settings
    return Settings(
        profile=args.profile_generate or "",
        whole_gpu=not args.capped_only,
        batches=tuple(int(b) for b in args.batches.split(",")),
        generate_caps=tuple(args.caps.split(",")) if args.caps else (),
        rounds=args.rounds,
        grpo_steps=args.grpo_steps,
        grpo_quantization=args.grpo_quantization,
        grpo_trainer=args.grpo_trainer,
        full_determinism=args.full_determinism,
        profile_grpo=args.profile_grpo or "",
        trace_decode=args.trace_decode or "",
        grpo_cap=args.grpo_cap,
        big_steps=args.big_steps,
        big_completion_tokens=args.big_completion_tokens,
    )


def output_folder(args) -> Path:
    """$OUT or --out; the dry run never writes into benchmarks/results."""
    results = HERE / "results"
    if args.dry_run:
        out = Path(args.out or os.environ.get("OUT") or Path(args.work) / "out")
        if out.resolve() == results.resolve():
            raise SystemExit("rl: a dry run's rows are not results: give --out elsewhere")
        return out
    return Path(args.out or os.environ.get("OUT") or results)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    deadline = time.monotonic() + args.deadline
    settings = settings_from(args)
    args.out = str(output_folder(args))
    Path(args.work).mkdir(parents=True, exist_ok=True)
    results = Results(Path(args.out), args.merge, own=not args.rows_only)  # --rows-only: the merged runs alone
    if args.rows_only:
        results.write_rows_only()
        print(summary(rows(list(results.runs.values()))))
        return 0
    command = shlex.join(["python", "benchmarks/rl.py", *argv])
    for part in PARTS if args.part == "all" else (args.part,):
        print(f"rl: {part}", flush=True)
        if part == "generate":
            measure_generate_part(settings, args, command, results.add, deadline)
        elif part == "grpo-8b":
            measure_grpo_pair(settings, args, command, results.add, deadline)
        else:
            measure_grpo_big(settings, args, command, results.add, deadline)
    print(summary(rows(list(results.runs.values()))))
    return 0


def measure_generate_part(settings: Settings, args, command: str, save, deadline: float) -> None:
    import torch

    from rl_generate import measure_generation

    if settings.dry_run:
        torch.set_num_threads(1)  # as the GRPO runs' OMP_NUM_THREADS=1: the copy thread shares the CPU
    measure_generation(settings, shape_values(settings.shape), args.tflops, command, save, deadline)


if __name__ == "__main__":
    sys.exit(main())
