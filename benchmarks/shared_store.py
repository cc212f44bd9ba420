"""One host store per node: host memory, copy bandwidth and step time of data-parallel
ranks that share it, against one process (GPU, or the whole harness on the CPU).

Writes a random-weight checkpoint of a real shape to disk (``checkpoints.py``), then loads
it through ``layerstream.from_pretrained`` and trains LoRA r16 (all linear layers, one
sequence per rank per step, DDP) twice: in one process, and in ``--ranks`` processes
started by torchrun (``python -m torch.distributed.run --standalone``), where the local
ranks share one host store (``share_host_store="auto"``). Each run reports:

- host memory of the node: MemTotal - MemAvailable after every rank has loaded, less the
  same before the run started (the shared segment counts once, as Shmem; page-locked
  memory counts as used), beside the store's own bytes (one copy of the frozen layers);
- each rank's host-to-device copy rate from its store (pinned shared pages) while every
  rank copies at once, started together at a barrier;
- the median step time.

With more ranks than GPUs (the one-GPU machine: two ranks on one GPU) the ranks share the
GPU too: the memory and the copy rate from two processes at once still say what they
should, the step time does not compare with one process; the GPU's own budget is then
left alone (``vram_budget=None``: every layer streams) so that two processes fit.

    python benchmarks/shared_store.py --ranks 2 --shape llama3.2-3b --work /tmp/ss --out $OUT
    python benchmarks/shared_store.py --dry-run     # tiny model, CPU, gloo: the harness only

Rows go to ``$OUT/shared-host-store.json`` (else benchmarks/results/), one per rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def meminfo() -> dict:
    """/proc/meminfo in bytes."""
    values = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            values[name] = int(rest.split()[0]) * 1024
    return values


def node_used_bytes() -> int:
    """MemTotal - MemAvailable: what the node's processes hold, shared memory and
    page-locked pages included, the reclaimable page cache not."""
    values = meminfo()
    return values["MemTotal"] - values["MemAvailable"]


# -- one rank (under torchrun, or alone) ------------------------------------------------------
def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    import layerstream

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if not args.dry_run else 0
    device = torch.device(f"cuda:{local % gpus}") if gpus else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if gpus >= world and gpus else "gloo"
    if world > 1:
        dist.init_process_group(backend)
    budget = "auto" if gpus >= world and gpus else None
    config = layerstream.StreamConfig(device=device, vram_budget=budget, share_host_store="auto")
    quantization = None if args.quantization == "none" else args.quantization
    model = layerstream.from_pretrained(args.checkpoint, dtype="bfloat16", quantization=quantization, stream=config)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.to(device)
    runtime = layerstream.get_runtime(model)
    if world > 1:
        dist.barrier()  # every rank has loaded: the node's memory now holds all of them
    used = node_used_bytes() - args.used_before
    shm = meminfo().get("Shmem", 0)
    rate = _copy_rate(runtime, device, world)
    trained = (
        DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) if world > 1 else model
    )
    times = _train(trained, model.config.vocab_size, device, args)
    segment = runtime.store.segment
    report = {
        "rank": rank,
        "device": str(device),
        "backend": backend if world > 1 else None,
        "shared": segment is not None,
        "builder": bool(segment and segment.builder),
        "node_used_bytes": used,
        "shmem_bytes": shm,
        "store_bytes": sum(record.nbytes for record in runtime.records),
        "h2d_gbps": rate,
        "step_s": times,
    }
    Path(args.reports, f"rank-{rank}.json").write_text(json.dumps(report))  # torchrun interleaves stdout
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _copy_rate(runtime, device, world: int):
    """GB/s of this rank's copies of every streamed layer from its host store, all ranks at once."""
    import torch
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    regions = [record.host_region for record in runtime.records if record.host_region is not None]
    target = torch.empty(max(r.numel() for r in regions), dtype=torch.uint8, device=device)
    for region in regions[:2]:  # warm up the path
        target[: region.numel()].copy_(region, non_blocking=True)
    torch.cuda.synchronize(device)
    if world > 1:
        dist.barrier()
    start, copied = time.perf_counter(), 0
    for _ in range(3):
        for region in regions:
            target[: region.numel()].copy_(region, non_blocking=True)
            copied += region.numel()
    torch.cuda.synchronize(device)
    return copied / (time.perf_counter() - start) / 1e9


