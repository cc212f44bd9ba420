"""Which long-sequence settings a step needs: what "auto" decides.

offload_activations, loss_chunk_tokens and mlp_tile_tokens default to "auto". Before a step
of a token count not seen before runs, its memory plan decides (``decide``): a step whose
plan with none of them needs at most the budget less ``OFFLOAD_AUTO_MARGIN`` (the plan has
come out under the measured peak by up to 14% at long sequences) runs without them, so
short sequences cost nothing. Otherwise they are turned on in ``LONG_ORDER`` until the plan
needs no more than that, and then any one that those turned on after it made unneeded is
turned off again (the costlier first). Where even all of them leave the plan over, every
one that frees memory stays on.

``stream_embeddings`` left at "auto" (the default) is the last resort, after the three
(``AUTO_ORDER``): where they leave the plan over the limit, the embedding and head move
to host memory, copied in as they run, and stay there until a measured step leaves room
for them on the GPU (the runtime's ``EndsOnDemand.bring_back``: the plan is cautious, a
measurement is not).
It frees the ends' bytes (4 GiB for an 8B Llama-3 in float32, as PEFT's k-bit preparation
leaves them) and costs their copies each step: the head twice, the embedding's rows once.

``LONG_ORDER`` is cheapest first for the memory each frees; what each frees at the step's
length comes from the plan (``LongDecision.frees``), what each costs is per step:

- loss_chunk_tokens frees the fp32 logits, their log-softmax and gradient, 3 x tokens x
  vocab x 4 bytes less one chunk's: 1.5 MB a token for a 128k vocabulary, the largest
  term at long sequences. It adds no arithmetic (each chunk's head product runs once
  forward and once for its gradient, as without chunks), only a few launches per chunk.
- mlp_tile_tokens frees one layer's MLP intermediates, about 3 x tokens x intermediate x
  elem bytes less one tile's. It adds no arithmetic either (backward runs each tile's
  forward once, where the checkpoint's recompute would have run the whole MLP), but its
  matmuls are smaller and its launches more.
- offload_activations frees the checkpointed inputs but two, (layers - 2) x tokens x hidden
  x elem bytes, by copying (layers - 1) of them to host memory and back every step: PCIe
  traffic beside the layer stream's own copies, and as much page-locked host memory.

Pure arithmetic on plan numbers: no CUDA and no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..config import OFFLOAD_AUTO_MARGIN
from ..decisions.disk import size_text
from .advice import option_value
from .memory import MemoryPlan, _build
from .request import AUTO, PlanRequest
from .shapes import layer_shapes

LONG_ORDER = ("loss_chunk_tokens", "mlp_tile_tokens", "offload_activations")
# each setting as it is when off, in a PlanRequest and StreamConfig alike
OFF = {"loss_chunk_tokens": None, "mlp_tile_tokens": None, "offload_activations": False}
# what "auto" may turn on for a step, in order: the per-step settings, then the ends, which
# once streamed stay streamed
ENDS = "stream_embeddings"
AUTO_ORDER = LONG_ORDER + (ENDS,)


@dataclass(frozen=True)
class LongDecision:
    """What "auto" turned on for a step of ``tokens`` tokens, and the plan's numbers behind it."""

    tokens: int
    budget: int
    limit: int  # the budget less the margin: what the plan must need at most
    needed_without: int  # the plan (peak and reserve) with none of the "auto" settings on
    needed: int  # with those in ``on``
    on: Tuple[Tuple[str, object], ...] = ()  # (setting, value), cheapest first
    frees: Tuple[int, ...] = ()  # what each one in ``on`` frees at this length, the others on
    needed_without_offload: int = 0  # with ``on`` but offload_activations

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.on)

    def value(self, name: str):
        """The value ``name`` takes for this step: as turned on, or None when it stays off."""
        return dict(self.on).get(name)

    @property
    def fits(self) -> bool:
        return self.needed <= self.limit

    @property
    def offload_for_margin_only(self) -> bool:
        """Offloading is on only to keep the margin: the plan fits the budget without it."""
        return "offload_activations" in self.names and self.needed_without_offload <= self.budget


