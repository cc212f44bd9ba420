"""The streamed decoder layer, and the modules above the stack.

A streamed layer keeps its class name, module tree, parameter names and Parameter
objects; ``StreamedLayer`` is mixed into its class (``swap``) and changes four things:

- ``__call__`` asks the runtime for a slot, binds the slot's tensors into the layer's
  ``_parameters``/``_buffers`` tables for the duration of the call, and restores the
  host tensors afterwards. With autograd on, the whole call (fetch, bind, compute) runs
  under non-reentrant activation checkpointing, so backward recomputes it and fetches
  the weights again: no autograd node keeps slot memory past the layer's call. The
  recompute replays the forward's random state, so dropout draws the forward's masks.
- ``gradient_checkpointing`` always reads False: the layer checkpoints itself, and
  transformers' own wrapper (on ``__call__`` up to 5.22, on ``forward`` from 5.23) must
  not checkpoint it a second time. Setting it is accepted and ignored.
- ``_apply`` (behind ``.to()``, ``.cuda()``, ``.half()``) skips the streamed tensors, so
  moving a model moves only its resident part.
- copying or pickling it is refused with an error that says what to do.

``AboveStreamedLayers`` is mixed into every module on the path from the model down to
the stack. Its ``_apply`` refuses a cast or move the streamed weights cannot follow
*before* any child is touched (``Module._apply`` recurses into children first, so a
refusal deep in the stack would come after the embedding was already cast), and it
refuses deepcopy and pickling the same way.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from ..errors import StreamingError
from ..system.log import get_logger
from . import swap

_COPY = (
    "copy.deepcopy and pickling of a streamed model are not supported: its weights live in "
    "layerstream's page-locked host store, which neither copies nor pickles. Call "
    "layerstream.unstream_model(model) first (and stream the copy again), save with "
    "save_pretrained / state_dict, or load a second model with layerstream.from_pretrained."
)


class _NotCopyable:
    def __deepcopy__(self, memo):
        raise StreamingError(_COPY)

    def __reduce_ex__(self, protocol):
        raise StreamingError(_COPY)


class StreamedLayer(_NotCopyable):
    """Mixed in front of a decoder layer's own class while it streams."""

    @property
    def gradient_checkpointing(self) -> bool:  # the layer checkpoints itself
        return False

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value) -> None:
        # kept where the layer's own class reads it once unstream_model swaps this class out
        self.__dict__["gradient_checkpointing"] = value

    def __call__(self, *args, **kwargs):
        return _streamed_call(self, args, kwargs)

    def _apply(self, fn, recurse=True):
        runtime = self._layerstream_runtime
        runtime.check_apply(fn)
        with runtime.hidden_from_apply(self._layerstream_index):
            return super()._apply(fn, recurse)


def refuse_cast_or_move(fn, dtypes, device: torch.device) -> None:
    """Refuse an ``_apply`` function (``.to()``, ``.half()``, ``.cuda()``) that would change
    the dtype of streamed weights of these ``dtypes``, or move them off ``device``: tried on
    an empty tensor of each dtype, before anything is changed."""
    for dtype in dtypes:
        probe = fn(torch.empty(0, dtype=dtype))
        if probe.dtype != dtype:
            raise StreamingError(
                f"this call would cast streamed weights from {dtype} to {probe.dtype}. Nothing "
                "was changed. Streamed weights keep the dtype they were streamed with: load the "
                f"model in {probe.dtype} (from_pretrained(..., dtype={probe.dtype}); under `layerstream "
                "run`, in the script's own call), or cast it before stream_model, or unstream_model, "
                "cast, and stream again."
            )
        if probe.device.type == "cuda" and probe.device != device:
            raise StreamingError(
                f"the model streams to {device}; moving it to {probe.device} is not "
                "supported (nothing was changed). Stream with StreamConfig(device=...) set to "
                "the device you want."
            )
        if probe.device.type not in ("cpu", "cuda"):
            raise StreamingError(
                f"a streamed model cannot move to {probe.device} (nothing was changed); unstream_model first."
            )


class AboveStreamedLayers(_NotCopyable):
    """Mixed in front of each module above a streamed stack (the model, its decoder, the
    stack's ModuleList): casts and moves are checked whole before anything changes."""

    def _apply(self, fn, recurse=True):
        runtime = self.__dict__.get("_layerstream_runtime")
        if runtime is not None:
            runtime.check_apply(fn)
        return super()._apply(fn, recurse)


