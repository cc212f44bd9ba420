"""Bindings: the device tensors a layer computes with while it sits in a slot (or in the
resident window), one per bound tensor, as views of the buffer at the layer's offsets.

A 4-bit weight becomes a Params4bit over the slot with a QuantState of its own whose
tensors are slot views too (``nf4.slot_weight``), and carries a check for backward that
its slot still holds the layer (``owner_check``). Built once per (slot, layer) and reused.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..errors import SlotOwnerError
from . import nf4


def make(record, buffer: torch.Tensor, owner_check) -> list:
    """(table, name, device tensor) for each bound tensor of a layer held in ``buffer``."""
    views = [buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in record.entries]
    quant: Dict[int, dict] = {}
    for entry, view in zip(record.entries, views):
        if entry.is_quant_state:
            quant.setdefault(id(entry.module), {})[entry.quant_path] = view
    binding = []
    for entry, view, host in zip(record.entries, views, record.host_values):
        if not entry.bound:
            continue
        if entry.kind == "_parameters":
            host_state = nf4.packed_state(host)
            if host_state is not None and id(entry.module) in quant:
                view = nf4.slot_weight(host, view, nf4.clone_state(host_state, quant[id(entry.module)]))
                view._layerstream_owner = owner_check
            else:
                view = nn.Parameter(view, requires_grad=False)
        binding.append((entry.table, entry.name, view))
    return binding


def owner_check(pool, index: int, name: str):
    """A check for backward: the slot a saved tensor lives in still holds this layer.

    The slot is found from the tensor's address, not remembered: under checkpointing the
    tensors backward reads come from the recompute, which may use another slot than the
    forward did.
    """

    def check(tensor: torch.Tensor) -> None:
        slot = pool.slot_of_pointer(tensor.data_ptr())
        if slot is None or not pool.owns(slot, index):
            holder = None if slot is None else pool.owner[slot]
            raise SlotOwnerError(f"backward of {name} reads slot {slot}, which holds layer {holder}")

    return check
