"""Whether a mixture-of-experts layer's experts are copied by need. Pure logic.

A routed layer reads only the experts its router chose for the tokens at hand: one decoding
step of a 128-expert model with 8 experts per token reads 8 of them (6%) for one sequence,
at most 64 (50%) for eight. Copying the others is wasted bandwidth, and at decoding sizes
the copies are the whole cost of a streamed step. So a streamed MoE layer can copy its
shared part (attention, norms, router, shared experts) ahead, as any layer, and the rows of
its expert stacks only once the router has run, for the experts it chose.

Waiting for the router costs a synchronisation per layer, and copying rows one expert at a
time costs more than one copy of the whole stack once most experts are hit (a training step
of 2,048 tokens hits every expert of every layer). So by-need copying is chosen per pass,
from the tokens it carries: where the expected share of experts hit, with the router's
choices taken as uniform, is under ``BY_NEED_SHARE``. A router that concentrates its
choices hits fewer, so the estimate errs towards copying whole stacks, which is always
correct, only slower.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

# by need while fewer than this share of the experts is expected to be hit
BY_NEED_SHARE = 0.5


def expected_share_hit(tokens: int, top_k: int, experts: int) -> float:
    """The expected share of ``experts`` that ``tokens`` tokens, each routed to ``top_k``
    distinct experts chosen uniformly, hit at least once."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    missed_by_one = max(0.0, 1.0 - min(top_k, experts) / experts)
    return 1.0 - missed_by_one**tokens


def copy_by_need(tokens: int, top_k: int, experts: int) -> bool:
    """Whether a pass of ``tokens`` tokens copies a layer's experts by need."""
    return expected_share_hit(tokens, top_k, experts) < BY_NEED_SHARE


def ranges_outside(total: int, holes: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The (begin, end) byte ranges of ``[0, total)`` that no hole covers, in order: what a
    layer's copy takes when its expert stacks (the holes) are copied by need."""
    ranges, at = [], 0
    for begin, end in sorted(holes):
        if begin > at:
            ranges.append((at, begin))
        at = max(at, end)
    if at < total:
        ranges.append((at, total))
    return ranges


def runs(rows: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted distinct rows as (first, past the last) runs of consecutive rows: one copy
    per run instead of one per row."""
    out: List[Tuple[int, int]] = []
    for row in sorted(set(rows)):
        if out and out[-1][1] == row:
            out[-1] = (out[-1][0], row + 1)
        else:
            out.append((row, row + 1))
    return out