# keyword arguments through which decoder layers receive or update a KV cache
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def without_cache(kwargs: dict, warned: bool):
    """A checkpointed layer must not write a KV cache (the recompute would write it twice):
    an empty cache is dropped, as transformers does under gradient checkpointing (one
    warning), and one holding past tokens is refused. Returns (kwargs, warned)."""
    names = [name for name in CACHE_KWARGS if kwargs.get(name) is not None]
    if not names:
        return kwargs, warned
    kwargs = dict(kwargs)
    for name in names:
        seq_length = getattr(kwargs[name], "get_seq_length", None)
        if seq_length is not None and seq_length() > 0:  # refused: the cache stays as it was, usable
            raise StreamingError(
                "a KV cache holding past tokens reached a streamed layer with autograd on. "
                "Streamed layers are checkpointed under autograd and cannot read or extend "
                "a cache there; run generation and cached inference under torch.no_grad() "
                "(model.generate does). PEFT prefix tuning passes its virtual tokens this way and "
                "cannot train streamed: use prompt tuning or LoRA."
            )
        _remember_unfilled(kwargs[name])
        kwargs[name] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    if not warned:
        get_logger("layerstream.runtime.core").warning(
            "layerstream: streamed layers are checkpointed while autograd is on, so they do "
            "not fill the KV cache passed to them (as with transformers' gradient "
            "checkpointing). Run inference under torch.no_grad() to fill it; set "
            "model.config.use_cache = False for training to silence this."
        )
    return kwargs, True


# caches a streamed layer was given with autograd on and did not fill: a later pass that
# decodes from one would run without the tokens it should hold. Each is marked too (an
# attribute, which copy.deepcopy and pickling carry to a copy of it), and held weakly
# where it takes no attribute.
_UNFILLED = weakref.WeakSet()
_UNFILLED_MARK = "_layerstream_unfilled"
_any_unfilled = False  # whether any cache was left unfilled in this process (the hot path's check)


def _remember_unfilled(cache) -> None:
    global _any_unfilled
    _any_unfilled = True
    try:
        setattr(cache, _UNFILLED_MARK, True)
        return
    except (AttributeError, TypeError):  # a class with __slots__, or a tuple
        pass
    try:
        _UNFILLED.add(cache)
    except TypeError:  # not weakly referable: a cache class of the model's own
        pass


def _unfilled(cache) -> bool:
    return getattr(cache, _UNFILLED_MARK, False) is True or (bool(_UNFILLED) and cache in _UNFILLED)


def refuse_unfilled_cache(kwargs: dict) -> None:
    """Refuse a KV cache that streamed layers were given with autograd on, which they did
    not fill (``without_cache``), or a copy of one: decoding from it, as a loop continuing
    from a forward's ``past_key_values`` does, would attend to none of the tokens that
    forward saw and give other tokens than the resident model, without a word."""
    if not _any_unfilled:
        return
    for name in CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is not None and _unfilled(cache):
            raise StreamingError(
                "this KV cache (or the cache it was copied from) was passed to streamed layers by a "
                "forward with autograd on, which did not fill it (streamed layers are checkpointed "
                "under autograd, as with transformers' gradient checkpointing), so decoding from it "
                "would ignore the tokens of that forward. Run the forward that fills the cache under "
                "torch.no_grad() (model.generate does), with a new cache."
            )


