"""Host store: each streamed layer's frozen tensors packed into a few large arenas.

A layer occupies one contiguous region of one arena, so one copy moves a whole layer.
Inside the region each tensor starts at an aligned offset; a slot on the device uses
the same offsets, so the device view of a tensor is the slot buffer at that offset.

The store is the truth about a streamed layer's values: the model's own Parameter
objects stay where they are (same names, same identity), their data is a view of the
arena, and device copies follow the arena (``sync`` takes in whatever was written or
assigned to the model's tensors since; see ``changes``). Each host view gets a storage
of its own (``torch.frombuffer`` over the arena), so tools that group tensors by storage,
such as safetensors and ``save_pretrained``, see separate tensors rather than one giant
shared buffer they would try to de-duplicate.

Arenas are allocated as ordinary host memory and page-locked with cudaHostRegister,
not with ``pin_memory=True``: torch's pinned allocator rounds each allocation up to a
power of two, which can cost close to double the host RAM.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch._C import TensorBase

from ..decisions.disk import Tiers, resolve_host_budget, split_tiers
from ..errors import HostMemoryError, PinError, StreamingError
from ..modules import nf4
from ..modules.discovery import layer_name
from ..system import cudart, memory_limits
from ..system.log import get_logger
from ..units import ALIGN, GiB, aligned, next_arena

logger = get_logger(__name__)

SAME, VALUES, LAYOUT = "same", "values", "layout"  # what sync found


def set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.data = value`` without the write tracking of a streamed parameter."""
    TensorBase.data.__set__(tensor, value)


