"""Host store: each streamed layer's frozen tensors packed into a few large arenas.

A layer occupies one contiguous region of one arena, so one copy moves a whole layer.
Inside the region each tensor starts at an aligned offset; a slot on the device uses
the same offsets, so the device view of a tensor is the slot buffer at that offset.

The model's own Parameter objects stay where they are (same names, same identity); only
their data moves into the arena. Each host view gets its own storage object (made with
``torch.frombuffer`` over the arena), so tools that group tensors by storage, such as
safetensors and ``save_pretrained``, see separate tensors rather than one giant shared
buffer they would try to de-duplicate.

Arenas are allocated as ordinary host memory and page-locked with cudaHostRegister,
not with ``pin_memory=True``: torch's pinned allocator rounds each allocation up to a
power of two, which can cost close to double the host RAM.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import cudart, nf4

logger = logging.getLogger(__name__)

ALIGN = 512  # bytes; keeps every tensor aligned for vectorised kernels on host and device


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class TensorEntry:
    """One frozen tensor of a layer: where it is bound and where it lives in the region."""

    module: nn.Module
    kind: str  # "_parameters" or "_buffers" (bound per call), or "quant" (a QuantState tensor)
    name: str  # key in the table, or for "quant" the dotted path in the weight's QuantState
    offset: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    qualified_name: str

    @property
    def table(self) -> dict:
        return getattr(self.module, self.kind)

    @property
    def bound(self) -> bool:
        """Bound into a module table per call (quant tensors ride on their weight)."""
        return self.kind != "quant"

    @property
    def quant_path(self) -> Tuple[str, ...]:
        return tuple(self.name.split("."))


@dataclass
class LayerRecord:
    """A streamed layer: its tensors, and the region of the arena that holds them."""

    index: int
    name: str
    module: nn.Module
    entries: List[TensorEntry]
    nbytes: int = 0
    arena: int = -1
    arena_offset: int = 0
    host_region: Optional[torch.Tensor] = None
    host_values: List[torch.Tensor] = field(default_factory=list)
    host_data_ptrs: List[int] = field(default_factory=list)
    host_binding: List[tuple] = field(default_factory=list)  # (table, name, host tensor)


class PinError(RuntimeError):
    pass


class HostMemoryError(MemoryError):
    """The host cannot hold (or page-lock) the layer store; raised before any copy."""


GiB = 1 << 30


def host_memory() -> Optional[Tuple[int, int]]:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo; None where there is none."""
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None


def check_host_memory(new_bytes: int, store_bytes: int, pin: bool, what: str) -> None:
    """Refuse, before work starts, a store the host cannot hold or should not page-lock.

    new_bytes: host memory the operation still has to allocate at its peak.
    store_bytes: the whole store, page-locked when ``pin``: locked pages cannot be
        swapped or reclaimed, so at least max(4 GiB, 10%) of the host must stay unlocked.
    """
    memory = host_memory()
    if memory is None:
        return
    available, total = memory
    if new_bytes > available:
        raise HostMemoryError(
            f"{what} needs {new_bytes / GiB:.1f} GiB more host RAM at its peak (the layer store is "
            f"{store_bytes / GiB:.1f} GiB) but only {available / GiB:.1f} GiB is available. Free host "
            "memory, or load in NF4 (quantization='nf4': about a quarter of the bytes); "
            "`layerstream plan` shows the host RAM a run needs before it starts.")
    keep = max(4 * GiB, total // 10)
    if pin and store_bytes > total - keep:
        raise HostMemoryError(
            f"{what} would page-lock {store_bytes / GiB:.1f} GiB of this host's {total / GiB:.1f} GiB, "
            f"leaving less than {keep / GiB:.1f} GiB for everything else. Load in NF4 "
            "(quantization='nf4'), use a host with more RAM, or pass StreamConfig(pin=False) "
            "(pageable copies, about 8x slower).")


def _register(tensor: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0))
    if code != 0:
        cudart.clear_error()
        raise PinError(f"cudaHostRegister failed with CUDA error {code}")


