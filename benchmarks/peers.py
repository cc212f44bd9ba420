"""Forward passes over a stack of real-shape decoder layers: layerstream against its peers,
in one process, on the same weights and inputs.

Rows: resident (every layer on the GPU), layerstream (slots:prefetch configs),
block-streamer's StreamedModel (prefetch_ahead 1), and Accelerate's cpu_offload. Each
row is the median wall time of `--iters` forward passes after `--warmup`, with the copy
bound (the stack's bytes over the pinned bandwidth measured in the same run) beside it.
Peers that cannot run here are reported as skipped with the reason, never dropped.

    python benchmarks/peers.py --shape llama3-8b --layers 8 --seq 2048     # writes $OUT/peers-*.json
    python benchmarks/peers.py --shape llama3-8b --layers 8 --seq 2048 --backward --nf4   # training, NF4 rows
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc

import torch

import layerstream

from common import build_random, cuda_timer, median, pinned_bandwidth, write_result


def layer_inputs(model, seq: int, batch: int):
    """Hidden states and the rotary position embeddings every decoder layer takes."""
    hidden = torch.randn(batch, seq, model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
    positions = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1)
    rotary = copy.deepcopy(model.model.rotary_emb).cuda()
    return hidden, rotary(hidden, positions)


def run_stack(layers, hidden, position_embeddings):
    for layer in layers:
        out = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def with_backward(forward, hidden):
    """Forward from a fresh leaf copy of ``hidden`` and backward to it through frozen layers
    (what a LoRA step streams: every layer twice, backward recomputing its forward)."""
    grad = torch.ones_like(hidden)

    def step():
        leaf = hidden.detach().requires_grad_(True)
        out = forward(leaf)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        return leaf.grad

    return step


def checkpointed(layers):
    """Resident layers under the non-reentrant checkpointing streamed layers use."""
    from torch.utils.checkpoint import checkpoint

    return [functools.partial(checkpoint, layer, use_reentrant=False) for layer in layers]


def timed(fn, iters: int, warmup: int, grad: bool = False):
    times = []
    with torch.set_grad_enabled(grad):
        for i in range(warmup + iters):
            start = cuda_timer()
            fn()
            if i >= warmup:
                times.append(cuda_timer() - start)
    return median(times), times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--configs", default="2:1,3:2")
    parser.add_argument(
        "--nf4",
        action="store_true",
        help="add layerstream rows streaming the same shape in NF4 (a quarter of the bytes; "
        "the peers stream bf16 only)",
    )
    parser.add_argument(
        "--backward",
        action="store_true",
        help="time forward + backward to the input through the frozen stack (training), "
        "the resident rows with non-reentrant checkpointing",
    )
    args = parser.parse_args()

    bandwidth = pinned_bandwidth()
    model = build_random(args.shape, layers=args.layers)
    model.eval()
    model.requires_grad_(False)  # frozen, as under LoRA: what streams
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    # one pass over the stack's bytes; with backward two (backward recomputes every layer),
    # less whatever a streamer keeps across the turnaround
    copy_bound = (2 if args.backward else 1) * layer_bytes / (bandwidth * 1e9)
    hidden, rope = layer_inputs(model, args.seq, args.batch)
    result = {
        "shape": args.shape,
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
        "iters": args.iters,
        "pinned_gbps": bandwidth,
        "stack_bytes": layer_bytes,
        "copy_bound_s": copy_bound,
        "rows": [],
    }

    def stack(layers):
        if args.backward:
            return with_backward(lambda h: run_stack(layers, h, rope), hidden)
        return functools.partial(run_stack, layers, hidden, rope)

    def record(name, fn, copied=None, **extra):
        """``copied()``: the streamer's cumulative bytes copied to the device, when it counts
        them. One more pass after the timed ones measures what a steady-state pass copies
        (less than the stack where layers are kept across the turnaround or NF4 streams),
        and that over the measured bandwidth is the row's own copy bound."""
        step, times = timed(fn, args.iters, args.warmup, grad=args.backward)
        row = {"name": name, "forward_s": step, "times": times, "over_copy_bound": step / copy_bound, **extra}
        line = f"{step / copy_bound:.2f}x copy bound of the bf16 stack"
        if copied is not None:
            before = copied()
            with torch.set_grad_enabled(args.backward):
                fn()
            torch.cuda.synchronize()
            row["bytes_per_pass"] = copied() - before
            row["own_copy_bound_s"] = row["bytes_per_pass"] / (bandwidth * 1e9)
            row["over_own_copy_bound"] = step / row["own_copy_bound_s"] if row["bytes_per_pass"] else None
            if row["bytes_per_pass"]:
                line += (
                    f", copies {row['bytes_per_pass'] / 2**30:.2f} GiB per pass: "
                    f"{row['over_own_copy_bound']:.2f}x its own copy bound"
                )
        result["rows"].append(row)
        print(name, f"{step:.4f} s", line, flush=True)

    def skipped(name, why):
        result["rows"].append({"name": name, "skipped": why})
        print(name, "skipped:", why, flush=True)

    # resident
    resident = copy.deepcopy(model.model.layers).cuda()
    record(
        "resident" + (" (checkpointed)" if args.backward else ""),
        stack(checkpointed(resident) if args.backward else resident),
    )
    del resident
    gc.collect()
    torch.cuda.empty_cache()

    # layerstream
    for spec in args.configs.split(","):
        slots, prefetch = (int(x) for x in spec.split(":"))
        streamed = copy.deepcopy(model)
        layerstream.stream_model(streamed, slots=slots, prefetch=prefetch, vram_budget=None)
        streamed.cuda()
        layers = streamed.model.layers
        runtime = layerstream.get_runtime(streamed)
        record(f"layerstream {slots}:{prefetch}", stack(layers), copied=lambda: runtime.stats()["h2d_bytes"])
        layerstream.unstream_model(streamed, device="cpu")
        del streamed, layers
        gc.collect()
        torch.cuda.empty_cache()

    if args.nf4:
        from common import build_random_nf4

        quantised = build_random_nf4(args.shape, layers=args.layers)
        quantised.requires_grad_(False)
        for spec in args.configs.split(","):
            slots, prefetch = (int(x) for x in spec.split(":"))
            layerstream.stream_model(quantised, slots=slots, prefetch=prefetch, vram_budget=None)
            quantised.cuda()
            runtime = layerstream.get_runtime(quantised)
            record(
                f"layerstream NF4 {slots}:{prefetch}",
                stack(quantised.model.layers),
                copied=lambda: runtime.stats()["h2d_bytes"],
            )
            layerstream.unstream_model(quantised, device="cpu")
            gc.collect()
            torch.cuda.empty_cache()
        del quantised

    # block-streamer
    try:
        from streamer import StreamedModel
    except ImportError as exc:
        skipped("block-streamer", f"not installed ({exc})")
    else:
        blocks = StreamedModel(copy.deepcopy(model.model.layers), device="cuda", prefetch_ahead=1)
        # StreamedModel puts itself in eval mode, where it runs without autograd; its
        # training path (recompute per block in backward) needs train mode
        blocks.train(args.backward)
        run_blocks = functools.partial(blocks, position_embeddings=rope, attention_mask=None)
        try:
            record(
                "block-streamer 0.2.0 (prefetch_ahead 1)",
                with_backward(run_blocks, hidden) if args.backward else functools.partial(run_blocks, hidden),
                copied=lambda streamer=blocks: streamer.stats()["transfer_bytes"],
            )
        except RuntimeError as exc:  # reported, never dropped
            skipped("block-streamer 0.2.0", f"raised {type(exc).__name__}: {str(exc)[:200]}")
        blocks.close()
        del blocks
        gc.collect()
        torch.cuda.empty_cache()

    # Accelerate cpu_offload: weights stay on the host, each module's are moved at its call
    try:
        from accelerate import cpu_offload
    except ImportError as exc:
        skipped("accelerate cpu_offload", f"not installed ({exc})")
    else:
        offloaded = copy.deepcopy(model.model.layers)
        for layer in offloaded:
            cpu_offload(layer, execution_device=torch.device("cuda"))
        try:
            record("accelerate cpu_offload", stack(offloaded))
        except RuntimeError as exc:  # reported, never dropped
            skipped("accelerate cpu_offload", f"raised {type(exc).__name__}: {str(exc)[:200]}")
        del offloaded
        gc.collect()
        torch.cuda.empty_cache()

    what = "stack forward + backward" if args.backward else "stack forward"
    print(f"| {what} | s | x copy bound (bf16 stack) | x own copy bound | x resident |")
    print("|---|---|---|---|---|")
    resident_s = result["rows"][0]["forward_s"]
    for row in result["rows"]:
        if "skipped" in row:
            print(f"| {row['name']} | skipped: {row['skipped']} | | | |")
            continue
        own = row.get("over_own_copy_bound")
        print(
            f"| {row['name']} | {row['forward_s']:.4f} | {row['over_copy_bound']:.2f} | "
            f"{'' if own is None else f'{own:.2f}'} | {resident_s / row['forward_s']:.2f} |"
        )
    result["backward"] = args.backward
    write_result(f"peers-{args.shape}-{args.layers}x-seq{args.seq}" + ("-backward" if args.backward else ""), result)


if __name__ == "__main__":
    main()
