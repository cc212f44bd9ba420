"""Model shapes the planner's tests share: real models' configs as configs/shapes ships
them, Llama-3-8B's sizes worked out by hand, and tiny configs of each family."""

import json
from pathlib import Path

from transformers import AutoConfig

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

SHAPES = Path(__file__).resolve().parents[1] / "configs" / "shapes"


def shipped_shape(name: str) -> dict:
    """A real model's config values as configs/shapes ships them (what `layerstream plan
    --model configs/shapes/<name>.json` reads)."""
    return json.loads((SHAPES / f"{name}.json").read_text())


# Llama-3.1-8B: Llama-3-8B's layers, embeddings and head (only the context is longer,
# which no planned size depends on)
LLAMA3_8B = shipped_shape("llama-3.1-8b")
MIXTRAL_8X7B = shipped_shape("mixtral-8x7b")
MISTRAL_7B = shipped_shape("mistral-7b-v0.3")
# the widths of every tiny config here (``tiny``), small enough to build on the CPU at once
TINY_WIDTHS = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# a small Qwen3-MoE: layer 0 dense (mlp_only_layers), then sparse every 2nd layer
QWEN3_MOE_SMALL = dict(
    TINY_WIDTHS,
    model_type="qwen3_moe",
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    mlp_only_layers=[0],
    decoder_sparse_step=2,
)

# Llama-3-8B, one layer, by hand:
#   q 4096*4096 = 16,777,216   k = v = 4096*1024 = 4,194,304   o = 16,777,216
#   gate = up = down = 4096*14336 = 58,720,256
#   linear weights: 2*16,777,216 + 2*4,194,304 + 3*58,720,256 = 218,103,808
#   two RMSNorms: 2*4096 = 8,192  ->  218,112,000 parameters (the norms included)
LLAMA3_8B_LAYER_PARAMS = 218_103_808 + 8_192
LLAMA3_8B_LAYER_BF16 = 436_224_000  # x2 bytes; every tensor is a multiple of 512 bytes
# embeddings and head: 128256*4096 = 525,336,576 each, plus the final norm (4096), bf16;
# plus the rotary embedding's buffers, inv_freq and original_inv_freq: 2 x 64 float32
LLAMA3_8B_ROTARY = 2 * 64 * 4
LLAMA3_8B_RESIDENT = (2 * 525_336_576 + 4_096) * 2 + LLAMA3_8B_ROTARY  # 2,101,355,008
# LoRA r=16 on all seven linears: 16*((4096+4096)*2 + (4096+1024)*2 + (4096+14336)*3)
#   = 16*81,920 = 1,310,720 per layer, 41,943,040 for 32 layers
LLAMA3_8B_LORA_PARAMS = 41_943_040


def config_of(values: dict):
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def write_config(directory: Path, values: dict, name: str = "config.json") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(values))
    return path


FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "mistral": dict(model_type="mistral"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(QWEN3_MOE_SMALL),
    # families whose layers differ from Llama's: four norms (gemma2), per-head q/k norms
    # too (gemma3_text, olmo2), fused q/k/v and gate/up projections (phi3), LayerNorms with
    # biases and biased fused projections (gpt_neox), Conv1D projections (gpt2)
    "gemma": dict(model_type="gemma", head_dim=16),
    "gemma2": dict(model_type="gemma2", head_dim=16),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16),
    "olmo2": dict(model_type="olmo2"),
    "phi3": dict(model_type="phi3", pad_token_id=None),
    "gpt_neox": dict(model_type="gpt_neox"),
    "gpt2": dict(model_type="gpt2"),
}


def tiny(family: str, **overrides):
    values = dict(TINY_WIDTHS)
    values.update(FAMILIES[family])
    values.update(overrides)
    return config_of(values)
