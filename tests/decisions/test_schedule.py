"""The prefetch planner: pure logic, every order for a grid of shapes."""

import random

import pytest

from layerstream.decisions.schedule import Phase, PrefetchSchedule

GRID = [(layers, slots, prefetch) for layers in (1, 2, 3, 5, 8) for slots in (2, 3, 4) for prefetch in range(1, slots)]


def training_step(layers):
    return [(i, Phase.TRAIN_FORWARD) for i in range(layers)] + [(i, Phase.BACKWARD) for i in reversed(range(layers))]


def run(planner, visits):
    plans = []
    for layer, phase in visits:
        plan = planner.visit(layer, phase)
        assert planner.owner[plan.slot] == layer, "the visited layer must own its slot"
        assert len(planner.resident()) <= planner.slots + planner.backward_slots
        assert len(set(planner.resident())) == len(planner.resident()), "a layer in two slots"
        loaded_slots = [slot for _, slot in plan.loads]
        assert len(set(loaded_slots)) == len(loaded_slots), "two copies into one slot in one visit"
        if not plan.demand:
            assert plan.slot not in loaded_slots, "the computing slot must not be overwritten"
        assert len(plan.loads) <= planner.prefetch + planner.backward_slots + 1
        plans.append(plan)
    return plans


@pytest.mark.parametrize("layers,slots,prefetch", GRID)
def test_training_steady_state_has_no_demand_loads(layers, slots, prefetch):
    planner = PrefetchSchedule(layers, slots, prefetch)
    run(planner, training_step(layers))  # first step: cold slots
    plans = run(planner, training_step(layers) * 3)
    assert not any(p.demand for p in plans)


@pytest.mark.parametrize("layers,slots,prefetch", GRID)
def test_backward_reuses_the_layers_left_by_forward(layers, slots, prefetch):
    planner = PrefetchSchedule(layers, slots, prefetch)
    run(planner, training_step(layers))
    run(planner, [(i, Phase.TRAIN_FORWARD) for i in range(layers)])
    left = set(planner.resident())
    assert left == set(range(max(0, layers - slots), layers))
    loaded = set()
    for i in reversed(range(layers)):
        loaded |= {layer for layer, _ in planner.visit(i, Phase.BACKWARD).loads}
    assert not (loaded & left), "layers still in slots at the turnaround must not be copied again"


@pytest.mark.parametrize("layers,slots,prefetch", GRID)
def test_loads_per_training_step(layers, slots, prefetch):
    """Each step copies every layer twice except those kept across both turnarounds."""
    planner = PrefetchSchedule(layers, slots, prefetch)
    run(planner, training_step(layers))
    plans = run(planner, training_step(layers))
    loads = sum(len(p.loads) for p in plans)
    kept = min(slots, layers)
    assert loads == max(0, 2 * (layers - kept))


@pytest.mark.parametrize("layers,slots,prefetch", GRID)
def test_inference_prefetches_ahead_and_wraps_to_the_first_layer(layers, slots, prefetch):
    planner = PrefetchSchedule(layers, slots, prefetch)
    forward = [(i, Phase.INFERENCE) for i in range(layers)]
    run(planner, forward)
    plans = run(planner, forward * 3)
    assert not any(p.demand for p in plans)
    # at the last layer, the first layers of the next pass are already on their way
    assert set(range(min(prefetch, layers))) <= set(planner.resident())


def test_prefetch_depth_is_honoured():
    planner = PrefetchSchedule(10, 4, 3)
    plan = planner.visit(0, Phase.INFERENCE)
    assert plan.demand and [layer for layer, _ in plan.loads] == [0, 1, 2, 3]
    plan = planner.visit(1, Phase.INFERENCE)
    assert [layer for layer, _ in plan.loads] == [4]


@pytest.mark.parametrize("seed", range(20))
def test_random_orders_keep_the_invariants(seed):
    rng = random.Random(seed)
    layers, slots = rng.randint(1, 9), rng.randint(2, 5)
    planner = PrefetchSchedule(layers, slots, rng.randint(1, slots - 1))
    visits = [(rng.randrange(layers), rng.choice(list(Phase))) for _ in range(300)]
    run(planner, visits)


def test_upcoming_follows_the_training_cycle():
    planner = PrefetchSchedule(4, 3, 2)
    assert planner.upcoming(2, Phase.TRAIN_FORWARD, 3) == [3, 1, 0]
    assert planner.upcoming(1, Phase.BACKWARD, 3) == [0, 2, 3]
    assert planner.upcoming(3, Phase.INFERENCE, 2) == [0, 1]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        PrefetchSchedule(0, 2, 1)
    with pytest.raises(ValueError):
        PrefetchSchedule(4, 2, 2)
    with pytest.raises(IndexError):
        PrefetchSchedule(4, 2, 1).visit(4, Phase.INFERENCE)


