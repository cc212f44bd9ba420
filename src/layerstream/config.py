"""StreamConfig: the settings of one streamed model, defined once.

Every field carries its help text and the kind of value it takes in its metadata; the
command-line flags (``layerstream run --vram-budget``), the HfArgumentParser fields
(``--layer_stream_vram_budget``) and the YAML keys (``stream.vram_budget``) are derived
from these fields (``settings()``, ``parse_setting``), so the surfaces cannot drift.
Every value is checked when the config is built, so a bad one fails before any weight
is copied or pinned, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch

from .errors import StreamConfigError
from .system.log import get_logger
from .units import GiB, parse_bytes

DEFAULT_ARENA_BYTES = GiB  # few enough arenas to pin cheaply, small enough to place
# slots="auto": three slots let a copy run one layer further ahead than two when compute
# is briefly faster than copies; each slot beyond that is worth no more than one more
# layer in the resident window (both save two copies per step), and a window layer has
# no per-visit cost. Two when the memory holds no more (``auto_slots``).
AUTO_SLOTS = 3
# vram_budget="auto" warns when this much of the GPU is held outside this run's allocator
# (other processes; this process's own CUDA context is about half a GiB of it)
FOREIGN_MEMORY_WARN_BYTES = GiB

logger = get_logger(__name__)
_warned_foreign_memory: set = set()  # devices whose auto budget warning was given

# the kinds of value a setting takes, as text on a command line or in YAML
COUNT = "integer or auto"
SIZE = "size"
BUDGET = "size, auto or none"
DEVICE = "device"
TRISTATE = "true, false or unset"
TOKENS = "integer, auto or none"
SWITCH = "true, false or auto"
DIRECTORIES = "directories, comma-separated, or none"

# offload_activations: the checkpointed inputs that stay on the device. The last layer's
# (its backward comes right after the loss) and one copied back ahead of the recompute
# that needs it; the engine (offload.py) and the planner (plan/) both read these.
OFFLOAD_LOOKAHEAD = 1  # layers whose inputs are copied back ahead of the recompute under way
OFFLOAD_KEPT_LAYERS = 1  # the last layers, whose inputs are never offloaded
# offload_activations, loss_chunk_tokens and mlp_tile_tokens set to "auto": the share of
# vram_budget kept in hand beyond the memory plan. At long sequences the plan has come out
# under the measured peak by up to 14% (8B QLoRA at 344,064 tokens under 80 GiB,
# docs/plan.md), and the three cost little where sequences are long, so "auto" turns them
# on before the plan's own verdict would (plan/long_settings.py decides which).
OFFLOAD_AUTO_MARGIN = 0.15
# what the help of each of the three says "auto" means
_AUTO_LONG_HELP = (
    f"auto: on for a step whose memory plan needs more than {100 - round(100 * OFFLOAD_AUTO_MARGIN)}% of "
    "vram_budget, cheapest first (loss chunks, MLP tiles, offloading) until it needs less; off without a budget"
)


def offloaded_layers(num_layers: int) -> int:
    """How many layers' checkpointed inputs offload_activations keeps in host memory."""
    return max(0, num_layers - OFFLOAD_KEPT_LAYERS)


def offload_device_layers(num_layers: int) -> int:
    """How many layers' checkpointed inputs are on the device at once with
    offload_activations: the kept ones, those copied back ahead (or still in flight), and
    the first layer's, the embedding's output: where input gradients are on (PEFT's k-bit
    preparation, TRL's trainers and the Trainer's gradient checkpointing turn them on) it
    is a leaf autograd keeps for its gradient, whatever the offload copied."""
    return min(num_layers, OFFLOAD_KEPT_LAYERS + OFFLOAD_LOOKAHEAD + 1)


def auto_slots(room_bytes: Optional[int], largest_layer_bytes: int) -> int:
    """What slots="auto" means, for the engine and the planner alike: AUTO_SLOTS, or two
    when ``room_bytes`` (the memory the slots may take; None: unknown) holds fewer."""
    if room_bytes is not None and AUTO_SLOTS * largest_layer_bytes > room_bytes:
        return 2
    return AUTO_SLOTS


