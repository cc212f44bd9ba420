"""Reading the GPU memory a training step used, for the resident window (``window``).

``CudaMeter`` reads torch's caching allocator: the reserved peak of a step (what the
allocator held at most, fragmentation included), the allocated bytes at its start and
peak, and the allocator's retries (allocations that only succeeded after freeing cached
memory: the step touched the limit). It resets torch's peak statistics at the start of
the steps it measures while the window is being sized (the first steps, and after each
change), so ``torch.cuda.max_memory_allocated()`` read by other code covers the steps
since then; once the window holds still it stops resetting.

``PlannedMeter`` stands in on the host (``device="cpu"`` with a ``vram_budget``, as in the
tests): its "measured" peak is the memory planner's prediction, so the window machinery
runs, deterministically, where there is no GPU to measure.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from ..config import gpu_memory_for_run
from ..decisions.window import Reading
from ..system.log import get_logger
from ..units import parse_bytes

logger = get_logger(__name__)

_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")


def wanted_bytes(error: BaseException) -> Optional[int]:
    """The allocation an out-of-memory error was refused, from its message."""
    match = _TRIED.search(str(error))
    return parse_bytes(match.group(1) + match.group(2)) if match else None


class CudaMeter:
    def __init__(self, device: torch.device, budget):
        self.device = device
        self.budget = budget  # bytes, or "auto"
        self._start_allocated = 0
        self._start_retries = 0
        self._start_peak: Optional[int] = None  # the peak when a step began without a reset
        self._start_inputs = 0
        self._start_grads = False

    def limit(self) -> int:
        """What the run may reserve now: the budget, this process's fraction of the GPU and
        what the device has free (beside what this process already holds), whichever is least."""
        reachable = gpu_memory_for_run(self.device)
        return reachable if self.budget == "auto" else min(int(self.budget), reachable)

    def allocated(self) -> int:
        """Bytes allocated on the device now."""
        return torch.cuda.memory_allocated(self.device)

    def begin(self, reset: bool, inputs: int = 0, grads: bool = False) -> None:
        """Start measuring a step; ``reset``: from here on, not since an earlier peak;
        ``inputs``: bytes of the step's inputs, allocated already; ``grads``: gradients held."""
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        stats = torch.cuda.memory_stats(self.device)  # one read: each builds the whole table
        self._start_allocated = stats.get("allocated_bytes.all.current", 0)
        self._start_retries = stats.get("num_alloc_retries", 0)
        self._start_peak = None if reset else stats.get("allocated_bytes.all.peak", 0)
        self._start_inputs = inputs
        self._start_grads = grads

    def read(self, window: int, tokens: int, next_inputs: int = 0, grads: bool = False) -> Reading:
        """What the step begun last used, read at the next step's start (``next_inputs``:
        that step's inputs, allocated already; ``grads``: gradients held now)."""
        stats = torch.cuda.memory_stats(self.device)
        peak = stats.get("allocated_bytes.all.peak", 0)
        return Reading(
            window=window,
            tokens=tokens,
            peak_reserved=stats.get("reserved_bytes.all.peak", 0),
            start_allocated=self._start_allocated,
            peak_allocated=peak,
            retries=stats.get("num_alloc_retries", 0) - self._start_retries,
            start_inputs=self._start_inputs,
            end_allocated=stats.get("allocated_bytes.all.current", 0),
            end_inputs=next_inputs,
            own_peak=self._start_peak is None or peak > self._start_peak,
            grads_at_start=self._start_grads,
            grads_at_end=grads,
        )

    def release_cache(self) -> None:
        """Give cached blocks nobody uses back to the driver (memory other work left in
        this process's cache would otherwise count as needed)."""
        torch.cuda.empty_cache()


class PlannedMeter:
    """The planner's prediction in place of a measurement (host runs with a budget)."""

    def __init__(self, runtime, budget: int):
        self.runtime = runtime
        self.budget = budget
        self._shape = (1, 1)
        self._grads = False

    def limit(self) -> int:
        return self.budget

    def allocated(self) -> int:
        """The planned resident part (the planner models no generation: a generate call on
        the host is measured as the training step the runtime last planned); the budget
        where the model cannot be planned, so that no window grows on a guess."""
        try:
            return self.runtime.memory_plan(*self.runtime.last_shape).resident_bytes
        except ValueError:
            return self.budget

    def begin(self, reset: bool, inputs: int = 0, grads: bool = False) -> None:
        self._shape = self.runtime.last_shape  # the step about to run
        self._grads = grads

    def read(self, window: int, tokens: int, next_inputs: int = 0, grads: bool = False) -> Reading:
        batch, seq = self._shape
        try:
            memory = self.runtime.memory_plan(batch, seq)
            peak = memory.peak_vram_bytes + memory.reserve_bytes + window * self.runtime.store.largest_layer_bytes
            start = peak - memory.activation_bytes
        except ValueError:  # not plannable (budget_check says so once): read as full, no window grows
            peak = start = self.budget
        # the planner's peak stands for what the step allocates (its reserve for the allocator)
        return Reading(
            window=window,
            tokens=tokens,
            peak_reserved=peak,
            start_allocated=start,
            peak_allocated=peak,
            retries=0,
            grads_at_start=self._grads,
            grads_at_end=grads,
        )

    def release_cache(self) -> None:
        pass


def for_runtime(runtime):
    """The meter a runtime's resident window is sized with: none without a vram_budget (the
    window is then set by hand only), the allocator's on CUDA, the planner's on the host."""
    budget = runtime.config.vram_budget
    if budget is None:
        return None
    if runtime.pool.cuda:
        return CudaMeter(runtime.device, budget)
    return PlannedMeter(runtime, budget)
