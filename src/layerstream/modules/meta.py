"""A causal LM built on the meta device from its transformers config: every module,
parameter and buffer with the shape and dtype the model loads with, and no memory behind
any of them. The loader fills such a model one layer at a time; the planner measures one."""

from __future__ import annotations

import torch


def meta_model(config, dtype=None, model_class=None, trust_remote_code: bool = False, **extra):
    """``config``'s model as transformers builds it (``AutoModelForCausalLM.from_config``, or
    ``model_class._from_config``) inside a ``torch.device("meta")`` context: nothing is
    allocated and CUDA is never touched. ``dtype``: the dtype its floating-point weights load
    in (None: transformers' default); ``extra``: other from_config arguments
    (``attn_implementation``, ``experts_implementation``)."""
    from transformers import AutoModelForCausalLM

    if dtype is not None:
        extra["dtype"] = dtype
    with torch.device("meta"):
        if model_class is not None:
            return model_class._from_config(config, **extra)
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **extra)
