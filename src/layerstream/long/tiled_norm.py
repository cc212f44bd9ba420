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

The input's gradient keeps the untiled bits whatever its dtype. A 16-bit input reaches the
norm through one operation (the upcast), so the norm hands autograd one term, which autograd
adds to the residual branch's. A float32 input (peft's ``prepare_model_for_kbit_training``
leaves the residual stream in float32) is read by several of the norm's operations directly
(the square and the scale in an RMSNorm), and autograd adds each one's term to the residual
branch's in turn: ``(residual + scale) + square`` is not ``residual + (scale + square)`` in
floating point. So the Function takes the input once per operation that reads it (counted
on one row, once per norm), and backward hands back each operation's own term, as
each tile's graph delivered it, in the order autograd delivered them: autograd adds them to
the residual's as it would have untiled.

Only norms whose weights take no gradient are tiled (LoRA and QLoRA freeze them): a
trainable norm weight's gradient sums over every token, and summing it tile by tile would
change the order of that sum. Such a norm runs untiled, and that is said once.

Rows are summed as in the whole input only where a tile has enough of them: on CUDA, torch
shapes a row reduction's launch by the number of rows below 16 (for float32 at 4,096 wide:
blocks of 32 lanes by 16 rows; 4 rows take blocks of 128 lanes by 4, which add a row's values
in another order); on the CPU, a single row wider than torch's grain (32,768) is summed in two
passes across threads. So a tile has at least ``fewest_rows`` rows (16 on CUDA, 2 on the CPU),
and a shorter remainder joins the tile before it (``tile_spans``): 16,388 tokens in tiles of
4,096 end with one of 4,100.

