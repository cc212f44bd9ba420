"""A streamed NF4 weight dequantised once for a run of calls on the same weight.

Why: bitsandbytes computes a training-sized 4-bit projection (more rows than its fused
kernel takes) as dequantise + ``F.linear``, so a weight is dequantised again at every call.
The tiled MLP calls each projection once per tile, forward and again in backward: at
45,056 tokens in 4,096-token tiles a streamed layer's three MLP weights were dequantised 66
times a step instead of 6 (an 8B model: 0.34 GiB written each time). Inside
``once_per_weight`` each weight is dequantised at its first call and the same tensor serves
the rest.

The bits do not change: dequantising is deterministic, so the tensor kept is the one each
call would have made, and ``F.linear`` on it is what bitsandbytes' unfused fallback (and
``dequantized_linear``, the route of a streamed projection that trains) runs. Calls that
bitsandbytes would send to its fused kernel never come here (``nf4.streamed_nf4_forward``
asks first), nor do weights quantised from another dtype than the compute dtype (whose
backward in bitsandbytes casts a copy dequantised to the stored dtype). Memory: the run
holds its weights' dequantised copies until it ends (an 8B MLP's three: 0.34 GiB). The
backward held them anyway (one tile's graph keeps all three, which the plan counts); the
forward's tiles, which held one at a time, now hold three, still under the backward's peak.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Optional, Tuple

import torch

_local = threading.local()


def dequantised_weight(packed: torch.Tensor, state, dtype: torch.dtype) -> torch.Tensor:
    """The 4-bit weight in ``dtype``, as bitsandbytes' gemm_4bit fallback dequantises it: the
    nested absmax rebuilt in float32 plus its offset, then the 4-bit codes scaled."""
    absmax = state.absmax
    if state.nested:
        absmax = (
            torch.ops.bitsandbytes.dequantize_blockwise.default(
                state.absmax, state.state2.absmax, state.state2.code, 256, torch.float32
            )
            + state.offset
        )
    return torch.ops.bitsandbytes.dequantize_4bit.default(
        packed, absmax, state.blocksize, state.quant_type, state.shape, dtype
    )


@contextlib.contextmanager
def once_per_weight():
    """Within: a streamed 4-bit projection taking bitsandbytes' dequantise + linear route
    dequantises its weight at the first call only (``kept``). The kept tensors are dropped
    when the outermost ``with`` ends; an inner one shares the outer one's."""
    outer: Optional[Dict] = getattr(_local, "table", None)
    if outer is None:
        _local.table = {}
    try:
        yield
    finally:
        if outer is None:
            _local.table = None


def active() -> bool:
    """Whether calls on this thread are inside ``once_per_weight``."""
    return getattr(_local, "table", None) is not None


def kept(module, packed: torch.Tensor, state, dtype: torch.dtype, counters: Optional[dict] = None) -> torch.Tensor:
    """``module``'s weight dequantised in ``dtype``: made at the run's first call, the same
    tensor after. Keyed by the module, the packed bytes' address (a slot the weight was
    bound to) and the dtype, so a weight bound elsewhere between calls is dequantised anew."""
    table: Dict[Tuple, torch.Tensor] = _local.table
    key = (id(module), packed.data_ptr(), packed.device, dtype)
    weight = table.get(key)
    if weight is None:
        weight = table[key] = dequantised_weight(packed, state, dtype)
        if counters is not None:
            counters["nf4_dequantisations"] += 1
    return weight
