"""Every exception layerstream raises, in one place.

Each says what went wrong and what to change; callers catch the base class they need
(``ValueError`` for bad input, ``RuntimeError`` for a run that cannot go on, ``MemoryError``
for a host that cannot hold the store) or ``LayerstreamError`` for any of them.
"""

from __future__ import annotations

import os


class LayerstreamError(Exception):
    """Base of every layerstream error."""


class StreamConfigError(LayerstreamError, ValueError):
    """A StreamConfig value is out of range or inconsistent."""


class StreamingError(LayerstreamError, RuntimeError):
    """Streaming cannot go on as asked; the message says what to change."""


class SlotOwnerError(LayerstreamError, RuntimeError):
    """A layer tried to read a slot that holds another layer."""


class SlotChecksumError(LayerstreamError, RuntimeError):
    """A slot's bytes differ from its layer's host bytes (debug checksums)."""


class NoDecoderStackError(LayerstreamError, ValueError):
    """The model has no stack of decoder layers layerstream can stream."""


class LoadingError(LayerstreamError, ValueError):
    """A checkpoint cannot be loaded as asked; raised before any layer is loaded where possible."""


class HostMemoryError(LayerstreamError, MemoryError):
    """The host cannot hold (or page-lock) the layer store; raised before any copy."""


class PinError(LayerstreamError, RuntimeError):
    """Page-locking host memory failed (the store falls back to pageable memory)."""


class TrainConfigError(LayerstreamError, ValueError):
    """A `layerstream train` config cannot run as written; the message says what to change."""


class DiskReadError(LayerstreamError, RuntimeError):
    """A disk-tier layer could not be read as it was loaded (I/O error, short read, a file
    changed under the run, a checksum mismatch); nothing wrong reached the device."""


class ActivationChecksumError(LayerstreamError, RuntimeError):
    """An offloaded activation came back with other bytes than it left with (debug checksums)."""


class DiskCacheError(LoadingError):
    """The NF4 layer cache cannot be written or used (a full disk, a directory that cannot
    be written); the message names the directory and what to change."""


class ForkedChildError(StreamingError):
    """A fork of the process that loaded a disk-tier model (a DataLoader worker) ran it: the
    child has none of the disk tier's reader threads, so its reads would never complete."""

    def __init__(self, owner_pid: int):
        super().__init__(
            f"this model reads its disk layers (host_budget) on threads of process {owner_pid}; process "
            f"{os.getpid()} is a fork of it (a DataLoader worker, a multiprocessing child) and has none of them. "
            "Run the model in the process that loaded it (num_workers=0 for a Dataset or collate_fn that runs "
            "it), or load a model in the child."
        )


# errors raised before anything changed, whose message says what to do: a command prints the
# message alone (no traceback) and exits with status 1
REFUSALS = (LoadingError, StreamConfigError, TrainConfigError, HostMemoryError, NoDecoderStackError)
