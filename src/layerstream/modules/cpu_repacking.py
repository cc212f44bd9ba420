"""bitsandbytes' CPU inference repacking, and why streamed 4-bit weights never take it.

On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit.forward`` repacks its weight in place on
the first eval-mode, no-gradient call: another byte layout for its CPU kernel, and a QuantState
whose block scales it rounds to bfloat16 (``packing_format_for_cpu``; it undoes that, re-quantising
the scales, when it saves a state dict or moves the weight with ``.cuda()``). A streamed weight
lives in the host store and is read in bitsandbytes' standard layout, so:

- a model whose layers were repacked before ``stream_model`` is refused (``repacked_projections``),
  since its bytes would be read as the standard layout and give other values;
- a streamed layer inferring on such a CPU runs bitsandbytes' portable path, which layerstream
  says once (``note_portable_inference``): the same values as a resident model whose modules
  have ``support_avx512bf16_for_cpu=False``, not those of a repacked one.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from ..system.log import get_logger

logger = get_logger(__name__)

_noted = False


def repacked(module: nn.Module) -> bool:
    """Whether bitsandbytes has repacked this Linear4bit's weight for its CPU kernel."""
    state = getattr(module._parameters.get("weight"), "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def repacked_projections(layers: nn.ModuleList, name_of) -> List[str]:
    """The qualified names of the repacked 4-bit projections of ``layers`` (``name_of(index)``:
    a layer's qualified name)."""
    return [
        f"{name_of(index)}.{name}"
        for index, layer in enumerate(layers)
        for name, module in layer.named_modules()
        if repacked(module)
    ]


def note_portable_inference(module: nn.Module, x: torch.Tensor) -> None:
    """Once, loudly, where bitsandbytes' own forward would have repacked this streamed weight
    (eval mode, no gradient, a CPU with AVX512-BF16): it runs the portable path instead."""
    global _noted
    if _noted or not getattr(module, "support_avx512bf16_for_cpu", False) or module.training or x.requires_grad:
        return
    _noted = True
    logger.warning(
        "layerstream: on this CPU bitsandbytes runs resident 4-bit inference through its AVX512-BF16 "
        "kernel, on weights it repacks in place (with bfloat16 block scales). Streamed weights are not "
        "repacked: they run bitsandbytes' portable CPU path, equal to a resident model with "
        "support_avx512bf16_for_cpu=False on its Linear4bit modules, and slightly different from (and "
        "slower than) a repacked one. Training is not affected."
    )
