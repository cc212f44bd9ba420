"""offload_activations at the runtime level: when a pass offloads its checkpointed inputs.

A mixin of ``StreamRuntime``. The copies themselves are ``offload.ActivationOffloader``'s;
this decides, per step shape, whether to use it ("auto": when the memory plan, with the
cheaper long-sequence settings, leaves less than ``OFFLOAD_AUTO_MARGIN`` of the VRAM budget
free; ``long_policy`` decides and says so).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Optional, Tuple, Union

from ..config import OFFLOAD_AUTO_MARGIN
from ..errors import HostMemoryError
from ..long.offload import ActivationOffloader
from ..system.log import get_logger
from ..units import gib

logger = get_logger("layerstream.runtime.core")

# "auto" wants offloading for a step shape only for the margin: the plan fits without it
MARGIN_ONLY = "margin only"


@dataclasses.dataclass
class AutoOffloadMemo:
    """What offload_activations="auto" has decided and said, per step shape (batch, seq)."""

    decided: Dict[Tuple[int, int], Union[bool, str]] = dataclasses.field(default_factory=dict)
    # the smallest host arena refused for a margin-only shape: larger ones are not tried
    refused_bytes: Optional[int] = None
    said_refused: bool = False
    release_when_idle: bool = False  # an arena kept by a pass under way when a later one was refused


class OffloadPolicy:
    """Expects the runtime's config, records, device, store, last_shape and ``memory_plan``."""

    def _new_offloader(self) -> Optional[ActivationOffloader]:
        if self.config.offload_activations is False:
            return None
        return ActivationOffloader(self.device, len(self.records), pin=self.config.pin, verify=self.config.checksum)

    def set_offload_activations(self, value) -> None:
        """Change offload_activations from the next pass on (a benchmark compares both on one
        model). A pass under way finishes as it started: its backward brings its inputs back
        through the offloader it began with, whose host arena is released once idle."""
        self.config = self.config.replace(offload_activations=value)
        self._auto_offload = AutoOffloadMemo()
        self.forget_long_decisions()
        if value is False and self.offloader is not None:
            if self.offloader.idle():
                self.offloader.release()
            self.offloader = None

    def _pass_offloader(self, hidden) -> Optional[ActivationOffloader]:
        """The offloader of a training pass starting now, or None: offload_activations as it
        is set when the pass starts (by ``set_offload_activations`` or in the runtime's config)."""
        if self.config.offload_activations is False:
            return None
        if self.offloader is None:
            self.offloader = self._new_offloader()
        return self.offloader if self._start_offloading(hidden) else None

    def _offload_wanted(self, batch: int, seq: int) -> bool:
        """offload_activations as set; "auto": on when the plan of this step shape without
        it leaves less than the margin free (decided once per shape)."""
        if self.config.offload_activations != "auto":
            return bool(self.config.offload_activations)
        memo = self._auto_offload
        if (batch, seq) not in memo.decided:
            memo.decided[(batch, seq)] = self._offload_needed(batch, seq)
        return bool(memo.decided[(batch, seq)])

    def _offload_needed(self, batch: int, seq: int) -> Union[bool, str]:
        """False, True (the plan does not fit without offloading) or MARGIN_ONLY, as the
        long-sequence settings' decision for this many tokens has it (``long_policy``)."""
        decision = self.long_decision(batch * seq)
        if decision.value("offload_activations") is None:
            return False
        return MARGIN_ONLY if decision.offload_for_margin_only else True

    def _start_offloading(self, hidden) -> bool:
        """Whether this training pass offloads its checkpointed inputs; when it does, room is
        made in host memory first. When "auto" wants them offloaded only for the margin and
        the host cannot hold them, the pass runs without offloading (said once per run);
        otherwise the host's refusal stands."""
        memo, shape = self._auto_offload, self.last_shape
        if not self._offload_wanted(*shape):
            if memo.release_when_idle and self.offloader.idle():
                self.offloader.release()
                memo.release_when_idle = False
            return False
        need = ActivationOffloader.pass_bytes(len(self.records), hidden)
        margin_only = memo.decided.get(shape) == MARGIN_ONLY
        # a margin-only shape needing an arena at least as large as one refused is not tried
        refused = margin_only and memo.refused_bytes is not None and need >= memo.refused_bytes
        if not refused:
            try:
                self.offloader.start_pass(hidden, self.store.host_bytes)
            except HostMemoryError:
                if not margin_only:
                    raise
                refused = True
        if refused:
            memo.decided[shape] = False
            memo.release_when_idle |= not self.offloader.idle()
            memo.refused_bytes = min(need, memo.refused_bytes or need)
            logger.log(
                logging.DEBUG if memo.said_refused else logging.WARNING,
                "layerstream: offload_activations='auto' stays off for batch %d x %d tokens (and for longer "
                "steps): the plan fits the budget without it, with less than %d%% to spare, and host memory "
                "cannot hold the %s of checkpointed inputs",
                *shape,
                round(100 * OFFLOAD_AUTO_MARGIN),
                gib(need),
            )
            memo.said_refused = True
            return False
        return True
