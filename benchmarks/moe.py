"""Mixture-of-experts models larger than the GPU: QLoRA steps and decoding, streamed.

Random weights at the real shapes (configs/shapes), on one GPU capped with
``torch.cuda.set_per_process_memory_fraction``:

- ``qwen3-30b-a3b``: QLoRA (NF4), 2048 tokens, under 8 GiB, through TRL's SFTTrainer,
  against the resident SFTTrainer step of the same model in the same process; then
  decoding at batch 1 and 8, milliseconds per token step against the copy bound of the
  experts actually routed.
- ``gpt-oss-20b``: QLoRA under 8 GiB through TRL's ``sft.py``, unchanged, behind
  ``layerstream run``, on a checkpoint written as gpt-oss is published (experts in MXFP4),
  against the same script run plainly on the whole GPU; transformers refuses
  ``--load_in_4bit`` on an MXFP4 checkpoint, so the plain run is bf16 (transformers
  dequantises the experts), which the row says (``resident_quantization``).
- ``gpt-oss-120b``: QLoRA under 24 GiB, its experts in MXFP4 as published, every layer,
  against the resident step (the same packed model unstreamed) and the copy bound.

Under NF4, bitsandbytes packs the nn.Linear weights (attention) and leaves the fused expert
stacks in bf16, as transformers' own 4-bit load does: the host store is most of the bf16
checkpoint. gpt-oss's experts stay in MXFP4, as layerstream's loader keeps them
(``modules.packed_experts``), dequantised by each experts call. LoRA adapts the attention projections: PEFT's "all-linear" on these families
also adapts the fused experts (about 1B LoRA parameters for Qwen3-30B-A3B), which no
8 GiB budget holds. gpt-oss runs transformers' eager attention (it has no SDPA path for the
attention sinks), in both routes, as TRL's script gets it.

Size arithmetic (``--sizes`` prints it, no GPU needed; ``case_sizes``): a case runs the
user's own command (``layerstream run -m trl.scripts.sft ... --load_in_4bit``) on a
checkpoint written to disk when its checkpoint (bf16; gpt-oss in MXFP4) takes at most ``CHECKPOINT_DISK_SHARE``
of the machine's disk and its whole store fits ``STORE_RAM_SHARE`` of the host RAM;
otherwise the model is built in host memory as transformers' 4-bit load leaves it
(``common.build_random_nf4``), with as many of its layers as the host RAM holds, and trained
in this process by TRL's SFTTrainer (``moe_measure.sft_steps``: batch 1, rows of exactly
``tokens`` token ids), streamed under the cap, then resident from the same adapters on the
same rows. Both routes train as users do, through SFTTrainer's fused log-prob head
(``TRL_LOSS``): it computes the loss in tiles, where the model's own loss holds the full
fp32 logits (2048 tokens x 151,936 vocabulary, about 3.5 GiB with autograd's copies: the
planner puts Qwen3-30B-A3B's streamed step over 8 GiB with them, under it with TRL's head),
and the streamed and resident steps of each ratio compute the same loss. bf16 Qwen3-30B-A3B is 61 GB (56.9 GiB) on a 64 GiB disk that
also holds the system: built in memory (NF4 checkpoints are not what users load: the
loader quantises bf16 ones). gpt-oss-20b's MXFP4 checkpoint is 13.8 GB: written.
gpt-oss-120b's is 65.3 GB, more than the disk's share, and its packed store 57.3 GiB: every
layer, built in memory.

Bounds: the copy bound of a step is the bytes it copied over the pinned host-to-device
bandwidth measured in the same run; the decode bounds are the planner's (every streamed
layer copied whole, ``plan.decode.decode_term``) and the by-need one (each copied layer's
non-expert bytes plus the experts its router chose that step, seen by a hook before each
experts call). ``experts_copied`` and ``expert_visits`` come from ``runtime.stats()`` where
layerstream counts them, else null.

    python benchmarks/moe.py --sizes
    python benchmarks/moe.py --case qwen3-30b-a3b --base benchmarks/results/moe.json   # $OUT/moe.json
    python benchmarks/moe.py --case gpt-oss-20b --work /tmp/moe
    python benchmarks/moe.py --case gpt-oss-120b
    python benchmarks/moe.py --dry-run --work /tmp/moe-dry --out /tmp/moe-dry/moe.json  # tiny, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from moe_cases import (  # noqa: E402
    CASES,
    LORA_ALPHA,
    LORA_DROPOUT,
    LORA_R,
    LORA_TARGETS,
    PROFILED_STEPS,
    TARGET_VS_RESIDENT,
    TINY_CASES,
    TINY_SHAPES,
    TRL_LOSS,
    WHOLE_GPU,
    Case,
    Session,
    case_sizes,
)
from moe_measure import (  # noqa: E402
    RoutedExperts,
    by_need_bound_s,
    counter_delta,
    decode_steps,
    failed,
    finish,
    host_to_device_gbps,
    load_trainable,
    per_visit,
    sft_steps,
    streamed_layer_bytes,
    token_rows,
    trainable_state,
)

from common import SHAPES, build_random_nf4, cap_gpu, commit, machine, shape_config  # noqa: E402


# -- the Python API route ------------------------------------------------------------------
def build_model(values: dict, layers: int, device: str):
    """The NF4 model as transformers' 4-bit load leaves it, LoRA on the attention, and the
    routing hooks (gpt-oss has no SDPA attention: eager, as transformers picks for it)."""
    from peft import LoraConfig, get_peft_model

    from layerstream.modules.discovery import find_decoder_layers

    attn = "eager" if values["model_type"] == "gpt_oss" else "sdpa"
    model = build_random_nf4(values, layers=layers, attn=attn)
    routing = RoutedExperts(find_decoder_layers(model)[1])
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, target_modules=list(LORA_TARGETS))
    return get_peft_model(model, lora), routing


def streamed_train_row(model, runtime, routing, case: Case, data, common: dict, gbps: float, out: str) -> dict:
    row = dict(common, kind="train", tokens=case.tokens, batch=1, loss=TRL_LOSS)
    warm = {}

    def at_timed_steps():  # the counters and the routing of the timed steps only
        warm.update(runtime.stats())
        routing.reset()

    try:
        times, losses, peak = sft_steps(model, data, case, common["device"], out, at_timed_steps)
    except Exception as error:  # noqa: BLE001  (the row says why)
        return failed(row, error)
    after = runtime.stats()
    visits = counter_delta(warm, after, "expert_visits")
    copied = counter_delta(warm, after, "experts_copied")
    bytes_per_step = (after["h2d_bytes"] - warm["h2d_bytes"]) / case.steps
    row.update(step_s=statistics.median(times), step_s_all=times, losses=losses, **peak)
    row.update(trained=all(math.isfinite(x) for x in losses), out_of_memory=False)
    row.update(bytes_per_step=bytes_per_step, copy_bound_s=bytes_per_step / (gbps * 1e9))
    row.update(window_layers=after["window_layers"], routed_expert_share=routing.share())
    row.update(experts_copied=copied, expert_visits=visits, experts_copied_per_visit=per_visit(copied, visits))
    return row


def streamed_decode_row(model, runtime, routing, vocab: int, case: Case, batch: int, common: dict, gbps: float) -> dict:
    from layerstream.plan.decode import decode_term

    row = dict(common, kind="decode", batch=batch, prompt_tokens=case.prompt_tokens, new_tokens=case.new_tokens)
    prefilled = {}  # the counters once the prompt's step is done: the rows count token steps only
    routing.reset()
    try:
        steps, peak = decode_steps(
            model,
            batch,
            case.prompt_tokens,
            case.new_tokens,
            common["device"],
            vocab,
            lambda: prefilled.update(runtime.stats()),
        )
    except Exception as error:  # noqa: BLE001
        return failed(row, error)
    after = runtime.stats()
    streamed = streamed_layer_bytes(runtime)
    whole = decode_term(list(streamed.values()), after["slots"], gbps, 0).copy_seconds
    chosen = [n for counts in routing.distinct(skip_first=True).values() for n in counts]
    visits = counter_delta(prefilled, after, "expert_visits")
    copied = counter_delta(prefilled, after, "experts_copied")
    row.update(decode_ms=statistics.median(steps[2:] or steps) * 1e3, decode_ms_all=[s * 1e3 for s in steps], **peak)
    row.update(copy_bound_ms=whole * 1e3)
    row.update(by_need_copy_bound_ms=by_need_bound_s(routing, streamed, after["slots"], gbps) * 1e3)
    row.update(bytes_per_token_step=(after["h2d_bytes"] - prefilled["h2d_bytes"]) / len(steps))
    row.update(routed_experts_per_layer=statistics.mean(chosen) if chosen else None)
    row.update(experts_per_layer=max((count for count, _ in routing.experts.values()), default=None))
    row.update(experts_copied=copied, expert_visits=visits, experts_copied_per_visit=per_visit(copied, visits))
    row.update(window_layers=after["window_layers"])
    return row


def run_api(case: Case, values: dict, sizes: dict, session: Session) -> list:
    """Build once; streamed training (and decoding) under the cap; then the same model
    resident on the whole GPU where its layers fit."""
    import layerstream
    from layerstream.units import parse_bytes

    args, device, gbps = session.args, session.device, session.gbps
    layers = sizes["layers_measured"]
    model, routing = build_model(values, layers, device)
    vocab = values["vocab_size"]
    data, adapters = token_rows(case.warmup + case.steps, case.tokens, vocab), trainable_state(model)
    if device == "cuda":  # the cap counts what the allocator keeps: the build's blocks go back first
        torch.cuda.empty_cache()
        cap_gpu(parse_bytes(case.cap))
    layerstream.stream_model(model, device=device)
    model.to(device)
    runtime = layerstream.get_runtime(model)
    common = dict(case=case.name, model=case.shape, quantization="nf4", cap=case.cap, route="api", layers=layers)
    common.update(layers_of_model=sizes["layers_of_model"], command=session.command, sizes=sizes, h2d_gbps=gbps)
    common.update(device=device)
    out = str(Path(args.work) / f"{case.name}-api")
    rows = [streamed_train_row(model, runtime, routing, case, data, common, gbps, out + "-streamed")]
    rows += [streamed_decode_row(model, runtime, routing, vocab, case, b, common, gbps) for b in case.decode_batches]
    session.keep(rows)
    if not args.no_resident and sizes["resident_fits_gpu_measured"]:
        add_resident_api(model, rows, case, (data, adapters), device, vocab, out + "-resident")
    del model, runtime
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_resident_api(model, rows: list, case: Case, start: tuple, device: str, vocab: int, out: str) -> None:
    """The same model, unstreamed onto the whole GPU, its adapters back as the streamed run
    began (``start``: the rows and the adapters): its SFTTrainer steps (gradient checkpointing
    on, as SFTConfig's default has it) and token steps."""
    import layerstream

    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0)
    layerstream.unstream_model(model, device=device)
    data, adapters = start
    load_trainable(model, adapters)
    try:
        times, losses, peak = sft_steps(model, data, case, device, out)
    except Exception as error:  # noqa: BLE001
        times, losses, peak = [], [], {"peak_allocated_gib": None}
        rows[0]["resident_error"] = f"{type(error).__name__}: {error}"[:2000]
    model.gradient_checkpointing_disable()
    for row in rows:
        if row["kind"] == "train":
            row.update(resident_step_s=statistics.median(times) if times else None, resident_step_s_all=times)
            row.update(resident_losses=losses, resident_peak_allocated_gib=peak["peak_allocated_gib"])
            row.update(target_vs_resident=TARGET_VS_RESIDENT)
        else:
            try:
                steps, peak = decode_steps(model, row["batch"], case.prompt_tokens, case.new_tokens, device, vocab)
            except Exception as error:  # noqa: BLE001
                row["resident_error"] = f"{type(error).__name__}: {error}"[:2000]
                continue
            row.update(resident_decode_ms=statistics.median(steps[2:] or steps) * 1e3)
            row.update(resident_peak_allocated_gib=peak["peak_allocated_gib"])