def gpu_memory_for_run(device: torch.device) -> int:
    """The GPU memory this process's caching allocator can reach now: what the driver
    reports free plus what the allocator already holds, capped by
    ``torch.cuda.set_per_process_memory_fraction`` (how users and benchmarks stand in
    for a smaller card).

    Not the card's total: on a desktop the display, or another job, holds part of it,
    and a window sized to the total would run out of memory mid-step."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    usable = min(total, free + reserved)
    fraction = per_process_fraction(device)
    if fraction < 1.0:
        usable = min(usable, int(fraction * total))
    foreign = total - (free + reserved)
    if foreign >= FOREIGN_MEMORY_WARN_BYTES and device not in _warned_foreign_memory:
        _warned_foreign_memory.add(device)
        logger.warning(
            "layerstream: vram_budget='auto' is %.2f GiB, not the GPU's %.2f GiB: %.2f GiB is held "
            "outside this run (other processes, the CUDA context). Close them for a larger "
            "resident window, or give vram_budget a size.",
            usable / GiB,
            total / GiB,
            foreign / GiB,
            main_process_only=False,
        )
    return usable


def per_process_fraction(device: torch.device) -> float:
    """The fraction of the GPU this process's allocator may take (1.0 when not capped)."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:  # pragma: no cover - torch without the query
        return 1.0
    try:
        return float(getter(device))
    except Exception:  # no CUDA in this build or process: no cap to read
        return 1.0


# torch's caching-allocator settings come from these variables (the first is CUDA's own)
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# what `layerstream run` sets when neither is: freed memory of one block shape serves another
DEFAULT_ALLOCATOR_CONF = "expandable_segments:True"


def set_default_allocator(env) -> bool:
    """Put DEFAULT_ALLOCATOR_CONF in ``env`` (os.environ, or a child process's copy) unless
    torch's allocator is configured there already; whether it was put."""
    if any(env.get(key) for key in ALLOCATOR_ENV):
        return False
    env[ALLOCATOR_ENV[0]] = DEFAULT_ALLOCATOR_CONF
    return True


