"""The attention adapters' dropped inputs drawn again in backward (with ``mlp_tile_tokens``).

Why: with LoRA dropout above 0 (TRL's default 0.05), PEFT computes ``lora_A(dropout(x))``
for each adapted projection, and autograd keeps, per projection, the dropout's mask and
``lora_A``'s input (the dropped ``x``, cast to the compute dtype under autocast). For the
four attention projections of a Llama layer that is ``4 x 3 x hidden`` bytes a token,
about a third of what a layer's backward holds at long sequences, though ``q``, ``k`` and
``v`` read the same ``x``. Once the MLP runs in tiles it is the largest term left that
does not need to be kept.

Here, where a step's MLP is tiled, each attention adapter's dropout and ``lora_A`` run as
one Function that keeps only ``x`` (one tensor for the three that share it) and the random
state the dropout drew from; backward runs the dropout and ``lora_A`` again on ``x`` with
that state replayed (as ``torch.utils.checkpoint`` does with ``preserve_rng_state``, and
the tiled MLP for its tiles), so the mask is the one the forward drew, and takes the
gradients of ``x`` and of ``lora_A``'s weight from the same operations on the same values:
the bits are those of adapters that keep their inputs. The forward computes exactly what
PEFT's does; the dropout's settings are taken there (``eval()`` before backward changes
nothing).

How it is reached without rewriting PEFT's forward: inside the PEFT layer's own forward
(``InsideLoraForward``), the adapter's ``nn.Dropout`` hands its input back unchanged and
marks its ``lora_A``, holding the input weakly (``DeferredDropout``), and ``lora_A`` then
runs both (``DroppedInputLinear``), in PEFT's own ``lora_A(dropout(x))``. A dropout called
from elsewhere drops as always; a ``lora_A`` with forward hooks (which could swap or read
its input) keeps PEFT's way, said once. Adapters with a variant (DoRA and others), whose
forward reads the dropout's output elsewhere, are left as they are; so are the MLP's, which
its tiles already recompute; so are float32 adapters on a 16-bit projection under autocast
(``_a_wide_cast_under_autocast``), where keeping PEFT's cast would cost more than it frees.
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import swap
from ..modules.discovery import find_decoder_layers, on_mlp_side
from ..system.log import get_logger
from .chunked_loss import autocast_as, autocast_state, refuse_second_order, span_graph
from .tiles import ForwardRandomState, tile_for

_TILE = "_layerstream_adapter_tile_tokens"  # the tile setting: recompute where a tile is decided
_PAIRED = "_layerstream_paired_lora_A"
_PENDING = "_layerstream_pending_dropout"
_BASE_LAYER = "_layerstream_adapted_base_layer"
_ADAPTER = "_layerstream_lora_layer"  # the dropout's PEFT LoRA layer
_INSIDE = "_layerstream_inside_lora_forward"
_said_hooked = False
logger = get_logger(__name__)


def _dropped_then_linear(linear: nn.Module, drop: tuple, x: torch.Tensor) -> torch.Tensor:
    """PEFT's ``lora_A(dropout(x))``: ``nn.Dropout``'s own operation with the dropout's
    settings as the forward found them (``drop``: p, training, inplace), then ``lora_A``'s
    own forward."""
    return super(DroppedInputLinear, linear).forward(F.dropout(x, *drop))


def _settings(dropout: nn.Dropout) -> tuple:
    return dropout.p, dropout.training, dropout.inplace


class DroppedInputFunction(torch.autograd.Function):
    """``lora_A(dropout(x))``, keeping ``x`` and the random state; backward draws the same
    mask again and differentiates the same operations."""

    @staticmethod
    def forward(ctx, x, linear, drop, *trainables):
        ctx.random = ForwardRandomState(x)
        ctx.trainables = trainables
        with torch.no_grad():
            out = _dropped_then_linear(linear, drop, x)
        ctx.save_for_backward(x)
        ctx.linear, ctx.drop = linear, drop  # the settings as the forward ran (eval() since changes nothing)
        ctx.autocast = autocast_state(x.device.type)
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_second_order("mlp_tile_tokens", "the attention adapters' recomputed dropout")
        (x,) = ctx.saved_tensors
        trainables, wanted = ctx.trainables, ctx.needs_input_grad[3:]
        with autocast_as(ctx.autocast), ctx.random.replayed(), torch.enable_grad(), span_graph():
            leaf = x.detach().requires_grad_(ctx.needs_input_grad[0])
            out = _dropped_then_linear(ctx.linear, ctx.drop, leaf)
            inputs = ([leaf] if ctx.needs_input_grad[0] else []) + [p for p, need in zip(trainables, wanted) if need]
            grads = list(torch.autograd.grad(out, inputs, grad, allow_unused=True)) if inputs else []
        grad_x = grads.pop(0) if ctx.needs_input_grad[0] else None
        taken = iter(grads)
        return (grad_x, None, None, *[next(taken) if need else None for need in wanted])


def _a_wide_cast_under_autocast(x: torch.Tensor, base: Optional[nn.Module]) -> bool:
    """Whether ``x`` is PEFT's cast of a 16-bit projection's input to wider adapters (float32
    adapters on a bf16 model) under autocast: kept as PEFT keeps it, that cast is not kept
    at all (the mask and autocast's 16-bit copy are, 3 bytes an element), where drawing again
    would keep the 4-byte cast. A projection whose weight is not floating point (4-bit)
    takes its input uncast under autocast."""
    if base is None or not torch.is_autocast_enabled(x.device.type):
        return False
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return False
    return x.element_size() > weight.element_size()


class DeferredDropout:
    """Mixed in front of an attention adapter's ``nn.Dropout``: where the step's MLP is
    tiled, hands its input back and leaves the dropout to its ``lora_A``."""

    def forward(self, x):
        linear = self.__dict__.get(_PAIRED)
        tile = tile_for(self.__dict__.get(_TILE), x) if linear is not None else None
        if (
            not tile
            or not self.training
            or not torch.is_grad_enabled()
            or x.dim() < 2
            or x.numel() // x.shape[-1] <= tile
            or _a_wide_cast_under_autocast(x, self.__dict__.get(_BASE_LAYER))
            or not _inside(self.__dict__.get(_ADAPTER))  # called directly, not by PEFT's forward
            or _hooked(linear)
        ):
            return super().forward(x)
        linear.__dict__[_PENDING] = (self, weakref.ref(x))  # weakly: an exception before lora_A keeps nothing
        return x


class DroppedInputLinear:
    """Mixed in front of an attention adapter's ``lora_A``: runs the dropout its
    ``DeferredDropout`` left to it, with its own forward, keeping only the input."""

    def forward(self, x):
        pending = self.__dict__.pop(_PENDING, None)
        if pending is None:  # called without its dropout deferring to it
            return super().forward(x)
        dropout, deferred = pending
        if deferred() is not x:  # not the tensor its dropout handed back: drop this one as PEFT would
            return super().forward(super(DeferredDropout, dropout).forward(x))
        trainables = [p for p in self.parameters() if p.requires_grad]
        return DroppedInputFunction.apply(x, self, _settings(dropout), *trainables)


class InsideLoraForward:
    """Mixed in front of a PEFT LoRA layer whose attention adapters draw their dropout again:
    marks its own forward, the one place that calls ``lora_A(dropout(x))``."""

    def forward(self, *args, **kwargs):
        depth = self.__dict__.get(_INSIDE, 0)
        self.__dict__[_INSIDE] = depth + 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__[_INSIDE] = depth


def _inside(adapter: Optional[nn.Module]) -> bool:
    return adapter is not None and adapter.__dict__.get(_INSIDE, 0) > 0


def _hooked(module: nn.Module) -> bool:
    """Whether hooks around ``module``'s call could change or read its input: then its
    dropout runs as PEFT's, so they see the dropped input (said once: it keeps more)."""
    hooked = swap.hooked(module)
    global _said_hooked
    if hooked and not _said_hooked:
        _said_hooked = True
        logger.warning(
            "layerstream: a LoRA adapter's lora_A has forward hooks, so its dropout runs as PEFT's and "
            "keeps its mask and dropped input for backward (more memory at long sequences than the plan "
            "counts); remove the hooks to have it drawn again in backward instead."
        )
    return hooked


def _attention_adapters(layer: nn.Module) -> List[tuple]:
    """(dropout, lora_A, base layer, LoRA layer) of each plain LoRA adapter outside the
    layer's MLP whose dropout is an ``nn.Dropout`` above 0 and whose ``lora_A`` is an
    ``nn.Linear``."""
    found = []
    for child_name, child in layer.named_children():
        if on_mlp_side(child_name):  # the MLP's adapters: its tiles recompute them
            continue
        for module in child.modules():
            dropouts, lora_As = getattr(module, "lora_dropout", None), getattr(module, "lora_A", None)
            if not isinstance(dropouts, nn.ModuleDict) or not isinstance(lora_As, nn.ModuleDict):
                continue
            variants = getattr(module, "lora_variant", None) or {}
            for name, dropout in dropouts.items():
                linear = lora_As[name] if name in lora_As else None
                if name in variants or not isinstance(linear, nn.Linear):
                    continue
                if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                    found.append((dropout, linear, getattr(module, "base_layer", None), module))
    return found


def apply(model: nn.Module, tiles) -> nn.Module:
    """Recompute the attention adapters' dropped inputs in backward where a step's MLP is
    tiled: ``tiles`` is the tile setting (a number, or the dict "auto" fills). Adapters
    already set up are left as they are, so it can be called again for adapters added since
    (PEFT's injection after streaming)."""
    _, layers = find_decoder_layers(model)
    for layer in layers:
        for dropout, linear, base, adapter in _attention_adapters(layer):
            recompute(dropout, linear, tiles, base, adapter)
    return model


def recompute(dropout: nn.Dropout, linear: nn.Linear, tiles, base: nn.Module, adapter: nn.Module) -> None:
    """One adapter's ``lora_dropout`` and ``lora_A``: drawn again in backward where ``tiles``
    has a tile for the input's token count, in ``adapter``'s (the PEFT LoRA layer's) forward.
    ``base``: the adapted projection (its weight's dtype tells PEFT's cast of the input apart)."""
    if not swap.has(adapter, InsideLoraForward):
        swap.swap_in(adapter, InsideLoraForward)
    object.__setattr__(dropout, _ADAPTER, adapter)
    if not swap.has(dropout, DeferredDropout):
        swap.swap_in(dropout, DeferredDropout)
    if not swap.has(linear, DroppedInputLinear):
        swap.swap_in(linear, DroppedInputLinear)
    object.__setattr__(dropout, _TILE, tiles)
    object.__setattr__(dropout, _PAIRED, linear)
    object.__setattr__(dropout, _BASE_LAYER, base)


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``."""
    for module in model.modules():
        if swap.has(module, DeferredDropout):
            swap.swap_out(module, DeferredDropout)
            module.__dict__.pop(_TILE, None)
            module.__dict__.pop(_PAIRED, None)
            module.__dict__.pop(_BASE_LAYER, None)
            module.__dict__.pop(_ADAPTER, None)
        if swap.has(module, InsideLoraForward):
            swap.swap_out(module, InsideLoraForward)
            module.__dict__.pop(_INSIDE, None)
        if swap.has(module, DroppedInputLinear):
            swap.swap_out(module, DroppedInputLinear)
            module.__dict__.pop(_PENDING, None)
    return model
