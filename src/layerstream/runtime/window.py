"""The resident window: layers held on the GPU for good, sized from measured memory.

``ResidentWindow`` is a component of ``StreamRuntime`` (``runtime.resident_window``): at each
training-step boundary it reads what the last step used (``meter``), asks the pure policy
(``decisions.window.WindowSizer``) for a size, and copies the chosen layers to buffers of
their own; after an out-of-memory error it shrinks the window so that the Trainer can run
the step again. The layers left out keep streaming; their dense numbering (``position_of``,
``streamed``) is what the runtime's prefetch schedule sees, and each change of the window
is handed to the runtime (``restream``) to plan its slots again.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..decisions import schedule
from ..decisions.window import GenerationSizer, WindowSizer
from ..modules import bindings
from ..modules.layer import registrations
from ..system.log import get_logger
from ..tiers.store import HostStore, LayerRecord
from . import report

logger = get_logger("layerstream.runtime.core")

WINDOW_RESETS = 3  # steps measured from a reset peak after the window is set or changes


def _always_owned(tensor: torch.Tensor) -> None:
    """The backward owner check of a resident-window layer: its buffer is never reused."""


class ResidentWindow:
    """Which layers stay on the device for good, their device copies, and the measured
    sizing of how many.

    Collaborators, passed in: the model (its trainable tensors: are gradients held between
    steps?), the layer records and the host store (the source of every copy), the device and
    the meter (the runtime hands new ones in ``move_to``), and two of the runtime's slot
    operations: ``restream(count)`` (the layers that stream changed: forget what the slots
    hold and plan for ``count`` streamed layers) and ``reset_slots()``.
    """

    def __init__(
        self,
        model: nn.Module,
        records: List[LayerRecord],
        store: HostStore,
        device: torch.device,
        meter,
        restream: Callable[[int], None],
        reset_slots: Callable[[], None],
    ):
        self.model = model
        self.records = records
        self.store = store
        self.device = device
        self.meter = meter  # meter.CudaMeter or PlannedMeter with a vram_budget, else None: no sizing
        self._restream = restream
        self._reset_slots = reset_slots
        self.bindings: Dict[int, list] = {}  # window layer -> its binding to its own buffer
        self.buffers: Dict[int, torch.Tensor] = {}  # window layer -> its device buffer
        # the dense numbering of the layers that still stream (the prefetch schedule sees only those)
        self.position_of: List[Optional[int]] = list(range(len(records)))  # layer -> position, None in the window
        self.streamed: List[int] = list(range(len(records)))  # position -> layer
        self.sizer = WindowSizer(len(records), store.largest_layer_bytes)
        self.generation = GenerationSizer(len(records), store.largest_layer_bytes)
        self._generating: Optional[Tuple[int, int]] = None  # (tokens cached, window) of a measured call
        self.window_changes: List[Tuple[int, int]] = []  # (tokens, window) at each change
        self.oom_retries = 0
        self._measured_tokens: Optional[int] = None  # tokens of the step being measured
        self._backward_ran = False
        self._trainable, self._trainable_at, self._trainable_age = [], None, 0  # _gradients_held
        self._resets_left = WINDOW_RESETS
        self._ends = None  # what size_for_step was last given: the window asks it before growing
        self._ends_held = 0  # the bytes of the ends brought back that the sizer counts (``_count_ends``)

    @property
    def layers(self) -> List[int]:
        """The layers kept on the device for good."""
        return sorted(self.bindings)

    def holds(self, index: int) -> bool:
        return index in self.bindings

    # -- sizing at step boundaries ---------------------------------------------------
    def size_for_step(self, tokens: int, inputs: int = 0, ends=None, floor: int = 0) -> None:
        """At the start of a training step (``inputs``: bytes of its first layer's input, on
        the device already): read what the last one used and size the window (``floor``:
        the least the step rises, a generation it opens with).

        ``ends`` (``ends_on_demand.EndsOnDemand``), where "auto" moved the embedding and head
        to host memory: they come back first when the measured room holds them, for they
        are copied in at every step, where the window's layers are copied behind compute.
        """
        meter = self.meter
        if meter is None:
            return
        self._ends = ends
        if self._measured_tokens is not None and not self._backward_ran:
            # the step measured has not run its backward yet (two forwards, or a generation
            # that sized the window first): it goes on, with fewer layers if it has more tokens
            if tokens > self._measured_tokens and self.sizer.reference is not None:
                self._shrink_for(tokens)
            return
        grads = self._gradients_held()
        if self._measured_tokens is not None:
            reading = meter.read(len(self.bindings), self._measured_tokens, inputs, grads)
            capped = self.sizer.max_window
            self.sizer.record(reading)
            if self.sizer.max_window < capped:
                logger.warning(
                    "layerstream: a %d-token step reached the memory limit (%d allocator retries) with "
                    "%d window layers; the window will not grow past that.",
                    reading.tokens,
                    reading.retries,
                    reading.window,
                )
        else:
            meter.release_cache()
        measured = self.sizer.reference
        if ends is not None:
            self._count_ends(ends.device_bytes)  # they may have left again for this step
        if ends is not None and measured is not None and tokens <= measured.tokens:  # measured, not scaled up
            room = self.sizer.room(meter.limit(), tokens, len(self.bindings), floor)
            if room is not None:
                ends.bring_back(room, measured.tokens)
                self._count_ends(ends.device_bytes)
        target = self.sizer.size(meter.limit(), tokens, len(self.bindings), floor)
        if target != len(self.bindings):
            shrinking = target < len(self.bindings)
            self.window_changes.append((tokens, target))
            self._set_size(target, tokens)
            if shrinking:
                meter.release_cache()  # the freed buffers go back, or the cap keeps them reserved
            self._resets_left = WINDOW_RESETS
        self._measured_tokens = tokens
        reset = self._resets_left > 0
        self._resets_left -= 1
        self._backward_ran = False
        meter.begin(reset, inputs, grads)

    def _count_ends(self, nbytes: int) -> None:
        """The ends brought back hold ``nbytes`` on the device now: the sizer counts them from
        now on (once, however often they come back), and no more once they left again."""
        if nbytes != self._ends_held:
            self.sizer.hold(nbytes - self._ends_held)
            self._ends_held = nbytes

    # -- sizing around generation ------------------------------------------------------
    def before_generation(self, tokens: int) -> None:
        """Before a ``generate`` call that caches ``tokens`` tokens (batch x final length).
        In a process whose training has not begun sizing the window: size the window for
        the call (none before one was measured), and measure the call. In one that trains,
        after a training step's backward: size the window for the next step now, from the
        step before, so that the generation which opens the next step has it."""
        meter = self.meter
        if meter is None or self._generating is not None:
            return  # no sizing, or nested
        if self._measured_tokens is not None:  # training sizes it: its steps take in their generation
            if self._backward_ran and self.generation.measured:
                # a training step ended since the window was last sized: size it now for the
                # next, which starts by generating (TRL's GRPO and RLOO), and not only when
                # its training pass starts, after the generation; beside this call's cache as
                # measured before training began, for the step read may have taken in no
                # generation (the first does not), and a generation may rise more than a
                # training pass (GRPO's caches the accumulated micro-batches' sequences)
                self.size_for_step(self._measured_tokens, 0, self._ends, self.generation.predicted_rise(tokens))
            return
        held = meter.allocated() - len(self.bindings) * self.store.largest_layer_bytes
        target = self.generation.size(meter.limit(), held, tokens)
        if target != len(self.bindings):
            shrinking = target < len(self.bindings)
            self.window_changes.append((tokens, target))
            self._set_size(target, tokens)
            if shrinking:
                meter.release_cache()
        elif not self.generation.measured:
            meter.release_cache()  # what other work left cached would count as the call's
        meter.begin(True)
        self._generating = (tokens, len(self.bindings))

    def after_generation(self) -> None:
        """After the call ``before_generation`` measured (also when it raised)."""
        pending, self._generating = self._generating, None
        if pending is not None and self.meter is not None:
            tokens, window = pending
            self.generation.record(self.meter.read(window, tokens))

    def _shrink_for(self, tokens: int) -> None:
        """Within a measured step that began for fewer tokens: as many layers fewer as a step
        of ``tokens`` tokens needs (never more), measured from here as a step of that many."""
        target = self.sizer.size(self.meter.limit(), tokens, len(self.bindings))
        if target < len(self.bindings):
            self.window_changes.append((tokens, target))
            self._set_size(target, tokens)
            self.meter.release_cache()
            self._resets_left = WINDOW_RESETS
        self._measured_tokens = tokens

    def step_reached_backward(self) -> None:
        """The step being measured ran its backward: the next step's start reads it."""
        self._backward_ran = True

    def _gradients_held(self) -> bool:
        """Whether a trainable tensor holds a gradient now (mid-accumulation): the sizer
        tells the gradients from the memory held for good by it."""
        self._trainable_age += 1
        # adapters may have come, or requires_grad changed (looked at again every 32 steps)
        if self._trainable_at != registrations() or self._trainable_age > 32:
            self._trainable_at, self._trainable_age = registrations(), 0
            self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        return any(p.grad is not None for p in self._trainable)

    def _set_size(self, count: int, tokens: int) -> None:
        before = len(self.bindings)
        while True:
            try:
                self.set_window(schedule.spread_resident(len(self.records), count))
                break
            except torch.OutOfMemoryError:  # the buffers themselves did not fit: fewer
                self.set_window([])
                self.meter.release_cache()
                count = max(0, count - 1)
                self.sizer.max_window = min(self.sizer.max_window, count)
        measured = (
            f"{report.gib(self.sizer.predicted_peak(tokens, count))} predicted for {tokens}-token steps, "
            if self.sizer.reference is not None
            else ""
        )
        logger.warning(
            "layerstream: resident window %d -> %d of %d layers (%slimit %s): they stay on the GPU "
            "for good, %d stream.",
            before,
            count,
            len(self.records),
            measured,
            report.gib(self.meter.limit()),
            len(self.records) - count,
        )

    def is_new(self) -> bool:
        """Whether the window changed within the last few measured steps (a step may still
        find it too large)."""
        return self._resets_left > 0

    def can_give_back(self) -> bool:
        """Whether ``recover_from_oom`` has memory to give back: window layers, or ends that
        "auto" brought back to the device."""
        ends = self._ends
        return bool(self.bindings) or (ends is not None and ends.device_bytes > 0)

    def recover_from_oom(self, wanted: int = 0) -> bool:
        """After a training step ran out of memory asking for ``wanted`` bytes: shrink the
        window so that the step can run again; with none left, send the ends that "auto"
        brought back to host memory again. False when there is neither."""
        if self.meter is None:
            return False
        if not self.bindings:
            if self._ends is None or not self._ends.send_away():
                return False
            self._count_ends(0)
            self.meter.release_cache()
            self.oom_retries += 1
            self._measured_tokens = None
            self._resets_left = WINDOW_RESETS
            return True
        limit = self.meter.limit()
        wanted = wanted or self.store.largest_layer_bytes
        count = self.sizer.shrink_after_oom(len(self.bindings), wanted, limit)
        self.sizer.max_window = min(self.sizer.max_window, count)  # never back to what ran out
        self._reset_slots()
        self.set_window([])
        self.meter.release_cache()
        self._set_size(count, self._measured_tokens or 0)
        self.window_changes.append((self._measured_tokens or 0, count))
        self.oom_retries += 1
        self._measured_tokens = None  # the failed step's peak is not a measurement
        self._resets_left = WINDOW_RESETS
        return True

    def restart_sizing(self) -> None:
        """Size from nothing measured (new slots: a layer grew, or the run moved device)."""
        self.sizer = WindowSizer(len(self.records), self.store.largest_layer_bytes)

    def move_to(self, device: torch.device, meter) -> None:
        """The run goes on on ``device`` (the window emptied already), measured by ``meter``."""
        self.device = device
        self.meter = meter
        self._measured_tokens = None

    # -- placing the window ------------------------------------------------------------
    def set_window(self, layers) -> None:
        """Keep these layers on the device for good (one copy each, now); the rest stream.

        The host store stays the source of truth. What the slots held is forgotten, so call
        this between steps, not inside one.
        """
        keep = sorted(set(layers))
        if keep and not 0 <= keep[0] <= keep[-1] < len(self.records):
            raise ValueError(f"layer indices must be in 0..{len(self.records) - 1}, got {keep}")
        self.bindings = {}
        self.buffers = {}
        for index in keep:
            self.copy_to_device(index)
        streamed = [i for i in range(len(self.records)) if i not in self.bindings]
        self.position_of = [None] * len(self.records)
        for dense, index in enumerate(streamed):
            self.position_of[index] = dense
        self.streamed = streamed
        self._restream(len(streamed))

    def copy_to_device(self, index: int) -> None:
        """Copy a window layer to its own device buffer (again, when its values changed)."""
        record = self.records[index]
        cuda = self.device.type == "cuda"
        buffer = self.buffers.get(index)
        if buffer is None or buffer.numel() < record.nbytes:
            buffer = self.buffers[index] = torch.empty(max(record.nbytes, 1), dtype=torch.uint8, device=self.device)
        if record.host_region is not None:
            buffer[: record.nbytes].copy_(record.host_region, non_blocking=cuda)
        else:  # a disk layer: through the staging ring, on the compute stream
            disk = self.store.disk
            buffer[: record.nbytes].copy_(disk.take(index), non_blocking=cuda)
            disk.copied(index, torch.cuda.current_stream(self.device) if cuda else None)
        self.bindings[index] = bindings.make(record, buffer, _always_owned)

    def release(self) -> None:
        """Drop the window's device buffers (the runtime closes)."""
        self.bindings = {}
        self.buffers = {}
