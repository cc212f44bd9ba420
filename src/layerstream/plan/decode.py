"""The decode term of a plan: what one token step of generation copies, and from which batch
its compute hides the copies (``layerstream plan``; docs/plan.md).

Decoding visits every streamed layer once per token step, for every sequence of the batch
at once: the copies per token step do not grow with the batch, the compute does. Each token
step copies every layer (the slots hold the last layers when the next step starts at the
first), unless the slots hold them all. So a
streamed model decodes at its copy bound (the layers copied per token step over the
host-to-device bandwidth) until the batch is large enough for the frozen layers' compute,
two FLOPs per parameter and sequence, to take as long: from there on it is compute-bound,
as a resident model is.

A mixture-of-experts layer copies its experts by need at small batches
(``decisions.experts``): its shared part, and of its expert stacks the share of the
experts the batch's tokens are expected to choose. Then a token step's copies do grow with
the batch, up to whole layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, List, Optional, Sequence, Tuple

from ..checkpoints import mxfp4
from ..decisions.experts import copy_by_need, expected_share_hit
from .shapes import LayerShape

# (bytes of its expert stacks, experts per token, experts) of a layer; (0, 0, 0): none
Routed = Tuple[int, int, int]

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
    sizes: Sequence[int],
    slots: int,
    bandwidth_gbps: float,
    params: int,
    tflops: Optional[float] = None,
    routed: Optional[Sequence[Routed]] = None,
    batch: int = 1,
    kept: Collection[int] = (),
) -> DecodeTerm:
    """One token step of ``batch`` sequences: every streamed layer is copied, unless the
    slots hold them all (a token step runs the layers first to last, and the previous one
    left the last layers in the slots, so the ring has copied each of them again by the
    time it reaches them); ``routed`` (per layer, in the order of ``sizes``): what of a
    mixture-of-experts layer is copied by need; ``kept``: the indices of the layers the
    resident window keeps on the device, which stream no more."""
    every = zip(sizes, routed or [(0, 0, 0)] * len(sizes))
    layers = sorted(layer for index, layer in enumerate(every) if index not in kept)
    copied = [] if len(layers) <= slots else layers
    copy_bytes = _bytes_at(copied, batch)
    seconds = copy_bytes / (bandwidth_gbps * 1e9) if bandwidth_gbps > 0 else 0.0
    compute_bound = None
    if tflops and params:
        per_sequence = DECODE_FLOPS_PER_TOKEN_PARAM * params / (tflops * 1e12)
        compute_bound = _compute_bound_batch(copied, per_sequence, bandwidth_gbps)
    return DecodeTerm(len(copied), copy_bytes, seconds, params, compute_bound)


def _bytes_at(layers: List[Tuple[int, Routed]], batch: int) -> int:
    """Bytes one token step of ``batch`` sequences copies of these layers."""
    total = 0
    for size, (stack_bytes, top_k, experts) in layers:
        if stack_bytes and copy_by_need(batch, top_k, experts):
            size -= stack_bytes - math.ceil(stack_bytes * expected_share_hit(batch, top_k, experts))
        total += size
    return total


def _compute_bound_batch(layers: List[Tuple[int, Routed]], per_sequence: float, bandwidth_gbps: float) -> int:
    """The smallest batch whose frozen-layer compute takes as long as its copies (which
    grow with the batch while experts are copied by need, up to whole layers)."""
    seconds_per_byte = 1 / (bandwidth_gbps * 1e9) if bandwidth_gbps > 0 else 0.0
    whole = max(1, math.ceil(sum(size for size, _ in layers) * seconds_per_byte / per_sequence))
    batch = 1
    while batch < whole and any(stack and copy_by_need(batch, k, e) for _, (stack, k, e) in layers):
        if batch * per_sequence >= _bytes_at(layers, batch) * seconds_per_byte:
            return batch
        batch += 1
    return whole


def routed_bytes(shapes: Sequence[LayerShape], elem: int) -> List[Routed]:
    """Per layer: the bytes of its fused expert stacks (``elem`` bytes per element, the
    compute dtype they stay in; MXFP4's where they stay packed), experts per token and experts."""
    out = []
    for shape in shapes:
        stacks = [param for param in shape.params if param.experts > 1]
        if not stacks or not shape.top_k:
            out.append((0, 0, 0))
            continue
        values = sum(param.numel for param in stacks)
        stored = mxfp4.stored_bytes(values) if shape.dequantised else values * elem
        out.append((stored, shape.top_k, stacks[0].experts))
    return out


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
