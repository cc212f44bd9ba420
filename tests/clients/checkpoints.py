"""Tiny random checkpoints of the families people fine-tune, written with save_pretrained
(and the byte tokenizer) to a directory, as a hub download would leave them."""

from __future__ import annotations

from pathlib import Path

from layerstream.data import byte_tokenizer

from tiny import routed_design

# family -> (model_type, the config values that give it its real shape)
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    # Qwen2.5 is Qwen2's class; its small checkpoints tie the head and use a long rope base
    "qwen2.5": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    "qwen3": ("qwen3", {}),
    # 16 experts, 2 per token: a few tokens choose a few of them (Qwen3-30B-A3B: 8 of 128)
    "qwen3_moe": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mistral": ("mistral", dict(sliding_window=8)),
    "gemma2": ("gemma2", dict(sliding_window=8)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=8, sliding_window_pattern=2)),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "smollm3": ("smollm3", {}),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    # as gpt-oss is published: experts in MXFP4 (layerstream keeps them packed; transformers
    # dequantises them on a machine without its kernels), 16 of them, 2 per token
    "gpt_oss_mxfp4": ("gpt_oss", dict(num_local_experts=16, num_experts_per_tok=2, sliding_window=8)),
    # routed experts beside shared ones, checkpoints with one tensor per expert (GLM-4.5-Air,
    # DeepSeek-V3), an expert-score bias frozen when built (ERNIE-4.5-MoE)
    **{family: (family, routed_design(family, 16)) for family in ("glm4_moe", "deepseek_v3", "ernie4_5_moe")},
}
MXFP4 = {"gpt_oss_mxfp4"}

LAYERS = 4  # more than the two slots the streamed runs use


def write(family: str, directory: Path, seed: int = 0) -> Path:
    """A float32 checkpoint of ``family`` with random weights, and its tokenizer; the
    families in ``MXFP4`` as gpt-oss is published: bfloat16, experts in MXFP4."""
    import torch
    from transformers import AutoConfig

    from tiny import mxfp4_experts, save_model_of

    model_type, shape = FAMILIES[family]
    tokenizer = byte_tokenizer()
    values = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    values.update(shape)
    dtype = torch.bfloat16 if family in MXFP4 else torch.float32
    save_model_of(AutoConfig.for_model(model_type, **values), directory, dtype=dtype, seed=seed)
    if family in MXFP4:
        mxfp4_experts(directory, seed)
    tokenizer.save_pretrained(directory)
    return Path(directory)