# a step for which nothing was decided (no budget, nothing left at "auto")
NOTHING = LongDecision(tokens=0, budget=0, limit=0, needed_without=0, needed=0)


def limit_for(budget: int, margin: float = OFFLOAD_AUTO_MARGIN) -> int:
    """What a step's plan may need at most before "auto" turns settings on."""
    return int(budget * (1 - margin))


def decide(
    tokens: int,
    budget: int,
    candidates: Dict[str, object],
    needed: Callable[[Dict[str, object]], int],
    margin: float = OFFLOAD_AUTO_MARGIN,
) -> LongDecision:
    """Which of ``candidates`` (setting -> its value when on; the ones left at "auto" that
    the model can take) a step of ``tokens`` tokens needs under ``budget`` bytes.
    ``needed(on)`` is the plan's peak plus reserve with the settings in ``on`` turned on and
    the other candidates off; it is asked at most eight times, each set once."""
    limit = limit_for(budget, margin)
    order = [name for name in AUTO_ORDER if name in candidates]
    plans: Dict[frozenset, int] = {}

    def need(names: List[str]) -> int:
        key = frozenset(names)
        if key not in plans:
            plans[key] = needed({name: candidates[name] for name in order if name in key})
        return plans[key]

    on: List[str] = []
    if need(on) > limit:
        for name in order:
            on.append(name)
            if need(on) <= limit:
                break
        for name in reversed(list(on)):
            rest = [other for other in on if other != name]
            if need(rest) <= max(limit, need(on)):  # still under, or it freed nothing
                on = rest
    without_offload = [name for name in on if name != "offload_activations"]
    return LongDecision(
        tokens=tokens,
        budget=budget,
        limit=limit,
        needed_without=need([]),
        needed=need(on),
        on=tuple((name, candidates[name]) for name in on),
        frees=tuple(need([other for other in on if other != name]) - need(on) for name in on),
        needed_without_offload=need(without_offload),
    )


# -- from a plan request -------------------------------------------------------------------
def auto_values(request: PlanRequest) -> Dict[str, object]:
    """The value each setting left at "auto" in ``request`` takes when turned on: offloading
    and streamed ends on, the loss chunk sized to the vocabulary, the default MLP tile."""
    values = {
        name: option_value(name, request.replace(**{name: OFF[name]}))
        for name in LONG_ORDER
        if getattr(request, name) == AUTO
    }
    if request.stream_embeddings == AUTO:
        values[ENDS] = True
    return values


def as_planned(request: PlanRequest, on: Optional[Dict[str, object]] = None) -> PlanRequest:
    """``request`` as a plan is built of it: each setting left at "auto" off, but those in ``on``."""
    off = {name: OFF[name] for name in LONG_ORDER if getattr(request, name) == AUTO}
    if request.stream_embeddings == AUTO:
        off[ENDS] = False
    return request.replace(**{**off, **(on or {})})


def decide_for(request: PlanRequest, budget: int, margin: float = OFFLOAD_AUTO_MARGIN) -> LongDecision:
    """``decide`` for a request whose long-sequence settings may be "auto"."""
    candidates = auto_values(request)
    if not candidates:
        return NOTHING

    def needed(on: Dict[str, object]) -> int:
        return _build(as_planned(request, on)).needed_bytes

    return decide(request.batch * request.seq, budget, candidates, needed, margin)


def resolve_auto(request: PlanRequest) -> PlanRequest:
    """The one place a plan's "auto" long-sequence settings are decided, for every surface
    (``make_plan``, ``layerstream plan``, ``layerstream train``'s check, the longest-sequence
    search): as a run decides them for this step under ``vram_bytes`` (``decide_for``), the
    others off. slots and backward_slots at "auto" are counted with the memory the plan
    leaves them (``memory._build``: ``config.auto_slots``, ``backward_slot_count``)."""
    if AUTO not in (getattr(request, name) for name in AUTO_ORDER):
        return request
    request = _without_what_the_model_refuses(request)
    return as_planned(request, dict(decide_for(request, request.vram_bytes).on))