@dataclass
class TensorEntry:
    """One frozen tensor of a layer: where it is bound and where it lives in the region."""

    module: nn.Module
    kind: str  # "_parameters" or "_buffers" (bound per call), or nf4.QUANT_KIND (a QuantState tensor)
    name: str  # key in the table, or for a quant-state tensor its name (nf4.quant_name)
    offset: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    qualified_name: str

    @property
    def table(self) -> dict:
        return getattr(self.module, self.kind)

    @property
    def is_quant_state(self) -> bool:
        """One tensor of a 4-bit weight's QuantState, rather than a module's own tensor."""
        return self.kind == nf4.QUANT_KIND

    @property
    def bound(self) -> bool:
        """Bound into a module table per call (quant tensors ride on their weight)."""
        return not self.is_quant_state

    @property
    def quant_path(self) -> Tuple[str, ...]:
        return nf4.quant_path(self.name)

    def current(self) -> Optional[torch.Tensor]:
        """The tensor the model holds for this entry now."""
        if self.is_quant_state:
            return nf4.weight_quant_tensor(self.module, self.quant_path)
        return self.table.get(self.name)

    def hold_in_quant_state(self, tensor: torch.Tensor) -> None:
        """Make the model hold ``tensor`` for a quant-state entry (its weight's QuantState
        does: the weight itself stays the same object)."""
        nf4.set_weight_quant_tensor(self.module, self.quant_path, tensor)


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
    arena_views: List[torch.Tensor] = field(default_factory=list)  # per entry, over the region
    host_values: List[torch.Tensor] = field(default_factory=list)  # per entry, what the model holds
    host_binding: List[tuple] = field(default_factory=list)  # (table, name, host tensor)
    # (table, name, tensor, alias, version) of each bound tensor as the device copies last
    # saw it: a different tensor in the table, or another version, means it changed since.
    # The version is read from ``alias``, a detached view sharing the tensor's version
    # counter: a plain tensor reads it three times faster than a Parameter subclass does
    watch: List[tuple] = field(default_factory=list)
    # the same for the quant-state tensors riding on 4-bit weights, and the QuantState
    # objects themselves (alias None: identity only), checked once per pass
    watch_deep: List[tuple] = field(default_factory=list)
    # the address of each watched tensor's memory: torch.utils.swap_tensors (and
    # load_state_dict(assign=True) under torch.__future__'s swap flag) gives the same
    # Parameter object another tensor, whose version counter ``alias`` does not share
    addresses: List[int] = field(default_factory=list)
    watched_tensors: List[torch.Tensor] = field(default_factory=list)  # ``watch``'s tensors, in order
    # a disk-tier layer (no host region) in debug mode: the checksum of its bytes at load
    reference_checksum: Optional[int] = None
    # a disk layer's tensors kept on the device for good once changed (runtime/disk_changes),
    # watched like the bound ones so that a change between a forward and its backward is
    # refused: (table, name, tensor, alias, version, address, qualified name)
    kept: List[tuple] = field(default_factory=list)

    def uncovered(self) -> List[tuple]:
        """(begin, end) of the region bytes no tensor covers (alignment padding)."""
        covered = sorted({(e.offset, e.offset + e.nbytes) for e in self.entries})
        gaps, end = [], 0
        for begin, stop in covered:
            if begin > end:
                gaps.append((end, begin))
            end = max(end, stop)
        if end < self.nbytes:
            gaps.append((end, self.nbytes))
        return gaps

    def fresh(self) -> bool:
        """Whether every bound tensor is the one, at the version, the device copies were made
        from (the per-visit check: a dict lookup and a version read per tensor, no sync)."""
        for table, name, tensor, alias, version in self.watch:
            if table.get(name) is not tensor or alias._version != version:
                return False
        return not self.kept_changed()

    def kept_changed(self) -> List[str]:
        """The qualified names of the ``kept`` tensors changed since they were watched."""
        return [
            qualified
            for table, name, tensor, alias, version, address, qualified in self.kept
            if table.get(name) is not tensor or alias._version != version or tensor.data_ptr() != address
        ]

    def fresh_deep(self) -> bool:
        """``fresh``, the tensors' memory (a swapped tensor keeps its object), and the 4-bit
        weights' quant states too (checked once per pass)."""
        if not self.fresh():
            return False
        if self._addresses_now() != self.addresses:
            return False
        return self.quant_states_unchanged()

    def _addresses_now(self) -> List[int]:
        """Where each watched tensor's memory is now. A layer in host memory reads it in C
        (a 4-bit weight's ``data_ptr`` through Python's ``__torch_function__`` costs most of
        the pass's check); a disk layer through each tensor's own ``data_ptr``, which checks
        its files first (``FileBacked``): a changed file is refused here, at the pass start."""
        if self.host_region is None:
            return [tensor.data_ptr() for tensor in self.watched_tensors]
        with torch._C.DisableTorchFunctionSubclass():
            return list(map(TensorBase.data_ptr, self.watched_tensors))

    def quant_states_unchanged(self) -> bool:
        """Whether the 4-bit weights' quant states (``watch_deep``) are as last snapshot."""
        for table, name, obj, alias, version in self.watch_deep:
            if table.get(name) is not obj or (alias is not None and alias._version != version):
                return False
        return True

    def changed_positions(self) -> List[int]:
        """The positions of the bound entries whose tensor changed since the snapshot
        (another tensor, another version, other memory)."""
        bound = [position for position, entry in enumerate(self.entries) if entry.bound]
        return [
            position
            for position, (table, name, tensor, alias, version), address in zip(bound, self.watch, self.addresses)
            if table.get(name) is not tensor or alias._version != version or table[name].data_ptr() != address
        ]

    def snapshot(self) -> None:
        """Remember the tensors and versions the device copies are made from from now on."""
        self.watch = [
            (e.table, e.name, v, _alias(v), v._version) for e, v in zip(self.entries, self.host_values) if e.bound
        ]
        self.watched_tensors = [watched[2] for watched in self.watch]
        self.addresses = self._addresses_now()
        deep, states = [], {}
        for entry, view in zip(self.entries, self.host_values):
            if not entry.is_quant_state:
                continue
            weight = entry.module._parameters["weight"]
            state = nf4.packed_state(weight)
            if id(state) not in states:
                states[id(state)] = state
                deep.append((weight.__dict__, nf4.STATE_ATTRIBUTE, state, None, None))
            holder = nf4.quant_holder(state, entry.quant_path).__dict__
            deep.append((holder, entry.quant_path[-1], view, _alias(view), view._version))
        self.watch_deep = deep

    def watch_kept(self, keys: List[Tuple[dict, str, str]]) -> None:
        """Watch, as ``kept``, the tensors now held under ``keys`` (table, name, qualified name)."""
        self.kept = [(t, n, t[n], _alias(t[n]), t[n]._version, t[n].data_ptr(), q) for t, n, q in keys]


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor sharing ``tensor``'s version counter (``detach`` shares it)."""
    with torch._C.DisableTorchFunctionSubclass():
        return TensorBase.detach(tensor)


