"""offload_activations at the runtime level: when a pass offloads its checkpointed inputs.

A mixin of ``StreamRuntime``. The copies themselves are ``offload.ActivationOffloader``'s;
this decides, per step shape, whether to use it ("auto": when the memory plan without
it leaves less than ``OFFLOAD_AUTO_MARGIN`` of the VRAM budget free).
"""

from __future__ import annotations

import logging
from typing import Optional

from .config import OFFLOAD_AUTO_MARGIN
from .offload import ActivationOffloader
from .units import gib

logger = logging.getLogger("layerstream.runtime")


class OffloadPolicy:
    """Expects the runtime's config, records, device and ``memory_plan``."""

    def _new_offloader(self) -> Optional[ActivationOffloader]:
        if self.config.offload_activations is False:
            return None
        return ActivationOffloader(self.device, len(self.records), pin=self.config.pin, verify=self.config.checksum)

    def set_offload_activations(self, value) -> None:
        """Change offload_activations between steps (a benchmark compares both on one model)."""
        self.config = self.config.replace(offload_activations=value)
        if self.offloader is not None:
            self.offloader.release()
        self.offloader = self._new_offloader()
        self._offload_decided.clear()

    def _offload_wanted(self, batch: int, seq: int) -> bool:
        """offload_activations as set; "auto": on when the plan of this step shape does
        not fit the VRAM budget without it (decided once per shape)."""
        if self.config.offload_activations != "auto":
            return bool(self.config.offload_activations)
        decided = self._offload_decided.get((batch, seq))
        if decided is None:
            decided = self._offload_decided[(batch, seq)] = self._offload_needed(batch, seq)
        return decided

    def _offload_needed(self, batch: int, seq: int) -> bool:
        budget = self.config.budget_bytes()
        if budget is None:
            return False
        try:
            plan = self.memory_plan(batch, seq, vram_bytes=budget, offload=False)
        except ValueError as exc:
            logger.warning("layerstream: offload_activations='auto' stays off: the step cannot be planned (%s)", exc)
            return False
        usable = int(budget * (1 - OFFLOAD_AUTO_MARGIN))
        if plan.needed_bytes > usable:
            logger.warning(
                "layerstream: offload_activations='auto' is on for batch %d x %d tokens: the plan needs %s "
                "with the reserve and the budget is %s (auto keeps %d%% of it in hand), so each layer's "
                "checkpointed input goes to host memory",
                batch,
                seq,
                gib(plan.needed_bytes),
                gib(budget),
                round(100 * OFFLOAD_AUTO_MARGIN),
            )
            return True
        return False