# -- TRL's script, unchanged, behind `layerstream run` -------------------------------------
def require_free(directory: Path, needed: int) -> None:
    import shutil

    free = shutil.disk_usage(directory).free
    if needed > free:
        raise SystemExit(
            f"{directory}: the checkpoint needs {needed / 1e9:.1f} GB and the disk has {free / 1e9:.1f} GB free: "
            "remove an earlier case's checkpoint there, pass another --work, or --route api"
        )


def write_inputs(case: Case, values: dict, work: Path, sizes: dict) -> tuple:
    """The checkpoint (bf16, gpt-oss in MXFP4; written once, as a hub download leaves it) and SFT text rows."""
    from layerstream import data as embedded

    import checkpoints

    checkpoint = work / case.shape
    if not (checkpoint / "model.safetensors.index.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        require_free(work, int(sizes["checkpoint_gb"] * 1e9 * 1.02))
        SHAPES.setdefault(case.shape, values)
        start = time.perf_counter()
        checkpoints.write(case.shape, checkpoint)
        print(f"moe: wrote {checkpoint} in {time.perf_counter() - start:.0f} s", flush=True)
    rows = [json.loads(line) for line in embedded.data_path().read_text().splitlines() if line.strip()]
    data = work / "data-sft"
    data.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"text": f"Q: {r['instruction']}\nA: {r['response']}"}) + "\n" for r in rows)
    (data / "train.jsonl").write_text(text * 8)  # about 50 packed sequences of 2048 tokens
    return checkpoint, data


