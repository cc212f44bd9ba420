"""The resident window: layers held on the GPU for good, sized from measured memory.

A mixin of ``StreamRuntime``: at each training-step boundary the runtime reads what the
last step used (``meter``), asks the pure policy (``window.WindowSizer``) for a size, and
copies the chosen layers to buffers of their own; after an out-of-memory error it shrinks
the window so that the Trainer can run the step again.
"""

from __future__ import annotations

from typing import List

import torch

from ..decisions import schedule
from ..modules.layer import registrations
from ..system.log import get_logger
from . import report

logger = get_logger("layerstream.runtime.core")

WINDOW_RESETS = 3  # steps measured from a reset peak after the window is set or changes


def _always_owned(tensor: torch.Tensor) -> None:
    """The backward owner check of a resident-window layer: its buffer is never reused."""


class ResidentWindow:
    """Window sizing and placement; expects the runtime's records, pool, meter and sizer."""

    def _size_window(self, tokens: int, inputs: int = 0) -> None:
        """At the start of a training step (``inputs``: bytes of its first layer's input, on
        the device already): read what the last one used and size the window."""
        meter = self.meter
        if self._measured_tokens is not None and not self._backward_ran:
            return  # the step measured has not run its backward yet (two forwards, or none): it goes on
        grads = self._gradients_held()
        if self._measured_tokens is not None:
            reading = meter.read(len(self._window), self._measured_tokens, inputs, grads)
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
        target = self.sizer.size(meter.limit(), tokens, len(self._window))
        if target != len(self._window):
            shrinking = target < len(self._window)
            self.window_changes.append((tokens, target))
            self._set_window_size(target, tokens)
            if shrinking:
                meter.release_cache()  # the freed buffers go back, or the cap keeps them reserved
            self._resets_left = WINDOW_RESETS
        self._measured_tokens = tokens
        reset = self._resets_left > 0
        self._resets_left -= 1
        self._backward_ran = False
        meter.begin(reset, inputs, grads)

    def _gradients_held(self) -> bool:
        """Whether a trainable tensor holds a gradient now (mid-accumulation): the sizer
        tells the gradients from the memory held for good by it."""
        self._trainable_age += 1
        # adapters may have come, or requires_grad changed (looked at again every 32 steps)
        if self._trainable_at != registrations() or self._trainable_age > 32:
            self._trainable_at, self._trainable_age = registrations(), 0
            self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        return any(p.grad is not None for p in self._trainable)

    def _set_window_size(self, count: int, tokens: int) -> None:
        before = len(self._window)
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

    def window_is_new(self) -> bool:
        """Whether the window changed within the last few measured steps (a step may still
        find it too large)."""
        return self._resets_left > 0

    def recover_from_oom(self, wanted: int = 0) -> bool:
        """After a training step ran out of memory asking for ``wanted`` bytes: shrink the
        window so that the step can run again. False when there is no window to shrink."""
        if self.meter is None or not self._window:
            return False
        limit = self.meter.limit()
        wanted = wanted or self.store.largest_layer_bytes
        count = self.sizer.shrink_after_oom(len(self._window), wanted, limit)
        self.sizer.max_window = min(self.sizer.max_window, count)  # never back to what ran out
        self.reset_slots()
        self.set_window([])
        self.meter.release_cache()
        self._set_window_size(count, self._measured_tokens or 0)
        self.window_changes.append((self._measured_tokens or 0, count))
        self.oom_retries += 1
        self._measured_tokens = None  # the failed step's peak is not a measurement
        self._resets_left = WINDOW_RESETS
        return True

    def set_window(self, layers) -> None:
        """Keep these layers on the device for good (one copy each, now); the rest stream.

        The host store stays the source of truth. What the slots held is forgotten, so call
        this between steps, not inside one.
        """
        keep = sorted(set(layers))
        if keep and not 0 <= keep[0] <= keep[-1] < len(self.records):
            raise ValueError(f"layer indices must be in 0..{len(self.records) - 1}, got {keep}")
        self._window = {}
        self._window_buffers = {}
        for index in keep:
            self._keep_on_device(index)
        streamed = [i for i in range(len(self.records)) if i not in self._window]
        self._dense = [None] * len(self.records)
        for dense, index in enumerate(streamed):
            self._dense[index] = dense
        self._layer_of = streamed
        self._forget_slots()
        self.prefetch = self._new_prefetch(len(streamed))

    def _keep_on_device(self, index: int) -> None:
        """Copy a window layer to its own device buffer (again, when its values changed)."""
        record = self.records[index]
        buffer = self._window_buffers.get(index)
        if buffer is None or buffer.numel() < record.nbytes:
            buffer = self._window_buffers[index] = torch.empty(
                max(record.nbytes, 1), dtype=torch.uint8, device=self.device
            )
        if record.host_region is not None:
            buffer[: record.nbytes].copy_(record.host_region, non_blocking=self.pool.cuda)
        else:  # a disk layer: through the staging ring, on the compute stream
            buffer[: record.nbytes].copy_(self.disk.take(index), non_blocking=self.pool.cuda)
            self.disk.copied(index, torch.cuda.current_stream(self.device) if self.pool.cuda else None)
        self._window[index] = self._make_binding(buffer, index, _always_owned)

    @property
    def window(self) -> List[int]:
        """The layers kept on the device for good (the resident window)."""
        return sorted(self._window)
