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
- memory held between steps (the weights' resident part, an optimizer's state: what is
  allocated when a step starts, less its inputs and the window's layers) is tracked as the
  most seen, apart for the times gradients are held (mid-accumulation) and not; the
  gradients' own size is what a micro-step that created and kept them grew by. A
  prediction starts from the most of "held without gradients, plus gradients" and "held
  with gradients", so gradient accumulation is neither missed nor counted twice;
- what a step allocates above the memory it began with (inputs, activations, gradients it
  creates and frees, optimizer buffers) is its rise: the most any measured step rose (less
  gradients it kept) and, for more tokens than measured, the reference's rise scaled up;
- the window grows only once a step has been read whose gradients were freed again (an
  optimizer step and ``zero_grad`` done, so its state exists) or after many steps that
  kept them (``zero_grad(set_to_none=False)``); before that it stays as it is. An
  optimizer creates its state at its first ``step()``, after the first training step's
  peak, so a window filled to the margin before that would run the step out of memory
  whenever the state is larger than the margin (LoRA r32 on every linear layer of an 8B
  model: 0.7 GB of AdamW state). Where that ``step()`` is itself a step's peak (short
  batches, large trainable tensors) its state is counted twice, in that rise and in the
  memory held afterwards: the window stays smaller by that much (counted twice, never
  missed);