def mxfp4_checkpoint(values: dict) -> bool:
    """Whether the case's checkpoint is written in MXFP4 (gpt-oss as published)."""
    from layerstream.checkpoints import mxfp4

    return mxfp4.keeps_packed(shape_config(values))


def trl_command(
    case: Case, checkpoint: Path, data: Path, out: Path, streamed: bool, extra: list, load_in_4bit: bool = True
) -> list:
    args = ["-m", "trl.scripts.sft", "--model_name_or_path", str(checkpoint), "--dataset_name", str(data)]
    args += ["--output_dir", str(out), "--max_steps", str(case.steps), "--logging_steps", "1"]
    args += ["--save_strategy", "steps", "--save_steps", str(case.steps), "--report_to", "none"]
    args += ["--use_peft", "--lora_r", str(LORA_R), "--lora_alpha", str(LORA_ALPHA), "--lora_target_modules"]
    args += [*LORA_TARGETS, "--per_device_train_batch_size", "1", "--max_length", str(case.tokens)]
    args += ["--packing", "true", "--packing_strategy", "wrapped", "--dtype", "bfloat16", "--bf16", "true"]
    args += ["--seed", "0", *(["--load_in_4bit"] if load_in_4bit else []), *extra]
    return ["layerstream", "run", *args] if streamed else ["python", *args]


