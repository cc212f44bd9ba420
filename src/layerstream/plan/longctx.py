"""Long sequences: whether a step fits with and without each long-sequence option
(offload_activations, a chunked loss, a tiled MLP), and the longest sequence that fits.
Where the embedding and head are resident, one more row adds ``stream_embeddings``: on a
large vocabulary they are the next wall (3.9 GiB for a 70B Llama-3), and a user who
asked about the three options would not otherwise learn that it is the one that fits."""

from __future__ import annotations

from typing import List, Tuple

from .advice import LONG_OPTIONS, option_value
from .memory import MemoryPlan, _build

# the longest sequence ``max_seq`` looks for (tokens per sequence)
MAX_SEQ_LIMIT = 1 << 24


def complete(args: dict) -> dict:
    """``make_plan``'s keyword arguments with its defaults filled in (``_build`` takes them all)."""
    import inspect

    from .planner import make_plan

    defaults = {
        name: p.default for name, p in inspect.signature(make_plan).parameters.items() if p.default is not p.empty
    }
    return {**defaults, **args}


def _without(args: dict) -> dict:
    return dict(args, offload_activations=False, loss_chunk_tokens=None, mlp_tile_tokens=None)


def option_label(name: str, value) -> str:
    return name if value is True else f"{name}={value}"


def option_rows(args: dict) -> List[Tuple[str, dict]]:
    """(label, plan arguments): none of the options, each alone, and all of them; an option's
    value is the one given or the planner's default chunk. Where TRL's fused head computes
    the loss (``trl_fused_head``), a loss chunk is no option."""
    base = _without(args)
    rows = [("none of them", base)]
    names = [name for name, _, _ in LONG_OPTIONS if not (name == "loss_chunk_tokens" and args.get("trl_fused_head"))]
    for name in names:
        value = option_value(name, args)
        rows.append((option_label(name, value), dict(base, **{name: value})))
    every = dict(base, **{name: option_value(name, args) for name in names})
    rows.append(("all three" if len(names) == 3 else "both", every))
    if not args.get("stream_embeddings"):
        rows.append((f"{rows[-1][0]}, stream_embeddings", dict(every, stream_embeddings=True)))
    return rows


def fits(args: dict, seq: int) -> bool:
    return _build(**complete(dict(args, seq=seq))).fits


def max_seq(args: dict, limit: int = MAX_SEQ_LIMIT) -> int:
    """The longest sequence (tokens, at the arguments' batch) whose step fits; 0 when not
    even one token does. The peak grows with the sequence, so a bisection finds it."""
    if not fits(args, 1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(args, high):
        low, high = high, high * 2
    if high > limit:
        return limit if fits(args, limit) else _bisect(args, low, limit)
    return _bisect(args, low, high)


def _bisect(args: dict, low: int, high: int) -> int:
    """Largest seq in [low, high) that fits, given that low fits and high does not."""
    while high - low > 1:
        middle = (low + high) // 2
        if fits(args, middle):
            low = middle
        else:
            high = middle
    return low


def comparison(args: dict, with_max_seq: bool) -> List[Tuple[str, MemoryPlan, int]]:
    """(label, plan at the arguments' seq, longest seq or -1 when not asked) for each row."""
    out = []
    for label, row in option_rows(args):
        out.append((label, _build(**complete(row)), max_seq(row) if with_max_seq else -1))
    return out
