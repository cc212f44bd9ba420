"""An explicit vram_budget checked against the memory planner before the first training
step of each batch shape: a step the plan says cannot fit, with every layer streamed, is
refused before any layer runs (``report.budget_refusal`` says what would fit)."""

from __future__ import annotations

from typing import Set, Tuple

from ..system.log import get_logger
from . import report

logger = get_logger("layerstream.runtime.core")


class BudgetCheck:
    """The largest (batch, seq) step shapes that passed. A shape no larger in batch and
    sequence than one that passed needs no plan (batches padded to their longest sequence
    come in a new shape at nearly every step); a refused shape is not remembered, so a
    smaller one that cannot fit either is planned and refused too."""

    def __init__(self):
        self.passed: Set[Tuple[int, int]] = set()

    def check(self, runtime, batch: int, seq: int) -> None:
        if any(batch <= b and seq <= s for b, s in self.passed):
            return
        budget = runtime.config.vram_budget
        try:
            memory = runtime.memory_plan(batch, seq, vram_bytes=budget)
            if not memory.fits and runtime.long_settings.ends.back_for(batch * seq):
                # "auto" brought the ends back as measured steps this long left room for
                # them: the plan, cautious, is met as before they came back, streaming them
                offload = runtime.pass_offloader is not None
                memory = runtime.long_settings.memory_plan(batch, seq, budget, 0, offload, ends=True)
            if not memory.fits:
                raise report.budget_refusal(memory, budget)
        except ValueError as exc:
            logger.warning(
                "layerstream: vram_budget is not checked for this model: its memory cannot be predicted (%s)", exc
            )
        self.passed = {(b, s) for b, s in self.passed if not (b <= batch and s <= seq)}
        self.passed.add((batch, seq))