def run_script(
    case: Case, command: list, work: Path, tag: str, logs: Path, timeout: float, env=None, profile=None
) -> dict:
    """One run of the script through capped.py: its step times, peaks, counters, losses
    (``profile``: a folder for capped.py's profiles of its steps, one subfolder per run)."""
    times = work / f"{case.name}-{tag}-times.json"
    times.unlink(missing_ok=True)
    cap = case.cap if tag == "streamed" else WHOLE_GPU
    argv = [sys.executable, str(HERE / "capped.py"), "--cap", cap, "--times", str(times)]
    argv += ["--profile", str(Path(profile) / f"{case.name}-{tag}")] if profile else []
    argv += ["--"]
    argv += [sys.executable, *command[1:]] if command[0] == "python" else command
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        log, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        log, returncode = f"{expired.stdout or ''}{expired.stderr or ''}\ntimed out after {timeout:.0f} s", None
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"moe-{case.name}-{tag}.log").write_text(log[-20000:])
    timing = json.loads(times.read_text()) if times.exists() else {}
    state = Path(command[command.index("--output_dir") + 1]) / f"checkpoint-{case.steps}" / "trainer_state.json"
    history = json.loads(state.read_text())["log_history"] if state.exists() else []
    losses = [entry["loss"] for entry in history if "loss" in entry]
    return {
        "returncode": returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "out_of_memory": "out of memory" in str(log).lower(),
        "trained": returncode == 0 and len(losses) == case.steps and all(math.isfinite(x) for x in losses),
        "losses": losses,
        "step_s_all": timing.get("step_s", []),
        "counters": timing.get("stream_counters", []),
        "peak_allocated_gib": timing.get("peak_allocated_gib"),
        "peak_reserved_gib": timing.get("peak_reserved_gib"),
    }


