"""What the tiled MLP and the tiled norms share: the tile a call takes, and the frozen
tensors a module reads, saved by the forward and bound again around the backward's tiles.

A streamed layer's weights are bound to a slot only during the layer's call; a tile's
recompute in backward must read the ones the checkpoint's recompute bound, which autograd
hands back as saved tensors."""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states


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


class TilesByLength(dict):
    """mlp_tile_tokens="auto": the tile decided for each token count (the runtime fills it,
    the MLPs and norms read it). Keyed by token count, a checkpoint's recompute tiles as its
    forward did whatever ran in between; where the decisions are made afresh between a
    forward and its backward (``set_offload_activations``), ``replaying`` makes the
    recompute's thread read the table its forward read."""

    def __init__(self):
        super().__init__()
        self._replay = threading.local()

    def get(self, tokens, default=None):
        table = getattr(self._replay, "table", None)
        return dict.get(self if table is None else table, tokens, default)

    def snapshot(self) -> Dict[int, int]:
        """The tiles as decided now, for a pass's recompute to replay."""
        return dict(self)

    @contextlib.contextmanager
    def replaying(self, table: Optional[Dict[int, int]]):
        """This thread reads ``table`` (a ``snapshot``; None: the live one) until the end."""
        previous = getattr(self._replay, "table", None)
        self._replay.table = table
        try:
            yield
        finally:
            self._replay.table = previous


def tile_for(setting, x: torch.Tensor):
    """The tile a call on ``x`` takes: the number set, or (mlp_tile_tokens="auto") the one
    decided for its token count in the dict the runtime fills; None under no_grad then."""
    if isinstance(setting, dict):
        return setting.get(x.numel() // x.shape[-1]) if x.dim() >= 2 and torch.is_grad_enabled() else None
    return setting


class ForwardRandomState:
    """The random state the forward's tiles start from: the CPU's and that of the device
    the input is on. Backward runs its tiles in the forward's order inside ``replayed``, so
    each tile draws the dropout masks its forward drew. ``fork_rng`` puts back the state
    backward found: the recompute takes no numbers from the stream the rest of the step
    draws from, so a streamed and a resident run consume the same numbers in one order."""

    def __init__(self, x: torch.Tensor):
        self.device_type = x.device.type
        self.cpu = torch.get_rng_state()
        self.devices, self.states = get_device_states(x)

    @contextlib.contextmanager
    def replayed(self):
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.states, device_type=self.device_type)
            yield
