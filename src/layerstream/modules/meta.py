"""A causal LM built on the meta device from its transformers config: every module,
parameter and buffer with the shape and dtype the model loads with, and no memory behind
any of them. The loader fills such a model one layer at a time; the planner measures one."""

from __future__ import annotations

import torch


def meta_model(config, dtype=None, model_class=None, trust_remote_code: bool = False, **extra):
    """``config``'s model as transformers builds it (``AutoModelForCausalLM.from_config``, or
    ``model_class._from_config``) inside a ``torch.device("meta")`` context: nothing is
    allocated and CUDA is never touched. ``dtype``: the dtype its floating-point weights load
    in (None: transformers' default), less the weights transformers' load keeps in float32
    (``keep_in_fp32``); ``extra``: other from_config arguments (``attn_implementation``,
    ``experts_implementation``)."""
    from transformers import AutoModelForCausalLM

    if dtype is not None:
        extra["dtype"] = dtype
    with torch.device("meta"):
        if model_class is not None:
            model = model_class._from_config(config, **extra)
        else:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **extra)
    if dtype is not None:
        keep_in_fp32(model, dtype)
    return model


def keep_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give the weights that transformers' ``from_pretrained`` loads in float32 whatever the
    dtype asked (the model's ``_keep_in_fp32_modules`` under float16, its
    ``_keep_in_fp32_modules_strict`` under float16 and bfloat16: gpt-oss's norms, some
    routers) that dtype here, matched as transformers matches them (its dtype plan and glob
    alternation, on the model's state-dict names). ``from_config`` alone does not: only the
    load applies the plan, and the loader casts each value to its tensor's dtype."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    pattern, group_globs, _ = build_glob_alternation(list(plan))
    for name, tensor in model.state_dict(keep_vars=True).items():
        found = pattern.search(name)
        if found is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(plan[group_globs[found.lastgroup]])
