"""offload_activations at the runtime level: when a pass offloads its checkpointed inputs.

``OffloadPolicy`` is a component of ``StreamRuntime`` (``runtime.offload_policy``). The
copies themselves are ``long.offload.ActivationOffloader``'s; this holds that offloader and
decides, per step shape, whether a training pass uses it ("auto": when the memory plan, with
the cheaper long-sequence settings, leaves less than ``OFFLOAD_AUTO_MARGIN`` of the VRAM
budget free; ``long_settings`` decides, and the runtime hands its decision in).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from ..config import OFFLOAD_AUTO_MARGIN, StreamConfig
from ..errors import HostMemoryError
from ..long.offload import ActivationOffloader
from ..plan.long_settings import LongDecision
from ..system.log import get_logger
from ..tiers.store import HostStore
from ..units import gib

logger = get_logger("layerstream.runtime.core")

# "auto" wants offloading for a step shape only for the margin: the plan fits without it
MARGIN_ONLY = "margin only"


@dataclasses.dataclass
class AutoOffloadMemo:
    """What offload_activations="auto" has decided and said, per step shape (batch, seq);
    started afresh whenever the setting changes."""

    decided: Dict[Tuple[int, int], Union[bool, str]] = dataclasses.field(default_factory=dict)
    # the smallest host arena refused for a margin-only shape: larger ones are not tried
    refused_bytes: Optional[int] = None
    said_refused: bool = False
    release_when_idle: bool = False  # an arena kept by a pass under way when a later one was refused


class OffloadPolicy:
    """The activation offloader of a streamed model and whether each training pass uses it.

    Collaborators, passed in: the runtime's config (the runtime hands a new one whenever it
    replaces it), the device (new in ``move_to``), the number of streamed layers, the host
    store and ``ends_store()``, the ends' store where they stream (whose sizes the
    host-memory check counts beside a pass's arena: all three are page-locked).
    """

    def __init__(
        self,
        config: StreamConfig,
        device: torch.device,
        num_layers: int,
        store: HostStore,
        ends_store: Callable[[], Optional[HostStore]] = lambda: None,
    ):
        self.config = config
        self.device = device
        self.num_layers = num_layers
        self.store = store
        self.ends_store = ends_store
        self.offloader: Optional[ActivationOffloader] = self._new_offloader()  # None: offloading off
        self._auto = AutoOffloadMemo()  # offload_activations="auto": decisions per shape

    def _new_offloader(self) -> Optional[ActivationOffloader]:
        if self.config.offload_activations is False:
            return None
        return ActivationOffloader(self.device, self.num_layers, pin=self.config.pin, verify=self.config.checksum)

    def setting_changed(self) -> None:
        """offload_activations changed in the config (``StreamRuntime.set_offload_activations``):
        "auto" decides afresh; turned off, the offloader goes (its host arena now if idle, else
        once the pass under way that holds it is done with it)."""
        self._auto = AutoOffloadMemo()
        if self.config.offload_activations is False and self.offloader is not None:
            if self.offloader.idle():
                self.offloader.release()
            self.offloader = None

    def move_to(self, device: torch.device) -> None:
        """Offload from ``device`` from now on: a new offloader, the old one's arenas freed."""
        self.device = device
        self.close()
        self.offloader = self._new_offloader()

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.release()

    def for_pass(
        self, hidden: torch.Tensor, shape: Tuple[int, int], decision: LongDecision
    ) -> Optional[ActivationOffloader]:
        """The offloader of a training pass of ``shape`` (batch, seq) starting now, or None:
        offload_activations as it is set when the pass starts; ``decision``: the long-sequence
        settings' decision for its tokens (what "auto" follows)."""
        if self.config.offload_activations is False:
            return None
        if self.offloader is None:
            self.offloader = self._new_offloader()
        return self.offloader if self._start_offloading(hidden, shape, decision) else None

    def _offload_wanted(self, shape: Tuple[int, int], decision: LongDecision) -> bool:
        """offload_activations as set; "auto": on when the plan of this step shape without
        it leaves less than the margin free (decided once per shape)."""
        if self.config.offload_activations != "auto":
            return bool(self.config.offload_activations)
        memo = self._auto
        if shape not in memo.decided:
            memo.decided[shape] = self._offload_needed(decision)
        return bool(memo.decided[shape])

    @staticmethod
    def _offload_needed(decision: LongDecision) -> Union[bool, str]:
        """False, True (the plan does not fit without offloading) or MARGIN_ONLY, as the
        long-sequence settings' decision for this many tokens has it (``long_settings``)."""
        if decision.value("offload_activations") is None:
            return False
        return MARGIN_ONLY if decision.offload_for_margin_only else True

    def _start_offloading(self, hidden: torch.Tensor, shape: Tuple[int, int], decision: LongDecision) -> bool:
        """Whether this training pass offloads its checkpointed inputs; when it does, room is
        made in host memory first. When "auto" wants them offloaded only for the margin and
        the host cannot hold them, the pass runs without offloading (said once per run);
        otherwise the host's refusal stands."""
        memo = self._auto
        if not self._offload_wanted(shape, decision):
            if memo.release_when_idle and self.offloader.idle():
                self.offloader.release()
                memo.release_when_idle = False
            return False
        need = ActivationOffloader.pass_bytes(self.num_layers, hidden)
        margin_only = memo.decided.get(shape) == MARGIN_ONLY
        # a margin-only shape needing an arena at least as large as one refused is not tried
        refused = margin_only and memo.refused_bytes is not None and need >= memo.refused_bytes
        if not refused:
            try:
                ends = self.ends_store()
                self.offloader.start_pass(hidden, self.store.host_bytes, ends.host_bytes if ends else 0)
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
