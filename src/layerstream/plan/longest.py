"""Long sequences: whether a step fits with and without each long-sequence option
(offload_activations, a chunked loss, a tiled MLP), and the longest sequence that fits.
Where the embedding and head are resident, one more row adds ``stream_embeddings``: on a
large vocabulary they are the next wall (3.9 GiB for a 70B Llama-3), and a user who
asked about the three options would not otherwise learn that it is the one that fits.
And what the options do for a step that ran out of memory (``oom_advice``)."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from ..decisions.disk import size_text
from .advice import LONG_OPTIONS, option_value
from .long_settings import LONG_ORDER, OFF, planned, setting_text
from .memory import MemoryPlan, _build
from .request import PlanRequest

# the longest sequence ``max_seq`` looks for (tokens per sequence)
MAX_SEQ_LIMIT = 1 << 24

# a plan -> the same plan with the host store a run keeps (``plan.disk.with_disk_store``:
# a disk tier's RAM layers and ring in place of every layer); None: every layer
HostStore = Optional[Callable[[MemoryPlan], MemoryPlan]]


def _without(request: PlanRequest) -> PlanRequest:
    """``request`` with none of the long-sequence settings, and ends resident unless asked
    to stream (True; "auto" streams them only as a last resort, its own row)."""
    return request.replace(
        offload_activations=False,
        loss_chunk_tokens=None,
        mlp_tile_tokens=None,
        stream_embeddings=request.stream_embeddings is True,
    )


def option_label(name: str, value) -> str:
    return name if value is True else f"{name}={value}"


def option_rows(request: PlanRequest) -> List[Tuple[str, PlanRequest]]:
    """(label, request): none of the options, each alone, and all of them; an option's
    value is the one given or the planner's default chunk. Where TRL's fused head computes
    the loss (``trl_fused_head``), a loss chunk is no option."""
    base = _without(request)
    rows = [("none of them", base)]
    names = [name for name, _, _ in LONG_OPTIONS if not (name == "loss_chunk_tokens" and request.trl_fused_head)]
    for name in names:
        value = option_value(name, request)
        rows.append((option_label(name, value), base.replace(**{name: value})))
    every = base.replace(**{name: option_value(name, request) for name in names})
    rows.append(("all three" if len(names) == 3 else "both", every))
    if request.stream_embeddings is not True:
        rows.append((f"{rows[-1][0]}, stream_embeddings", every.replace(stream_embeddings=True)))
    return rows


def fits(request: PlanRequest, seq: int, host: Optional[Tuple[int, int]] = None, store: HostStore = None) -> bool:
    """Whether a step of ``seq`` tokens a sequence fits, its "auto" settings decided for it;
    with ``host`` (available, total bytes), also whether that host holds it
    (``MemoryPlan.host_holds``: the offloaded inputs grow with the sequence), its layer
    store as ``store`` keeps it."""
    plan = planned(request.replace(seq=seq))
    if store is not None:
        plan = store(plan)
    return plan.fits and (host is None or plan.host_holds(*host))


def max_seq(
    request: PlanRequest,
    limit: int = MAX_SEQ_LIMIT,
    host: Optional[Tuple[int, int]] = None,
    store: HostStore = None,
) -> int:
    """The longest sequence (tokens, at the request's batch) whose step fits; 0 when not
    even one token does. ``host``: (available, total) bytes of the host RAM, where it
    bounds the length too; None: the GPU alone. ``store``: the host store a disk tier
    keeps (``HostStore``); None: every layer. The peaks grow with the sequence, so a
    bisection finds it."""

    def ok(seq: int) -> bool:
        return fits(request, seq, host, store)

    if not ok(1):
        return 0
    low, high = 1, 2
    while high <= limit and ok(high):
        low, high = high, high * 2
    if high > limit:
        if ok(limit):
            return limit
        high = limit
    while high - low > 1:  # the largest seq in [low, high) that fits: low fits, high does not
        middle = (low + high) // 2
        if ok(middle):
            low = middle
        else:
            high = middle
    return low


def comparison(request: PlanRequest, with_max_seq: bool) -> List[Tuple[str, MemoryPlan, int]]:
    """(label, plan at the request's seq, longest seq or -1 when not asked) for each row."""
    out = []
    for label, row in option_rows(request):
        out.append((label, _build(row), max_seq(row) if with_max_seq else -1))
    return out


def _spelled(name: str, value) -> str:
    """A setting as each surface spells it turned on."""
    flag = "--" + name.replace("_", "-")
    text = "true" if value is True else str(value)
    return f"StreamConfig({name}={value!r}) ({flag} {text}, stream.{name}: {text})"


def oom_advice(request: PlanRequest, budget: Optional[int]) -> List[str]:
    """What the long-sequence settings do for a step that ran out of memory: ``request`` is
    that step's, its settings as it ran (no "auto"). Each setting with the memory it frees
    at this length (or frees already, when on), and the longest sequence the plan fits
    under ``budget`` (None: not said), as the step ran and with all three on."""

    def needed(**settings) -> int:
        return _build(request.replace(**settings)).needed_bytes

    now = needed()
    tokens = f"batch {request.batch} x {request.seq} tokens"
    lines = []
    for name in LONG_ORDER:
        value = getattr(request, name)
        if value:
            frees = needed(**{name: OFF[name]}) - now
            lines.append(f"{setting_text(name, value)} is on: it frees {size_text(frees)} at {tokens}")
            continue
        value = option_value(name, request)
        frees = now - needed(**{name: value})
        lines.append(f"turn on {_spelled(name, value)}: frees {size_text(frees)} at {tokens}")
    if budget is not None:
        every = {name: getattr(request, name) or option_value(name, request) for name in LONG_ORDER}
        at_budget = request.replace(vram_bytes=budget)
        as_ran, with_all = max_seq(at_budget), max_seq(at_budget.replace(**every))
        lines.append(
            f"the memory plan fits up to {as_ran} tokens a sequence at batch {request.batch} under "
            f"{size_text(budget)} with the settings this step ran with, and {with_all} with all three on"
        )
    return lines