def _unregister(tensor: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
    if code != 0:
        cudart.clear_error()
        logger.warning("layerstream: cudaHostUnregister failed with CUDA error %d", code)


def _unregister_all(arenas: List[torch.Tensor]) -> None:
    for arena in arenas:
        _unregister(arena)


def _host_view(arena_np, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor over arena bytes [offset, offset+nbytes) with a storage of its own."""
    raw = torch.frombuffer(arena_np[offset : offset + nbytes], dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


class HostStore:
    """Packs layers into arenas, rebinds the model's tensors to arena views."""

    def __init__(self, arena_bytes: int, pin: bool):
        self.arena_bytes = arena_bytes
        self.requested_pin = pin
        self.pinned = False
        self.arenas: List[torch.Tensor] = []
        self._arena_np: list = []
        self.records: List[LayerRecord] = []
        self._unpin = None  # finaliser: unregister before the arena memory can be freed
        self._registered: List[torch.Tensor] = []
        self._used = 0  # bytes used in the last arena (incremental filling)

    @property
    def host_bytes(self) -> int:
        return sum(a.numel() for a in self.arenas)

    @property
    def largest_layer_bytes(self) -> int:
        return max((r.nbytes for r in self.records), default=0)

    @staticmethod
    def plan_layer(index: int, name: str, module: nn.Module, streamed: Callable[[torch.Tensor], bool]) -> LayerRecord:
        """Lay out a layer's streamed tensors; shared tensors are stored once."""
        entries: List[TensorEntry] = []
        placed: Dict[int, int] = {}  # id(tensor) -> offset in the region
        end = 0

        def add(mod, kind, key, tensor, qualified):
            nonlocal end
            nbytes = tensor.numel() * tensor.element_size()
            if id(tensor) not in placed:
                placed[id(tensor)] = end
                end += _aligned(nbytes)
            entries.append(TensorEntry(mod, kind, key, placed[id(tensor)], nbytes, tuple(tensor.shape),
                                       tensor.dtype, qualified))

        for mod_name, mod in module.named_modules(remove_duplicate=False):
            prefix = f"{name}.{mod_name}" if mod_name else name
            for kind in ("_parameters", "_buffers"):
                for tname, tensor in getattr(mod, kind).items():
                    if tensor is not None and streamed(tensor):
                        add(mod, kind, tname, tensor, f"{prefix}.{tname}")
            # a streamed 4-bit weight brings its quant-state tensors into the region
            weight = mod._parameters.get("weight")
            state = getattr(weight, "quant_state", None)
            if state is None or id(weight) not in placed:
                continue
            for path, tensor in nf4.quant_tensors(state):
                dotted = ".".join(path)
                add(mod, "quant", dotted, tensor, f"{prefix}.weight.quant_state.{dotted}")
        return LayerRecord(index=index, name=name, module=module, entries=entries, nbytes=end)

    def build(self, records: List[LayerRecord]) -> None:
        """Allocate arenas, copy each layer in, and point the model's tensors at them."""
        # each layer's own memory is freed once it is copied, so the fill needs about one
        # layer more than the model already takes
        check_host_memory(max((r.nbytes for r in records), default=0), sum(r.nbytes for r in records),
                          self.requested_pin, "streaming this model")
        self.records = records
        layout: List[List[LayerRecord]] = [[]]
        used = 0
        for record in records:
            if layout[-1] and used + record.nbytes > max(self.arena_bytes, record.nbytes):
                layout.append([])
                used = 0
            record.arena = len(layout) - 1
            record.arena_offset = used
            used += record.nbytes
            layout[-1].append(record)
        for group in layout:
            size = sum(r.nbytes for r in group)
            arena = torch.empty(max(size, ALIGN), dtype=torch.uint8)
            self.arenas.append(arena)
            self._arena_np.append(arena.numpy())
        for record in records:
            self._fill(record)
        # pin after filling: registration locks every page at once, and before the fill
        # that would hold the whole store next to the model's own copy of the layers
        self._pin_all()

    def _pin_all(self) -> None:
        for arena in self.arenas:
            if not self._pin(arena):
                return

    def _pin(self, arena: torch.Tensor) -> bool:
        """Page-lock one arena; on refusal unpin all, warn once, and go on pageable."""
        if not self.requested_pin:
            return False
        try:
            _register(arena)
        except PinError as exc:
            self._unpin_now()
            self.requested_pin = False
            self.pinned = False
            logger.warning(
                "layerstream: could not page-lock host memory for the layer store (%s). Falling "
                "back to pageable memory: host-to-device copies will run about 8x slower (~7 GB/s "
                "instead of ~55 GB/s) and will not overlap compute. Raise the locked-memory limit "
                "(ulimit -l) or free host RAM to get pinned copies back.", exc,
            )
            return False
        self._registered.append(arena)
        self.pinned = True
        if self._unpin is None:
            # memory freed while still registered would make a later registration of the
            # same pages fail: unregister whenever the store goes away (the finaliser holds
            # the list, so arenas pinned later are covered too)
            self._unpin = weakref.finalize(self, _unregister_all, self._registered)
        return True

    def _unpin_now(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._registered = []

    def add(self, record: LayerRecord, expected_bytes: int = 0) -> None:
        """Append one layer (loading layer by layer); a new arena starts when it does not fit.

        ``expected_bytes`` (the bytes still to come, this layer included) keeps the last
        arena from being much larger than what is left to store.
        """
        if not self.arenas or self._used + record.nbytes > self.arenas[-1].numel():
            # a whole number of layers of this size, so equal layers leave no gap at the end
            whole_layers = max(1, self.arena_bytes // max(record.nbytes, 1)) * record.nbytes
            size = max(min(whole_layers, max(expected_bytes, record.nbytes)), record.nbytes, ALIGN)
            arena = torch.empty(size, dtype=torch.uint8)
            self.arenas.append(arena)
            self._arena_np.append(arena.numpy())
            self._pin(arena)
            self._used = 0
        record.arena = len(self.arenas) - 1
        record.arena_offset = self._used
        self._used += record.nbytes
        self.records.append(record)
        self._fill(record)

    def _fill(self, record: LayerRecord) -> None:
        arena = self.arenas[record.arena]
        arena_np = self._arena_np[record.arena]
        base = record.arena_offset
        record.host_region = arena[base : base + record.nbytes]
        views: Dict[int, torch.Tensor] = {}
        for entry in record.entries:
            if entry.kind == "quant":
                state = entry.module.weight.quant_state
                tensor = dict(nf4.quant_tensors(state))[entry.quant_path]
                if entry.offset not in views:
                    view = _host_view(arena_np, base + entry.offset, entry.nbytes, entry.dtype, entry.shape)
                    view.copy_(tensor)
                    views[entry.offset] = view
                nf4.set_quant_tensor(state, entry.quant_path, views[entry.offset])
                record.host_values.append(views[entry.offset])
                continue
            table = entry.table
            tensor = table[entry.name]
            if entry.offset not in views:
                view = _host_view(arena_np, base + entry.offset, entry.nbytes, entry.dtype, entry.shape)
                with torch.no_grad():
                    view.copy_(tensor)
                views[entry.offset] = view
            view = views[entry.offset]
            if isinstance(tensor, nn.Parameter):
                tensor.data = view  # same Parameter object: names, identity, optimiser refs hold
            else:
                table[entry.name] = view
            record.host_values.append(table[entry.name])
        record.host_data_ptrs = [v.data_ptr() for v in record.host_values]
        record.host_binding = [(e.table, e.name, v) for e, v in zip(record.entries, record.host_values)
                               if e.bound]

    def release(self) -> None:
        self._unpin_now()
        self.pinned = False
        self.arenas = []
        self._arena_np = []
