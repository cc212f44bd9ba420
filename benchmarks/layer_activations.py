"""What one decoder layer's activations cost when it is not checkpointed (no GPU).

A streamed layer is checkpointed: autograd keeps only its input and recomputes the rest in
backward. Keeping a layer's activations instead (to skip its recompute) holds every tensor
its forward saves for backward. This counts them for a LoRA'd layer on the meta device
(shapes only, nothing allocated): each saved tensor that has a sequence dimension, once,
outside the attention kernel (what that saves depends on the kernel: on the meta device
the math path's score matrices, on the GPU a flash kernel's few per-head tensors), so the
figure is a lower bound. Weights, which autograd also saves, are not counted: a slot
holds them anyway.

    python benchmarks/layer_activations.py [--seq 2048]   # Llama-3-8B layer, bf16, LoRA r=16 all-linear
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from common import SHAPES, write_result


def saved_bytes(seq: int, hidden: int, intermediate: int, heads: int, kv_heads: int) -> dict:
    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=1,
        vocab_size=256,
        max_position_embeddings=max(seq, 4096),
    )
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    inner = model.base_model.model.model
    x = torch.empty(1, seq, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
    positions = torch.arange(seq, device="meta")[None]
    saved = {}

    def pack(tensor):
        saved[id(tensor)] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        inner.layers[0](x, position_embeddings=inner.rotary_emb(x, positions), position_ids=positions)
    # the attention kernel's own tensors come as (batch, heads, ...) or (heads, ...)
    kept = [
        t
        for t in saved.values()
        if seq in t.shape and t.dim() <= 3 and not (t.dim() == 3 and t.shape[0] in (heads, kv_heads))
    ]
    return {
        "seq": seq,
        "saved_tensors": len(saved),
        "counted_tensors": len(kept),
        "activation_bytes": sum(t.numel() * t.element_size() for t in kept),
        "float32_bytes": sum(t.numel() * t.element_size() for t in kept if t.dtype == torch.float32),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    shape = SHAPES["llama3-8b"]
    hidden, intermediate = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    result = saved_bytes(args.seq, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads)
    # the same layer's bf16 weights, what a slot holds: q and o, k and v, the MLP's three, two norms
    head_dim = hidden // heads
    weights = 2 * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate + 2 * hidden)
    result["layer_weight_bytes"] = weights
    print(
        f"Llama-3-8B layer, seq {args.seq}: {result['counted_tensors']} of {result['saved_tensors']} saved "
        f"tensors counted, at least {result['activation_bytes'] / 2**20:.0f} MiB of activations "
        f"({result['float32_bytes'] / 2**20:.0f} MiB of it float32: LoRA's inputs, cast for its float32 "
        f"adapters); the layer's bf16 weights {weights / 2**20:.0f} MiB"
    )
    write_result(f"layer-activations-llama3-8b-seq{args.seq}", result)


if __name__ == "__main__":
    main()
