"""Values a checkpoint does not hold: non-persistent buffers, computed as transformers does.

A model built on the meta device and filled from a checkpoint gets its parameters and
persistent buffers from the files, but its non-persistent buffers (Gemma's embedding scale,
rotary frequencies under any name, causal masks kept in attention modules) are not in any
file: ``to_empty`` leaves them as uninitialised memory. transformers' own loader fills them
by running the model's ``_init_weights`` on every module with the loaded tensors flagged
``_is_hf_initialized``. This module does the same for one module at a time, as the loader
materialises it, and shields the loaded tensors so that no ``_init_weights`` (even one that
writes in place without the flag's guard) can touch a loaded value: while the module is
initialised, its parameters and persistent buffers are flagged meta stand-ins.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
from torch import nn


def initialisers(model: nn.Module) -> Dict[int, nn.Module]:
    """id(module) -> the PreTrainedModel whose ``_init_weights`` applies to it: the nearest
    one at or above it, as transformers' ``initialize_weights`` dispatches for composite
    models (a vision tower keeps its own initialiser)."""
    from transformers import PreTrainedModel

    owners: Dict[int, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners.setdefault(id(module), owner)
        for child in module.children():
            visit(child, owner)

    visit(model, model)
    return owners


def _computed(module: nn.Module) -> list[str]:
    return [name for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None]


def compute_buffers(modules: Iterable[nn.Module], owners: Dict[int, nn.Module]) -> None:
    """Give each non-persistent buffer of ``modules`` (already materialised, not meta) the
    value transformers' loader would give it. Loaded tensors are never written."""
    from transformers import initialization

    for module in modules:
        names = _computed(module)
        owner = owners.get(id(module))
        if not names or owner is None or not hasattr(owner, "_init_weights"):
            continue
        shielded = {}
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is None or (kind == "_buffers" and name in names):
                    continue
                stand_in = torch.empty_like(tensor, device="meta")
                stand_in = (
                    nn.Parameter(stand_in, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else stand_in
                )
                stand_in._is_hf_initialized = True
                shielded[(kind, name)] = tensor
                getattr(module, kind)[name] = stand_in
        try:
            for name in names:
                module._buffers[name]._is_hf_initialized = False
            with torch.no_grad(), initialization.guard_torch_init_functions():
                owner._init_weights(module)
        finally:
            for (kind, name), tensor in shielded.items():
                getattr(module, kind)[name] = tensor
            for name in names:
                buffer = module._buffers.get(name)
                if buffer is not None and hasattr(buffer, "_is_hf_initialized"):
                    del buffer._is_hf_initialized
