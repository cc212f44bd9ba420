"""offload_activations at the runtime level: when a pass offloads its checkpointed inputs.

A mixin of ``StreamRuntime``. The copies themselves are ``offload.ActivationOffloader``'s;
this decides, per step shape, whether to use it ("auto": when the memory plan without
it leaves less than ``OFFLOAD_AUTO_MARGIN`` of the VRAM budget free).
"""

from __future__ import annotations

import logging
from typing import Optional

from .config import OFFLOAD_AUTO_MARGIN
from .errors import HostMemoryError
from .offload import ActivationOffloader
from .units import gib

logger = logging.getLogger("layerstream.runtime")

# "auto" wants offloading for a step shape only for the margin: the plan fits without it
MARGIN_ONLY = "margin only"


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
        """offload_activations as set; "auto": on when the plan of this step shape without
        it leaves less than the margin free (decided once per shape)."""
        if self.config.offload_activations != "auto":
            return bool(self.config.offload_activations)
        decided = self._offload_decided.get((batch, seq))
        if decided is None:
            decided = self._offload_decided[(batch, seq)] = self._offload_needed(batch, seq)
        return bool(decided)

    def _offload_needed(self, batch: int, seq: int):
        """False, True (the plan does not fit without offloading) or MARGIN_ONLY."""
        budget = self.config.budget_bytes()
        if budget is None:
            return False
        try:
            plan = self.memory_plan(batch, seq, vram_bytes=budget, offload=False)
        except ValueError as exc:
            logger.warning("layerstream: offload_activations='auto' stays off: the step cannot be planned (%s)", exc)
            return False
        usable = int(budget * (1 - OFFLOAD_AUTO_MARGIN))
        if plan.needed_bytes <= usable:
            return False
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
        return MARGIN_ONLY if plan.fits else True

    def _start_offloading(self, hidden) -> bool:
        """Make room in host memory for this pass's checkpointed inputs. When "auto" wants
        them offloaded only for the margin and the host cannot hold them, the step runs
        without offloading (said once per shape); otherwise the host's refusal stands."""
        try:
            self.offloader.start_pass(hidden, self.store.host_bytes)
        except HostMemoryError as exc:
            if self._offload_decided.get(self.last_shape) != MARGIN_ONLY:
                raise
            self._offload_decided[self.last_shape] = False
            logger.warning(
                "layerstream: offload_activations='auto' turns off again for batch %d x %d tokens: the plan "
                "fits the budget without it, and host memory cannot hold the inputs (%s)",
                *self.last_shape,
                exc,
            )
            return False
        return True