def _train(model, vocab: int, device, args) -> list:
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    generator = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    times = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(3, vocab, (1, args.seq), generator=generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


# -- the parent: checkpoint, the two runs, the row ----------------------------------------------
def write_checkpoint(work: Path, shape: str, dry_run: bool) -> Path:
    target = work / ("tiny" if dry_run else shape)
    if (target / "config.json").exists():
        return target
    if dry_run:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from tiny import tiny_model

        tiny_model("llama", layers=4).to(dtype=__import__("torch").bfloat16).save_pretrained(target)
        return target
    sys.path.insert(0, str(HERE))
    import checkpoints

    checkpoints.write(shape, target)
    return target


def launch(args, checkpoint: Path, ranks: int, shm_dir: str) -> list:
    """Run the ranks (torchrun for several) and collect each rank's report."""
    reports = Path(args.work) / f"reports-{ranks}"
    reports.mkdir(parents=True, exist_ok=True)
    for stale in reports.glob("rank-*.json"):
        stale.unlink()
    own = [
        str(Path(__file__).resolve()),
        "--rank-run",
        "--checkpoint",
        str(checkpoint),
        "--quantization",
        args.quantization,
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--used-before",
        str(node_used_bytes()),
        "--reports",
        str(reports),
    ] + (["--dry-run"] if args.dry_run else [])
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] + own
    else:
        command = [sys.executable] + own
    env = dict(os.environ, LAYERSTREAM_SHM_DIR=shm_dir, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    found = [json.loads(path.read_text()) for path in sorted(reports.glob("rank-*.json"))]
    if len(found) != ranks:
        tail = (done.stdout + done.stderr)[-3000:]
        raise SystemExit(f"{ranks} rank(s): {len(found)} reported (exit {done.returncode}):\n{tail}")
    return sorted(found, key=lambda r: r["rank"])


def row(args, ranks: int, reports: list, single: list) -> dict:
    step = statistics.median(t for r in reports for t in r["step_s"])
    return {
        "ranks": ranks,
        "model": args.shape if not args.dry_run else "tiny",
        "quantization": args.quantization,
        "host_bytes_per_node": max(r["node_used_bytes"] for r in reports),
        "host_bytes_one_copy": reports[0]["store_bytes"],
        "single_process_host_bytes": single[0]["node_used_bytes"],
        "shmem_bytes": max(r["shmem_bytes"] for r in reports),
        "h2d_gbps_per_rank": [r["h2d_gbps"] for r in reports],
        "single_process_h2d_gbps": single[0]["h2d_gbps"],
        "step_s": step,
        "single_process_step_s": statistics.median(single[0]["step_s"]),
        "shared": [r["shared"] for r in reports],
        "builders": sum(r["builder"] for r in reports),
        "devices": [r["device"] for r in reports],
        "backend": reports[0]["backend"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shape", default="llama3.2-3b")
    parser.add_argument("--quantization", choices=("none", "nf4"), default="none")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--work", default="/tmp/shared-store")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results"))
    parser.add_argument("--timeout-s", type=int, default=540)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, gloo: checks the harness")
    for hidden in ("--checkpoint", "--used-before", "--reports"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_run:
        args.used_before = int(args.used_before)
        rank_main(args)
        return 0
    if args.dry_run:
        args.seq, args.steps, args.warmup = 16, 2, 1
    work = Path(args.work)
    checkpoint = write_checkpoint(work, args.shape, args.dry_run)
    shm_dir = str(work / "shm") if args.dry_run else ""  # a real run uses /dev/shm
    if shm_dir:
        Path(shm_dir).mkdir(parents=True, exist_ok=True)
    single = launch(args, checkpoint, 1, shm_dir)
    reports = launch(args, checkpoint, args.ranks, shm_dir)
    result = row(args, args.ranks, reports, single)
    print(json.dumps(result), flush=True)
    path = Path(args.out) / "shared-host-store.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [
        r
        for r in rows
        if (r["ranks"], r["model"], r["quantization"]) != (args.ranks, result["model"], args.quantization)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows + [result], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
