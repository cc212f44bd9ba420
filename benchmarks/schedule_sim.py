"""Predict a streamed training step's time from the engine's own planner and measured pieces.

No GPU: the planner (``layerstream.decisions.schedule.PrefetchSchedule``) decides every copy as it does
in a run, and two queues play it out. The compute queue runs each visit for a measured
time (a layer's forward, its recompute and backward, the model's ends at the turnaround,
the optimizer step at the step's end), after the copy of its layer has finished. The copy
queue runs the copies in the order they are issued, each for one layer's bytes over the
pinned bandwidth, after the compute that last read the slot it overwrites. A backward
slot's memory is new when it is first filled, so its copy waits only for the compute
queued before that visit.

It assumes the host is never late (at batch 1 and short sequences it is: see
docs/performance.md), one layer size, and pieces that do not slow each other down.

A layer's recompute and backward is taken from a full step, not from the layer timed
alone: (the resident step's backward - the ends' backward) / layers, from a throughput.py
result with phase times (7.05 ms for the 8B at seq 2048, where turnaround.py timed one
layer alone at 7.88 ms, start-up included). With it, against the H200 (Llama-3-8B bf16,
seq 2048, 3:2): 0.490 s predicted, 0.493 s measured in the same suite run, 0.934x of the
copy bound against 0.93x measured; 4 backward slots shorten it by 36 ms (by 30 ms with
the earlier rule, ``--kept-only-backward-slots``, measured 22-40 ms: the pairs in
docs/performance.md). ``--phases ''`` uses the layer timed alone.

    python benchmarks/schedule_sim.py                      # the 8B turnaround pieces, 3:2
    python benchmarks/schedule_sim.py --slots 3 --prefetch 2 --backward-slots 0,2,4
    python benchmarks/schedule_sim.py --backward-slots 0 --skip-last-recompute --ends-scale 0.8
    python benchmarks/schedule_sim.py --backward-slots 0 --skip-first-recompute --skip-last-recompute
    python benchmarks/schedule_sim.py --backward-slots 0,2,4 --kept-only-backward-slots
    python benchmarks/schedule_sim.py --backward-slots 0 --attention-mlp-units 0.25 --slots 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerstream.decisions.schedule import Phase, PrefetchSchedule

RESULTS = Path(__file__).resolve().parent / "results"


class KeptOnlyBackwardSlotsPlanner(PrefetchSchedule):
    """The earlier rule, for comparison: backward slots take only the layers they keep
    across the step boundary, so backward's first copy waits for the last layer's backward
    to free a ring slot."""

    def _early_in_backward_slot(self, target: int, active: int) -> bool:
        return False


def _per_unit(value, count: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * count


def simulate(
    layers: int,
    slots: int,
    prefetch: int,
    backward_slots: int,
    forward_ms,
    backward_ms,
    ends_forward_ms: float,
    ends_backward_ms: float,
    optimizer_ms: float,
    copy_ms,
    steps: int = 8,
    planner_class: type = PrefetchSchedule,
) -> dict:
    """The last of ``steps`` steady training steps: its time, its copies (and their time)
    and its demand loads. ``forward_ms``, ``backward_ms`` and ``copy_ms`` are one number
    for every streamed unit or one per unit (a unit whose recompute is skipped: its
    backward less its forward, ``without_recompute``)."""
    forward_ms, backward_ms, copy_ms = (_per_unit(v, layers) for v in (forward_ms, backward_ms, copy_ms))
    planner = planner_class(layers, slots, prefetch, backward_slots=backward_slots)
    total = slots + planner.backward_slots
    ready, released = [0.0] * total, [0.0] * total
    allocated = [False] * total
    copy_free = compute_free = 0.0
    order = [(i, Phase.TRAIN_FORWARD) for i in range(layers)] + [(i, Phase.BACKWARD) for i in reversed(range(layers))]
    step_ms, copies, demand, copying = 0.0, 0, 0, 0.0
    for _ in range(steps):
        start, copies, demand, copying = compute_free, 0, 0, 0.0
        for layer, phase in order:
            plan = planner.visit(layer, phase)
            demand += plan.demand
            for slot in plan.drop:
                allocated[slot] = False
            for target, slot in plan.loads:
                if slot >= slots and not allocated[slot]:
                    allocated[slot] = True
                    released[slot] = compute_free  # new memory: only what is queued before
                begin = max(copy_free, released[slot])
                copy_free = ready[slot] = begin + copy_ms[target]
                copies += 1
                copying += copy_ms[target]
            begin = max(compute_free, ready[plan.slot])
            compute_free = begin + (forward_ms if phase is Phase.TRAIN_FORWARD else backward_ms)[layer]
            released[plan.slot] = compute_free
            if phase is Phase.TRAIN_FORWARD and layer == layers - 1:
                compute_free += ends_forward_ms + ends_backward_ms
            if phase is Phase.BACKWARD and layer == 0:
                compute_free += optimizer_ms
        step_ms = compute_free - start
    return {
        "backward_slots": planner.backward_slots,
        "step_ms": step_ms,
        "copies": copies,
        "demand_loads": demand,
        "copy_ms": copying,
        "fraction_of_copy_bound": copying / step_ms,
    }


def without_recompute(forward_ms, backward_ms, units: int, skipped) -> list:
    """Per-unit backward times where the units in ``skipped`` keep their activations from
    the forward: their backward less their forward."""
    forward, backward = _per_unit(forward_ms, units), _per_unit(backward_ms, units)
    return [b - f if unit in skipped else b for unit, (f, b) in enumerate(zip(forward, backward))]


def attention_mlp_units(
    layers: int,
    forward_ms: float,
    backward_ms: float,
    copy_ms: float,
    attention_share: float,
    attention_fraction_of_bytes: float,
):
    """Per-unit times if each decoder layer streamed and checkpointed as two units, its
    attention (``attention_share`` of the layer's compute, ``attention_fraction_of_bytes``
    of its bytes) then its MLP: forward, backward and copy times of 2 x ``layers`` units."""
    forward, backward, copy = [], [], []
    for _ in range(layers):
        forward += [forward_ms * attention_share, forward_ms * (1 - attention_share)]
        backward += [backward_ms * attention_share, backward_ms * (1 - attention_share)]
        copy += [copy_ms * attention_fraction_of_bytes, copy_ms * (1 - attention_fraction_of_bytes)]
    return forward, backward, copy


def backward_in_step_ms(phases: dict, pieces: dict, layers: int) -> float:
    """A layer's recompute and backward within a resident step: the step's backward less
    the ends' backward, per layer."""
    return (phases["resident"]["backward_s"] * 1e3 - pieces["ends_backward_ms"]) / layers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pieces",
        default=str(RESULTS / "throughput/turnaround-llama3-8b-seq2048.json"),
        help="a turnaround.py result: the layer and ends times",
    )
    parser.add_argument(
        "--phases",
        default=str(RESULTS / "throughput/throughput-llama3-8b-phases-seq2048.json"),
        help="a throughput.py result with phase times, for a layer's recompute and backward "
        "within a step ('' for the pieces' layer timed alone)",
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--backward-slots", default="0,1,2,3,4")
    parser.add_argument("--layer-bytes", type=int, default=436_224_000, help="one layer (Llama-3-8B bf16)")
    parser.add_argument("--bandwidth-gbps", type=float, default=55.3, help="pinned host->device GB/s")
    parser.add_argument("--optimizer-ms", type=float, default=1.5, help="measured: throughput.py phases")
    parser.add_argument(
        "--skip-last-recompute",
        action="store_true",
        help="what if the last layer kept its activations: its backward without its forward",
    )
    parser.add_argument(
        "--skip-first-recompute",
        action="store_true",
        help="what if the first layer kept its activations through the step: its backward without its forward",
    )
    parser.add_argument(
        "--kept-only-backward-slots",
        action="store_true",
        help="the earlier rule: backward slots take only the layers they keep (KeptOnlyBackwardSlotsPlanner)",
    )
    parser.add_argument(
        "--attention-mlp-units",
        type=float,
        default=None,
        metavar="SHARE",
        help="what if each layer streamed as two units, attention (this share of the "
        "layer's compute) and MLP; slots then hold the larger unit, the MLP",
    )
    parser.add_argument(
        "--attention-bytes",
        type=int,
        default=83_886_080,
        help="one layer's attention projections (Llama-3-8B bf16: q, k, v, o)",
    )
    parser.add_argument(
        "--ends-scale",
        type=float,
        default=1.0,
        help="what if the ends (head and loss) took this fraction of their measured time",
    )
    args = parser.parse_args()
    pieces = json.loads(Path(args.pieces).read_text())
    copy_ms = args.layer_bytes / (args.bandwidth_gbps * 1e9) * 1e3
    forward, backward = pieces["layer_forward_ms"], pieces["layer_recompute_backward_ms"]
    if args.phases:
        backward = backward_in_step_ms(json.loads(Path(args.phases).read_text()), pieces, args.layers)
    print(
        f"pieces from {args.pieces}; a layer's recompute and backward {backward:.2f} ms"
        f"{' (from ' + args.phases + ')' if args.phases else ''}; one copy {copy_ms:.2f} ms"
    )
    units, unit_forward, unit_backward, unit_copy = args.layers, forward, backward, copy_ms
    if args.attention_mlp_units is not None:
        units = 2 * args.layers
        unit_forward, unit_backward, unit_copy = attention_mlp_units(
            args.layers, forward, backward, copy_ms, args.attention_mlp_units, args.attention_bytes / args.layer_bytes
        )
        print(
            f"attention and MLP as units: {args.slots} slots of "
            f"{(args.layer_bytes - args.attention_bytes) / 2**20:.0f} MiB (the MLP)"
        )
    # as units, the first unit is an attention and the last an MLP
    skipped = {unit for unit, skip in ((0, args.skip_first_recompute), (units - 1, args.skip_last_recompute)) if skip}
    unit_backward = without_recompute(unit_forward, unit_backward, units, skipped)
    print("| backward slots | step ms | copies | demand loads | copy ms | x copy bound |")
    print("|---|---|---|---|---|---|")
    for count in (int(x) for x in args.backward_slots.split(",")):
        row = simulate(
            units,
            args.slots,
            args.prefetch,
            count,
            unit_forward,
            unit_backward,
            args.ends_scale * pieces["ends_forward_ms"],
            args.ends_scale * pieces["ends_backward_ms"],
            args.optimizer_ms,
            unit_copy,
            planner_class=KeptOnlyBackwardSlotsPlanner if args.kept_only_backward_slots else PrefetchSchedule,
        )
        print(
            f"| {row['backward_slots']} | {row['step_ms']:.1f} | {row['copies']} | {row['demand_loads']} | "
            f"{row['copy_ms']:.1f} | "
            f"{row['fraction_of_copy_bound']:.3f} |"
        )


if __name__ == "__main__":
    main()