def _without_what_the_model_refuses(request: PlanRequest) -> PlanRequest:
    """The "auto" settings a run of this model keeps off, off in its plan too (a run finds
    out from the model itself): no tiled MLP in a model with routed experts, no chunked loss
    where the model's forward does more than pass its head's output to its loss function
    (a mixture of experts adds the router's loss)."""
    changes = {}
    if request.mlp_tile_tokens == AUTO and any(shape.sparse for shape in layer_shapes(request.config)):
        changes["mlp_tile_tokens"] = None
    no_lm_head = request.head_outputs is not None  # a classifier's score: no causal LM loss to chunk
    if request.loss_chunk_tokens == AUTO and (no_lm_head or not _loss_chunks_possible(request.config)):
        changes["loss_chunk_tokens"] = None
    return request.replace(**changes) if changes else request


def _loss_chunks_possible(config) -> bool:
    """Whether the causal LM class of ``config`` lets its loss be chunked (unknown classes:
    planned as if it did, as before a model exists nothing else says)."""
    from ..long.chunked_loss import class_takes_chunks

    try:
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ImportError, ValueError):
        return True
    return class_takes_chunks(cls)


def planned(request: PlanRequest) -> MemoryPlan:
    """The plan of a request, its "auto" settings decided (``resolve_auto``); no advice."""
    return _build(resolve_auto(request))


# -- what is said ------------------------------------------------------------------------------
def setting_text(name: str, value) -> str:
    """A setting as turned on: ``offload_activations``, ``loss_chunk_tokens=512``."""
    return name if value is True else f"{name}={value}"


def describe(decision: LongDecision, batch: int, seq: int, offloaded: bool = True) -> str:
    """What "auto" turned on for a step and why, with the plan's numbers; ``offloaded``:
    whether offloading, when decided, did start (the host may refuse it a margin-only step)."""
    kept = [
        (name, value, frees)
        for (name, value), frees in zip(decision.on, decision.frees)
        if offloaded or name != "offload_activations"
    ]
    turned = [
        f"{name}='auto' is on"
        + (f" at {value} tokens" if value is not True else "")
        + f" (frees {size_text(frees)})"
        + (
            ": the embedding and head stay in host memory until a measured step leaves them room"
            if name == ENDS
            else ""
        )
        for name, value, frees in kept
    ]
    needed = decision.needed if offloaded else decision.needed_without_offload
    after = f"; the plan then needs {size_text(needed)}"
    if needed > decision.budget:
        after += ", still over vram_budget: the step may run out of memory (shorter sequences or a smaller batch fit)"
    elif needed > decision.limit:  # the margin is for the plan's error and the window, not a wall
        after += (
            f", still over the {100 - round(100 * OFFLOAD_AUTO_MARGIN)}% but within vram_budget: the step should "
            "fit, with little room left for the resident window"
        )
    return (
        f"layerstream: a training step of batch {batch} x {seq} tokens needs {size_text(decision.needed_without)} by "
        f"the memory plan (peak and reserve), over the {size_text(decision.limit)} auto keeps it under "
        f"({100 - round(100 * OFFLOAD_AUTO_MARGIN)}% of vram_budget {size_text(decision.budget)}): "
        + ", ".join(turned)
        + after
    )


def plan_line(decision: LongDecision, batch: int, seq: int) -> str:
    """`layerstream plan`'s line: what a run's defaults ("auto") turn on at this length."""
    pct = 100 - round(100 * OFFLOAD_AUTO_MARGIN)
    head = f"auto (a run's default) at batch {batch} x {seq} tokens"
    if not decision.on:
        return f"{head}: none of the long-sequence settings (the plan needs at most {pct}% of the budget without them)"
    turned = ", ".join(setting_text(name, value) for name, value in decision.on)
    return (
        f"{head} turns on {turned}: the plan needs {size_text(decision.needed_without)} without them, "
        f"{size_text(decision.needed)} with them, against {size_text(decision.limit)} ({pct}% of the budget)"
    )
