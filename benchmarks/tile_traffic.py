"""Where the tiled MLP's extra memory traffic comes from, on the CPU: the bytes every operation
of one training step reads and writes (views and allocations left out), untiled against tiled,
tiled with the tiled norms or the attention adapters' recomputed dropout left out, and tiled
with each NF4 weight dequantised at every tile (as before ``modules/nf4_dense``). That last count
is a lower bound: bitsandbytes' ``gemm_4bit`` op dequantises inside itself (the tiles' forward),
which an operation's inputs and outputs do not show; only the backward's dequantise op is seen.

A GPU step at long sequences is bound by memory traffic outside its matrix products, so the
extra bytes of the tiled step say which part of ``mlp_tile_tokens`` (the MLP's tiles, the
norms' tiled backward, the attention adapters' dropout drawn again in backward) costs what.
A Llama with 8B's ratios scaled down (hidden 512, intermediate 1792, 2 layers), a Trainer
script's QLoRA setup (NF4 with double quantisation, ``prepare_model_for_kbit_training``'s
float32 residual stream, LoRA r=8 on every linear layer with dropout 0.05, bf16 autocast),
streamed on the CPU with 512-token loss chunks.

    python benchmarks/tile_traffic.py --tokens 8192 --tile 1024 --out results/cpu/tile-traffic.json
"""

import argparse
import collections
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# operations that move no bytes of their own: views, and allocations without a fill
NO_TRAFFIC = {
    "view", "detach", "slice", "t", "transpose", "_unsafe_view", "unsqueeze", "select", "expand",
    "as_strided", "alias", "empty_like", "empty", "squeeze", "permute", "split", "unbind", "new_empty",
    "reshape", "lift_fresh", "empty_strided",
}  # fmt: skip
VARIANTS = (
    "untiled",
    "tiled",
    "tiled, norms untiled",
    "tiled, adapters as PEFT keeps them",
    "tiled, NF4 weights dequantised at every tile",
)


class Traffic(TorchDispatchMode):
    """Bytes of every tensor each operation reads or writes, by operation."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func._overloadpacket).replace("aten.", "")
        if name not in NO_TRAFFIC:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
            self.calls[name] += 1
        return out


def step_traffic(variant: str, tokens: int, tile: int, directory: Path) -> dict:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import layerstream
    from layerstream.long import adapter_inputs, tiled_norm
    from layerstream.modules import nf4_dense

    from tiny import portable_cpu_nf4

    kept = tiled_norm.apply, adapter_inputs.apply, nf4_dense.once_per_weight
    if variant == "tiled, NF4 weights dequantised at every tile":  # as before nf4_dense
        nf4_dense.once_per_weight = contextlib.nullcontext
    if variant == "tiled, norms untiled":
        tiled_norm.apply = lambda model, tiles: model
    if variant == "tiled, adapters as PEFT keeps them":
        adapter_inputs.apply = lambda model, tiles: model
    try:
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu", attn_implementation="sdpa"
        )
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
        model = portable_cpu_nf4(get_peft_model(model, lora))
        layerstream.stream_model(
            model,
            device="cpu",
            slots=2,
            prefetch=1,
            mlp_tile_tokens=None if variant == "untiled" else tile,
            loss_chunk_tokens=512,
            offload_activations=False,
            vram_budget=None,
            stream_embeddings=False,
        )
        model.train()
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
        with Traffic() as traffic:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    finally:
        tiled_norm.apply, adapter_inputs.apply, nf4_dense.once_per_weight = kept
    return {"bytes": dict(traffic.bytes), "calls": dict(traffic.calls), "total_bytes": sum(traffic.bytes.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1792,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=args.tokens,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
        results = {variant: step_traffic(variant, args.tokens, args.tile, Path(folder)) for variant in VARIANTS}
    untiled = results["untiled"]["total_bytes"]
    summary = {variant: (r["total_bytes"] - untiled) / 1e9 for variant, r in results.items()}
    tiled = summary["tiled"]
    parts = {
        "the MLP's tiles": summary["tiled, norms untiled"] + summary["tiled, adapters as PEFT keeps them"] - tiled,
        "the norms' tiled backward": tiled - summary["tiled, norms untiled"],
        "the attention adapters' dropout drawn again": tiled - summary["tiled, adapters as PEFT keeps them"],
        "NF4 weights dequantised at every tile, on top": summary["tiled, NF4 weights dequantised at every tile"]
        - tiled,
    }
    report = {
        "command": "python benchmarks/tile_traffic.py " + " ".join(sys.argv[1:]),
        "tokens": args.tokens,
        "tile": args.tile,
        "untiled_gb": untiled / 1e9,
        "extra_gb_over_untiled": summary,
        "extra_gb_by_part": parts,
        "variants": results,
    }
    print(json.dumps({k: report[k] for k in ("untiled_gb", "extra_gb_over_untiled", "extra_gb_by_part")}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
