"""The files the disk tier reads: their descriptors, their fingerprint at load (checked
before each read), their private memory map (which a disk layer's host tensors are views
of), and reads that must return every byte asked for.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

from .checkpoint import StoredTensor
from .errors import DiskReadError


@dataclass
class SourceFile:
    path: Path
    fd: int  # the descriptor reads use (O_DIRECT when allowed)
    buffered_fd: int
    fingerprint: Tuple[int, int]  # (size, mtime in ns) at load
    tensors: Dict[str, StoredTensor]
    offsets: Dict[str, Tuple[int, int]]
    mapping: mmap.mmap

    def check(self, layer: str) -> None:
        """Refuse a file that changed since it was loaded (what was read would be other bytes)."""
        stat = os.fstat(self.buffered_fd)
        now = (stat.st_size, stat.st_mtime_ns)
        if now != self.fingerprint:
            raise DiskReadError(
                f"{self.path} changed while the run used it (size/mtime {self.fingerprint} at load, {now} now), "
                f"so {layer} can no longer be read from it as it was loaded. Restore the file, or restart the "
                "run on an unchanged checkpoint (copy it first if something rewrites it)."
            )


def read_fully(source: SourceFile, fd: int, target: memoryview, offset: int) -> None:
    """pread until ``target`` is full; a read that returns nothing is a short file."""
    done, wanted = 0, len(target)
    while done < wanted:
        got = os.preadv(fd, [target[done:]], offset + done)
        if got <= 0:
            raise short_read(source, offset, wanted, done)
        done += got


def short_read(source: SourceFile, offset: int, wanted: int, got: int) -> DiskReadError:
    return DiskReadError(
        f"a read of {wanted} bytes at offset {offset} of {source.path} returned {got}: the file is shorter than "
        "when it was loaded (truncated or replaced). Nothing was copied to the GPU; restore the checkpoint and "
        "restart the run."
    )
