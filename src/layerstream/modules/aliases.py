"""Streamed weights whose memory a tensor outside the model still shares.

``stream_model`` copies each frozen layer tensor into the host store and the model holds
views of that store from then on. A tensor taken from the model before (a ``state_dict()``,
a ``.detach()``, a ``.data``) keeps the old memory: reading it gives the values streamed,
but a write through it no longer reaches the model, as it would reach a model that is not
streamed, and its memory (the whole layer's, on a GPU) stays allocated while it is held.
This finds those tensors before the copy, so that ``stream_model`` can say so once.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import List, Optional

import torch
from torch import nn


def storage_owners(tensor: torch.Tensor) -> Optional[int]:
    """How many owners ``tensor``'s storage has, as torch counts them: each tensor on it, and
    the storage object this asks through, is one. None where torch does not offer the count."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(tensor.untyped_storage()._cdata)


def held_elsewhere(model: nn.Module, records) -> List[str]:
    """The qualified names of the streamed tensors (``records``' bound entries) whose
    storage more tensors share than the model's own: torch counts a storage's owners, and
    each of the model's parameters and buffers on it, and the storage object asked, is
    one. Empty where torch does not offer the count."""
    if getattr(torch._C, "_storage_Use_Count", None) is None:
        return []
    owners = Counter()
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type != "meta":
            owners[_key(tensor)] += 1
    shared = []
    for record in records:
        for entry in record.entries:
            tensor = entry.current() if entry.bound else None
            if tensor is None or tensor.device.type == "meta":
                continue
            if storage_owners(tensor) > owners[_key(tensor)] + 1:
                shared.append(entry.qualified_name)
    return shared


def _key(tensor: torch.Tensor):
    return tensor.device, tensor.untyped_storage().data_ptr()
