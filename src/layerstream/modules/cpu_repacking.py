"""bitsandbytes' CPU inference repacking, and why streamed 4-bit weights never take it.

On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit.forward`` repacks its weight in place on
the first call in eval mode whose input does not require grad: another byte layout for its CPU
kernel, and a QuantState whose block scales it rounds to bfloat16 (``packing_format_for_cpu``).
It converts them back when it saves a state dict or moves the weight with ``.cuda()``, but not
exactly: the scales stay rounded (re-quantised under double quantisation). A streamed weight
lives in the host store and is read in bitsandbytes' standard layout, so:

- a model whose layers hold repacked weights is refused by ``stream_model``
  (the ``projections`` that are ``repacked``): their bytes would be read as the standard layout, other values;
- weights repacked and converted back stream as they now are, equal to the same model resident,
  and ``stream_model`` says once that they are no longer the loaded weights (``round_tripped``);
- a streamed layer called where bitsandbytes would have repacked runs its portable path, which
  layerstream says once (``note_portable_path``): the same values as a resident model whose
  modules have ``support_avx512bf16_for_cpu=False``, not those of a repacked one.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from ..system.log import get_logger

logger = get_logger(__name__)

_noted = False


def _state(module: nn.Module):
    return getattr(module._parameters.get("weight"), "quant_state", None)


def repacked(module: nn.Module) -> bool:
    """Whether this Linear4bit's weight is in bitsandbytes' repacked CPU layout now."""
    return bool(getattr(_state(module), "packing_format_for_cpu", False))


def round_tripped(module: nn.Module) -> bool:
    """Whether bitsandbytes repacked this weight and converted it back (its QuantState keeps
    the ``original_qshape`` the repacking recorded): the block scales are not the loaded ones."""
    state = _state(module)
    return state is not None and not repacked(module) and hasattr(state, "original_qshape")


def projections(layers: nn.ModuleList, name_of) -> List[Tuple[str, nn.Module]]:
    """The 4-bit projections of ``layers`` with their qualified names (``name_of(index)``: a
    layer's qualified name)."""
    return [
        (f"{name_of(index)}.{name}", module)
        for index, layer in enumerate(layers)
        for name, module in layer.named_modules()
        if _state(module) is not None
    ]


def note_portable_path(module: nn.Module, x: torch.Tensor) -> None:
    """Once, loudly, where bitsandbytes' own forward would have repacked this streamed weight
    (a CPU with AVX512-BF16, the module in eval mode, an input that does not require grad):
    it runs bitsandbytes' portable path instead."""
    global _noted
    if _noted or not getattr(module, "support_avx512bf16_for_cpu", False) or module.training or x.requires_grad:
        return
    _noted = True
    logger.warning(
        "layerstream: on this CPU bitsandbytes computes a 4-bit projection in eval mode (its input not "
        "requiring grad) with its AVX512-BF16 kernel, on weights it repacks in place with bfloat16 block "
        "scales. Streamed weights are not repacked: they run bitsandbytes' portable CPU path, equal to a "
        "resident model with support_avx512bf16_for_cpu=False on its Linear4bit modules, and slightly "
        "different from (and slower than) a repacked one. Modules in train mode are not affected."
    )
