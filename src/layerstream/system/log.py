"""layerstream's warnings and notes, said once per job.

Under ``accelerate launch`` or ``torchrun`` every rank runs the same code, so a warning about
a setting every rank shares (a budget it cannot check, an option that stays off) would be
printed once per rank: eight identical lines on eight GPUs. Every module takes its logger
from ``get_logger``, whose messages the main process alone says. A message about a fact of
one rank (its GPU ran out of memory, its host memory could not be page-locked) is said by
every rank with its rank in front, ``[rank 3] layerstream: ...``: pass
``main_process_only=False`` to the call, or take a logger whose calls all do so
(``get_logger(name, main_process_only=False)``).

The rank is torch.distributed's once a process group exists, else the launcher's RANK and
WORLD_SIZE (Accelerate and torchrun set them before the script runs). A single process,
or a launcher with one process, is the main process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional


def process_rank() -> Optional[int]:
    """This process's rank in a job of several processes; None in a process of its own."""
    dist = sys.modules.get("torch.distributed")  # never imports torch: the CLI stays quick
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() if dist.get_world_size() > 1 else None
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return rank if world > 1 else None


def is_main_process() -> bool:
    """Whether this process speaks for the job (rank 0, or a process of its own)."""
    return process_rank() in (None, 0)


class RankLogger(logging.LoggerAdapter):
    """A logger whose messages the main process alone says, unless a call passes
    ``main_process_only=False`` (then every rank says it, its rank in front)."""

    def __init__(self, logger: logging.Logger, main_process_only: bool = True):
        super().__init__(logger, {})
        self.main_process_only = main_process_only

    def log(self, level, msg, *args, main_process_only: Optional[bool] = None, **kwargs):
        if main_process_only is None:
            main_process_only = self.main_process_only
        if not self.isEnabledFor(level):
            return
        rank = process_rank()
        if rank is not None and main_process_only and rank != 0:
            return
        if rank is not None and not main_process_only:
            msg = f"[rank {rank}] {msg}"
        kwargs.setdefault("stacklevel", 3)  # the caller's line, past this adapter
        self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str, main_process_only: bool = True) -> RankLogger:
    """The logger of module ``name`` (``logging.getLogger(name)``, so its level and handlers
    are configured as usual), speaking on the main process only, or on every rank with its
    rank in front (``main_process_only=False``)."""
    return RankLogger(logging.getLogger(name), main_process_only)
