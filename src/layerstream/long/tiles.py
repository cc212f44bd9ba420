"""What the tiled MLP and the tiled norms share: the tile a call takes, and the frozen
tensors a module reads, saved by the forward and bound again around the backward's tiles.

A streamed layer's weights are bound to a slot only during the layer's call; a tile's
recompute in backward must read the ones the checkpoint's recompute bound, which autograd
hands back as saved tensors."""

from __future__ import annotations

import contextlib
from typing import List

import torch
from torch import nn


def frozen_tensors(module: nn.Module) -> List[tuple]:
    """(table, name) of every tensor the module tree reads that takes no gradient, now."""
    found = []
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is not None and not tensor.requires_grad:
                    found.append((table, name))
    return found


@contextlib.contextmanager
def bound_to(specs: List[tuple], tensors) -> None:
    saved = [table[name] for table, name in specs]
    for (table, name), tensor in zip(specs, tensors):
        table[name] = tensor
    try:
        yield
    finally:
        for (table, name), tensor in zip(specs, saved):
            table[name] = tensor


def tile_for(setting, x: torch.Tensor):
    """The tile a call on ``x`` takes: the number set, or (mlp_tile_tokens="auto") the one
    decided for its token count in the dict the runtime fills; None under no_grad then."""
    if isinstance(setting, dict):
        return setting.get(x.numel() // x.shape[-1]) if x.dim() >= 2 and torch.is_grad_enabled() else None
    return setting