def refuse_second_order(output, layer: nn.Module):
    """A streamed layer's backward recomputes it on weights bound from a slot that later
    layers' copies overwrite, so a graph built by that backward (``create_graph=True``:
    gradients of gradients, e.g. a gradient penalty) would be differentiated on other
    bytes. A hook on the layer's output sees its gradient before the layer's backward
    starts, with grad mode on only under ``create_graph``: the refusal comes before any
    layer recomputes. Returns ``output``."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if first is not None:
        first.register_hook(functools.partial(_refuse_create_graph, layer))
    return output


def _refuse_create_graph(layer: nn.Module, grad):
    if torch.is_grad_enabled():
        name = layer._layerstream_runtime.records[layer._layerstream_index].name
        raise StreamingError(
            f"a second derivative (backward with create_graph=True, e.g. a gradient penalty) through the "
            f"streamed layer {name} is not supported: its backward reads weights from a GPU slot that later "
            "layers reuse, so the graph for the second derivative would read other weights. Differentiate "
            "twice on a model that is not streamed (layerstream.unstream_model(model))."
        )


def call_unstreamed(layer: nn.Module, args, kwargs):
    """Run the layer as plain ``nn.Module.__call__`` (hooks, then forward)."""
    return nn.Module.__call__(layer, *args, **kwargs)


def _streamed_call(layer, args, kwargs):
    return layer._layerstream_runtime.call_layer(layer, args, kwargs)


# torch.compile would otherwise turn a raised error into a graph break and run on; a
# forbidden callable stops compilation, and its name is the message the user sees.
_streamed_call.__qualname__ = (
    "layerstream: torch.compile cannot trace a streamed decoder layer (its weights change "
    "place on every call); run the model eagerly, or compile only modules that do not stream"
)
torch._dynamo.forbid_in_graph(_streamed_call)


def make_streamed(layer: nn.Module, runtime, index: int) -> None:
    swap.swap_in(layer, StreamedLayer)
    object.__setattr__(layer, "_layerstream_runtime", runtime)
    object.__setattr__(layer, "_layerstream_index", index)


def make_plain(layer: nn.Module) -> None:
    swap.swap_out(layer, StreamedLayer)
    for name in ("_layerstream_runtime", "_layerstream_index"):
        layer.__dict__.pop(name, None)


def ancestors(model: nn.Module, layers: nn.ModuleList) -> list:
    """The modules from ``model`` down to the stack (the stack included): each has the
    next one, or the stack, among its descendants."""
    path = [model]
    while path[-1] is not layers:
        for child in path[-1].children():
            if child is layers or any(m is layers for m in child.modules()):
                path.append(child)
                break
        else:  # pragma: no cover - find_decoder_layers found it under model
            break
    return path


def guard_ancestors(modules, runtime) -> None:
    for module in modules:
        swap.swap_in(module, AboveStreamedLayers)
        object.__setattr__(module, "_layerstream_runtime", runtime)


def release_ancestors(modules, runtime) -> None:
    for module in modules:
        swap.swap_out(module, AboveStreamedLayers)
        if module.__dict__.get("_layerstream_runtime") is runtime:
            module.__dict__.pop("_layerstream_runtime", None)


_REGISTRATIONS = [0]  # parameters and buffers registered anywhere, since installed


def _count_registration(*_args):
    _REGISTRATIONS[0] += 1


def registrations() -> int:
    """A counter that moves whenever any module registers a parameter or buffer: a cheap
    sign that adapters may have been added since it was last read. (Not children: a
    model's forward that slices its ``ModuleList`` registers modules on every call.)"""
    if not _REGISTRATIONS[0]:
        _REGISTRATIONS[0] = 1
        nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        nn.modules.module.register_module_buffer_registration_hook(_count_registration)
    return _REGISTRATIONS[0]


def tensors_off_device(records, device: torch.device):
    """(module, table kind, key, tensor) of each tensor of a streamed layer that does not
    stream (LoRA adapters, added buffers) and is not on ``device``."""
    for record in records:
        streamed = {(id(e.module), e.name) for e in record.entries if e.bound}
        for module in record.module.modules():
            for kind in ("_parameters", "_buffers"):
                for key, tensor in getattr(module, kind).items():
                    if tensor is not None and tensor.device != device and (id(module), key) not in streamed:
                        yield module, kind, key, tensor


def place_resident_tensors(records, device: torch.device) -> int:
    """Move the tensors of streamed layers that do not stream to the device the layers
    run on; returns how many moved.

    PEFT puts an adapter on its base layer's device, and a streamed base weight lives in
    host memory, so adapters added after streaming start on the host; the Trainer does not
    move a 4-bit model, and a user's own loop may not move it either. Parameters keep their
    identity (``.data`` is replaced), so an optimizer made before still holds them.
    """
    misplaced = list(tensors_off_device(records, device))
    with torch.no_grad():
        for module, kind, key, tensor in misplaced:
            if kind == "_parameters":
                tensor.data = tensor.data.to(device)
            else:
                module._buffers[key] = tensor.to(device)
    return len(misplaced)
