"""Writes to streamed weights: the host store is the truth, the device copies follow it.

A streamed layer's weights are computed from device copies (slots, the resident window)
of its host region. Whatever changes the model's tensors after streaming must reach the
next forward, or be refused before any output comes from stale copies:

- in-place writes (``p.mul_()``, ``load_state_dict``, an optimizer step) bump the tensor's
  version counter;
- writes through ``p.data`` would not: ``.data`` is a new tensor with a counter of its own.
  So each streamed host Parameter gets ``WritesVisible`` mixed into its class: its
  ``.data`` is an alias that shares the parameter's counter, and assigning ``.data`` bumps
  it;
- a tensor assigned in place of a streamed one (``load_state_dict(assign=True)``,
  ``module.weight = ...``, a new Params4bit from a 4-bit merge) is a different object in
  the module's table.

``LayerRecord.fresh`` checks a layer's tensors and versions at each of its visits (a dict
lookup and a version read per tensor, no device sync); ``StreamRuntime`` then has the store
take in the change (``HostStore.sync``) and drops or refreshes the layer's device copies.
A change between a layer's forward and its backward recompute is refused, as autograd
refuses one to a tensor it saved. What stays invisible: writes that bypass torch's
tensors altogether (through ``.numpy()`` or ``untyped_storage()``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch._C import TensorBase

from . import swap


class WritesVisible:
    """Mixed into a streamed host Parameter's class: ``.data`` shares the version counter."""

    @property
    def data(self):
        with torch._C.DisableTorchFunctionSubclass():
            return TensorBase.detach(self)

    @data.setter
    def data(self, value):
        TensorBase.data.__set__(self, value)
        torch.autograd.graph.increment_version(self)


def watch(record) -> None:
    """Make writes to the layer's host Parameters through ``.data`` visible (idempotent)."""
    for entry, host in zip(record.entries, record.host_values):
        if entry.bound and isinstance(host, nn.Parameter):
            swap.swap_in(host, WritesVisible)


def unwatch(record) -> None:
    for host in record.host_values:
        if isinstance(host, nn.Parameter):
            swap.swap_out(host, WritesVisible)
