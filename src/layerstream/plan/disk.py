"""The disk term of a plan: with ``host_budget`` (``layerstream plan --host-budget``) the
layers beyond it are read from disk every time they are copied, so a step also reads
``disk_bytes_per_step`` at the disk's bandwidth; reads overlap compute and the host-to-GPU
copies, so the step takes at least the largest of the three (docs/plan.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from ..decisions.disk import Tiers, split_tiers

# frozen-weight FLOPs per token and parameter of a checkpointed LoRA step: the forward,
# its recompute in backward, and the backward to the activations (2 each; frozen weights
# get no weight gradient)
FLOPS_PER_TOKEN_PARAM = 6


@dataclass(frozen=True)
class DiskTerm:
    tiers: Tiers
    disk_bytes_per_step: int
    disk_gbps: float
    copy_seconds: float
    compute_seconds: Optional[float]  # None: no --tflops given

    @property
    def disk_seconds(self) -> float:
        return self.disk_bytes_per_step / (self.disk_gbps * 1e9) if self.disk_gbps > 0 else 0.0

    @property
    def step_seconds(self) -> float:
        """The step's lower bound: compute (when known), copies and disk reads overlap."""
        return max(self.disk_seconds, self.copy_seconds, self.compute_seconds or 0.0)


def disk_bytes_per_step(sizes: Sequence[int], disk_layers: Sequence[int], slots: int) -> int:
    """Bytes a steady training step reads from disk: each disk layer as often as it is
    copied (forward copies all but the first ``slots`` layers, which the previous backward
    left in slots; backward all but the last ``slots``, which forward left)."""
    count = len(sizes)
    disk = set(disk_layers)
    return sum(
        sizes[i] * ((i >= min(count, slots)) + (i < count - min(count, slots))) for i in range(count) if i in disk
    )


def disk_term(
    sizes: Sequence[int],
    host_budget: int,
    slots: int,
    disk_gbps: float,
    copy_seconds: float,
    params: int,
    tokens: int,
    tflops: Optional[float] = None,
    quantized: bool = False,
) -> DiskTerm:
    """The disk term of a run whose layers (``sizes`` bytes each, ``params`` frozen
    parameters in all, ``quantized`` to NF4 or not) stream under ``host_budget``."""
    tiers = split_tiers(list(sizes), host_budget, quantized=quantized)
    compute = FLOPS_PER_TOKEN_PARAM * params * tokens / (tflops * 1e12) if tflops else None
    return DiskTerm(tiers, disk_bytes_per_step(sizes, tiers.disk, slots), disk_gbps, copy_seconds, compute)


def with_disk_store(plan, sizes: Sequence[int], tiers: Tiers):
    """``plan`` (a ``MemoryPlan``) with its host store as the disk tier keeps it: the
    ``tiers.ram`` layers and the staging ring, in place of every layer. The host check then
    counts what a run with that ``host_budget`` holds in host RAM and page-locks (the
    offloaded inputs and the ends as before)."""
    share = sum(sizes[i] for i in tiers.ram) / max(sum(sizes), 1)
    store = round(plan.loader_store_bytes * share) + tiers.ring_bytes
    return dataclasses.replace(
        plan,
        loader_store_bytes=store,
        loader_ram_bytes=plan.loader_ram_bytes - plan.loader_store_bytes + store,
    )


def tokens_that_hide_the_disk(term: DiskTerm, params: int, tflops: float) -> int:
    """Tokens per step from which compute takes longer than the step's disk reads."""
    return int(term.disk_seconds * tflops * 1e12 / (FLOPS_PER_TOKEN_PARAM * params)) + 1
