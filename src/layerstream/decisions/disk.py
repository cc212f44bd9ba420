"""The disk tier's decisions, as pure logic (no CUDA, no files): what ``host_budget``
means in bytes, which layers stay in the page-locked host store and which are read from
disk each time, how large the staging ring is, and how far ahead reads run.

The lookahead follows from two measurements the disk tier makes as it runs: how long a
layer's read takes, and how long a layer's visit lasts (the compute the read can hide
behind). A read must start ``ceil(read / visit)`` visits before its layer is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import StreamConfigError
from ..units import GiB, size_text
from .schedule import spread_resident

# a few layer-sized staging regions: one being copied to the device, the rest being read
RING_REGIONS = 4
MIN_RING_REGIONS = 2
# host_budget="auto" leaves this much of the host to everything else (as the pin check does)
MIN_SYSTEM_RESERVE = 4 * GiB
SYSTEM_RESERVE_FRACTION = 0.10
# how quickly the measured read and visit times follow a change (exponential average)
SMOOTHING = 0.25


def system_reserve(total: int) -> int:
    return max(MIN_SYSTEM_RESERVE, int(total * SYSTEM_RESERVE_FRACTION))


def resolve_host_budget(setting, memory: Optional[Tuple[int, int]]) -> Optional[int]:
    """``host_budget`` in bytes: a size as given, "auto" the available RAM less a reserve
    for the system (``memory``: (MemAvailable, MemTotal), None where unknown), None: no
    budget (every layer in host RAM)."""
    if setting is None or isinstance(setting, int):
        return setting
    if memory is None:
        raise StreamConfigError(
            "host_budget='auto' needs the host's available memory (/proc/meminfo), which this "
            "system does not report; give host_budget a size, e.g. '48GiB'."
        )
    available, total = memory
    return max(available - system_reserve(total), 0)


@dataclass(frozen=True)
class Tiers:
    """Which layers live where: ``ram`` in the host store, ``disk`` read each time into a
    ring of ``ring_regions`` regions of ``region_bytes``."""

    ram: Tuple[int, ...]
    disk: Tuple[int, ...]
    ring_regions: int
    region_bytes: int

    @property
    def ring_bytes(self) -> int:
        return self.ring_regions * self.region_bytes if self.disk else 0


def split_tiers(layer_bytes: Sequence[int], budget: Optional[int], quantized: bool = False) -> Tiers:
    """Place the layers under ``budget`` host bytes: the staging ring first (up to
    RING_REGIONS regions, at least MIN_RING_REGIONS), then as many layers in RAM as the rest
    holds, spread through the stack so the compute of RAM layers hides disk reads.

    Raises StreamConfigError when the budget cannot hold even the smallest ring (advising NF4
    unless the layers are ``quantized`` already)."""
    count = len(layer_bytes)
    if budget is None or sum(layer_bytes) <= budget or count == 0:
        return Tiers(tuple(range(count)), (), 0, 0)
    largest = max(layer_bytes)
    regions = min(RING_REGIONS, budget // max(largest, 1))
    if regions < MIN_RING_REGIONS:
        raise StreamConfigError(
            f"host_budget {size_text(budget)} cannot hold the disk tier's staging ring: it needs at least "
            f"{MIN_RING_REGIONS} layer-sized regions ({size_text(MIN_RING_REGIONS * largest)} for layers of "
            f"{size_text(largest)}). Raise host_budget to {size_text(MIN_RING_REGIONS * largest)} or more, "
            + ("" if quantized else "load in NF4 (quantization='nf4': about a quarter of the bytes per layer), ")
            + "or leave host_budget unset to keep every layer in host RAM."
        )
    room = budget - regions * largest
    # the largest count of layers whose bytes fit the room (layers are usually all alike)
    kept = 0
    for candidate in range(count, -1, -1):
        chosen = spread_resident(count, candidate)
        if sum(layer_bytes[i] for i in chosen) <= room:
            kept = candidate
            break
    ram = tuple(spread_resident(count, kept))
    disk = tuple(i for i in range(count) if i not in set(ram))
    return Tiers(ram, disk, regions, largest)


class ReadAhead:
    """How many disk layers to keep being read ahead of the visit under way, from the
    measured time of one layer's read and of one layer's visit."""

    def __init__(self, ring_regions: int):
        self.ring_regions = ring_regions
        self.read_seconds: Optional[float] = None
        self.visit_seconds: Optional[float] = None

    @staticmethod
    def _average(old: Optional[float], new: float) -> float:
        return new if old is None else old + SMOOTHING * (new - old)

    def read_took(self, seconds: float) -> None:
        self.read_seconds = self._average(self.read_seconds, max(seconds, 0.0))

    def visit_took(self, seconds: float) -> None:
        self.visit_seconds = self._average(self.visit_seconds, max(seconds, 0.0))

    @property
    def wanted(self) -> Optional[int]:
        """Layers that must be in flight for a read to finish before its layer is needed
        (None: not measured yet)."""
        if self.read_seconds is None or not self.visit_seconds:
            return None
        return max(1, math.ceil(self.read_seconds / self.visit_seconds))

    @property
    def depth(self) -> int:
        """Reads to keep in flight: what is wanted, at most the ring less the region whose
        copy to the device is under way; the whole ring until both times are measured."""
        most = max(self.ring_regions - 1, 1)
        wanted = self.wanted
        return most if wanted is None else min(wanted, most)

    @property
    def ring_too_small(self) -> bool:
        """Whether reads cannot hide behind compute with this ring (the disk is the bound)."""
        wanted = self.wanted
        return wanted is not None and wanted > max(self.ring_regions - 1, 1)


def busy_seconds(intervals: List[Tuple[float, float]]) -> float:
    """The time covered by at least one of the (start, end) intervals (reads in flight)."""
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


# several reads in flight must read this much faster than one to be chosen
READERS_GAIN = 1.10


def pick_readers(rates: dict) -> int:
    """How many reads to keep in flight, from probed read rates {readers: bytes/s}: the
    fewest readers within ``READERS_GAIN`` of the fastest (NVMe drives read faster with
    several requests in flight; some disks, virtual ones among them, read slower)."""
    best = max(rates.values())
    return min(count for count, rate in rates.items() if rate * READERS_GAIN >= best)


# the reads a measurement of one reads-in-flight count covers, and how much is read before
# the counts not in use are measured again (the disk's speed can drift: shared, virtual)
SAMPLE_BYTES = 2 * GiB
RECHECK_BYTES = 64 * GiB


class ReaderChoice:
    """How many reads to keep in flight, kept right from the run's own reads. A probe at
    load is short and can mislead (on a virtual disk it rated one reader far below what
    longer reads then gave), so each count is also measured on the real reads:
    ``sample_bytes`` at the count in use, then ``sample_bytes`` at each other count; the
    run then keeps the count in use unless another reads ``READERS_GAIN`` faster (noise
    does not flip it), and measures the others again after every ``recheck_bytes``.
    A read is charged only the time after the read before it ended (reads queue behind
    each other when the disk is the bound), and a rate is bytes over that time, so time
    the ring stood full (compute was the bound) does not count against the disk."""

    def __init__(self, counts: Sequence[int], start: int, sample_bytes=SAMPLE_BYTES, recheck_bytes=RECHECK_BYTES):
        self.counts = tuple(counts)
        self.current = start
        self.sample_bytes, self.recheck_bytes = sample_bytes, recheck_bytes
        self.rates: Dict[int, float] = {}  # reads at once -> bytes/s, measured in the run
        self._measured_at: Dict[int, int] = {}  # total bytes read when each rate was taken
        self._total = 0
        self.changes = 0  # how often the run's reads changed the count
        self._last_end = float("-inf")
        self._bytes, self._intervals = 0, []

    def observe(self, count: int, nbytes: int, start: float, end: float) -> Optional[int]:
        """One layer's read, queued at ``start`` with ``count`` reads in flight allowed and
        done at ``end``; returns the count to use from now on when it changes, else None."""
        self._total += nbytes
        start, self._last_end = max(start, self._last_end), max(self._last_end, end)
        if count != self.current:  # queued before the last change
            return None
        self._bytes += nbytes
        self._intervals.append((start, max(start, end)))
        if self._bytes < self.sample_bytes:
            return None
        self.rates[count] = self._bytes / max(busy_seconds(self._intervals), 1e-9)
        self._measured_at[count] = self._total
        self._bytes, self._intervals = 0, []
        due = self._total - self.recheck_bytes
        stale = [c for c in self.counts if self._measured_at.get(c, due) <= due]
        best = max(self.rates, key=self.rates.get)
        wanted = stale[0] if stale else best if self.rates[best] > READERS_GAIN * self.rates[count] else count
        if wanted == self.current:
            return None
        self.current = wanted
        self.changes += 1
        return wanted

    def __str__(self) -> str:
        rates = ", ".join(f"{n} at once {rate / 1e9:.2f} GB/s" for n, rate in sorted(self.rates.items()))
        return f"measured in the run: {rates}"