def allocator_setting(name: str) -> Optional[str]:
    """A setting of torch's CUDA caching allocator (e.g. expandable_segments), as text."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    text = getter() if getter is not None else ""
    if not text:
        text = ",".join(os.environ.get(key, "") for key in ALLOCATOR_ENV)
    for item in text.split(","):
        key, _, value = item.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def expandable_segments() -> bool:
    """Whether torch's CUDA caching allocator uses expandable segments, where memory freed
    in one shape of blocks serves another without fragmenting."""
    return (allocator_setting("expandable_segments") or "").lower() == "true"


def _setting(default, kind: str, help: str):
    return field(default=default, metadata={"kind": kind, "help": help})


def argparse_help(setting) -> str:
    """A setting's help as argparse takes it (every flag surface is argparse underneath,
    HfArgumentParser too), where a bare ``%`` would break ``--help``."""
    return setting.metadata["help"].replace("%", "%%")


@dataclass
class StreamConfig:
    """How a model's decoder layers stream. Each field's help is in its metadata
    (``settings()``); docs/usage.md has the same table."""

    slots: Union[int, str] = _setting(
        "auto",
        COUNT,
        (
            "GPU buffers that hold one layer each (>= 2). More slots let copies run further ahead. "
            "auto: 3, or 2 when the GPU memory holds no more"
        ),
    )
    prefetch: Union[int, str] = _setting(
        "auto", COUNT, ("layers copied ahead of the one computing (>= 1, < slots). auto: slots - 1")
    )
    device: Optional[Union[str, torch.device]] = _setting(
        None,
        DEVICE,
        (
            "where streamed layers compute: cuda, cuda:N or cpu (host-to-host copies, for tests). "
            "Unset: the device the script trains on"
        ),
    )
    pin: Optional[bool] = _setting(
        None, TRISTATE, ("page-lock the host store so copies are asynchronous DMA. Unset: on CUDA")
    )
    arena_bytes: int = _setting(DEFAULT_ARENA_BYTES, SIZE, ("target size of one page-locked host arena, e.g. 1GiB"))
    checksum: Optional[bool] = _setting(
        None,
        TRISTATE,
        (
            "debug mode: checksum every slot after its copy and before each use (slow). "
            "Unset: on when LAYERSTREAM_CHECKSUM=1"
        ),
    )
    vram_budget: Optional[Union[int, str]] = _setting(
        "auto",
        BUDGET,
        (
            "GPU memory the run may use, e.g. 12GiB. The layers that fit beside what training "
            "measurably needs stay on the GPU for good (the resident window). auto: the GPU memory "
            "this process can reach (free memory, the per-process memory fraction); none: every "
            "layer streams"
        ),
    )
    stream_embeddings: Union[bool, str] = _setting(
        "auto",
        SWITCH,
        (
            "keep the input embedding and output head in host memory too, copied in as they run. auto: only "
            "where a training step's memory plan still needs more than "
            f"{100 - round(100 * OFFLOAD_AUTO_MARGIN)}% of vram_budget with the long-sequence settings on; "
            "they then move to host memory at that step and stay there"
        ),
    )
    backward_slots: Union[int, str] = _setting(
        "auto",
        COUNT,
        (
            "extra slots used only outside the loss (>= 0). auto: as many as the loss's memory "
            "holds, on CUDA with expandable segments and vram_budget none"
        ),
    )
    loss_chunk_tokens: Optional[Union[int, str]] = _setting(
        "auto",
        TOKENS,
        (
            "compute the head and cross-entropy this many tokens at a time, so the full fp32 logits "
            "never exist (long sequences; e.g. 4096). none or 0: off. Liger-Kernel's fused loss, when "
            f"applied, is used instead. {_AUTO_LONG_HELP} (a chunk sized to the vocabulary)"
        ),
    )
    mlp_tile_tokens: Optional[Union[int, str]] = _setting(
        "auto",
        TOKENS,
        (
            "run each decoder layer's MLP this many tokens at a time, forward and backward, so one "
            "layer's tokens x intermediate working set stays bounded (long sequences; e.g. 8192). "
            f"none or 0: off. {_AUTO_LONG_HELP} (tiles of 4096)"
        ),
    )

    host_budget: Optional[Union[int, str]] = _setting(
        None,
        BUDGET,
        (
            "host RAM the layer store may use, e.g. 48GiB. Layers beyond it are read from disk each "
            "time they are needed: from the checkpoint's safetensors files, or for NF4 from a layer "
            "cache written as the loader quantises (layerstream.from_pretrained). "
            "auto: the available RAM less a reserve for the system; none: every layer in host RAM"
        ),
    )
    disk_cache_dir: Optional[str] = _setting(
        None,
        DIRECTORIES,
        (
            "where an NF4 load under host_budget keeps its cache of packed layers; a comma list "
            "stripes layer i over directory i % n. Unset: .layerstream-nf4 in the checkpoint "
            "directory when writable, else under ~/.cache/layerstream"
        ),
    )
    offload_activations: Union[bool, str] = _setting(
        "auto",
        SWITCH,
        (
            "copy each layer's checkpointed input to page-locked host memory after its forward "
            "and back ahead of its recompute, so long sequences keep ~2 layers' inputs on the GPU "
            f"instead of all of them. {_AUTO_LONG_HELP}"
        ),
    )

    share_host_store: Union[bool, str] = _setting(
        False,
        SWITCH,
        (
            "under torchrun or accelerate launch, let the ranks of a node share one host store of "
            "the frozen layers (in /dev/shm) instead of one each; from_pretrained loads only. "
            "auto: on when LOCAL_WORLD_SIZE > 1"
        ),
    )

    def __post_init__(self) -> None:
        if self.share_host_store not in (True, False, "auto"):
            raise StreamConfigError(f"share_host_store must be True, False or 'auto', got {self.share_host_store!r}")
        if not isinstance(self.stream_embeddings, bool) and self.stream_embeddings != "auto":
            raise StreamConfigError(f"stream_embeddings must be True, False or 'auto', got {self.stream_embeddings!r}")
        self.vram_budget = _budget(self.vram_budget)
        self.loss_chunk_tokens = _tokens_setting("loss_chunk_tokens", self.loss_chunk_tokens)
        self.mlp_tile_tokens = _tokens_setting("mlp_tile_tokens", self.mlp_tile_tokens)
        self.host_budget = _budget(self.host_budget, "host_budget")
        if isinstance(self.disk_cache_dir, os.PathLike):
            self.disk_cache_dir = os.fspath(self.disk_cache_dir)
        if self.disk_cache_dir is not None and (
            not isinstance(self.disk_cache_dir, str) or not self.disk_cache_dir.strip(", ")
        ):
            raise StreamConfigError(
                f"disk_cache_dir must be a directory or a comma list of directories, got {self.disk_cache_dir!r}"
            )
        if self.offload_activations not in (True, False, "auto"):
            raise StreamConfigError(
                f"offload_activations must be True, False or 'auto', got {self.offload_activations!r}"
            )
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
        elif (
            isinstance(self.backward_slots, bool) or not isinstance(self.backward_slots, int) or self.backward_slots < 0
        ):
            raise StreamConfigError(f"backward_slots must be an integer >= 0 or 'auto', got {self.backward_slots!r}")
        # which fields were chosen here, so replace() can choose them again
        self.automatic = frozenset(auto)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int):
            raise StreamConfigError(f"prefetch must be an integer >= 1 or 'auto', got {self.prefetch!r}")
        if self.prefetch < 1 or self.prefetch >= self.slots:
            fix = (
                f"Use prefetch from 1 to {self.slots - 1}."
                if self.prefetch < 1
                else f"Use prefetch <= {self.slots - 1} or raise slots to {self.prefetch + 1}."
            )
            raise StreamConfigError(
                f"prefetch={self.prefetch} with slots={self.slots}: prefetch must be >= 1 and "
                f"< slots (one slot is always the layer computing). {fix}"
            )
        if isinstance(self.arena_bytes, bool) or not isinstance(self.arena_bytes, int) or self.arena_bytes < (1 << 20):
            raise StreamConfigError(f"arena_bytes must be an integer >= 1 MiB, got {self.arena_bytes!r}")
        self.device = resolve_device(self.device)
        if self.vram_budget == "auto" and self.device.type != "cuda":
            self.vram_budget = None  # on the host there is no GPU memory to budget
        if self.pin is None:
            self.pin = self.device.type == "cuda"
        elif self.pin and self.device.type != "cuda":
            raise StreamConfigError(
                f"pin=True needs a CUDA device (device is {self.device}); pinned memory only "
                "speeds host-to-GPU copies. Leave pin unset or pass pin=False."
            )

    def budget_bytes(self) -> Optional[int]:
        """The budget in bytes now: a size as given, "auto" measured now, None: none."""
        if self.vram_budget == "auto":
            return gpu_memory_for_run(self.device)
        return self.vram_budget

    def replace(self, **overrides) -> "StreamConfig":
        """A copy with some fields changed, validated again; fields chosen automatically
        are chosen again (prefetch follows a changed slots)."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = set(overrides) - set(names)
        if unknown:
            known = ", ".join(names)
            raise StreamConfigError(f"unknown StreamConfig field(s) {sorted(unknown)}; known fields: {known}")
        values = {name: "auto" if name in self.automatic else getattr(self, name) for name in names}
        values.update(overrides)
        return StreamConfig(**values)


