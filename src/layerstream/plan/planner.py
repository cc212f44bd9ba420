"""The planner's entry point: a memory plan of one streamed LoRA training step, with advice
(what to change, and by how much) when it does not fit. The advice is computed from
alternative plans (``advice``), so it sits above the memory model (``memory``)."""

from __future__ import annotations

from .advice import advice
from .long_settings import resolve_auto
from .memory import MemoryPlan, _build
from .request import PlanRequest


def make_plan(request: PlanRequest) -> MemoryPlan:
    """Plan a streamed LoRA training step as ``request`` asks (``PlanRequest``: the model's
    config, batch x seq tokens, the GPU budget, the settings). Settings left at "auto" are
    decided as a run decides them (``long_settings.resolve_auto``); the plan carries the
    values taken.

    A plan that does not fit carries ``advice``: what to change, and by how much.
    """
    if not isinstance(request, PlanRequest):
        raise TypeError("make_plan takes one PlanRequest: make_plan(PlanRequest(config, seq, batch, vram_bytes, ...))")
    request = resolve_auto(request)
    plan = _build(request)
    if not plan.fits:
        plan.advice = advice(plan, request)
    return plan
