"""The decoder layers' MLP in tiles of tokens (``mlp_tile_tokens``).

Why: a Llama-style MLP's working set is tokens x intermediate (14336 for Llama-3-8B,
28672 for 70B): gate, up, their product and the gradients of each. At long sequences that
is the largest part of one layer's backward. Here the MLP runs ``tile`` tokens at a time:
forward keeps only its input; backward runs each tile's forward again and takes its
gradient, so only one tile's intermediates exist at a time. The MLP is per token, so the
tiles' outputs are the rows of the whole output.

Streamed layers are recomputed under checkpoint, and their weights are bound to a slot only
during each call. So the frozen tensors the tiles read are saved with
``save_for_backward`` (checkpointing then hands backward the ones its recompute bound) and
bound again around the backward's tiles; nothing keeps a slot's memory past the call.
Trainable tensors (LoRA) are resident: their gradients are summed over the tiles in order,
the same code resident or streamed, so the two agree bit for bit.

Dropout (PEFT's ``lora_dropout``): the backward's tiles run with the random state the
forward's tiles started from (``ForwardRandomState``), so each tile draws the masks its
forward drew, as ``torch.utils.checkpoint`` does with ``preserve_rng_state``. The masks are
drawn tile by tile, so they are not those of an untiled MLP with the same seed.

Streamed NF4 projections dequantise their weight once for all of a call's tiles
(``nf4_dense``), forward and backward, where bitsandbytes would dequantise it at each tile:
the same bits, without re-dequantising every tile.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from ..config import check_tokens
from ..errors import StreamingError
from ..modules import nf4_dense, swap
from ..modules.discovery import describe_family, find_decoder_layers, layer_name
from . import adapter_inputs, tiled_norm
from .chunked_loss import autocast_as, autocast_state, refuse_second_order, span_gradients, spans
from .tiles import ForwardRandomState, bound_to, frozen_tensors, tile_for

_TILE = "_layerstream_mlp_tile_tokens"
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _plain(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return super(TiledMLP, module).forward(x)


class StashInputs(torch.autograd.Function):
    """Identity on the MLP's input that saves it and the frozen weights for the tiles'
    backward, before any tile runs. A non-reentrant checkpoint's recompute stops once it
    has rebuilt every tensor its forward saved (torch's early stop): in a decoder layer
    nothing after the MLP saves one, so the recompute stops here and never runs the MLP,
    whose output it would discard. Saved after the tiles instead, the MLP's forward ran
    three times per step instead of two. Where something after the MLP does save (a norm
    on its output), the recompute goes on and runs the tiles as before."""

    @staticmethod
    def forward(ctx, x, *frozen):
        ctx.save_for_backward(x, *frozen)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


class TiledFunction(torch.autograd.Function):
    """The MLP on ``tile``-token rows of ``x``; backward recomputes each tile. Its input and
    frozen weights are saved by ``stash`` (the StashInputs node ``x`` came from), or here
    when there is none (``x`` takes no gradient, so no node was recorded)."""

    @staticmethod
    def forward(ctx, x, stash, module, tile, specs, frozen_count, *tensors):
        frozen = tensors[:frozen_count]
        ctx.random = ForwardRandomState(x)
        rows = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad(), nf4_dense.once_per_weight():  # each tile written into the output
            for a, b in spans(rows.shape[0], tile):
                part = _plain(module, rows[a:b].unsqueeze(0))[0]
                if out is None:
                    out = part.new_empty((rows.shape[0], part.shape[-1]))
                out[a:b] = part
        ctx.stash = stash
        ctx.save_for_backward(*(() if stash is not None else (x, *frozen)))
        ctx.module, ctx.tile, ctx.specs = module, tile, specs
        ctx.trainables = tensors[frozen_count:]
        ctx.autocast = autocast_state(x.device.type)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        refuse_second_order("mlp_tile_tokens", "the tiled MLP")  # before the saved tensors recompute
        x, *frozen = ctx.stash.saved_tensors if ctx.stash is not None else ctx.saved_tensors
        wanted = ctx.needs_input_grad[6 + len(frozen) :]
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(rows) if ctx.needs_input_grad[0] else None

        def run(leaf, a, b):
            return _plain(ctx.module, leaf.unsqueeze(0)), grad_rows[a:b].unsqueeze(0)

        with bound_to(ctx.specs, frozen), autocast_as(ctx.autocast), ctx.random.replayed(), nf4_dense.once_per_weight():
            parts = spans(rows.shape[0], ctx.tile)
            param_grads = span_gradients(rows, parts, ctx.trainables, wanted, run, grad_x)
        return (
            None if grad_x is None else grad_x.reshape(x.shape),
            *([None] * (5 + len(frozen))),
            *param_grads,
        )


class TiledMLP:
    """Mixed in front of the MLP's class: inputs longer than the tile run tile by tile."""

    def forward(self, x, *args, **kwargs):
        tile = tile_for(self.__dict__[_TILE], x)
        if not tile or args or kwargs or x.dim() < 2 or x.numel() // x.shape[-1] <= tile:
            return super().forward(x, *args, **kwargs)
        specs = frozen_tensors(self)
        frozen = [table[name] for table, name in specs]
        trainables = [p for p in self.parameters() if p.requires_grad]
        stash = None
        if torch.is_grad_enabled() and x.requires_grad:
            x = StashInputs.apply(x, *frozen)
            stash = x.grad_fn
        return TiledFunction.apply(x, stash, self, tile, specs, len(frozen), *frozen, *trainables)


def _tileable(mlp) -> bool:
    """A per-token MLP of projections: Llama-style (gate_proj, up_proj, down_proj) or with the
    gate and up projections fused (Phi-3's gate_up_proj). A mixture of experts is not: its
    block routes tokens and returns more than the MLP's output."""
    if mlp is None or hasattr(mlp, "experts") or not hasattr(mlp, "down_proj"):
        return False
    return all(hasattr(mlp, name) for name in _PROJECTIONS) or hasattr(mlp, "gate_up_proj")


def mlps(model: nn.Module) -> List[nn.Module]:
    """Each decoder layer's MLP, or an error naming the one that cannot be tiled."""
    path, layers = find_decoder_layers(model)
    found = []
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not _tileable(mlp):
            what = "no mlp" if mlp is None else f"an mlp of type {type(mlp).__name__}"
            if hasattr(mlp, "experts"):
                what += " (a mixture of experts, which routes each token to some of its experts)"
            raise StreamingError(
                f"mlp_tile_tokens tiles MLPs of gate, up and down projections (Llama, Mistral, Qwen, "
                f"Gemma, Phi-3), but {layer_name(path, index)} of {describe_family(model)} has {what}. "
                "Nothing was changed. Leave mlp_tile_tokens unset for this model (StreamConfig("
                "mlp_tile_tokens=None); no --mlp-tile-tokens, --layer_stream_mlp_tile_tokens or "
                "stream.mlp_tile_tokens); offload_activations still lowers the memory of long sequences."
            )
        found.append(mlp)
    return found


def check(model: nn.Module, tokens: int) -> None:
    """Refuse what ``apply`` cannot tile, before anything changes (``stream_model`` and
    ``from_pretrained`` call it before they stream a layer)."""
    check_tokens("mlp_tile_tokens", tokens)
    mlps(model)


def apply(model: nn.Module, tokens: int) -> nn.Module:
    """Run each decoder layer's MLP ``tokens`` tokens at a time, differentiate its norms as
    many at a time (``tiled_norm``), and keep only the inputs of its attention adapters'
    dropout (``adapter_inputs``). Returns the same model."""
    check_tokens("mlp_tile_tokens", tokens)
    for mlp in mlps(model):  # every layer's, or a refusal before any changes
        swap.swap_in(mlp, TiledMLP)
        object.__setattr__(mlp, _TILE, tokens)
    adapter_inputs.apply(model, tokens)
    return tiled_norm.apply(model, tokens)


def apply_per_length(model: nn.Module, tiles: dict) -> nn.Module:
    """mlp_tile_tokens="auto": each MLP takes the tile ``tiles`` holds for its input's token
    count (none: untiled), a dict the caller fills as it decides. Keyed by the token count,
    a checkpoint's recompute runs as its forward did, whatever ran in between. Autograd off
    (evaluation, generation), the MLPs run untiled."""
    for mlp in mlps(model):
        swap.swap_in(mlp, TiledMLP)
        object.__setattr__(mlp, _TILE, tiles)
    adapter_inputs.apply(model, tiles)
    return tiled_norm.apply(model, tiles)


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``."""
    _, layers = find_decoder_layers(model)
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and swap.has(mlp, TiledMLP):
            swap.swap_out(mlp, TiledMLP)
            mlp.__dict__.pop(_TILE, None)
    adapter_inputs.remove(model)
    return tiled_norm.remove(model)
