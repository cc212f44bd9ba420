"""Units and layout arithmetic shared by the engine and the memory planner: byte sizes,
the alignment of tensors inside a layer's region, and parsing sizes written by people."""

from __future__ import annotations

import math
import re
from typing import List, Union

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# every tensor of a layer region starts at a multiple of this (vectorised kernels on host
# and device); slots use the same layout, so the planner's slot size is the engine's
ALIGN = 512


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the region alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def arena_sizes(sizes: List[int], arena_bytes: int) -> List[int]:
    """The arenas the host store allocates for layers of these sizes added one at a time
    (``HostStore.add``, as the loader does; the planner predicts the loader's host RAM
    with it): when a layer does not fit in the last arena, a new one holds a whole number
    of layers of that size (at most ``arena_bytes``, at least one layer, never more than
    the bytes still to come)."""
    arenas: List[int] = []
    used = 0
    for index, nbytes in enumerate(sizes):
        if not arenas or used + nbytes > arenas[-1]:
            arenas.append(next_arena(nbytes, sum(sizes[index:]), arena_bytes))
            used = 0
        used += nbytes
    return arenas


def next_arena(nbytes: int, expected: int, arena_bytes: int) -> int:
    """The size of the arena started for a layer of ``nbytes`` with ``expected`` bytes still
    to come: a whole number of such layers (equal layers leave no gap), at most
    ``arena_bytes``."""
    whole_layers = max(1, arena_bytes // max(nbytes, 1)) * nbytes
    return max(min(whole_layers, max(expected, nbytes)), nbytes, ALIGN)


def size_text(nbytes: int) -> str:
    """A byte count in the largest unit that keeps it above one: '1.50 GiB', '34.0 KiB'."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit:
            return f"{nbytes / unit:.2f} {name}"
    return f"{nbytes} B"


def gib(nbytes: float) -> str:
    """A byte count as people read it in logs: '12.34 GiB'."""
    return f"{nbytes / GiB:.2f} GiB"


_SIZE_UNITS = ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))


def size(nbytes: float, round_up: bool = False) -> str:
    """A byte count in the unit that shows it, at most three digits before the point:
    '12.34 GiB', '0.98 GiB', '51.20 MiB', '111.00 KiB', '100 B' (a tiny model's kilobytes
    never read '0.00 GiB'). ``round_up``: for a least amount, never shown below what it is
    ('at least 1.01 GiB' for 1 GiB and 52 KiB, not '1.00 GiB', which would not be enough)."""
    for unit, name in _SIZE_UNITS:
        if abs(nbytes) >= unit * 1000 // 1024:
            value = -(-math.ceil(nbytes) * 100 // unit) / 100 if round_up else nbytes / unit
            return f"{value:.2f} {name}"
    return f"{math.ceil(nbytes) if round_up else int(nbytes)} B"


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: Union[str, int]) -> int:
    """ "16GiB" (2**30), "24GB" (10**9), "1.5GiB", "512MiB", "16000000000" -> bytes."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r}; write a number with a unit, e.g. 16GiB, 24GB, 1.5GiB")
    number, unit = match.group(1), match.group(2).lower()
    if unit in ("k", "m", "g", "t"):
        raise ValueError(
            f"ambiguous unit in {text!r}: write {unit.upper()}iB (powers of 1024) or {unit.upper()}B (powers of 1000)"
        )
    if unit not in _UNITS and unit:
        raise ValueError(f"unknown unit {match.group(2)!r} in {text!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    value = float(number) * _UNITS.get(unit, 1)
    if not value.is_integer() and not unit:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(round(value))
