"""The compute at a step's two turnarounds, measured piece by piece on resident weights.

A streamed step with S slots holds S layers across each turnaround, and no copy can
start while every slot holds a layer still needed: from the last forward copy until
the last layer's backward frees its slot, and from the last backward copy until the
next step's first layer frees its slot. This times the pieces that run then, on the
GPU, at the real shape (LoRA r=16 on all linear layers, non-reentrant checkpointing,
as the throughput benchmark): one decoder layer's forward, its recompute and backward,
and the model's ends (embedding, final norm, head and loss) forward and backward.

The idle copy time they predict per step:
  forward phase:  layer forward (layer 0, before its slot frees) + layer forward (the
                  last layer, after the last copy) + ends forward
  backward phase: ends backward + layer recompute and backward (the last layer, before
                  its slot frees) + layer recompute and backward (layer 0, after the
                  last copy)
to set beside the per-phase excess that throughput.py measures.

    python benchmarks/turnaround.py --shape llama3-8b --seq 2048
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.checkpoint import checkpoint

from common import build_random, median, write_result


def event_ms(fn, iters: int, warmup: int, prepare=None):
    """Median GPU time of ``fn`` between two CUDA events, in ms; ``prepare`` runs untimed
    before each call (the forward whose backward is timed)."""
    times = []
    for i in range(warmup + iters):
        if prepare is not None:
            prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    model = build_random(args.shape, layers=1)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")).cuda()
    model.train()
    inner = model.base_model.model
    layer = inner.model.layers[0]
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    hidden = torch.randn(
        args.batch, args.seq, model.config.hidden_size, dtype=torch.bfloat16, device="cuda", requires_grad=True
    )
    positions = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.batch, -1)
    rope = inner.model.rotary_emb(hidden, positions)

    def layer_forward():
        out = checkpoint(layer, hidden, position_embeddings=rope, attention_mask=None, use_reentrant=False)
        return out[0] if isinstance(out, tuple) else out

    state = {}

    def forward_only():
        state["out"] = layer_forward()

    def backward_only():  # recompute and backward of one checkpointed layer
        state["out"].backward(torch.ones_like(state["out"]))

    # the ends: the model with its one layer skipped; the loss's gradient flows into the
    # hidden states through the frozen head, as it flows into the last layer in a step
    def ends_forward():
        embeds = inner.model.embed_tokens(ids)
        normed = inner.model.norm(embeds + hidden)
        logits = inner.lm_head(normed)
        state["loss"] = inner.loss_function(logits=logits, labels=ids, vocab_size=model.config.vocab_size)

    def ends_backward():
        state["loss"].backward()

    result = {"shape": args.shape, "seq": args.seq, "batch": args.batch, "iters": args.iters}
    result["layer_forward_ms"] = event_ms(forward_only, args.iters, args.warmup)
    result["layer_recompute_backward_ms"] = event_ms(backward_only, args.iters, args.warmup, prepare=forward_only)
    result["ends_forward_ms"] = event_ms(ends_forward, args.iters, args.warmup)
    result["ends_backward_ms"] = event_ms(ends_backward, args.iters, args.warmup, prepare=ends_forward)
    result["predicted_forward_idle_ms"] = 2 * result["layer_forward_ms"] + result["ends_forward_ms"]
    result["predicted_backward_idle_ms"] = result["ends_backward_ms"] + 2 * result["layer_recompute_backward_ms"]
    for key, value in result.items():
        print(key, f"{value:.2f}" if isinstance(value, float) else value, flush=True)
    write_result(f"turnaround-{args.shape}-seq{args.seq}", result)


if __name__ == "__main__":
    main()