class _Unmemoised(PrefetchSchedule):
    def visit(self, layer, phase):
        return self._plan(layer, phase)


@pytest.mark.parametrize("seed", range(5))
def test_remembered_plans_equal_fresh_plans(seed):
    """The plan memo must answer exactly what planning from scratch answers, and leave
    the same owners, for regular steps and arbitrary visit orders mixed together."""
    rng = random.Random(seed)
    layers, slots = rng.randint(2, 9), rng.randint(2, 4)
    prefetch = rng.randint(1, slots - 1)
    memo, fresh = PrefetchSchedule(layers, slots, prefetch), _Unmemoised(layers, slots, prefetch)
    visits = []
    for _ in range(30):
        if rng.random() < 0.5:
            visits += training_step(layers)
        else:
            visits += [(rng.randrange(layers), rng.choice(list(Phase))) for _ in range(layers)]
    for layer, phase in visits:
        assert memo.visit(layer, phase) == fresh.visit(layer, phase)
        assert memo.owner == fresh.owner and memo.slot_of == fresh.slot_of
    assert len(memo._plans) < len(visits), "steady state must reuse remembered plans"


def test_remembered_plans_are_reused_in_steady_state():
    planner = PrefetchSchedule(8, 3, 1)
    run(planner, training_step(8) * 2)
    known = len(planner._plans)
    run(planner, training_step(8) * 5)
    assert len(planner._plans) == known


@pytest.mark.parametrize("layers", [1, 2, 5, 8, 32, 80])
def test_resident_layers_are_spread_so_streamed_ones_are_evenly_spaced(layers):
    from layerstream.decisions.schedule import spread_resident

    for count in range(0, layers + 2):
        resident = spread_resident(layers, count)
        assert resident == sorted(set(resident)) and len(resident) == min(count, layers)
        streamed = [i for i in range(layers) if i not in resident]
        if len(streamed) > 1:
            gaps = [b - a for a, b in zip(streamed, streamed[1:])]
            assert max(gaps) - min(gaps) <= 1, (layers, count, streamed)


# -- backward slots ------------------------------------------------------------------------

BACKWARD_GRID = [
    (layers, slots, prefetch, extra)
    for layers in (4, 6, 9)
    for slots in (2, 3)
    for prefetch in range(1, slots)
    for extra in (1, 2, 3)
    if 2 * slots + extra <= layers
]


def _step_checking_backward_slots(planner, layers):
    """One training step; asserts backward slots take new memory only at backward visits,
    hold their own layers or ones whose backward comes before those are fetched, and are
    empty from the last forward visit to the first backward one, the loss."""
    ring, extra = planner.slots, planner.backward_slots
    for layer, phase in training_step(layers):
        plan = planner.visit(layer, phase)
        assert planner.owner[plan.slot] == layer
        for target, slot in plan.loads:
            if slot >= ring:
                assert phase is Phase.BACKWARD, "only backward fills a backward slot"
                assert ring <= target < ring + extra or target >= ring + 2 * extra + planner.prefetch, (
                    "a backward slot holds one of its layers, or one done before those are fetched"
                )
        if phase is Phase.TRAIN_FORWARD and layer == layers - 1:
            assert all(owner is None for owner in planner.owner[ring:]), "a backward slot is held at the loss"


@pytest.mark.parametrize("layers,slots,prefetch,extra", BACKWARD_GRID)
def test_backward_slots_are_empty_at_the_loss_and_keep_more_layers_across_the_step(layers, slots, prefetch, extra):
    planner = PrefetchSchedule(layers, slots, prefetch, backward_slots=extra)
    for _ in range(2):
        _step_checking_backward_slots(planner, layers)
    # the next forward starts with its first slots + extra layers in slots
    assert sorted(planner.resident()) == list(range(slots + extra))
    loads = []
    for layer, phase in training_step(layers):
        plan = planner.visit(layer, phase)
        assert not plan.demand
        loads += [target for target, _ in plan.loads]
    assert len(loads) == (layers - slots - extra) + (layers - slots)


@pytest.mark.parametrize("layers,slots,prefetch,extra", BACKWARD_GRID)
def test_each_backward_slot_is_given_back_once_per_step_after_its_last_forward_use(layers, slots, prefetch, extra):
    planner = PrefetchSchedule(layers, slots, prefetch, backward_slots=extra)
    run(planner, training_step(layers))
    dropped, last_use = [], {}
    for layer, phase in training_step(layers):
        plan = planner.visit(layer, phase)
        for slot in plan.drop:
            assert last_use[slot] < layer, "given back before the visit that used it was queued"
        dropped += plan.drop
        if phase is Phase.TRAIN_FORWARD and plan.slot >= slots:
            last_use[plan.slot] = layer
    assert sorted(dropped) == sorted(last_use) == list(range(slots, slots + extra))