def host_memory() -> Optional[Tuple[int, int]]:
    """(available, total) bytes of host memory this process may use: /proc/meminfo's
    MemAvailable and MemTotal, lowered to its container's cgroup limit where that is lower
    (``memory_limits``); None where there is no /proc/meminfo."""
    return memory_limits.host_memory()


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
            "`layerstream plan` shows the host RAM a run needs before it starts."
        )
    lockable = memory_limits.lockable_bytes(total)
    if pin and store_bytes > lockable:
        raise HostMemoryError(
            f"{what} would page-lock {store_bytes / GiB:.1f} GiB of this host's {total / GiB:.1f} GiB, "
            f"leaving less than {(total - lockable) / GiB:.1f} GiB for everything else. Load in NF4 "
            "(quantization='nf4'), use a host with more RAM, or pass StreamConfig(pin=False) "
            "(pageable copies, about 8x slower)."
        )


def _host_view(arena_np, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor over arena bytes [offset, offset+nbytes) with a storage of its own."""
    return _tensor_over(arena_np[offset : offset + nbytes]).view(dtype).view(shape)


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
        self.disk = None  # disk.DiskTier: the layers the host budget does not hold
        self.segment = None  # shared_store.Segment: arenas in shared memory, read-only

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
                end += aligned(nbytes)
            entries.append(
                TensorEntry(mod, kind, key, placed[id(tensor)], nbytes, tuple(tensor.shape), tensor.dtype, qualified)
            )

        for mod_name, mod in module.named_modules(remove_duplicate=False):
            prefix = f"{name}.{mod_name}" if mod_name else name
            for kind in ("_parameters", "_buffers"):
                for tname, tensor in getattr(mod, kind).items():
                    if tensor is not None and streamed(tensor):
                        add(mod, kind, tname, tensor, f"{prefix}.{tname}")
            # a streamed 4-bit weight brings its quant-state tensors into the region
            state = nf4.weight_quant_state(mod)
            if state is None or id(mod._parameters["weight"]) not in placed:
                continue
            for path, tensor in nf4.quant_tensors(state):
                dotted = nf4.quant_name(path)
                add(mod, nf4.QUANT_KIND, dotted, tensor, f"{prefix}.weight.quant_state.{dotted}")
        return LayerRecord(index=index, name=name, module=module, entries=entries, nbytes=end)

    def build(self, records: List[LayerRecord], new_bytes: Optional[int] = None) -> None:
        """Allocate arenas, copy each layer in, and point the model's tensors at them.

        ``new_bytes``: host memory the fill adds at its peak; by default one layer (each
        layer's own host memory is freed once it is copied), the whole store when the
        layers come from the GPU."""
        total = sum(r.nbytes for r in records)
        check_host_memory(
            max((r.nbytes for r in records), default=0) if new_bytes is None else new_bytes,
            total,
            self.requested_pin,
            "streaming this model",
        )
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
            self._new_arena(max(sum(r.nbytes for r in group), ALIGN), pin=False)
        for record in records:
            self._fill(record)
        # pin after filling: registration locks every page at once, and before the fill
        # that would hold the whole store next to the model's own copy of the layers
        for arena in self.arenas:
            if not self._pin(arena):
                break

    def _new_arena(self, size: int, pin: bool) -> int:
        if self.segment is not None:
            import numpy

            arena_np = numpy.frombuffer(self.segment.new_arena(len(self.arenas), size), dtype=numpy.uint8)
            arena = _tensor_over(arena_np)
        else:
            arena = torch.empty(size, dtype=torch.uint8)
            arena_np = arena.numpy()
        self.arenas.append(arena)
        self._arena_np.append(arena_np)
        if pin:
            self._pin(arena)
        return len(self.arenas) - 1

    def _pin(self, arena: torch.Tensor) -> bool:
        """Page-lock one arena; on refusal unpin all, warn once, and go on pageable."""
        if not self.requested_pin:
            return False
        try:
            cudart.register_host(arena, read_only=self.segment is not None)
        except PinError as exc:
            self._unpin_now()
            self.requested_pin = False
            self.pinned = False
            logger.warning(
                "layerstream: could not page-lock host memory for the layer store (%s). Falling "
                "back to pageable memory: host-to-device copies will run about 8x slower (~7 GB/s "
                "instead of ~55 GB/s) and will not overlap compute. Raise the locked-memory limit "
                "(ulimit -l) or free host RAM to get pinned copies back.",
                exc,
                main_process_only=False,
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
            self._new_arena(next_arena(record.nbytes, expected_bytes, self.arena_bytes), pin=True)
            self._used = 0
        record.arena = len(self.arenas) - 1
        record.arena_offset = self._used
        self._used += record.nbytes
        self.records.append(record)
        self._fill(record)

    def _fill(self, record: LayerRecord) -> None:
        """Copy the layer's tensors into its region and point the model's tensors there."""
        arena_np = self._arena_np[record.arena]
        base = record.arena_offset
        record.host_region = self.arenas[record.arena][base : base + record.nbytes]
        views: Dict[int, torch.Tensor] = {}
        record.arena_views, record.host_values = [], []
        target = arena_np  # where the bytes are written: the arena, or the builder's writable map
        if self.segment is not None:
            import numpy

            self.segment.check_layer(record.index, layer_layout(record))
            writer = self.segment.writable(record.arena)
            target = None if writer is None else numpy.frombuffer(writer, dtype=numpy.uint8)
        for entry in record.entries:
            tensor = entry.current()
            if entry.offset not in views:
                views[entry.offset] = _host_view(arena_np, base + entry.offset, entry.nbytes, entry.dtype, entry.shape)
                if target is not None:
                    with torch.no_grad():
                        _host_view(target, base + entry.offset, entry.nbytes, entry.dtype, entry.shape).copy_(
                            tensor.detach()
                        )
            view = views[entry.offset]
            record.arena_views.append(view)
            record.host_values.append(self._point_at(entry, tensor, view))
        self._bound(record)

    @staticmethod
    def _point_at(entry: TensorEntry, tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """Make the model hold ``view``'s memory for this entry; returns what it holds."""
        if entry.is_quant_state:
            entry.hold_in_quant_state(view)
            return view
        if isinstance(tensor, nn.Parameter):
            set_data(tensor, view)  # same Parameter object: names, identity, optimiser refs hold
            return tensor
        entry.table[entry.name] = view
        return view

    @staticmethod
    def _bound(record: LayerRecord) -> None:
        record.host_binding = [(e.table, e.name, v) for e, v in zip(record.entries, record.host_values) if e.bound]
        record.snapshot()

    # -- the model's tensors changed -------------------------------------------------------
    def sync(self, record: LayerRecord) -> str:
        """Take in what the model holds for this layer now; returns SAME (nothing to do),
        VALUES (the region's bytes changed: device copies are stale) or LAYOUT (a tensor's
        shape or dtype changed: ``repack`` the layer).

        Values written in place are in the region already. A tensor assigned in place of
        the streamed one (``load_state_dict(assign=True)``, ``.data =``, a new Params4bit)
        is copied into the region and the model's tensor pointed back at it, so the region
        stays the layer's one copy."""
        changed = False
        for position, entry in enumerate(record.entries):
            view = record.arena_views[position]
            current = entry.current()
            if current is None:
                raise StreamingError(
                    f"{entry.qualified_name} was removed from the model after stream_model; "
                    "unstream_model first to change what a layer holds."
                )
            if tuple(current.shape) != entry.shape or current.dtype != entry.dtype:
                return LAYOUT
            if current.data_ptr() != view.data_ptr() or current.device.type != "cpu":
                self._refuse_writes(entry)
                with torch.no_grad():
                    view.copy_(current.detach())
                record.host_values[position] = self._point_at(entry, current, view)
                changed = True
        if changed or not record.fresh_deep():
            self._bound(record)
            return VALUES
        return SAME

    def repack(self, record: LayerRecord) -> None:
        """Give a layer whose tensors changed shape or dtype a new region (in an arena of
        its own) laid out for what the model holds now; the old region is not reused."""
        self._refuse_writes(record.entries[0])
        streamed = {id(e.current()) for e in record.entries if e.bound}
        fresh = self.plan_layer(record.index, record.name, record.module, lambda t: id(t) in streamed)
        self._new_arena(max(fresh.nbytes, ALIGN), pin=self.requested_pin and self.pinned)
        fresh.arena, fresh.arena_offset = len(self.arenas) - 1, 0
        record.entries, record.nbytes = fresh.entries, fresh.nbytes
        record.arena, record.arena_offset = fresh.arena, 0
        self._fill(record)

    # -- the inverse -------------------------------------------------------------------------
    def copies_out(self, record: LayerRecord, device: torch.device) -> List[torch.Tensor]:
        """A copy of each entry's value on ``device``, memory of its own (shared entries once)."""
        by_offset: Dict[int, torch.Tensor] = {}
        return [
            by_offset.setdefault(e.offset, view.detach().to(device, copy=True))
            for e, view in zip(record.entries, record.arena_views)
        ]

    @staticmethod
    def restore(record: LayerRecord, copies: List[torch.Tensor]) -> None:
        """Point the model's tensors at ``copies`` (from ``copies_out``): plain assignments
        that cannot fail half way through for want of memory."""
        for entry, host, copy in zip(record.entries, record.host_values, copies):
            if entry.is_quant_state:
                entry.hold_in_quant_state(copy)
            elif isinstance(host, nn.Parameter):
                set_data(host, copy)
            else:
                entry.table[entry.name] = copy

    def _refuse_writes(self, entry: TensorEntry) -> None:
        if self.segment is not None:
            raise StreamingError(
                f"{entry.qualified_name} was changed, but the host store is shared between this node's "
                "ranks (share_host_store) and its weights are read-only. Change frozen weights in a "
                "single process (share_host_store=False), or before streaming."
            )

    def release(self) -> None:
        if self.segment is not None:
            self.segment.leave()
        self._unpin_now()
        self.pinned = False
        self.arenas = []
        self._arena_np = []


def region_bytes(sizes: Iterable[int]) -> int:
    """Bytes of a layer's region holding tensors of ``sizes`` bytes, each once: what
    ``HostStore.plan_layer`` lays out (every tensor at an ``ALIGN``-aligned offset)."""
    return sum(aligned(nbytes) for nbytes in sizes)


def layer_layout(record: LayerRecord) -> dict:
    """Where a layer is and how it is laid out, as the shared store's manifest records it."""
    return {
        "name": record.name,
        "arena": record.arena,
        "offset": record.arena_offset,
        "nbytes": record.nbytes,
        "entries": [[e.offset, e.nbytes, list(e.shape), str(e.dtype)] for e in record.entries],
    }


def _tensor_over(array) -> torch.Tensor:
    """A uint8 tensor over a numpy array's bytes, with a storage of its own; the array may
    be read-only (a shared arena's mapping), and nothing writes through such a tensor."""
    if not array.size:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(array, dtype=torch.uint8)


def _unregister_all(arenas: List[torch.Tensor]) -> None:
    for arena in arenas:
        cudart.unregister_host(arena)


def plan_tiers(stream, layers: nn.ModuleList, path: str, sizes: Optional[list] = None) -> Optional[Tiers]:
    """Where each layer of a model being loaded lives under ``stream.host_budget`` (None: no
    budget, every layer in host RAM). Sized from the meta model before any weight is read,
    or from ``sizes`` (the packed NF4 layers, as the planner computes them)."""
    budget = resolve_host_budget(stream.host_budget, host_memory())
    if budget is None:
        return None
    quantized = sizes is not None
    if sizes is None:
        sizes = [
            HostStore.plan_layer(i, layer_name(path, i), layer, lambda t: True).nbytes for i, layer in enumerate(layers)
        ]
    tiers = split_tiers(sizes, budget, quantized=quantized)
    return tiers if tiers.disk else None
