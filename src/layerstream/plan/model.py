"""The plan of a live model: its request read from the model itself."""

from __future__ import annotations

from typing import Optional

import torch

from ..long import trl_head
from ..modules.discovery import unwrap_peft
from .memory import MemoryPlan
from .planner import make_plan
from .request import PlanRequest


def adapters_of(model) -> dict:
    """The request's fields a model's LoRA adapters decide: their dtype (the first adapted
    module's ``lora_A``) and whether any adapter's dropout is above 0. Empty without LoRA."""
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not len(lora_a):
            continue
        weight = getattr(next(iter(lora_a.values())), "weight", None)
        if weight is None:
            continue
        return {"adapter_dtype": weight.dtype, "lora_dropout": dropout_probability(module) > 0}
    return {}


def dropout_probability(module) -> float:
    """The largest dropout probability of a LoRA-adapted module's ``lora_dropout`` (0: none,
    or not an adapted module)."""
    dropouts = getattr(module, "lora_dropout", None)
    if not isinstance(dropouts, torch.nn.ModuleDict):
        return 0.0
    return max((d.p for d in dropouts.values() if isinstance(d, torch.nn.Dropout)), default=0.0)


def four_bit_compute_dtype(model) -> Optional[torch.dtype]:
    """The compute dtype of the model's first 4-bit projection (bitsandbytes' ``Linear4bit``),
    or None."""
    for module in model.modules():
        dtype = getattr(module, "compute_dtype", None)
        if isinstance(dtype, torch.dtype) and hasattr(getattr(module, "weight", None), "quant_state"):
            return dtype
    return None


def head_outputs_of(model) -> Optional[int]:
    """What ``PlanRequest.head_outputs`` says of a live model: None for a causal LM (it has
    output embeddings); the width of a classifier's ``score`` (transformers' sequence and
    token classifiers of decoder models; TRL's reward models), PEFT's copy of it included;
    0 where the model has no head at all."""
    inner = unwrap_peft(model)
    try:
        if getattr(inner, "get_output_embeddings", lambda: None)() is not None:
            return None
    except NotImplementedError:  # a model that does not say: planned as the causal LM its config is
        return None
    score = getattr(inner, "score", None)
    if not isinstance(score, torch.nn.Module):
        return 0
    linear = next((m for m in score.modules() if isinstance(m, torch.nn.Linear)), None)
    return int(linear.out_features) if linear is not None else 0


def model_plan_request(model, seq: int, batch: int, vram_bytes: int = 1 << 50, **settings) -> PlanRequest:
    """The request of a live (possibly PEFT-wrapped) model: its config, 4-bit state,
    compute dtype, LoRA rank, targets, dtype and dropout; ``settings`` are the request's
    other fields (slots, stream_embeddings, the long-sequence settings, which may be "auto",
    autocast); TRL's fused loss is planned where a TRL trainer gave the model its head.
    Reads attributes only; raises ValueError when the adapters cannot be described to the
    planner (regex targets, several adapters)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("the model has no transformers config")
    quantization = "nf4" if getattr(model, "is_loaded_in_4bit", False) else "none"
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = embeddings.weight.dtype if embeddings is not None else torch.bfloat16
    residual_dtype = None
    compute = four_bit_compute_dtype(model) if quantization == "nf4" else None
    if compute is not None and compute.itemsize < dtype.itemsize:
        # prepare_model_for_kbit_training's float32 embeddings, head and norms around 4-bit
        # layers that compute (and dequantise) in their compute dtype
        dtype, residual_dtype = compute, dtype
    rank, targets, parameters, ranks = 0, "all-linear", "", ()
    peft_configs = getattr(model, "peft_config", None) or {}
    if len(peft_configs) > 1:
        raise ValueError("several adapters: plan each with `layerstream plan`")
    for peft_config in peft_configs.values():
        rank = int(getattr(peft_config, "r", 0))
        modules = getattr(peft_config, "target_modules", None)
        if isinstance(modules, str) and modules.lower() != "all-linear":
            raise ValueError(f"LoRA target_modules is a pattern ({modules!r})")
        if modules is not None and not isinstance(modules, str) and not modules:
            targets = "none"  # PEFT adapts target_parameters alone
        elif modules and not isinstance(modules, str):
            # PEFT may spell "all-linear" as the full names of the modules it found
            # (model.layers.1.mlp.down_proj, for Phi-3); the planner counts per module name
            targets = ",".join(sorted({name.rsplit(".", 1)[-1] for name in modules}))
        named = getattr(peft_config, "target_parameters", None)  # what PEFT adapted beside them
        if named:
            parameters = ",".join(sorted(named))
        ranks = tuple(sorted((getattr(peft_config, "rank_pattern", None) or {}).items()))
    return PlanRequest(
        config=config,
        seq=seq,
        batch=batch,
        vram_bytes=vram_bytes,
        quantization=quantization,
        dtype=dtype,
        lora_rank=rank,
        lora_targets=targets,
        lora_parameters=parameters,
        lora_rank_pattern=ranks,
        residual_dtype=residual_dtype,
        head_outputs=head_outputs_of(model),
        **{"trl_fused_head": trl_head.installed(model), **adapters_of(model), **settings},
    )


def plan_for_model(model, seq: int, batch: int, vram_bytes: int = 1 << 50, **settings) -> MemoryPlan:
    """The plan of a live model (``model_plan_request``); ``settings`` are the request's other
    fields (slots, stream_embeddings, the chunked loss and tiled MLP as the model streams or would)."""
    return make_plan(model_plan_request(model, seq, batch, vram_bytes, **settings))
