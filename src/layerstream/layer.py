"""The streamed decoder layer: one call binds slot views, runs the layer, unbinds.

A streamed layer keeps its class name, module tree, parameter names and Parameter
objects. Its class is swapped for a subclass made here that changes three things:

- ``__call__`` asks the runtime for a slot, binds the slot's tensors into the layer's
  ``_parameters``/``_buffers`` tables for the duration of the call, and restores the
  host tensors afterwards. With autograd on, the whole call (fetch, bind, compute) runs
  under non-reentrant activation checkpointing, so backward recomputes it and fetches
  the weights again: no autograd node keeps slot memory past the layer's call.
- ``gradient_checkpointing`` always reads False: the layer checkpoints itself, and
  transformers' own wrapper (on ``__call__`` up to 5.22, on ``forward`` from 5.23) must
  not checkpoint it a second time. Setting it is accepted and ignored.
- ``_apply`` (behind ``.to()``, ``.cuda()``, ``.half()``) skips the streamed tensors, so
  moving a model moves only its resident part.
"""

from __future__ import annotations

from typing import Dict, Type

import torch
from torch import nn

from . import nf4

_SUBCLASSES: Dict[tuple, type] = {}


class StreamedLayerMixin:
    """Mixed in front of a decoder layer's own class while it streams."""

    _layerstream_is_streamed = True

    @property
    def gradient_checkpointing(self) -> bool:  # the layer checkpoints itself
        return False

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return _streamed_call(self, args, kwargs)

    def _apply(self, fn, recurse=True):
        runtime = self._layerstream_runtime
        runtime.check_apply(fn)
        with runtime.streamed_tensors_hidden(self._layerstream_index):
            return super()._apply(fn, recurse)


def _streamed_call(layer, args, kwargs):
    return layer._layerstream_runtime.call_layer(layer, args, kwargs)


# torch.compile would otherwise turn a raised error into a graph break and run on; a
# forbidden callable stops compilation, and its name is the message the user sees.
_streamed_call.__qualname__ = (
    "layerstream: torch.compile cannot trace a streamed decoder layer (its weights change "
    "place on every call); run the model eagerly, or compile only modules that do not stream"
)
torch._dynamo.forbid_in_graph(_streamed_call)


class StreamedLinear4bitMixin:
    """Mixed in front of a bitsandbytes Linear4bit whose weight streams: routes its
    matmul around MatMul4Bit (see nf4.py)."""

    def forward(self, x):
        weight = self.weight
        return nf4.streamed_nf4_forward(self, x, getattr(weight, "_layerstream_owner", None),
                                        self._layerstream_runtime.nf4_counts)


def streamed_class(cls: Type[nn.Module], mixin: type = StreamedLayerMixin) -> Type[nn.Module]:
    """The streamed subclass of ``cls`` (same name), made once per class and reused."""
    key = (cls, mixin)
    sub = _SUBCLASSES.get(key)
    if sub is None:
        sub = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__,
                                                "__qualname__": cls.__qualname__,
                                                "_layerstream_base": cls})
        _SUBCLASSES[key] = sub
    return sub


def call_unstreamed(layer: nn.Module, args, kwargs):
    """Run the layer as plain ``nn.Module.__call__`` (hooks, then forward)."""
    return nn.Module.__call__(layer, *args, **kwargs)


def make_streamed(layer: nn.Module, runtime, index: int) -> None:
    layer.__class__ = streamed_class(type(layer))
    object.__setattr__(layer, "_layerstream_runtime", runtime)
    object.__setattr__(layer, "_layerstream_index", index)


def make_streamed_linear4bit(module: nn.Module, runtime) -> None:
    module.__class__ = streamed_class(type(module), StreamedLinear4bitMixin)
    object.__setattr__(module, "_layerstream_runtime", runtime)


def make_plain(layer: nn.Module) -> None:
    layer.__class__ = type(layer)._layerstream_base
    for name in ("_layerstream_runtime", "_layerstream_index"):
        layer.__dict__.pop(name, None)