def run_trl(case: Case, values: dict, sizes: dict, session: Session) -> list:
    """The streamed script under the cap, then the plain one on the whole GPU; compared step by
    step from the third (the same packed batches in the same order)."""
    args, gbps = session.args, session.gbps
    if args.profile:  # capped.py profiles steps 8-17: the runs go that far
        case = dataclasses.replace(case, steps=max(case.steps, PROFILED_STEPS))
    work, logs = Path(args.work), Path(args.out).parent / "moe"
    checkpoint, data = write_inputs(case, values, work, sizes)
    extra = ["--use_cpu"] if args.dry_run else []
    # the dry run's tiny matmuls: one thread each, not two waiting on each other on a busy CPU
    env = dict(os.environ, OMP_NUM_THREADS="1") if args.dry_run else None
    streamed_cmd = trl_command(case, checkpoint, data, work / f"{case.name}-streamed", True, extra)
    streamed = run_script(case, streamed_cmd, work, "streamed", logs, args.run_timeout, env, args.profile)
    times = streamed["step_s_all"]
    counts = [c for c in streamed["counters"] if c] if len(times) > 2 else []
    bytes_per_step = (counts[-1]["h2d_bytes"] - counts[1]["h2d_bytes"]) / (len(counts) - 2) if len(counts) > 2 else None
    row = dict(case=case.name, model=case.shape, quantization="nf4", cap=case.cap, route="trl-sft", kind="train")
    row.update(tokens=case.tokens, batch=1, layers=sizes["layers_of_model"], layers_of_model=sizes["layers_of_model"])
    row.update(loss=TRL_LOSS, profiled=bool(args.profile))
    row.update(command=session.command, script_command=" ".join(streamed_cmd), sizes=sizes, h2d_gbps=gbps)
    row.update({k: v for k, v in streamed.items() if k != "counters"})
    row.update(step_s=statistics.median(times[2:]) if len(times) > 2 else None, bytes_per_step=bytes_per_step)
    row.update(copy_bound_s=bytes_per_step / (gbps * 1e9) if bytes_per_step is not None else None)
    first, last = (counts[1], counts[-1]) if len(counts) > 2 else ({}, {})
    visits, copied = counter_delta(first, last, "expert_visits"), counter_delta(first, last, "experts_copied")
    row.update(experts_copied=copied, expert_visits=visits, experts_copied_per_visit=per_visit(copied, visits))
    row.update(window_layers=last.get("window_layers"), routed_expert_share=None)
    session.keep([row])
    if not args.no_resident and sizes["resident_fits_gpu_full"]:
        # transformers refuses a BitsAndBytesConfig for an MXFP4 checkpoint: plainly, it dequantises
        packed = mxfp4_checkpoint(values)
        plain_cmd = trl_command(case, checkpoint, data, work / f"{case.name}-plain", False, extra, not packed)
        row.update(resident_quantization="bf16, experts dequantised by transformers" if packed else "nf4")
        plain = run_script(case, plain_cmd, work, "plain", logs, args.run_timeout, env, args.profile)
        ratios = [p / s for p, s in zip(plain["step_s_all"][2:], times[2:]) if s > 0]
        row.update(resident_command=" ".join(plain_cmd), resident_trained=plain["trained"])
        row.update(resident_step_s=statistics.median(plain["step_s_all"][2:]) if ratios else None)
        row.update(resident_step_s_all=plain["step_s_all"], resident_losses=plain["losses"])
        row.update(resident_peak_allocated_gib=plain["peak_allocated_gib"], target_vs_resident=TARGET_VS_RESIDENT)
        row.update(speed_vs_resident=statistics.median(ratios) if ratios else None)
    finish(row)
    return [row]


