"""Random-weight checkpoints of real model shapes, written to disk as a hub download leaves
them (config.json, safetensors shards with an index, a tokenizer), for the benchmarks
that run people's scripts unchanged: they load by path, like the real model.

A shape whose config names MXFP4 (gpt-oss as published) gets its expert projections as
MXFP4 blocks and scales, random bytes, and keeps that quantization_config in config.json.

Values are drawn on the GPU when there is one (the host's generator is single-threaded),
one tensor at a time, and written one shard at a time, so writing an 8B-shaped checkpoint
needs about one shard of host memory, not the model.

    python benchmarks/checkpoints.py --shape llama3-8b --out /tmp/ckpt/llama3-8b
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from layerstream.checkpoints import mxfp4

from common import SHAPES, random_mxfp4, shape_config, shipped_shape

SHAPES.setdefault("llama3.2-3b", shipped_shape("llama-3.2-3b"))

SHARD_BYTES = 2 << 30


def write(shape: str, out: Path, dtype=torch.bfloat16, layers: int | None = None, seed: int = 0) -> Path:
    from layerstream.data import byte_tokenizer

    config = shape_config(shape, layers)
    config.dtype = dtype
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if config.tie_word_embeddings else set()
    shard, shard_bytes, index, shards = {}, 0, {}, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            shards.append(name)
            index.update({key: name for key in shard})
            shard, shard_bytes = {}, 0

    packed = mxfp4.keeps_packed(config)  # gpt-oss as published: MXFP4 experts, as blocks and scales
    for name, param in model.state_dict().items():
        if name in tied or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if packed and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            experts, inputs, outputs = param.shape  # stored transposed, 32 values a block
            for suffix, shape in (
                ("_blocks", (experts, outputs, inputs // 32, 16)),
                ("_scales", (experts, outputs, inputs // 32)),
            ):
                shard[name + suffix] = random_mxfp4(shape, suffix == "_scales", generator, device)
                shard_bytes += shard[name + suffix].numel()
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            value = torch.ones(param.shape, dtype=dtype)
        else:
            std = 1.0 / math.sqrt(param.shape[-1]) if param.dim() > 1 else 0.02
            value = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32) * std
            value = value.to(dtype).cpu()
        shard[name] = value
        shard_bytes += value.numel() * value.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    total = sum((out / s).stat().st_size for s in shards)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index})
    )
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=None)
    args = parser.parse_args()
    print(write(args.shape, Path(args.out), layers=args.layers))


if __name__ == "__main__":
    main()
