"""Debug mode (``StreamConfig(checksum=True)`` or ``LAYERSTREAM_CHECKSUM=1``): every slot
is checked against its layer's host bytes twice, after the copy that filled it and
before each use, and the first mismatch raises with the layer and the slot.

The checksum is the 64-bit sum of the region's 32-bit words (plus any tail bytes). It
catches a slot holding another layer, a copy that had not finished or was cut short, and
bytes changed after the copy; it does not catch words swapped within one layer. Each
check waits for the device, so this mode is for finding a fault, not for training.
"""

from __future__ import annotations

import warnings
from typing import Dict

import torch

from ..errors import SlotChecksumError


def checksum(region: torch.Tensor) -> int:
    """Sum of the 32-bit words of a uint8 region (and of its 0-3 tail bytes)."""
    whole = region.numel() // 4 * 4
    total = region[:whole].view(torch.int32).sum(dtype=torch.int64)
    if whole < region.numel():
        total = total + region[whole:].sum(dtype=torch.int64)
    return int(total.item())


def checksum_of(buffer, offset: int, nbytes: int) -> int:
    """``checksum`` of ``nbytes`` bytes of any buffer (a read-only memory map too) from ``offset``."""
    if not nbytes:
        return 0
    with warnings.catch_warnings():  # read only: nothing writes through this view
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return checksum(torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset))


class SlotChecker:
    def __init__(self, pool, records):
        self.pool = pool
        self.records = records
        self._host: Dict[int, int] = {}
        self.checks = 0

    def _expected(self, index: int) -> int:
        value = self._host.get(index)
        if value is None:
            region = self.records[index].host_region
            value = checksum(region) if region is not None else self.records[index].reference_checksum
            self._host[index] = value
        return value

    def _check(self, index: int, slot: int, when: str) -> None:
        record = self.records[index]
        got = checksum(self.pool.buffers[slot][: record.nbytes])
        self.checks += 1
        want = self._expected(index)
        if got != want:
            raise SlotChecksumError(
                f"layerstream debug checksum: slot {slot} does not hold {record.name} (layer {index}) "
                f"{when}: checksum {got}, the host copy has {want}. The slot was overwritten, or "
                "its copy had not finished or was wrong; slot owner says layer "
                f"{self.pool.owner[slot]}."
            )

    def forget(self, index: int) -> None:
        """The layer's host bytes changed: checksum them again at its next check."""
        self._host.pop(index, None)

    def after_copy(self, index: int, slot: int) -> None:
        if self.pool.cuda:
            self.pool.copy_stream.synchronize()
        self._check(index, slot, "after its copy")

    def before_use(self, index: int, slot: int) -> None:
        self._check(index, slot, "before use")