# -- results -------------------------------------------------------------------------------
def row_key(row: dict) -> tuple:
    return (row["case"], row["kind"], row.get("batch"))


def save(path: Path, base: list, rows: list) -> None:
    """``base``'s rows, those of the same case, kind and batch replaced by ``rows``."""
    fresh = {row_key(r) for r in rows}
    merged = sorted([r for r in base if row_key(r) not in fresh] + rows, key=row_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": merged}, indent=1) + "\n")
    print(f"moe: wrote {len(rows)} row(s) to {path}", flush=True)


def sizes_table(cases: dict) -> str:
    lines = ["| case | checkpoint | fits disk | NF4 store | fits RAM | layers | resident fits GPU | route |"]
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in cases.values():
        s = case_sizes(case, SHAPES[case.shape])
        lines.append(
            f"| {case.name} | {s['checkpoint_gb']} GB | {s['checkpoint_fits_disk']} | {s['store_nf4_gib']} GiB "
            f"| {s['store_fits_host_ram']} | {s['layers_measured']} of {s['layers_of_model']} "
            f"| {s['resident_fits_gpu_measured']} ({s['resident_gib_measured']} GiB) | {s['route']} |"
        )
    return "\n".join(lines)


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default=None, help=f"comma list of {', '.join(CASES)} (default: all)")
    parser.add_argument("--route", choices=("auto", "trl-sft", "api"), default="auto", help="auto: by the sizes")
    parser.add_argument("--layers", type=int, default=None, help="API route: decoder layers built (default: sizes)")
    parser.add_argument("--work", default="/tmp/moe", help="checkpoints, data and the script's outputs")
    out = os.path.join(os.environ["OUT"], "moe.json") if os.environ.get("OUT") else str(HERE / "results" / "moe.json")
    parser.add_argument("--out", default=out, help="the rows file (default $OUT/moe.json, else results/moe.json)")
    parser.add_argument("--base", default=None, help="a rows file whose other rows the output keeps")
    parser.add_argument("--no-resident", action="store_true", help="skip the resident baselines")
    parser.add_argument("--run-timeout", type=float, default=480.0, help="seconds one script run may take")
    parser.add_argument("--sizes", action="store_true", help="print the size arithmetic of the cases and exit")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="TRL route: profile both runs' steps 8-17 (capped.py --profile) into DIR/<case>-<run>; "
        f"the runs take {PROFILED_STEPS} steps and their rows say profiled (their times include the profilers)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = arguments(argv)
    if args.sizes:
        print(sizes_table(CASES))
        return 0
    table = TINY_CASES if args.dry_run else CASES
    if args.dry_run:
        SHAPES.update(TINY_SHAPES)
    names = args.case.split(",") if args.case else list(table)
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; cases: {', '.join(table)}")
    cases = [table[name] for name in names]
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cuda":  # the allocator `layerstream run` gives a script, before CUDA starts
        from layerstream.commands.run import allocator_defaults

        allocator_defaults()
    out = Path(args.out)
    # the first run of all has no rows file yet: it starts one
    base = json.loads(Path(args.base).read_text())["rows"] if args.base and Path(args.base).exists() else []
    if out.exists() and not args.base:
        base = json.loads(out.read_text())["rows"]
    gbps = host_to_device_gbps(args.dry_run)
    print(f"moe: host-to-device {gbps:.1f} GB/s", flush=True)
    command = "python benchmarks/moe.py " + " ".join(argv if argv is not None else sys.argv[1:])
    done = []

    def keep(rows: list) -> None:
        stamp = dict(machine=machine(), commit=commit(), when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
        stamp.update(alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"))
        for row in rows:
            finish(row)
            row.update(stamp)
        save(out, base, done + rows)

    session = Session(args, device, gbps, command, keep)
    for case in cases:
        values = SHAPES[case.shape]
        sizes = case_sizes(case, values, args.layers)
        route = sizes["route"] if args.route == "auto" else args.route
        print(f"moe: {case.name}: {route}; {json.dumps(sizes)}", flush=True)
        rows = (run_trl if route == "trl-sft" else run_api)(case, values, sizes, session)
        keep(rows)
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all") and k != "machine"}), flush=True)
        done += rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
