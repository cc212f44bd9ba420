"""The decoder layers' norms differentiated in tiles of tokens (with ``mlp_tile_tokens``).

Why: an RMSNorm upcasts its input to float32, and autograd keeps that float32 copy for the
backward; the backward then makes several more float32 tensors of tokens x hidden (the
gradient through the upcast, the square, the scale) before it hands back a gradient in the
compute dtype. Once the MLP runs in tiles, that is the largest working set left in a layer's
backward at long sequences: about 48 bytes x hidden per token, where the layer's input in
bf16 is 2.

Here a norm's forward runs whole, as it would untiled (the same kernels on the same
tensor, so the same output), and keeps only its input in the compute dtype. Backward runs
the norm's forward again on ``tile`` tokens at a time and takes each tile's input gradient,
so only one tile's float32 temporaries exist at once. A norm is per token: each row's
gradient is computed from that row alone, by the same operations as untiled.

Only inputs in bf16 or fp16 are tiled, which is where the memory is (a float32 copy of a
16-bit input). A float32 input is read by the norm's operations directly, so autograd sums
their gradients for it together with the gradient of the residual branch, in an order that
tiling would change; the upcast makes the norm's part one term, added to the residual's as
untiled. Float32 inputs run untiled.

Only norms whose weights take no gradient are tiled (LoRA and QLoRA freeze them): a
trainable norm weight's gradient sums over every token, and summing it tile by tile would
change the order of that sum. Such a norm runs untiled, and that is said once.

The norm's weight of a streamed layer is bound to a slot only during the layer's call, so
it is saved with ``save_for_backward`` (the checkpoint's recompute hands backward the one
it bound) and bound again around the backward's tiles, as the tiled MLP does.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from ..modules import swap
from ..modules.discovery import find_decoder_layers
from ..system.log import get_logger
from .chunked_loss import autocast_as, autocast_state, refuse_second_order, span_gradients, spans
from .tiles import bound_to, frozen_tensors, tile_for

logger = get_logger(__name__)

_TILE = "_layerstream_norm_tile_tokens"
# inputs the norms upcast to float32: only through the upcast is the input's gradient from
# inside the norm one term (see the module's docstring)
_UPCAST = (torch.bfloat16, torch.float16)
_said_trainable = False


def _plain(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return super(TiledNorm, module).forward(x)


class TiledNormFunction(torch.autograd.Function):
    """The norm on the whole of ``x``; backward recomputes it ``tile`` rows at a time."""

    @staticmethod
    def forward(ctx, x, module, tile, specs, *frozen):
        with torch.no_grad():
            out = _plain(module, x)
        ctx.save_for_backward(x, *frozen)
        ctx.module, ctx.tile, ctx.specs = module, tile, specs
        ctx.autocast = autocast_state(x.device.type)
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_second_order("mlp_tile_tokens", "the tiled norms")
        x, *frozen = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(rows)

        def run(leaf, a, b):
            return _plain(ctx.module, leaf), grad_rows[a:b]

        with bound_to(ctx.specs, frozen), autocast_as(ctx.autocast):
            span_gradients(rows, spans(rows.shape[0], ctx.tile), [], [], run, grad_x)
        return (grad_x.reshape(x.shape), None, None, None, *([None] * len(frozen)))


class TiledNorm:
    """Mixed in front of a norm's class: a longer input than the tile is differentiated
    tile by tile (its forward is the norm's own)."""

    def forward(self, x, *args, **kwargs):
        tile = tile_for(self.__dict__[_TILE], x)
        if (
            not tile
            or args
            or kwargs
            or x.dim() < 2
            or x.numel() // x.shape[-1] <= tile
            or not (torch.is_grad_enabled() and x.requires_grad)
            or x.dtype not in _UPCAST
        ):
            return super().forward(x, *args, **kwargs)
        if any(p.requires_grad for p in self.parameters()):
            _say_trainable(self)
            return super().forward(x, *args, **kwargs)
        specs = frozen_tensors(self)
        return TiledNormFunction.apply(x, self, tile, specs, *[table[name] for table, name in specs])


def _say_trainable(norm: nn.Module) -> None:
    global _said_trainable
    if not _said_trainable:
        _said_trainable = True
        logger.warning(
            "layerstream: %s has a trainable weight, so its backward is not tiled (a tiled sum of "
            "its gradient would change its order); long sequences hold its float32 temporaries whole.",
            type(norm).__name__,
        )


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Norm") and not list(module.children())


def norms(model: nn.Module) -> List[nn.Module]:
    """The norms that are direct parts of each decoder layer (before and after attention and
    the MLP), not those inside attention (Qwen3's per-head q/k norms act on a few columns)."""
    _, layers = find_decoder_layers(model)
    return [child for layer in layers for child in layer.children() if _is_norm(child)]


def apply(model: nn.Module, tiles) -> nn.Module:
    """Differentiate each decoder layer's norms ``tiles`` tokens at a time: a number, or
    (mlp_tile_tokens="auto") the dict of token count -> tile the caller fills as it decides."""
    for norm in norms(model):
        swap.swap_in(norm, TiledNorm)
        object.__setattr__(norm, _TILE, tiles)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``."""
    _, layers = find_decoder_layers(model)
    for layer in layers:
        for norm in layer.children():
            if swap.has(norm, TiledNorm):
                swap.swap_out(norm, TiledNorm)
                norm.__dict__.pop(_TILE, None)
    return model
