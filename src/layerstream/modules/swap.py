"""Class swapping: how layerstream gives the model's own objects streamed behaviour.

A streamed decoder layer, the streamed embedding and head, a streamed 4-bit projection,
the modules above the decoder stack, and the host copy of every streamed parameter keep
their identity (names, state_dict keys, optimiser references, hooks); only their class is
swapped for a subclass made here, with the same name, that mixes one or more behaviours
in front of the original class. ``swap_in`` adds a behaviour, ``swap_out`` removes it, and
the class goes back to the original once none is left, so behaviours stack and come off
in any order.

``tensors_hidden`` is the other half of the vocabulary: it hides some of a module's
tensors from ``nn.Module._apply`` (behind ``.to()``, ``.cuda()``, ``.half()``), so moving a
model moves only its resident part.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Tuple

_BASE = "_layerstream_base"
_MIXINS = "_layerstream_mixins"
_CLASSES: Dict[tuple, type] = {}


def original_class(obj) -> type:
    """The class ``obj`` had before any swap."""
    return getattr(type(obj), _BASE, type(obj))


def hooked(module, backward: bool = False) -> bool:
    """Whether a call of ``module`` runs hooks beside its class's forward: forward hooks of
    its own or global ones, and with ``backward`` backward hooks too (a caller that would
    compute the module's output another way must not skip them)."""
    from torch.nn.modules import module as torch_module

    own = [module._forward_pre_hooks, module._forward_hooks]
    shared = [torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks]
    if backward:
        own += [module._backward_pre_hooks, module._backward_hooks]
        shared += [torch_module._global_backward_pre_hooks, torch_module._global_backward_hooks]
    return any(own) or any(shared)


def behaviours(obj) -> Tuple[type, ...]:
    """The behaviours mixed into ``obj``'s class, oldest first."""
    return getattr(type(obj), _MIXINS, ())


def has(obj, mixin: type) -> bool:
    return mixin in behaviours(obj)


def _composed(base: type, mixins: Tuple[type, ...]) -> type:
    """``base`` with ``mixins`` in front (the newest first in the method order); a mixin
    that names the torch class it stands in for (``replaces``) goes below ``base``'s own
    methods instead, just above that class, so a subclass's forward that calls
    ``super().forward`` reaches it."""
    if not mixins:
        return base
    key = (base, mixins)
    cls = _CLASSES.get(key)
    if cls is None:
        names = {"__module__": base.__module__, "__qualname__": base.__qualname__}
        core = base
        for below in (m for m in mixins if getattr(m, "replaces", None) is not None):
            core = below if core is below.replaces else _undecorated(type(base.__name__, (core, below), dict(names)))
        front = tuple(m for m in reversed(mixins) if getattr(m, "replaces", None) is None)
        cls = _undecorated(type(base.__name__, (*front, core), {**names, _BASE: base, _MIXINS: mixins}))
        _CLASSES[key] = cls
    return cls


def _undecorated(cls: type) -> type:
    """Drop a ``forward`` that a base class's ``__init_subclass__`` put on ``cls`` when it was
    made (transformers >= 5.23 wraps every subclass's forward for gradient checkpointing):
    the swapped class keeps the original class's own forward, not one wrapped twice."""
    if "forward" in cls.__dict__:
        delattr(cls, "forward")
    return cls


def swap_in(obj, mixin: type) -> None:
    """Mix ``mixin`` into ``obj``'s class (once; a second call changes nothing)."""
    mixins = behaviours(obj)
    if mixin not in mixins:
        obj.__class__ = _composed(original_class(obj), mixins + (mixin,))


def swap_out(obj, mixin: type) -> None:
    """Take ``mixin`` out of ``obj``'s class (nothing happens when it is not there)."""
    mixins = behaviours(obj)
    if mixin in mixins:
        obj.__class__ = _composed(original_class(obj), tuple(m for m in mixins if m is not mixin))


@contextlib.contextmanager
def tensors_hidden(tables: Iterable[Tuple[dict, set]]):
    """Hide the named entries of these ``_parameters``/``_buffers`` dicts for the block.

    The dicts are edited in place and restored in their original order: other code holds
    these dict objects, and state_dict order must not change. An entry the block replaced
    keeps its new value; a hidden entry comes back as it was.
    """
    saved = []
    for table, names in tables:
        saved.append((table, names, list(table.items())))
        for name in names:
            table.pop(name, None)
    try:
        yield
    finally:
        for table, names, original in saved:
            changed = dict(table)
            table.clear()
            table.update((key, value if key in names else changed.get(key, value)) for key, value in original)
            table.update((key, value) for key, value in changed.items() if key not in table)
