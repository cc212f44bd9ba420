"""Which layer to copy into which slot, and when. Pure logic: no CUDA, no tensors.

The planner sees one *visit* at a time (layer index and phase) and answers with the
slot that layer computes in and the copies to issue now. It predicts the visits to
come from the phase:

- TRAIN_FORWARD: a forward under autograd. Backward follows, recomputing the layers in
  reverse, so the order is a cycle F0 .. F(L-1), B(L-1) .. B0 of length 2L. The layers
  still in slots at the end of forward are the first ones backward needs (turnaround
  reuse), and the layers left in slots at the end of backward are the first ones the
  next forward needs.
- BACKWARD: the recompute of a checkpointed layer during backward (same cycle).
- INFERENCE: a forward without autograd (evaluation, generation): F0 .. F(L-1), then
  F0 again for the next token or batch.

A wrong prediction never breaks correctness: a layer that is not in a slot at its visit
is loaded on demand (counted as a demand load, and the compute waits for it).

Eviction follows the prediction: the slot whose owner is needed furthest in the future
is overwritten first, and never one whose owner is needed before the layer being
fetched (that would only trade one wait for another).

Backward slots: extra slots, one for each of the layers ``slots`` .. ``slots +
backward_slots - 1``, that take memory at the first copy backward puts in them and give
it back once the next forward has run their layer. So they hold memory from the start of backward
until early in the next forward, never while the loss holds its logits, the step's
memory peak: they borrow that memory for the rest of the step. With them those layers
stay on the GPU across the step boundary (one copy fewer per step each). Before that,
each also takes one of the backward's first copies: backward then starts copying as soon
as the head's backward has freed the logits, instead of waiting for the last layer's
backward to free a ring slot. Only a layer done early enough takes one (before the
backward slots' own layers are fetched, ``_early_in_backward_slot``), so a kept layer
never waits for its slot; and only an empty one, so two layers pass through each per
step (each needs its tensor views rebuilt, the memory being new each step).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import List, Optional, Tuple


class Phase(Enum):
    TRAIN_FORWARD = "train_forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


@dataclass(frozen=True)
class VisitPlan:
    """What to do at one visit.

    slot: the slot the visited layer computes in.
    loads: (layer, slot) copies to issue now, in order. The first one is the visited
        layer itself when it was not resident (a demand load); the rest are prefetches.
    demand: True when the visited layer had to be loaded at its own visit.
    drop: backward slots given back at this visit (their memory can be freed now: every
        kernel that read them is queued).
    """

    slot: int
    loads: Tuple[Tuple[int, int], ...] = ()
    demand: bool = False
    drop: Tuple[int, ...] = ()


def usable_backward_slots(wanted: int, num_layers: int, slots: int) -> int:
    """How many of ``wanted`` backward slots a stack can use: at most the layers beyond
    twice the ring, so the layers they keep (``slots`` .. ``slots + n - 1``) are none of
    the last ``slots``, which the ring keeps across the forward/backward turnaround and
    which run just before the loss."""
    return min(wanted, max(0, num_layers - 2 * slots))


class PrefetchSchedule:
    """Tracks slot owners and plans copies for a stack of ``num_layers`` layers."""

    def __init__(self, num_layers: int, slots: int, prefetch: int, backward_slots: int = 0):
        if num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        if slots < 2 or not 1 <= prefetch < slots:
            raise ValueError(f"need slots >= 2 and 1 <= prefetch < slots, got {slots=}, {prefetch=}")
        if backward_slots < 0:
            raise ValueError(f"backward_slots must be >= 0, got {backward_slots}")
        self.num_layers = num_layers
        self.slots = slots
        self.prefetch = prefetch
        self.backward_slots = usable_backward_slots(backward_slots, num_layers, slots)
        # slots 0..slots-1 are the ring; slots from `slots` on are backward slots
        self.owner: List[Optional[int]] = [None] * (slots + self.backward_slots)
        self.slot_of: dict = {}
        self._disabled: set = set()  # backward slots whose memory could not be had
        # (layer, phase) -> ((target, visits until needed), ...): the lookahead is a pure
        # function of the visit, so the hot path reads it instead of recomputing it
        self._lookahead: dict = {}
        # (layer, phase, owners before) -> plan: planning is a pure function of these,
        # and steady-state training or inference cycles through a few such states
        self._plans: dict = {}

    # -- the predicted order -------------------------------------------------------
    def _cycle(self, phase: Phase) -> int:
        return self.num_layers if phase is Phase.INFERENCE else 2 * self.num_layers

    def _position(self, layer: int, phase: Phase) -> int:
        if phase is Phase.BACKWARD:
            return 2 * self.num_layers - 1 - layer
        return layer

    def _layer_at(self, position: int, phase: Phase) -> int:
        position %= self._cycle(phase)
        if position < self.num_layers:
            return position
        return 2 * self.num_layers - 1 - position

    def _distance(self, layer: int, position: int, phase: Phase) -> int:
        """Visits from ``position`` until ``layer`` is needed again (0: needed now)."""
        cycle = self._cycle(phase)
        best = (layer - position) % cycle
        if phase is not Phase.INFERENCE:
            best = min(best, (2 * self.num_layers - 1 - layer - position) % cycle)
        return best

    def upcoming(self, layer: int, phase: Phase, count: int) -> List[int]:
        """The next ``count`` distinct layers predicted after this visit (not itself)."""
        position = self._position(layer, phase)
        seen = {layer}
        out: List[int] = []
        for step in range(1, self._cycle(phase) + 1):
            nxt = self._layer_at(position + step, phase)
            if nxt not in seen:
                seen.add(nxt)
                out.append(nxt)
                if len(out) == count:
                    break
        return out

    @property
    def active_backward_slots(self) -> int:
        """Backward slots still in use (some may have been disabled: no memory for them)."""
        return self.backward_slots - len(self._disabled)

    # -- planning ------------------------------------------------------------------
    def _candidates(self, phase: Phase, target: Optional[int] = None):
        """Slots a copy of ``target`` planned at a visit of this phase may go into: the
        ring; at backward visits, only the backward slots for the layers they keep across
        the step boundary (``slots`` .. ``slots + backward_slots - 1``; the ring keeps the
        first ``slots``, so the next forward's first copy waits only for layer 0), and the
        ring or a backward slot for a layer early in backward."""
        if phase is not Phase.BACKWARD or target is None or target < self.slots:
            return range(self.slots)
        backward = [slot for slot in range(self.slots, len(self.owner)) if slot not in self._disabled]
        if target < self.slots + len(backward):
            return backward
        if self._early_in_backward_slot(target, len(backward)):
            # an empty one only: each backward slot takes one early layer per step, so at
            # most two layers pass through it (each needs its tensor views rebuilt)
            return [*range(self.slots), *(slot for slot in backward if self.owner[slot] is None)]
        return range(self.slots)

    def _early_in_backward_slot(self, target: int, active: int) -> bool:
        """Whether ``target`` may take a backward slot: its backward must come before the
        backward slots' own layers are fetched, ``prefetch + active`` visits ahead of the
        first of them (``slots + active - 1``)."""
        return active > 0 and target >= self.slots + 2 * active + self.prefetch

    def _victim(
        self, needed_at: int, position: int, phase: Phase, keep: set, target: Optional[int] = None
    ) -> Optional[int]:
        """A slot to overwrite for ``target``, needed ``needed_at`` visits from now."""
        best_slot, best_distance = None, -1
        for slot in self._candidates(phase, target):
            owner = self.owner[slot]
            if owner is None:
                return slot
            if owner in keep:
                continue
            distance = self._distance(owner, position, phase)
            if distance > best_distance:
                best_slot, best_distance = slot, distance
        if best_slot is None or best_distance <= needed_at:
            return None
        return best_slot

    def _assign(self, layer: int, slot: int) -> None:
        old = self.owner[slot]
        if old is not None:
            del self.slot_of[old]
        self.owner[slot] = layer
        self.slot_of[layer] = slot

    _MAX_PLANS = 1 << 14  # bounds the memo for odd visit orders; steady state needs few

    def visit(self, layer: int, phase: Phase) -> VisitPlan:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        key = (layer, phase, tuple(self.owner))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(layer, phase)
            if len(self._plans) >= self._MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        else:
            for target, slot in plan.loads:
                self._assign(target, slot)
        if self.backward_slots and phase is not Phase.BACKWARD:
            spent = self._spent_backward_slots(layer, phase)
            if spent:
                for slot in spent:
                    del self.slot_of[self.owner[slot]]
                    self.owner[slot] = None
                plan = VisitPlan(plan.slot, plan.loads, plan.demand, drop=spent)
        return plan

    def _spent_backward_slots(self, layer: int, phase: Phase) -> Tuple[int, ...]:
        """Backward slots to give back at this forward visit: those whose layer this pass
        has already run (its kernels are queued)."""
        return tuple(
            slot
            for slot in range(self.slots, len(self.owner))
            if self.owner[slot] is not None and self.owner[slot] < layer
        )

    def _plan(self, layer: int, phase: Phase) -> VisitPlan:
        """Plan one visit from scratch and apply its assignments."""
        position = self._position(layer, phase)
        loads: List[Tuple[int, int]] = []
        demand = False
        slot = self.slot_of.get(layer)
        if slot is None:
            demand = True
            # into the ring: a backward slot's memory may not be there (its loads can be
            # refused), and the layer computing must have its slot
            slot = self._victim(0, position, phase, keep=set())
            if slot is None:  # every owner is needed now: impossible with >= 2 slots
                raise RuntimeError("no slot can take the visited layer")
            self._assign(layer, slot)
            loads.append((layer, slot))
        lookahead = self._lookahead.get((layer, phase))
        if lookahead is None:
            ahead = self.prefetch + (self.active_backward_slots if phase is Phase.BACKWARD else 0)
            lookahead = tuple((t, self._distance(t, position, phase)) for t in self.upcoming(layer, phase, ahead))
            self._lookahead[(layer, phase)] = lookahead
        keep = {layer}
        for target, needed_at in lookahead:
            keep.add(target)
            if target in self.slot_of:
                continue
            victim = self._victim(needed_at, position, phase, keep, target)
            if victim is None:
                break
            self._assign(target, victim)
            loads.append((target, victim))
        return VisitPlan(slot=slot, loads=tuple(loads), demand=demand)

    def disable_backward_slot(self, slot: int) -> None:
        """Stop using a backward slot (its memory was not there); what it was given is
        unassigned, and is loaded into the ring when its turn comes."""
        if slot < self.slots:
            raise ValueError(f"slot {slot} is a ring slot, not a backward slot")
        owner = self.owner[slot]
        if owner is not None:
            del self.slot_of[owner]
            self.owner[slot] = None
        self._disabled.add(slot)
        self._plans.clear()
        self._lookahead.clear()

    def drop(self, layer: int) -> None:
        """Forget that ``layer`` is in a slot (its copy is stale); its next visit loads it."""
        slot = self.slot_of.pop(layer, None)
        if slot is not None:
            self.owner[slot] = None

    def forget(self) -> None:
        """Drop all ownership (after a fault, or when slots were released)."""
        self.owner = [None] * len(self.owner)
        self.slot_of = {}

    def resident(self) -> List[int]:
        return [owner for owner in self.owner if owner is not None]


def spread_resident(num_layers: int, count: int) -> List[int]:
    """Which ``count`` of ``num_layers`` layers to keep on the GPU for good (sorted).

    The streamed layers are spread evenly through the stack, so between two of them run
    resident layers whose compute hides the next copy; clustering the streamed layers
    would leave copies back to back with nothing to hide behind.
    """
    if count <= 0:
        return []
    if count >= num_layers:
        return list(range(num_layers))
    streamed_count = num_layers - count
    streamed = {min(num_layers - 1, int((i + 0.5) * num_layers / streamed_count)) for i in range(streamed_count)}
    return [layer for layer in range(num_layers) if layer not in streamed]