def check_tokens(name: str, value) -> Optional[int]:
    """A setting in tokens: None (off) or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise StreamConfigError(f"{name} must be an integer >= 1 (tokens at a time) or None (off), got {value!r}")
    return value


def _tokens_setting(name: str, value):
    """loss_chunk_tokens or mlp_tile_tokens as StreamConfig keeps it: "auto", an integer
    >= 1, or None for off (given as None, 0 or False)."""
    if isinstance(value, str) and value == "auto":
        return value
    if value is None or value is False or (type(value) is int and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StreamConfigError(
            f"{name} must be an integer >= 1 (tokens at a time), 'auto', or 0 or None (off), got {value!r}"
        )
    return value


def _budget(value, name: str = "vram_budget"):
    if value is None or value == "auto":
        return value
    try:
        value = parse_bytes(value)
    except ValueError as exc:
        raise StreamConfigError(f"{name}: {exc}") from None
    if value <= 0:
        raise StreamConfigError(f"{name} must be a positive size, e.g. '16GiB', 'auto' or None")
    return value


def resolve_device(device) -> torch.device:
    """A StreamConfig device: None is the current CUDA device (an error without CUDA)."""
    if device is None:
        if not torch.cuda.is_available():
            raise StreamConfigError(
                "no CUDA device is available and StreamConfig.device was not given. "
                "Pass device='cpu' (from_pretrained(..., device='cpu'), stream_model(model, "
                "device='cpu') or StreamConfig(device='cpu')) to run the streaming machinery on "
                "the host (host-to-host copies), or run on a machine with a GPU."
            )
        return torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise StreamConfigError(f"device={device!r} is not a torch device: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StreamConfigError(f"device={device} but CUDA is not available; use device='cpu'.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise StreamConfigError(f"device={device}: layerstream streams to CUDA devices or 'cpu' only.")
    return device


# -- the surfaces derived from the fields --------------------------------------------------
def settings() -> List[dataclasses.Field]:
    """The StreamConfig fields every surface offers, in their order."""
    return list(dataclasses.fields(StreamConfig))


def setting_default_text(setting: dataclasses.Field) -> Optional[str]:
    """A field's default as a surface writes it ('auto', '1GiB', None)."""
    default = setting.default
    if setting.metadata["kind"] == SWITCH:
        return default if isinstance(default, str) else str(default).lower()
    if setting.metadata["kind"] == TRISTATE or default is None:
        return default
    if setting.metadata["kind"] == SIZE:
        return f"{default // GiB}GiB" if default % GiB == 0 else str(default)
    return str(default)


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def parse_setting(name: str, value: Any, spelled: Optional[str] = None) -> Any:
    """A value given as text (a flag, an HfArgumentParser field) or as YAML read it, turned
    into what StreamConfig takes; ``spelled`` names the setting as the user wrote it."""
    spelled = spelled or name
    kinds = {f.name: f.metadata["kind"] for f in settings()}
    if name not in kinds:
        raise StreamConfigError(f"unknown setting {spelled!r}; known: {', '.join(kinds)}")
    kind = kinds[name]
    text = value.strip().lower() if isinstance(value, str) else value
    if kind == COUNT:
        if text == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return text
        try:
            return int(text)
        except (TypeError, ValueError):
            raise StreamConfigError(f"{spelled} must be an integer or 'auto', got {value!r}") from None
    if kind == SWITCH and text == "auto":
        return "auto"
    if kind in (TRISTATE, SWITCH):
        if isinstance(value, bool) or (value is None and kind == TRISTATE):
            return value
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        choices = "true, false or auto" if kind == SWITCH else "true or false"
        raise StreamConfigError(f"{spelled} must be {choices}, got {value!r}")
    if kind == TOKENS:
        if value is None or value is False or text in ("", "none", "null", "off", "false"):
            return None
        if text == "auto":
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(text)
        except (TypeError, ValueError):
            raise StreamConfigError(f"{spelled} must be an integer (tokens), auto or none, got {value!r}") from None
    if kind == BUDGET and (value is None or text in ("none", "null", "off")):
        return None
    if kind == BUDGET and text == "auto":
        return "auto"
    if kind == DEVICE:
        return None if value is None or text in ("", "auto") else str(value)
    if kind == DIRECTORIES:
        return None if value is None or text in ("", "none", "null") else str(value).strip()
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise StreamConfigError(f"{spelled}: {exc}") from None


def config_from_settings(values: Dict[str, Any], spelling=lambda name: name, **fixed) -> StreamConfig:
    """A StreamConfig from surface values (text or YAML), each parsed by ``parse_setting``;
    ``fixed`` are values already parsed (a resolved device)."""
    parsed = {name: parse_setting(name, value, spelling(name)) for name, value in values.items()}
    parsed.update(fixed)
    try:
        return StreamConfig(**parsed)
    except StreamConfigError as exc:
        names = sorted(parsed, key=len, reverse=True)
        message = str(exc)
        for name in names:  # the user's spelling of the settings the message names
            if message.startswith(f"{name}") and spelling(name) != name:
                message = spelling(name) + message[len(name) :]
        raise StreamConfigError(message) from None
