"""Resident vs streamed training throughput of a real-shape random-weight model.

LoRA r=16 on every linear layer, bf16, batch 1. The resident baseline uses the same
non-reentrant activation checkpointing the streamed layers use. In the same run the
benchmark measures pinned host-to-device bandwidth, so it can state the bound:
max(resident step time, bytes streamed per step / pinned bandwidth).

    python benchmarks/throughput.py --shape llama3-8b --seq 2048 --configs 3:1,4:2
    python benchmarks/throughput.py --shape llama3-8b --seq 2048 --configs 3:2:0,3:2   # slots:prefetch[:backward slots, default auto]
    python benchmarks/throughput.py --shape llama3-70b --quantization nf4 --configs 3:1
    python benchmarks/throughput.py --shape llama3-70b --quantization nf4 --configs 3:1 --stream-embeddings
"""

from __future__ import annotations

import argparse
import gc
import gzip
import os
import time

import torch
from peft import LoraConfig, get_peft_model

import layerstream
from layerstream.units import parse_bytes

from common import (
    build_random,
    build_random_nf4,
    cap_gpu,
    cuda_timer,
    median,
    parse_streamed_config,
    pinned_bandwidth,
    write_result,
)

ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counters() -> dict:
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_COUNTERS}


def run_steps(model, ids, steps: int, warmup: int, trace: str | None = None, copied=None):
    """Timed optimizer steps; also the host time to enqueue each step (before the sync),
    and the GPU time of each phase (forward with the loss, backward, optimizer) from CUDA
    events. ``copied()``, the streamer's cumulative bytes issued, is read when the host
    has enqueued the forward, to split a step's copies between forward and backward; it
    must be a host counter (``runtime.stats()`` waits for the device, which would stall
    the step between its forward and backward). Also per step: the host time to enqueue
    the forward (``host_forward_s``; the rest of ``host`` is backward and optimizer), and
    the garbage collector's runs of each generation over the timed steps
    (``gc_collections``): a step whose host time equals its GPU time waits on the host,
    and these say where the host spent it. ``per_step`` keeps each timed step's phases and
    the CUDA caching allocator's counters of device allocations, frees and retries
    (``ALLOCATOR_COUNTERS``), to tell a slow step's cause from the medians'."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.train()
    times, host = [], []
    phases = {"forward_s": [], "backward_s": [], "optimizer_s": [], "forward_bytes": [], "host_forward_s": []}

    def step():
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        start = cuda_timer()
        before = copied() if copied else 0
        marks[0].record()
        loss = model(input_ids=ids, labels=ids).loss
        marks[1].record()
        host_forward = time.perf_counter() - start
        forward_bytes = (copied() - before) if copied else 0
        loss.backward()
        marks[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks[3].record()
        enqueued = time.perf_counter() - start
        elapsed = cuda_timer() - start
        split = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return elapsed, enqueued, split, forward_bytes, host_forward

    collections_before = None
    per_step = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.reset_peak_memory_stats()
            collections_before = [g["collections"] for g in gc.get_stats()]
        counters = allocator_counters()
        gc_before = [g["collections"] for g in gc.get_stats()]
        elapsed, enqueued, split, forward_bytes, host_forward = step()
        if i >= warmup:
            after = allocator_counters()
            per_step.append(
                {
                    "step_s": elapsed,
                    "host_s": enqueued,
                    "host_forward_s": host_forward,
                    **dict(zip(("forward_s", "backward_s", "optimizer_s"), split)),
                    **{k: after[k] - counters[k] for k in after},
                    "gc": [g["collections"] - b for g, b in zip(gc.get_stats(), gc_before)],
                }
            )
            times.append(elapsed)
            host.append(enqueued)
            for key, value in zip(("forward_s", "backward_s", "optimizer_s"), split):
                phases[key].append(value)
            phases["forward_bytes"].append(forward_bytes)
            phases["host_forward_s"].append(host_forward)
    gc_collections = [g["collections"] - b for g, b in zip(gc.get_stats(), collections_before or [])]
    peak = torch.cuda.max_memory_allocated()
    if trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        raw = trace + ".json"
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(trace + ".json.gz", "wb") as dst:
            dst.write(src.read())
        os.remove(raw)
        print(f"wrote {trace}.json.gz", flush=True)
    summary = {key: median(values) for key, values in phases.items() if values}
    summary["gc_collections"] = gc_collections
    summary["per_step"] = per_step
    return times, host, peak, summary


def add_bounds(row: dict, resident: dict, bandwidth_gbps: float) -> None:
    """The bound of the performance target, max(resident step, copies / bandwidth), and the
    phase bound: the same per phase, where a copy cannot move between forward and backward
    (a slot holds a layer only between its uses, so backward's copies cannot start before
    the forward, nor the next forward's before backward frees a slot):
    max(resident forward, forward copies) + max(resident backward, backward copies) +
    resident optimizer step."""
    bound = max(resident["step_s"], row["copy_bound_s"])
    row["bound_s"] = bound
    row["fraction_of_bound"] = bound / row["step_s"]
    row["fraction_of_resident"] = resident["step_s"] / row["step_s"]
    if "forward_bytes" in row and "forward_s" in resident:
        forward_copies = row["forward_bytes"] / (bandwidth_gbps * 1e9)
        backward_copies = (row["bytes_per_step"] - row["forward_bytes"]) / (bandwidth_gbps * 1e9)
        phase = (
            max(resident["forward_s"], forward_copies)
            + max(resident["backward_s"], backward_copies)
            + resident["optimizer_s"]
        )
        row["phase_bound_s"] = phase
        row["fraction_of_phase_bound"] = phase / row["step_s"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--configs", default="3:1,4:2", help="slots:prefetch[:backward_slots] list; backward slots default to auto"
    )
    parser.add_argument("--no-resident", action="store_true")
    parser.add_argument("--name", default=None)
    parser.add_argument("--trace", default=None, help="slots:prefetch config to profile one step of")
    parser.add_argument(
        "--budget",
        default=None,
        help="VRAM budget for streamed rows, e.g. 12GiB: StreamConfig(vram_budget=...) "
        "(resident window) and enforced with set_per_process_memory_fraction",
    )
    parser.add_argument(
        "--quantization",
        choices=["none", "nf4"],
        default="none",
        help="nf4: bitsandbytes NF4 with double quantisation, bf16 compute",
    )
    parser.add_argument(
        "--stream-embeddings",
        action="store_true",
        help="streamed rows keep the input embedding and head in host memory too "
        "(StreamConfig(stream_embeddings=True)); their copies count in bytes_per_step",
    )
    args = parser.parse_args()

    bandwidth = pinned_bandwidth()
    print(f"pinned H2D bandwidth: {bandwidth:.1f} GB/s", flush=True)
    nf4 = args.quantization == "nf4"
    model = build_random_nf4(args.shape, layers=args.layers) if nf4 else build_random(args.shape, layers=args.layers)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device="cuda")
    tokens = args.batch * args.seq
    result = {
        "shape": args.shape,
        "quantization": args.quantization,
        "layers": model.config.num_hidden_layers,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "pinned_gbps": bandwidth,
        "stream_embeddings": args.stream_embeddings,
        "rows": [],
    }

    def run_resident():
        model.cuda()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        times, host, peak, phases = run_steps(model, ids, args.steps, args.warmup)
        step = median(times)
        result["resident"] = {
            "step_s": step,
            "tokens_per_s": tokens / step,
            "peak_gib": peak / 2**30,
            "host_s": median(host),
            "times": times,
            **phases,
        }
        print("resident", {k: v for k, v in result["resident"].items() if k not in ("times", "per_step")}, flush=True)
        model.gradient_checkpointing_disable()

    # bf16: resident first, then back to the host to stream. NF4 models are built on the
    # host (4-bit weights do not come back from the GPU cheaply): stream first, then
    # unstream onto the GPU for the resident run.
    if not args.no_resident and not nf4:
        run_resident()
        model.cpu()
        gc.collect()
        torch.cuda.empty_cache()

    for spec in args.configs.split(","):
        slots, prefetch, backward = parse_streamed_config(spec)
        budget = parse_bytes(args.budget) if args.budget else None
        layerstream.stream_model(
            model,
            slots=slots,
            prefetch=prefetch,
            vram_budget=budget,
            stream_embeddings=args.stream_embeddings,
            backward_slots=backward,
        )
        if budget:
            cap_gpu(budget)
        model.cuda()
        runtime = layerstream.get_runtime(model)
        before = runtime.stats()
        out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
        trace = (
            os.path.join(out_dir, f"trace-{args.shape}-{args.quantization}-{slots}x{prefetch}")
            if spec == args.trace
            else None
        )
        times, host, peak, phases = run_steps(
            model, ids, args.steps, args.warmup, copied=lambda: runtime.pool.h2d_bytes
        )
        after = runtime.stats()
        if trace:
            run_steps(model, ids, 0, 1, trace=trace)
        step = median(times)
        measured = args.steps + args.warmup
        bytes_per_step = (after["h2d_bytes"] - before["h2d_bytes"]) / measured
        copy_bound = bytes_per_step / (bandwidth * 1e9)
        row = {
            "slots": slots,
            "prefetch": prefetch,
            "backward_slots": after["backward_slots"],
            "backward_slots_asked": backward,
            "backward_slot_peak_gib": after["backward_slot_peak_bytes"] / 2**30,
            "step_s": step,
            "tokens_per_s": tokens / step,
            "peak_gib": peak / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "host_s": median(host),
            "times": times,
            "loads_per_step": (after["layer_loads"] - before["layer_loads"]) / measured,
            "bytes_per_step": bytes_per_step,
            "copy_bound_s": copy_bound,
            "h2d_gbps": after["h2d_gbps"],
            "stall_s_per_step": (after["stall_seconds"] - before["stall_seconds"]) / measured,
            "pinned": after["pinned"],
            "window_layers": after.get("window_layers", 0),
            "vram_budget_gib": (budget / 2**30) if budget else None,
            "stream_embeddings": after["stream_embeddings"],
            "head_bytes_per_step": (after["head_h2d_bytes"] - before["head_h2d_bytes"]) / measured,
            **phases,
        }
        if "resident" in result:
            add_bounds(row, result["resident"], bandwidth)
        result["rows"].append(row)
        print("streamed", {k: v for k, v in row.items() if k not in ("times", "per_step")}, flush=True)
        layerstream.unstream_model(model, device="cpu")
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()

    if not args.no_resident and nf4:
        run_resident()
        for row in result["rows"]:
            add_bounds(row, result["resident"], bandwidth)

    print(
        "| config | step s | host s | tokens/s | peak GiB | loads/step | stall s/step | copy bound s | x resident | x bound | x phase bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    if "resident" in result:
        r = result["resident"]
        print(
            f"| resident | {r['step_s']:.3f} | {r['host_s']:.3f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | - | - | - | 1.00 | - | - |"
        )
    for row in result["rows"]:
        print(
            f"| streamed {row['slots']}:{row['prefetch']}+{row['backward_slots']}{' +emb' if row['stream_embeddings'] else ''} | {row['step_s']:.3f} | {row['host_s']:.3f} | {row['tokens_per_s']:.0f} | "
            f"{row['peak_gib']:.1f} | {row['loads_per_step']:.1f} | {row['stall_s_per_step']:.3f} | {row['copy_bound_s']:.3f} | "
            f"{row.get('fraction_of_resident', float('nan')):.2f} | {row.get('fraction_of_bound', float('nan')):.2f} | "
            f"{row.get('fraction_of_phase_bound', float('nan')):.2f} |"
        )
    suffix = (
        ("-nf4" if nf4 else "")
        + (f"-budget{args.budget}" if args.budget else "")
        + ("-stream-embeddings" if args.stream_embeddings else "")
    )
    write_result(args.name or f"throughput-{args.shape}{suffix}-seq{args.seq}", result)


if __name__ == "__main__":
    main()
