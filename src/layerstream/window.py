"""The resident window's size, decided from memory the run actually used. Pure logic.

Layers kept on the GPU for good (the resident window) save two copies per training step
each, so spare GPU memory should hold as many as fit; but a window that takes memory a
step needs runs the step out of memory. Predicting a step's peak is not enough (the
allocator's fragmentation, a fused loss, whatever else the process did before), so the
window is sized from measurements:

- the first training step of a run runs with no window, on an emptied cache, and its peaks
  are read afterwards: the allocated peak (what the step needed) and the reserved peak
  (what the caching allocator held for it: the allocated peak plus the allocator's own
  overhead, fragmentation included);
- the window then grows by the whole layers that fit between that reserved peak and the
  limit (the budget, the per-process memory fraction and what the device has free,
  whichever is least), less a margin; each later step is measured again, its allocated
  peak plus the overhead learnt at the first step standing for what it needs (its own
  reserved peak does not: under a cap the allocator keeps reserving up to the cap and
  recycles), and the window shrinks when a step came closer to the limit than the margin;
- memory held between steps (the weights' resident part, an optimizer's state, gradients
  kept for accumulation: what is allocated when a step starts, less the step's inputs and
  the window's layers) is tracked as the most seen so far, and every prediction starts from
  it: an optimizer creates its state at its first ``step()``, after the first training
  step's peak, so a window filled to the margin from that step alone would run the second
  out of memory whenever the state is larger than the margin (LoRA r32 on every linear
  layer of an 8B model: 0.7 GB of AdamW state). What a step allocates above the memory it
  began with (inputs, activations, gradients it creates) comes from the reference step;
- the reference is the measured step with the most tokens, and of steps with as many, the
  one that rose most above the memory it began with (with gradient accumulation the first
  micro-step of each cycle creates the gradients, the others do not); a reading whose
  allocated peak is not its own (no reset, and the peak did not rise during the step: an
  earlier step's peak still stands) says nothing new and is not used. Where the first
  step's peak is the optimizer's own first ``step()``, that peak holds the new state and
  the memory held afterwards holds it again: the window stays smaller by that much until a
  step with more tokens is measured (counted twice, never missed);
- before a step with more tokens than any measured, the step's growth is predicted from
  the measured one (activation memory grows linearly with tokens) and the window shrinks
  first when it would not fit.

A step that still runs out of memory is the Trainer integration's to retry with a smaller
window (``integrations.trainer``); this module only says how many layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .units import MiB

MARGIN_BYTES = 384 * MiB  # at least this much stays free below the limit
MARGIN_SHARE = 0.03  # ... or this share of the limit, whichever is more


def margin_bytes(limit: int) -> int:
    """Memory kept free below the limit: step-to-step variation (batch lengths, workspaces)."""
    return max(MARGIN_BYTES, int(MARGIN_SHARE * limit))


@dataclass(frozen=True)
class Reading:
    """What one training step used, measured after it."""

    window: int  # window layers during the step
    tokens: int  # batch x sequence of the step
    peak_reserved: int  # the caching allocator's peak reserved bytes during the step
    start_allocated: int  # bytes allocated when the step began (its inputs included)
    peak_allocated: int  # the allocated peak during the step
    retries: int  # allocations that had to free cached memory and retry (reported, not used)
    start_inputs: int = 0  # bytes of the step's inputs (the first layer's input) at its start
    end_allocated: Optional[int] = None  # bytes allocated when read: at the next step's start
    end_inputs: int = 0  # bytes of the next step's inputs, allocated then
    own_peak: bool = True  # False: the peak is an earlier step's (not reset, did not rise)

    @property
    def transient(self) -> int:
        """What the step allocated on top of what lived across it (activations, loss)."""
        return max(0, self.peak_allocated - self.start_allocated)


class WindowSizer:
    """How many of ``num_layers`` layers of ``layer_bytes`` each the window holds."""

    def __init__(self, num_layers: int, layer_bytes: int):
        self.num_layers = num_layers
        self.layer_bytes = max(layer_bytes, 1)
        self.reference: Optional[Reading] = None  # the step whose rise predicts the next ones
        self.held = 0  # the most memory seen held between steps (no inputs, no window layers)
        self.overhead = 0  # reserved beyond allocated at the first step (the allocator's own)
        self.excess = 0  # how far a step with fewer tokens went past what the reference predicts
        self.max_window = num_layers  # lowered when a window ran a step out of memory

    def _held(self, allocated: int, inputs: int, window: int) -> int:
        return allocated - inputs - window * self.layer_bytes

    def rise(self, reading: Reading) -> int:
        """What the step allocated above the memory held when it began: its inputs, its
        activations, gradients and optimizer buffers it created (freed or not)."""
        held = self._held(reading.start_allocated, reading.start_inputs, reading.window)
        return max(0, reading.peak_allocated - reading.window * self.layer_bytes - held)

    def predicted_peak(self, tokens: int, window: int) -> int:
        """Peak reserved bytes of a step of ``tokens`` tokens with ``window`` layers: the
        most memory held between steps so far, the window, and the reference step's rise
        (activations grow linearly with the tokens of a step; fewer never predict less)."""
        return self._predicted(tokens, window) + self.excess

    def _predicted(self, tokens: int, window: int) -> int:
        reference = self.reference
        rise = self.rise(reference)
        if tokens > reference.tokens:
            rise = math.ceil(rise * tokens / reference.tokens)
        return self.held + rise + window * self.layer_bytes + self.overhead

    def record(self, reading: Reading) -> None:
        start_held = self._held(reading.start_allocated, reading.start_inputs, reading.window)
        end_held = (
            start_held
            if reading.end_allocated is None
            else self._held(reading.end_allocated, reading.end_inputs, reading.window)
        )
        self.held = max(self.held, start_held, end_held)
        if self.reference is None:
            self.overhead = max(0, reading.peak_reserved - reading.peak_allocated)
        elif not reading.own_peak:
            return  # an earlier step's peak still stands: this one's is unknown, and no higher
        reference = self.reference
        if (
            reference is None
            or reading.tokens > reference.tokens
            or (reading.tokens == reference.tokens and self.rise(reading) >= self.rise(reference))
        ):
            self.reference, self.excess = reading, 0
            return
        over = reading.peak_allocated + self.overhead - self._predicted(reading.tokens, reading.window)
        self.excess = max(self.excess, over + (self.held - start_held))

    def size(self, limit: int, tokens: int, window: int) -> int:
        """The window for the next step of ``tokens`` tokens, under ``limit`` bytes, with
        ``window`` layers held now; before any measurement, none."""
        if self.reference is None:
            return 0
        room = limit - margin_bytes(limit) - self.predicted_peak(tokens, window)
        if room >= 0:
            return min(self.max_window, window + room // self.layer_bytes)
        return min(self.max_window, max(0, window - math.ceil(-room / self.layer_bytes)))

    def shrink_after_oom(self, window: int, wanted_bytes: int, limit: int) -> int:
        """The window to retry a step with after it ran out of memory asking for
        ``wanted_bytes``: enough layers fewer to free that and the margin."""
        need = wanted_bytes + margin_bytes(limit)
        return max(0, window - max(1, math.ceil(need / self.layer_bytes)))