- a reading whose allocated peak is not its own (no reset, and the peak did not rise during
  the step: an earlier step's peak still stands) gives no rise;
- a step that needed the allocator's retries (an allocation that only succeeded after
  cached memory was freed: the step touched the limit) caps the window at the size it ran
  with: there, the allocator's fragmentation decides, not the allocated bytes the
  prediction counts (a long sequence's first step, whose large loss chunks then find no
  free block once the optimizer's state has split the cached segments);
- before a step with more tokens than any measured, the step's growth is predicted from
  the measured one (activation memory grows linearly with tokens) and the window shrinks
  first when it would not fit.

A step that still runs out of memory is the Trainer integration's to retry with a smaller
window (``integrations.trainer``); this module only says how many layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..units import MiB

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
    retries: int  # allocations that had to free cached memory and retry: the step touched the limit
    start_inputs: int = 0  # bytes of the step's inputs (the first layer's input) at its start
    end_allocated: Optional[int] = None  # bytes allocated when read: at the next step's start
    end_inputs: int = 0  # bytes of the next step's inputs, allocated then
    own_peak: bool = True  # False: the peak is an earlier step's (not reset, did not rise)
    grads_at_start: bool = False  # trainable tensors held gradients when the step began
    grads_at_end: bool = False  # ... and when it was read (accumulating)


# readings after which the window may grow though no optimizer step was seen (an optimizer
# without state whose zero_grad keeps the gradients): far more micro-steps than one accumulates
READINGS_WITHOUT_OPTIMIZER = 256
GROWTH_TOLERANCE = 16 * MiB  # memory held for good that grew by less than this did not grow


class WindowSizer:
    """How many of ``num_layers`` layers of ``layer_bytes`` each the window holds."""

    def __init__(self, num_layers: int, layer_bytes: int):
        self.num_layers = num_layers
        self.layer_bytes = max(layer_bytes, 1)
        self.reference: Optional[Reading] = None  # the measured step with the most tokens
        self.reference_rise = 0  # its rise, less gradients it kept
        # the most a measured step rose (less gradients it kept), by whether it ended
        # accumulating (gradients kept) or not (an optimizer step ran after it)
        self.rises = {True: 0, False: 0}
        # the rise of a step during which the memory held for good grew (the optimizer's
        # first step(): its peak may hold the new state that is held from then on too), until
        # a step of the same kind with as many tokens rose without anything growing
        self.growing: Optional[Tuple[bool, int, int]] = None  # (accumulating, tokens, rise)
        self.held_bare = 0  # the most memory held between steps without gradients
        self.held_with_grads = 0  # ... and with them (mid-accumulation)
        self.gradient_bytes = 0  # what a step that created gradients and kept them grew by
        self.optimizer_seen = False  # a step was read after which an optimizer step ran
        self.readings = 0
        self.overhead = 0  # reserved beyond allocated at the first step (the allocator's own)
        self.max_window = num_layers  # lowered when a window ran a step out of memory

    def _held(self, allocated: int, inputs: int, window: int) -> int:
        return allocated - inputs - window * self.layer_bytes

    def rise(self, reading: Reading) -> int:
        """What the step allocated above the memory held when it began: its inputs, its
        activations, gradients and optimizer buffers it created (freed or not)."""
        return max(0, reading.peak_allocated - reading.start_allocated + reading.start_inputs)

    @property
    def held(self) -> int:
        """The memory a step may begin with: held without gradients plus the gradients (the
        first micro-step of a cycle creates them), or held with them, whichever is more."""
        return max(self.held_bare + self.gradient_bytes, self.held_with_grads)

    def predicted_peak(self, tokens: int, window: int, floor: int = 0) -> int:
        """Peak reserved bytes of a step of ``tokens`` tokens with ``window`` layers: the
        memory held between steps, the window, and the most a step rose (activations grow
        linearly with the tokens of a step; fewer never predict less), or ``floor`` where
        more (a generation the step opens with, measured apart: ``GenerationSizer``)."""
        rise = max(max(self.rises.values()), floor)
        if self.growing is not None:
            rise = max(rise, self.growing[2])
        reference = self.reference
        if tokens > reference.tokens:
            rise = max(rise, math.ceil(self.reference_rise * tokens / reference.tokens))
        return self.held + rise + window * self.layer_bytes + self.overhead

    def record(self, reading: Reading) -> None:
        start_held = self._held(reading.start_allocated, reading.start_inputs, reading.window)
        end_held = (
            start_held
            if reading.end_allocated is None
            else self._held(reading.end_allocated, reading.end_inputs, reading.window)
        )
        # memory held for good grew (or nothing was measured before: the optimizer's first
        # step), gradients a cycle's first micro-step created and kept aside
        if reading.grads_at_end:
            grew = reading.grads_at_start and end_held > max(self.held_with_grads, start_held) + GROWTH_TOLERANCE
        else:
            grew = end_held > self.held_bare + GROWTH_TOLERANCE
        for held, with_grads in ((start_held, reading.grads_at_start), (end_held, reading.grads_at_end)):
            if with_grads:
                self.held_with_grads = max(self.held_with_grads, held)
            else:
                self.held_bare = max(self.held_bare, held)
        created = 0
        if reading.grads_at_end and not reading.grads_at_start:  # a cycle's first micro-step kept them
            created = max(0, end_held - start_held)
            self.gradient_bytes = max(self.gradient_bytes, created)
        if reading.retries > 0:  # at the limit the prediction does not hold: no growth past it
            self.max_window = min(self.max_window, reading.window)
        self.readings += 1
        # an optimizer step ran: the gradients the step's backward made are gone again, or
        # (gradients kept zeroed, not freed) memory held with them grew by its new state
        if (
            not reading.grads_at_end
            or (reading.grads_at_start and end_held > start_held + GROWTH_TOLERANCE)
            or self.readings >= READINGS_WITHOUT_OPTIMIZER
        ):
            self.optimizer_seen = True
        if self.reference is None:
            self.overhead = max(0, reading.peak_reserved - reading.peak_allocated)
        elif not reading.own_peak:
            return  # an earlier step's peak still stands: this one's is unknown, and no higher
        rise = max(0, self.rise(reading) - created)
        kind = reading.grads_at_end
        if grew:
            if self.growing is None or rise >= self.growing[2]:
                self.growing = (kind, reading.tokens, rise)
        else:
            self.rises[kind] = max(self.rises[kind], rise)
            # an optimizer step (gradients freed after it) with as many tokens rose without the
            # growth: it was counted twice. Where gradients are never freed (zero_grad keeps
            # them) optimizer steps cannot be told from micro-steps, and it stays counted
            growing = self.growing
            if growing is not None and not growing[0] and not kind and reading.tokens >= growing[1]:
                self.growing = None
        reference = self.reference
        if (
            reference is None
            or reading.tokens > reference.tokens
            or (reading.tokens == reference.tokens and rise >= self.reference_rise)
        ):
            self.reference, self.reference_rise = reading, rise

    def room(self, limit: int, tokens: int, window: int, floor: int = 0) -> Optional[int]:
        """Bytes a step of ``tokens`` tokens with ``window`` layers would leave free under
        ``limit`` and its margin (negative: over), as measured (``floor``: as
        ``predicted_peak``); None until a step has been read after an optimizer step (the
        memory held for good is not known before)."""
        if self.reference is None or not self.optimizer_seen:
            return None
        return limit - margin_bytes(limit) - self.predicted_peak(tokens, window, floor)

    def hold(self, nbytes: int) -> None:
        """Memory held for good grew by ``nbytes`` between steps, outside any step (the
        embedding and head came back to the GPU): every later prediction counts it; a
        negative ``nbytes``: it shrank (they left again), and every measurement since they
        came back held them."""
        self.held_bare = max(0, self.held_bare + nbytes)
        if self.held_with_grads:
            self.held_with_grads = max(0, self.held_with_grads + nbytes)

    def size(self, limit: int, tokens: int, window: int, floor: int = 0) -> int:
        """The window for the next step of ``tokens`` tokens, under ``limit`` bytes, with
        ``window`` layers held now (``floor``: as ``predicted_peak``); before any
        measurement, none, and no growth before an optimizer step has been read."""
        if self.reference is None:
            return 0
        room = limit - margin_bytes(limit) - self.predicted_peak(tokens, window, floor)
        if room >= 0:
            grown = window + room // self.layer_bytes if self.optimizer_seen else window
            return min(self.max_window, grown)
        return min(self.max_window, max(0, window - math.ceil(-room / self.layer_bytes)))

    def shrink_after_oom(self, window: int, wanted_bytes: int, limit: int) -> int:
        """The window to retry a step with after it ran out of memory asking for
        ``wanted_bytes``: enough layers fewer to free that and the margin."""
        need = wanted_bytes + margin_bytes(limit)
        return max(0, window - max(1, math.ceil(need / self.layer_bytes)))


class GenerationSizer:
    """The window of a process that generates before it trains (or never trains).

    A ``generate`` call holds what the process holds between calls, the window, and what
    the call allocates above that: the KV cache and the prefill's activations, both growing
    with the cached tokens (batch x (prompt + new tokens)). The first call runs with no
    window and is measured; later calls keep as many layers as fit beside the most a
    measured call rose, scaled up to a call that caches more tokens; a call caching as many
    tokens as one measured before takes what such calls rose (its KV cache and activations
    are theirs), so a larger batch sized from a smaller one's rise per token, at first
    cautiously, gets its own measurement from its second call on. Once the process
    trains, ``WindowSizer`` sizes the window from its steps, whose measured interval takes
    in the generation inside them (TRL's GRPO and RLOO generate within the step).
    """

    def __init__(self, num_layers: int, layer_bytes: int):
        self.num_layers = num_layers
        self.layer_bytes = max(layer_bytes, 1)
        self.rise_per_token = 0.0  # the most a measured call rose, per cached token
        self.rise = 0  # ... and the most it rose at all
        self.overhead = 0  # reserved beyond allocated at the first measured call
        self.measured = False
        self.rise_at: Dict[int, int] = {}  # cached tokens -> the most a call caching that many rose

    def record(self, reading: Reading) -> None:
        """A measured call (``reading.tokens``: the tokens it cached)."""
        rise = max(0, reading.peak_allocated - reading.start_allocated)
        if not self.measured:
            self.overhead = max(0, reading.peak_reserved - reading.peak_allocated)
        self.measured = True
        self.rise = max(self.rise, rise)
        self.rise_per_token = max(self.rise_per_token, rise / max(reading.tokens, 1))
        self.rise_at[reading.tokens] = max(self.rise_at.get(reading.tokens, 0), rise)

    def predicted_rise(self, tokens: int) -> int:
        """What a call that caches ``tokens`` tokens allocates above what it starts with,
        and the allocator's overhead: what it adds to the memory held (after a call was
        measured)."""
        rise = self.rise_at.get(tokens)
        if rise is None:
            rise = max(self.rise, math.ceil(self.rise_per_token * tokens))
        return rise + self.overhead

    def size(self, limit: int, held: int, tokens: int) -> int:
        """The window for a call that caches ``tokens`` tokens, ``held`` bytes being held
        outside the window when it starts; none before a call was measured."""
        if not self.measured:
            return 0
        room = limit - margin_bytes(limit) - held - self.predicted_rise(tokens)
        return max(0, min(self.num_layers, room // self.layer_bytes))
