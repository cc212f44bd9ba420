"""StreamConfig: the validated settings of one streamed model.

Every field is checked when the config is built, so a bad value fails before any
weight is copied or pinned, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

DEFAULT_ARENA_BYTES = 1 << 30  # 1 GiB: few enough arenas to pin cheaply, small enough to place
# slots="auto": three slots let a copy run one layer further ahead than two when compute
# is briefly faster than copies; each slot beyond that is worth no more than one more
# layer in the resident window (both save two copies per step), and a window layer has
# no per-visit cost. Two when the budget holds no more (see stream_model).
AUTO_SLOTS = 3
# vram_budget="auto" warns when this much of the GPU is held outside this run's allocator
# (other processes; this process's own CUDA context is about half a GiB of it)
FOREIGN_MEMORY_WARN_BYTES = 1 << 30

logger = logging.getLogger(__name__)
_warned_foreign_memory: set = set()  # devices whose auto budget warning was given


class StreamConfigError(ValueError):
    """A StreamConfig value is out of range or inconsistent."""


def gpu_memory_for_run(device: torch.device) -> int:
    """What vram_budget="auto" means: the GPU's memory less what is held outside this
    run's caching allocator, measured now.

    Not the card's total: on a desktop the display, or another job, holds part of it,
    and a window sized to the total would run out of memory mid-step. Memory this
    process's allocator already reserved counts as usable (the model's resident part
    may be on the GPU already)."""
    free, total = torch.cuda.mem_get_info(device)
    usable = min(total, free + torch.cuda.memory_reserved(device))
    foreign = total - usable
    gib = 2**30
    if foreign >= FOREIGN_MEMORY_WARN_BYTES and device not in _warned_foreign_memory:
        _warned_foreign_memory.add(device)  # once: a YAML run resolves the budget more than once
        logger.warning(
            "layerstream: vram_budget='auto' is %.2f GiB, not the GPU's %.2f GiB: %.2f GiB is held "
            "outside this run (other processes, the CUDA context). Close them for a larger "
            "resident window, or give vram_budget a size.", usable / gib, total / gib, foreign / gib)
    return usable


def expandable_segments() -> bool:
    """Whether torch's CUDA caching allocator uses expandable segments, where memory freed
    in one shape of blocks serves another without fragmenting (backward_slots="auto"
    needs it: backward slots reuse the loss's memory in blocks of another size)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = getter() if getter is not None else ""
    if not settings:
        settings = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def int_or_auto(text, name: str = "the value"):
    """A slots/prefetch value given as text (command lines, HfArgumentParser): 'auto' or
    an integer."""
    if text == "auto" or isinstance(text, int):
        return text
    try:
        return int(text)
    except (TypeError, ValueError):
        raise StreamConfigError(f"{name} must be an integer or 'auto', got {text!r}") from None


@dataclass
class StreamConfig:
    """How a model's decoder layers stream.

    slots: device buffers that hold one layer each (>= 2). More slots let copies run
        further ahead and keep more layers across the forward/backward turnaround, at
        the cost of one largest-layer of device memory each. Default "auto": 3, or 2
        when vram_budget holds no more than two of the largest layer.
    prefetch: how many layers ahead of the one computing are copied (>= 1, < slots).
        Default "auto": slots - 1, as far ahead as the slots allow (a copy waits only
        for the readers of the slot it overwrites, so looking further ahead never delays
        the layer computing).
    device: where streamed layers compute. Default: the current CUDA device. "cpu" runs
        the whole machinery with host-to-host copies (tests and the embedded demo).
    pin: page-lock the host arenas so copies are asynchronous DMA. Default: pin when
        the device is CUDA. Pinning is meaningless (and refused) for device="cpu".
    arena_bytes: target size of one host arena; a layer never straddles arenas, so an
        arena grows to the largest layer when that is bigger.
    vram_budget: GPU memory the run may use, in bytes, as text ("16GiB"), or "auto" (the
        GPU's memory less what other processes hold, measured when the config is built).
        The slots must fit it at stream time; at the first training step of each batch
        shape the memory planner's predicted peak (plus its 1 GiB reserve) must too, and the layers the remaining room holds stay on the GPU for good (the
        resident window: no copies for them). Default None: no budget, everything streams.
    checksum: debug mode. Checksum each slot after its copy and again before each use,
        against the layer's host bytes, and raise at the first mismatch naming the layer
        and slot. Waits for the device on every copy and visit: slow, for debugging only.
        Default: on when the environment variable LAYERSTREAM_CHECKSUM=1.
    backward_slots: extra slots, one for each of the layers slots .. slots +
        backward_slots - 1, that take memory at the start of backward (where each first
        takes one of backward's first copies) and give it back once the next forward has
        run their layer: they never coexist with the loss's logits, the step's memory
        peak. Those layers stay on the GPU across each step boundary, one copy fewer per
        step each, and backward starts copying without waiting for a ring slot. Default "auto": as many as the memory
        planner finds room for below the loss (at most 4; none where a layer's working
        set sets the peak), decided at the first training step of each batch shape, each
        allocated only while memory in use stays below this process's peak so far; and
        only on CUDA, with no vram_budget (the resident window spends a budget better: a
        window layer saves two copies per step), and with the caching allocator's
        expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): without
        them the loss's memory, reused in blocks of another size, can fragment.
        0: none; an integer: that many (at most the layers beyond twice ``slots``).
    stream_embeddings: also keep the input embedding and the output head in (pinned) host
        memory instead of on the GPU (2 x 2.1 GB of bf16 for a 70B model). The embedding
        gathers its rows on the host and copies only those; the head's weight is copied to
        the device for each forward and each backward and dropped after use (one head of
        transient device memory). Both must be frozen. Default False.
    """

    slots: Union[int, str] = "auto"
    prefetch: Union[int, str] = "auto"
    device: Optional[Union[str, torch.device]] = None
    pin: Optional[bool] = None
    arena_bytes: int = DEFAULT_ARENA_BYTES
    checksum: Optional[bool] = None
    vram_budget: Optional[Union[int, str]] = None
    stream_embeddings: bool = False
    backward_slots: Union[int, str] = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.stream_embeddings, bool):
            raise StreamConfigError(
                f"stream_embeddings must be True or False, got {self.stream_embeddings!r}")
        if self.vram_budget is not None and self.vram_budget != "auto":
            from .plan import parse_bytes

            try:
                self.vram_budget = parse_bytes(self.vram_budget)
            except ValueError as exc:
                raise StreamConfigError(f"vram_budget: {exc}") from None
            if self.vram_budget <= 0:
                raise StreamConfigError("vram_budget must be a positive size, e.g. '16GiB'")
        if self.checksum is None:
            self.checksum = os.environ.get("LAYERSTREAM_CHECKSUM", "") == "1"
        auto = set()
        if self.slots == "auto":
            self.slots = AUTO_SLOTS
            auto.add("slots")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int):
            raise StreamConfigError(f"slots must be an integer >= 2 or 'auto', got {self.slots!r}")
        if self.slots < 2:
            raise StreamConfigError(
                f"slots={self.slots} is too few: streaming needs >= 2 slots so the next "
                "layer can be copied while one computes. Use slots=2 or more."
            )
        if self.prefetch == "auto":
            self.prefetch = self.slots - 1
            auto.add("prefetch")
        if self.backward_slots == "auto":
            auto.add("backward_slots")
        elif isinstance(self.backward_slots, bool) or not isinstance(self.backward_slots, int) \
                or self.backward_slots < 0:
            raise StreamConfigError(
                f"backward_slots must be an integer >= 0 or 'auto', got {self.backward_slots!r}")
        # which fields were chosen here, so replace() can choose them again
        self.automatic = frozenset(auto)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int):
            raise StreamConfigError(f"prefetch must be an integer >= 1 or 'auto', got {self.prefetch!r}")
        if self.prefetch < 1 or self.prefetch >= self.slots:
            raise StreamConfigError(
                f"prefetch={self.prefetch} with slots={self.slots}: prefetch must be >= 1 and "
                f"< slots (one slot is always the layer computing). Use prefetch <= "
                f"{self.slots - 1} or raise slots to {self.prefetch + 1}."
            )
        if not isinstance(self.arena_bytes, int) or self.arena_bytes < (1 << 20):
            raise StreamConfigError(
                f"arena_bytes must be an integer >= 1 MiB, got {self.arena_bytes!r}"
            )
        self.device = self._resolve_device(self.device)
        if self.vram_budget == "auto":
            if self.device.type != "cuda":
                raise StreamConfigError("vram_budget='auto' means the GPU's memory; give a size on the host")
            self.vram_budget = gpu_memory_for_run(self.device)
        if self.pin is None:
            self.pin = self.device.type == "cuda"
        elif self.pin and self.device.type != "cuda":
            raise StreamConfigError(
                f"pin=True needs a CUDA device (device is {self.device}); pinned memory only "
                "speeds host-to-GPU copies. Leave pin unset or pass pin=False."
            )

    @staticmethod
    def _resolve_device(device) -> torch.device:
        if device is None:
            if not torch.cuda.is_available():
                raise StreamConfigError(
                    "no CUDA device is available and StreamConfig.device was not given. "
                    "Pass device='cpu' to run the streaming machinery on the host "
                    "(host-to-host copies), or run on a machine with a GPU."
                )
            return torch.device("cuda", torch.cuda.current_device())
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise StreamConfigError(f"device={device!r} is not a torch device: {exc}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise StreamConfigError(
                    f"device={device} but CUDA is not available; use device='cpu'."
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise StreamConfigError(
                f"device={device}: layerstream streams to CUDA devices or 'cpu' only."
            )
        return device

    def replace(self, **overrides) -> "StreamConfig":
        """A copy with some fields changed, validated again; fields chosen automatically
        are chosen again (prefetch follows a changed slots)."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = set(overrides) - set(names)
        if unknown:
            known = ", ".join(names)
            raise StreamConfigError(
                f"unknown StreamConfig field(s) {sorted(unknown)}; known fields: {known}"
            )
        values = {name: "auto" if name in self.automatic else getattr(self, name) for name in names}
        values.update(overrides)
        return StreamConfig(**values)
