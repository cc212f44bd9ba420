"""How many backward slots a streamed run takes, and the guard that allocates each one.

Backward slots (see ``schedule``) borrow the memory the loss's logits need only briefly.
``"auto"`` takes them only where that is safe: on CUDA, with no ``vram_budget`` (the
resident window spends a budget better), with the caching allocator's expandable segments
(otherwise the loss's memory, reused in blocks of another size, can fragment), as many as
the memory planner finds room for below the loss; and each is allocated only while the
memory in use, the slot and what the rest of the step allocates stay below this process's
peak so far (a fused loss leaves no such room).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .. import plan
from ..config import StreamConfig, expandable_segments
from ..system.log import get_logger
from ..units import GiB

logger = get_logger(__name__)


class BackwardSlots:
    def __init__(self, config: StreamConfig):
        self.config = config
        fixed = config.backward_slots if isinstance(config.backward_slots, int) else None
        if fixed is None and config.device.type != "cuda":
            fixed = 0  # auto borrows GPU memory; on the host there is none to borrow
        self.auto = fixed is None
        self.capacity = plan.BACKWARD_SLOTS_MAX if self.auto else fixed  # buffers the pool can hold
        self.count = fixed or 0  # what the planner is given now
        self._decided: Dict[Tuple[int, int], int] = {}  # (batch, seq) -> auto count
        self._margin = 0  # memory the rest of the step allocates while backward slots hold layers
        self._warned = False

    def decide(self, runtime, hidden: torch.Tensor, streamed_layers: int) -> Optional[int]:
        """At the first training step of each batch shape: the new count when it changes,
        else None. A later shape may lower the count, never raise it (the memory is
        borrowed from the smallest loss seen)."""
        if not self.auto or hidden.dim() < 2:
            return None
        slot_bytes = runtime.store.largest_layer_bytes
        batch, seq = int(hidden.shape[0]), int(hidden.shape[1])
        if (batch, seq) in self._decided:
            return None
        first = not self._decided
        count = 0
        off = self._auto_off()
        if off is not None:
            if first:
                logger.info("layerstream: no backward slots: %s", off[1])
        else:
            try:
                memory = runtime.memory_plan(batch, seq)
            except ValueError as exc:
                logger.info("layerstream: no backward slots: the model's memory cannot be predicted (%s)", exc)
            else:
                count = plan.backward_slot_count(
                    memory.loss_phase_bytes,
                    memory.layer_working_bytes,
                    memory.lora_bytes,
                    slot_bytes,
                    streamed_layers,
                    self.config.slots,
                )
                self._margin = memory.layer_working_bytes + 3 * memory.lora_bytes
        if not first:
            count = min(count, self.count)
        self._decided[(batch, seq)] = count
        if count == self.count:
            return None
        self.count = count
        logger.info(
            "layerstream: %d backward slot(s) of %.2f GiB at batch %d x %d tokens", count, slot_bytes / GiB, batch, seq
        )
        return count

    def _auto_off(self) -> Optional[Tuple[str, str]]:
        """Why auto takes none whatever the memory: (summary note, log line), or None."""
        if self.config.vram_budget is not None:
            return (
                "auto leaves a vram_budget to the resident window (vram_budget=None to use them)",
                "under vram_budget the resident window spends the budget, and each window "
                "layer saves two copies per step to a backward slot's one",
            )
        if not expandable_segments():
            return (
                "auto needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                "backward_slots='auto' needs the caching allocator's expandable segments "
                "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before CUDA starts); with "
                "them, where the loss sets the memory peak, a few more layers stay on the GPU "
                "across each step boundary",
            )
        return None

    def borrow(self, pool, planner, slot: int) -> bool:
        """Allocate a backward slot, under auto only below the run's peak so far; when it
        cannot be had, the planner stops using it (said once, loudly)."""
        if pool.cuda and self.auto:
            device = pool.device
            in_use, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
            if in_use + pool.slot_bytes + self._margin > peak:
                gib = GiB
                self._refuse(
                    planner,
                    slot,
                    pool.ring_slots,
                    f"{in_use / gib:.2f} GiB in use + {pool.slot_bytes / gib:.2f} GiB for the slot + "
                    f"{self._margin / gib:.2f} GiB for the rest of backward would pass this run's "
                    f"peak of {peak / gib:.2f} GiB (the loss may not hold fp32 logits, e.g. a fused "
                    "loss)",
                )
                return False
        try:
            pool.allocate(slot)
        except torch.OutOfMemoryError:
            self._refuse(planner, slot, pool.ring_slots, "the GPU has no room for it")
            return False
        return True

    def _refuse(self, planner, slot: int, ring: int, why: str) -> None:
        planner.disable_backward_slot(slot)
        if not self._warned:
            self._warned = True
            logger.warning(
                "layerstream: backward slot %d not used: %s. Training goes on with fewer "
                "backward slots, a few copies more per step; StreamConfig(backward_slots=0) "
                "silences this.",
                slot - ring,
                why,
                main_process_only=False,
            )

    def note(self, planner_count: int, cuda: bool) -> str:
        """The start-up summary's line."""
        how = " (auto)" if "backward_slots" in self.config.automatic else ""
        if how and not cuda:
            return "none (auto: none on the host)"
        if self.auto and not self._decided:
            off = self._auto_off()
            if off is not None:
                return f"none ({off[0]})"
            return "auto, decided at the first training step (extra slots in the loss's memory, used outside the loss)"
        return f"{planner_count} backward slot(s), allocated outside the loss{how}" if planner_count else f"none{how}"
