"""Whether a process's host work gets slower once it streams a model, and from what (GPU).

A training step of a small model at short sequences is bound by the host: Python, torch's
dispatcher and kernel launches. In TRL's SFT script on a 3B shape (about 170 tokens a
step, every layer in the resident window) the streamed run launched the same kernels as
the plain one and spent the same device time, yet every host operation took about 1.5x as
long (torch's profiler: cudaLaunchKernel, allocator calls, Python alike). This measures,
in one process, stage by stage: tiny kernel launches, allocator calls, a pure-Python loop,
and a resident LoRA training step of the shape; first fresh, then with host memory
page-locked the way the host store does it (``cudaHostRegister``), after unregistering it,
with the same bytes from ``cudaHostAlloc`` (torch's ``pin_memory``), then the same shape
streamed with every layer in the resident window; last, the resident and the streamed
model's steps alternated one by one, which cancels the host's drift between stages.

    python benchmarks/host_overhead.py --out results/host-overhead.json
    python benchmarks/host_overhead.py --dry-run      # the harness on the CPU, tiny shape
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GiB = 1 << 30


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def micro(device: str, n: int) -> dict:
    """Microseconds per tiny launch and per allocator call, nanoseconds per Python loop
    turn (median of three)."""
    x = torch.zeros(1, device=device)

    def launches():
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        _sync(device)
        return (time.perf_counter() - start) / n * 1e6

    def allocations():
        start = time.perf_counter()
        for _ in range(n):
            torch.empty(1024, device=device)
        return (time.perf_counter() - start) / n * 1e6

    def python_loop():
        start = time.perf_counter()
        total = 0
        for i in range(n * 20):
            total += i & 7
        return (time.perf_counter() - start) / (n * 20) * 1e9  # ns per turn

    return {
        "launch_us": statistics.median(launches() for _ in range(3)),
        "empty_us": statistics.median(allocations() for _ in range(3)),
        "python_ns_per_turn": statistics.median(python_loop() for _ in range(3)),
    }


def build(shape: str, device: str, streamed: bool):
    from peft import LoraConfig, get_peft_model

    from common import build_random

    model = build_random(shape)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    if streamed:
        import layerstream

        layerstream.stream_model(model, device=device, vram_budget="auto" if device == "cuda" else None)
        model.to(device)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.to(device)
    return model


class Trainer:
    """Training steps of one model on random batches (its own optimizer and generator)."""

    def __init__(self, model, device: str, batch: int, seq: int):
        self.model, self.device, self.shape = model, device, (batch, seq)
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> float:
        ids = torch.randint(3, self.model.config.vocab_size, self.shape, generator=self.gen).to(self.device)
        _sync(self.device)
        start = time.perf_counter()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - start


def steps(model, device: str, count: int, batch: int, seq: int) -> list:
    trainer = Trainer(model, device, batch, seq)
    return [trainer.step() for _ in range(count)]


def interleaved(resident, streamed, device: str, count: int, batch: int, seq: int) -> dict:
    """Resident and streamed steps alternated one by one, so that the host's drift falls
    on both alike: the median over pairs of resident step / streamed step (after 4 pairs)."""
    a, b = Trainer(resident, device, batch, seq), Trainer(streamed, device, batch, seq)
    pairs = [(a.step(), b.step()) for _ in range(count)]
    kept = pairs[4:]
    return {
        "stage": "interleaved, resident then streamed",
        "resident_step_s": [x for x, _ in pairs],
        "streamed_step_s": [y for _, y in pairs],
        "resident_median_s": statistics.median(x for x, _ in kept),
        "streamed_median_s": statistics.median(y for _, y in kept),
        "streamed_speed_vs_resident": statistics.median(x / y for x, y in kept),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3.2-3b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=170)
    parser.add_argument("--steps", type=int, default=14, help="per stage; the median skips the first 4")
    parser.add_argument("--pinned-gib", type=float, default=5.25, help="host memory page-locked (the 3B store)")
    parser.add_argument("--micro-n", type=int, default=20000)
    parser.add_argument("--pairs", type=int, default=24, help="alternated resident/streamed steps")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "host-overhead.json"))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    import checkpoints  # noqa: F401  (adds the 3B shape to common.SHAPES)
    from common import SHAPES

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if args.dry_run:
        SHAPES["tiny"] = dict(
            model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        args.shape, args.steps, args.micro_n, args.pairs = "tiny", 5, 200, 6
    rows = []

    def stage(name: str, model=None) -> None:
        row = {"stage": name, **micro(device, args.micro_n)}
        if model is not None:
            times = steps(model, device, args.steps, args.batch, args.seq)
            row.update(step_s=times, median_step_s=statistics.median(times[4:]))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)

    stage("fresh")
    model = build(args.shape, device, streamed=False)
    stage("resident", model)
    if device == "cuda":  # the page-locking stages
        from layerstream.system.cudart import register_host, unregister_host

        nbytes = int(args.pinned_gib * GiB)
        arenas = [torch.empty(nbytes // 6, dtype=torch.uint8) for _ in range(6)]
        for arena in arenas:
            arena.fill_(1)  # touched, as the store's are
        for arena in arenas:
            register_host(arena)
        stage("resident, host memory registered", model)
        for arena in arenas:
            unregister_host(arena)
        stage("resident, unregistered again", model)
        del arenas
        pinned = [torch.empty(nbytes // 6, dtype=torch.uint8, pin_memory=True) for _ in range(6)]
        for arena in pinned:
            arena.fill_(1)
        stage("resident, host memory from cudaHostAlloc", model)
        del pinned
    streamed = build(args.shape, device, streamed=True)
    stage("streamed, window", streamed)
    import layerstream

    rows[-1]["window_layers"] = len(layerstream.get_runtime(streamed).window)
    rows.append(interleaved(model, streamed, device, args.pairs, args.batch, args.seq))
    print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("step_s")}), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        from layerstream.system.versions import versions

        payload = {"shape": args.shape, "batch": args.batch, "seq": args.seq, "rows": rows, "versions": versions()}
        json.dump(payload, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
