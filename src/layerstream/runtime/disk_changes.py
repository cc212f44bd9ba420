"""A change to a disk layer's small tensors: kept on the device, as a plain model holds it.

The disk tier reads a layer's bytes from the checkpoint's files (or the NF4 layer cache)
as they are stored, so a change to one of its tensors cannot reach the copies the layer
computes from. The change QLoRA scripts make is peft's ``prepare_model_for_kbit_training``:
it casts every weight that is not 4-bit to float32 (``param.data = param.data.to(float32)``),
which in a 4-bit layer means the norms and biases: a few KiB of a layer of hundreds of MiB.
Between passes, such changed tensors leave the layer's streamed set and stay on the device
for good, holding the new values (a Parameter keeps its identity, so an optimizer made
before holds it still); the computation is the plain model's, which holds them there too.
The layer's other tensors stream from disk as before; the bytes the files hold for the
changed ones are still read and are not used.

What is refused as before (``report.disk_layer_write``): a change to a 4-bit weight or its
quantisation state, to a tensor's shape, to anything but a floating-point tensor, or one
whose tensors would hold more than ``1 / SHARE`` of the layer's bytes on the device (a
bfloat16 model cast whole would move its layers to the GPU, which the disk tier is there
to avoid).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ..modules import changes, nf4, swap
from ..system.log import get_logger
from ..tiers import disk_files
from ..tiers.store import HostStore, LayerRecord
from ..units import size_text

logger = get_logger(__name__)

SHARE = 8  # the changed tensors may hold at most this fraction (1 / SHARE) of the layer's bytes


def _can_stay(tensor: Optional[torch.Tensor], shape) -> bool:
    return (
        tensor is not None
        and not nf4.is_packed(tensor)
        and tensor.is_floating_point()
        and tuple(tensor.shape) == tuple(shape)
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DiskChanges:
    """Keeps the changed small tensors of disk layers on ``device``, and says so once."""

    def __init__(self, device: torch.device, store: HostStore):
        self.device = device
        self.store = store
        self.tensors = 0
        self.bytes = 0
        self._unreported: List[str] = []
        self._said = False

    def keep(self, record: LayerRecord) -> bool:
        """Take the changed tensors of ``record`` (a disk layer) out of its streamed set and
        onto the device, and take changes to those kept before; False (nothing changed)
        where the change cannot be kept, or where the layer is not a disk layer (a layer in
        host RAM takes any change into the store; one in a node-shared store refuses it)."""
        disk = self.store.disk
        if disk is None or not disk.holds(record.index) or self.store.segment is not None:
            return False
        if not record.quant_states_unchanged():
            return False
        positions = record.changed_positions()
        entries = [record.entries[position] for position in positions]
        keys = [(table, name, qualified) for table, name, *_, qualified in record.kept]
        keys += [(e.table, e.name, e.qualified_name) for e in entries]
        held = [table.get(name) for table, name, _ in keys]
        if any(tensor is None for tensor in held[: len(record.kept)]):
            return False  # a kept tensor removed from its module: refused, as for a streamed one
        if not all(_can_stay(e.current(), e.shape) for e in entries):
            return False
        nbytes = sum(_nbytes(tensor) for tensor in held)
        if nbytes * SHARE > record.nbytes:  # what the layer keeps on the device, all passes together
            return False
        with torch.no_grad():
            for entry in entries:
                self._move(entry)
            for table, name, _ in keys[: len(record.kept)]:  # assigned anew since: to the device too
                if table[name].device != self.device:
                    self._place(table, name)
        self._unreported += [entry.qualified_name for entry in entries]
        moved = set(positions)
        keep = [position for position in range(len(record.entries)) if position not in moved]
        record.entries = [record.entries[position] for position in keep]
        record.arena_views = [record.arena_views[position] for position in keep]
        record.host_values = [record.host_values[position] for position in keep]
        HostStore._bound(record)  # what each call binds and restores, and the watch, without them
        record.watch_kept(keys)
        self.tensors += len(entries)
        self.bytes += sum(_nbytes(entry.current()) for entry in entries)
        return True

    def _move(self, entry) -> None:
        current = entry.current()
        disk_files.unguard(current)  # its values are no longer the files'
        if isinstance(current, nn.Parameter):
            swap.swap_out(current, changes.WritesVisible)
        self._place(entry.table, entry.name)

    def _place(self, table: dict, name: str) -> None:
        current = table[name]
        if isinstance(current, nn.Parameter):
            current.data = current.data.to(self.device, copy=True)  # the same Parameter; not the files' map
        else:
            table[name] = current.to(self.device, copy=True)

    def report(self) -> None:
        """Once, after the pass start that first kept any: what stays on the device, and why."""
        if not self._unreported:
            return
        first, count = self._unreported[0], len(self._unreported)
        self._unreported = []
        if self._said:
            return
        self._said = True
        logger.warning(
            "layerstream: %d tensors of layers the disk tier reads were changed (e.g. %s; peft's "
            "prepare_model_for_kbit_training casts every weight that is not 4-bit to float32). The disk tier "
            "reads each layer as stored, so these stay on %s for good with their new values (%s), as a plain "
            "model holds them; the rest of each layer streams from disk as before.",
            count,
            first,
            self.device,
            size_text(self.bytes),
        )
