"""Soak: thousands of streamed LoRA training steps on the GPU, with evaluation and
generation interleaved, recording memory and speed to show nothing grows or slows.

Every `--every` steps it records allocated and reserved VRAM, the process's resident
set size, the page-locked host store, the host memory torch's pinned allocator holds, and
the mean step time since the last record. Every `--interleave` steps it runs one
evaluation forward and one short greedy generation.

    python benchmarks/soak.py --steps 2000                # GPU: writes $OUT/soak.json
    python benchmarks/soak.py --plot results/soak.json docs/soak.png   # anywhere: the plot
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def host_allocator_bytes() -> int:
    """Bytes torch's caching pinned-host allocator holds (0 where torch does not say)."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None:
        return 0
    return int(stats().get("reserved_bytes.current", stats().get("allocated_bytes.current", 0)))


def soak(args) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    import layerstream

    config = AutoConfig.for_model(
        "llama",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    layerstream.stream_model(model, slots=args.slots, prefetch=args.prefetch, vram_budget=None)
    model.cuda()
    runtime = layerstream.get_runtime(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, 32000, (1, 16), device="cuda", generator=generator)
    rows = []
    last = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda", generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.interleave == 0:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
            model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
            )
            model.train()
        if step % args.every == 0:
            torch.cuda.synchronize()
            now = time.perf_counter()
            stats = runtime.stats()
            rows.append(
                {
                    "step": step,
                    "step_s": (now - last) / args.every,
                    "allocated": torch.cuda.memory_allocated(),
                    "reserved": torch.cuda.memory_reserved(),
                    "rss": rss_bytes(),
                    "pinned_store": stats["host_bytes"] if stats["pinned"] else 0,
                    "torch_pinned_host": host_allocator_bytes(),
                    "layer_loads": stats["layer_loads"],
                }
            )
            if len(rows) % 50 == 0:  # a run cut short keeps what it recorded
                _write(args, rows)
            last = time.perf_counter()
    return _write(args, rows)


def _write(args, rows) -> dict:
    from common import median, write_result

    tenth = max(1, len(rows) // 10)
    early, late = rows[1 : 1 + tenth], rows[-tenth:]  # the first record includes warm-up
    summary = {}
    for key in ("step_s", "allocated", "reserved", "rss", "pinned_store", "torch_pinned_host"):
        a, b = median([r[key] for r in early]), median([r[key] for r in late])
        summary[key] = {
            "early": a,
            "late": b,
            "late_over_early": (b / a) if a else None,
            "max": max(r[key] for r in rows[1:]),
            "min": min(r[key] for r in rows[1:]),
        }
    result = {
        "steps": rows[-1]["step"],
        "steps_asked": args.steps,
        "layers": args.layers,
        "slots": args.slots,
        "prefetch": args.prefetch,
        "seq": args.seq,
        "batch": args.batch,
        "every": args.every,
        "interleave": args.interleave,
        "summary": summary,
        "rows": rows,
    }
    write_result("soak", result)
    for key, value in summary.items():
        print(key, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in value.items()})
    return result


def plot(source: str, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(source))
    rows = result["rows"]
    steps = [r["step"] for r in rows]
    gib = 2**30
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    axes[0].plot(steps, [r["allocated"] / gib for r in rows], label="allocated VRAM")
    axes[0].plot(steps, [r["reserved"] / gib for r in rows], label="reserved VRAM")
    axes[0].set_ylabel("GiB")
    axes[0].legend(loc="center right")
    axes[1].plot(steps, [r["rss"] / gib for r in rows], label="process RSS")
    axes[1].plot(steps, [r["pinned_store"] / gib for r in rows], label="page-locked layer store")
    axes[1].plot(steps, [r["torch_pinned_host"] / gib for r in rows], label="torch pinned host allocator")
    axes[1].set_ylabel("GiB")
    axes[1].legend(loc="center right")
    axes[2].plot(steps, [r["step_s"] * 1000 for r in rows], label="mean step time")
    axes[2].set_ylabel("ms per step")
    axes[2].set_xlabel("training step")
    axes[2].legend(loc="upper right")
    axes[0].set_title(
        f"layerstream soak: {result['steps']} streamed LoRA steps, {result['layers']} layers, "
        f"{result['slots']} slots; eval + generation every {result['interleave']} steps",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--interleave", type=int, default=200)
    parser.add_argument("--plot", nargs=2, metavar=("RESULT_JSON", "PNG"))
    args = parser.parse_args()
    if args.plot:
        plot(*args.plot)
    else:
        soak(args)


if __name__ == "__main__":
    main()