The norm's weight of a streamed layer is bound to a slot only during the layer's call, so
it is saved with ``save_for_backward`` (the checkpoint's recompute hands backward the one
it bound) and bound again around the backward's tiles, as the tiled MLP does.
"""

from __future__ import annotations

import weakref
from typing import Dict, List

import torch
from torch import nn

from ..modules import swap
from ..modules.discovery import find_decoder_layers
from ..system.log import get_logger
from .chunked_loss import autocast_as, autocast_state, refuse_second_order, span_graph, spans
from .tiles import bound_to, frozen_tensors, tile_for

logger = get_logger(__name__)

_TILE = "_layerstream_norm_tile_tokens"
# the fewest rows a CUDA tile takes: from 16 rows on, a row reduction's launch is that of the
# whole input (torch's setReduceConfig, at every width a norm has)
FEWEST_ROWS = 16
# how many of a norm's operations read its input, by norm (weakly) and (dtype, device, autocast)
_READS: "weakref.WeakKeyDictionary[nn.Module, Dict[tuple, int]]" = weakref.WeakKeyDictionary()
_said_trainable = False


def _plain(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return super(TiledNorm, module).forward(x)


def fewest_rows(device: torch.device) -> int:
    """The fewest rows a tile on ``device`` takes for its row sums to be those of the whole
    input: CUDA chooses a reduction's launch by its row count below ``FEWEST_ROWS``; the CPU
    splits a reduction with one output across threads, one with two or more by output."""
    return FEWEST_ROWS if device.type == "cuda" else 2


def tile_spans(rows: int, tile: int, fewest: int) -> List[tuple]:
    """(start, end) of each tile of ``rows`` rows: ``tile`` rows each (at least ``fewest``),
    a last one shorter than ``fewest`` joined to the one before it."""
    parts = spans(rows, max(tile, fewest))
    if len(parts) > 1 and parts[-1][1] - parts[-1][0] < fewest:
        parts[-2:] = [(parts[-2][0], parts[-1][1])]
    return parts


def _edges_to(leaf: torch.Tensor, out: torch.Tensor) -> Dict[torch.autograd.graph.Node, List[int]]:
    """The nodes of ``out``'s graph that hand ``leaf`` a gradient, each with the indices of
    its edges to it (an operation may read the leaf twice)."""
    edges: Dict[torch.autograd.graph.Node, List[int]] = {}
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for index, (child, _) in enumerate(node.next_functions):
            if child is not None and getattr(child, "variable", None) is leaf:
                edges.setdefault(node, []).append(index)
            elif child is not None:
                todo.append(child)
    return edges


def _reads(module: nn.Module, x: torch.Tensor) -> int:
    """How many of the norm's operations read its input: counted on one row's graph, once
    per norm (held weakly), dtype, device type and autocast state. Its saved tensors stay out
    of any hooks around the step (a checkpoint's, offloading's)."""
    known = _READS.setdefault(module, {})
    key = (x.dtype, x.device.type, str(autocast_state(x.device.type)))
    if key not in known:
        row = x.detach()[(0,) * (x.dim() - 1)].clone().unsqueeze(0).requires_grad_()
        with torch.enable_grad(), span_graph():
            known[key] = sum(len(indices) for indices in _edges_to(row, _plain(module, row)).values())
    return known[key]


def _each_reads_gradient(
    module: nn.Module, leaf: torch.Tensor, grad: torch.Tensor, terms: list, a: int, b: int
) -> None:
    """Rows ``a:b`` of ``terms``: the gradient each operation reading ``leaf`` hands it, in
    the order autograd hands them over (the order it adds them in), for the norm's forward
    on ``leaf``. Each is copied as its operation's backward returns it, and goes no further:
    autograd would otherwise add them up into ``leaf``'s gradient, a sum nothing reads (for a
    float32 input, a read of two terms and a write of their sum per element, per tile)."""
    out = _plain(module, leaf)
    delivered = 0

    def keep(indices):
        def hook(grad_inputs, _grad_outputs):
            nonlocal delivered
            for i in indices:
                if delivered < len(terms):
                    terms[delivered][a:b] = grad_inputs[i]
                delivered += 1
            return tuple(None if i in indices else g for i, g in enumerate(grad_inputs))

        return hook

    handles = [node.register_hook(keep(indices)) for node, indices in _edges_to(leaf, out).items()]
    try:
        torch.autograd.grad(out, leaf, grad, allow_unused=True)  # None: every term was kept above
    finally:
        for handle in handles:
            handle.remove()
    if delivered != len(terms):  # the graph differs from the one counted in forward
        raise RuntimeError(f"layerstream: a tiled norm's input was read {delivered} times, not {len(terms)}")


class TiledNormFunction(torch.autograd.Function):
    """The norm on the whole of ``x``; backward recomputes it ``tile`` rows at a time. ``x``
    comes once per operation of the norm that reads it, and each gets that operation's term."""

    @staticmethod
    def forward(ctx, x, module, tile, specs, reads, *copies_and_frozen):
        with torch.no_grad():
            out = _plain(module, x)
        ctx.save_for_backward(x, *copies_and_frozen[reads - 1 :])
        ctx.module, ctx.tile, ctx.specs, ctx.reads = module, tile, specs, reads
        ctx.autocast = autocast_state(x.device.type)
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_second_order("mlp_tile_tokens", "the tiled norms")
        x, *frozen = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad.reshape(-1, grad.shape[-1])
        terms = [torch.empty_like(rows) for _ in range(ctx.reads)]
        with bound_to(ctx.specs, frozen), autocast_as(ctx.autocast), torch.enable_grad(), span_graph():
            for a, b in tile_spans(rows.shape[0], ctx.tile, fewest_rows(x.device)):
                leaf = rows[a:b].detach().requires_grad_()
                _each_reads_gradient(ctx.module, leaf, grad_rows[a:b], terms, a, b)
        terms = [term.reshape(x.shape) for term in terms]
        return (terms[0], None, None, None, None, *terms[1:], *([None] * len(frozen)))


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
            or x.numel() // x.shape[-1] <= tile  # past it by fewer than fewest_rows: one span, kept as tiled
            or not (torch.is_grad_enabled() and x.requires_grad)
            or not x.is_contiguous()  # the tiles' rows would be a copy, reduced by other kernels
        ):
            return super().forward(x, *args, **kwargs)
        if any(p.requires_grad for p in self.parameters()):
            _say_trainable(self)
            return super().forward(x, *args, **kwargs)
        specs = frozen_tensors(self)
        reads = _reads(self, x)
        if not reads:  # nothing of the input reaches the output's graph: nothing to tile
            return super().forward(x, *args, **kwargs)
        copies = [x] * (reads - 1)
        return TiledNormFunction.apply(x, self, tile, specs, reads, *copies, *[table[name] for table, name in specs])


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
