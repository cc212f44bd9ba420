"""The decode term of a plan: what one token step of generation copies, and from which batch
its compute hides the copies (``layerstream plan``; docs/plan.md).

Decoding visits every streamed layer once per token step, for every sequence of the batch
at once: the copies per token step do not grow with the batch, the compute does. So a
streamed model decodes at its copy bound (the layers copied per token step over the
host-to-device bandwidth) until the batch is large enough for the frozen layers' compute,
two FLOPs per parameter and sequence, to take as long: from there on it is compute-bound,
as a resident model is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .shapes import LayerShape

# frozen-weight FLOPs per generated token and parameter: one forward, no backward
DECODE_FLOPS_PER_TOKEN_PARAM = 2


@dataclass(frozen=True)
class DecodeTerm:
    layers_copied: int  # per token step
    copy_bytes: int  # per token step
    copy_seconds: float  # the copy bound of one token step
    params: int  # the streamed layers' frozen parameters (a sequence's FLOPs are twice this)
    compute_bound_batch: Optional[int]  # None: no --tflops given


def decode_term(
    sizes: Sequence[int], slots: int, bandwidth_gbps: float, params: int, tflops: Optional[float] = None
) -> DecodeTerm:
    """One token step: every layer but those the slots still hold from the last step is
    copied (counted from the smallest layers held, so an uneven stack is not undercounted)."""
    held = min(slots, len(sizes))
    copied = sorted(sizes)[held:]
    copy_bytes = sum(copied)
    seconds = copy_bytes / (bandwidth_gbps * 1e9) if bandwidth_gbps > 0 else 0.0
    batch = None
    if tflops and params:
        per_sequence = DECODE_FLOPS_PER_TOKEN_PARAM * params / (tflops * 1e12)
        batch = max(1, math.ceil(seconds / per_sequence))
    return DecodeTerm(len(copied), copy_bytes, seconds, params, batch)


def active_params(shapes: Sequence[LayerShape]) -> int:
    """Frozen parameters one token computes with across the layers: every nn.Linear, the
    router, and of a fused expert stack the share of the experts it is routed to."""
    total = 0
    for shape in shapes:
        total += sum(linear.in_features * linear.out_features for linear in shape.linears)
        for param in shape.params:
            routed = param.experts > 1 and shape.top_k
            total += param.numel * shape.top_k // param.experts if routed else param.numel
    return total