def test_the_ring_keeps_the_first_layers_so_the_next_forward_copies_after_layer_0():
    """At the step boundary the ring holds layers 0 .. slots-1 and the backward slots the
    next ones: the forward's first copy goes into layer 0's ring slot, free once layer 0
    has run, not into a slot whose layer runs later."""
    layers, slots, extra = 10, 3, 3
    planner = PrefetchSchedule(layers, slots, 2, backward_slots=extra)
    run(planner, training_step(layers))
    assert sorted(planner.owner[:slots]) == [0, 1, 2] and sorted(planner.owner[slots:]) == [3, 4, 5]
    first = None
    for layer in range(layers):
        loads = planner.visit(layer, Phase.TRAIN_FORWARD).loads
        if loads and first is None:
            first = loads[0]
    assert first == (slots + extra, 0)


def test_backward_slots_take_the_backwards_first_copies_without_waiting_for_a_ring_slot():
    """At the first backward visit the ring holds the last layers, all still needed; the
    backward's first copies go into the backward slots then, not after the last layer's
    backward has freed a ring slot."""
    layers, slots, extra = 32, 3, 4
    planner = PrefetchSchedule(layers, slots, 2, backward_slots=extra)
    run(planner, training_step(layers))
    for layer in range(layers):
        planner.visit(layer, Phase.TRAIN_FORWARD)
    first = planner.visit(layers - 1, Phase.BACKWARD).loads
    assert [target for target, _ in first] == [28, 27, 26, 25]
    assert sorted(slot for _, slot in first) == list(range(slots, slots + extra))


def _steady_step(planner, layers):
    run(planner, training_step(layers))
    run(planner, training_step(layers))
    return [planner.visit(layer, phase) for layer, phase in training_step(layers)]


def test_early_copies_into_backward_slots_never_cost_a_copy_or_a_wait():
    """The backward slots' early copies leave a steady step's copies at
    (L - slots - extra) + (L - slots), make no demand load, and pass at most two layers
    through each backward slot per step, across stacks of 6-39 layers."""
    for layers in range(6, 40):
        for slots, prefetch in [(2, 1), (3, 1), (3, 2), (4, 2), (4, 3)]:
            for extra in (1, 2, 3, 4):
                planner = PrefetchSchedule(layers, slots, prefetch, backward_slots=extra)
                used = planner.backward_slots
                plans = _steady_step(planner, layers)
                case = (layers, slots, prefetch, extra)
                assert not any(plan.demand for plan in plans), case
                assert sum(len(plan.loads) for plan in plans) == (layers - slots - used) + (layers - slots), case
                into_backward_slots = [slot for plan in plans for _, slot in plan.loads if slot >= slots]
                assert all(into_backward_slots.count(slot) <= 2 for slot in set(into_backward_slots)), case


def test_without_the_early_rule_a_small_stack_costs_a_demand_load_and_a_copy(monkeypatch):
    """Negative control: let any layer past the kept ones take an empty backward slot, and
    in a small stack an early layer still holds the single backward slot when its kept
    layer is due."""
    monkeypatch.setattr(PrefetchSchedule, "_early_in_backward_slot", lambda self, target, active: active > 0)
    layers, slots = 8, 3
    plans = _steady_step(PrefetchSchedule(layers, slots, 2, backward_slots=1), layers)
    assert any(plan.demand for plan in plans)
    assert sum(len(plan.loads) for plan in plans) > (layers - slots - 1) + (layers - slots)


def test_a_disabled_backward_slot_is_never_planned_again():
    layers = 8
    planner = PrefetchSchedule(layers, 3, 2, backward_slots=2)
    run(planner, training_step(layers))
    planner.disable_backward_slot(3)
    for _ in range(2):
        for layer, phase in training_step(layers):
            plan = planner.visit(layer, phase)
            assert all(slot != 3 for _, slot in plan.loads) and plan.slot != 3
    loads = sum(len(planner.visit(visited, p).loads) for visited, p in training_step(layers))
    assert loads == (layers - 3 - 1) + (layers - 3)
    with pytest.raises(ValueError, match="ring slot"):
        planner.disable_backward_slot(1)


def test_inference_neither_fills_nor_keeps_backward_slots():
    layers = 6
    planner = PrefetchSchedule(layers, 2, 1, backward_slots=2)
    run(planner, training_step(layers))
    assert any(owner is not None for owner in planner.owner[2:])
    for _ in range(2):
        for layer in range(layers):
            plan = planner.visit(layer, Phase.INFERENCE)
            assert all(slot < 2 for _, slot in plan.loads)
    assert all(owner is None for owner in planner.owner[2:])
