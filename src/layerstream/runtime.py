"""StreamRuntime: ties the store, the slot pool and the planner to a model's layers.

One runtime per streamed model, reachable with ``layerstream.get_runtime(model)``.
The per-visit path (``call_layer`` -> ``_run``) is the hot path: it plans, issues the
copies, makes the compute stream wait, swaps dictionary entries, and calls the layer.
It allocates nothing per visit beyond the planner's small lists, and never waits on
the host.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import layer as layer_mod
from . import checksum, nf4, plan, schedule, timeline
from .backward_slots import BackwardSlots
from .config import StreamConfig
from .pool import SlotOwnerError, SlotPool
from .schedule import Phase, PrefetchPlanner
from .store import HostStore, LayerRecord

logger = logging.getLogger(__name__)

# keyword arguments through which decoder layers receive or update a KV cache
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _always_owned(tensor: torch.Tensor) -> None:
    """The backward owner check of a resident-window layer: its buffer is never reused."""


class StreamingError(RuntimeError):
    """Streaming cannot go on as asked; the message says what to change."""


class StreamRuntime:
    def __init__(self, model: nn.Module, layers: nn.ModuleList, layers_path: str,
                 config: StreamConfig, records: List[LayerRecord], store: HostStore):
        self.model = model
        self.layers = layers
        self.layers_path = layers_path
        self.config = config
        self.device = config.device
        self.records = records
        self.store = store
        self.backward = BackwardSlots(config)
        self.pool = SlotPool(config.device, config.slots, store.largest_layer_bytes,
                             backward_slots=self.backward.capacity)
        self.planner = self._new_planner(len(records))
        # the resident window: layers kept on the device for good, and the dense numbering
        # of the layers that still stream (the planner sees only those)
        self._window: Dict[int, list] = {}
        self._window_buffers: List[torch.Tensor] = []
        self._dense: List[Optional[int]] = list(range(len(records)))
        self._layer_of: List[int] = list(range(len(records)))
        self._window_decided = False
        self._last_slot: Optional[int] = None  # the slot of the previous streamed visit
        # (slot, layer) -> [(table, name, slot tensor)], built on first use, then reused
        self._bindings: Dict[Tuple[int, int], list] = {}
        # every streamed layer's _apply checks these; collect them once, not per layer
        self._streamed_dtypes = {e.dtype for r in records for e in r.entries}
        self.visits = 0
        self.demand_loads = 0
        self.peak_resident_layers = 0
        self._warned_cache = False
        self.nf4_counts = {"nf4_function_calls": 0, "nf4_dequant_calls": 0}
        # test hook: replace the copied bytes of a load (negative controls)
        self._load_source = None
        self._recording = None  # timeline.Recording while a step is recorded
        self._budget_checked: set = set()  # (batch, seq) shapes checked against vram_budget
        self._checker = checksum.SlotChecker(self.pool, records) if config.checksum else None
        self.ends = None  # ends.StreamedEnds when the embedding and head stream too
        if self._checker is not None:
            logger.warning("layerstream: debug checksums are on (StreamConfig.checksum or "
                           "LAYERSTREAM_CHECKSUM=1): every copy and visit waits for the device")

    # -- binding -------------------------------------------------------------------
    def _binding(self, slot: int, index: int) -> list:
        key = (slot, index)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self._make_binding(self.pool.buffers[slot], index,
                                                               self._owner_check(index))
        return binding

    def _make_binding(self, buffer: torch.Tensor, index: int, owner_check) -> list:
        """(table, name, device tensor) for each bound tensor of a layer held in ``buffer``."""
        record = self.records[index]
        views = [buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in record.entries]
        quant: Dict[int, dict] = {}
        for entry, view in zip(record.entries, views):
            if entry.kind == "quant":
                quant.setdefault(id(entry.module), {})[entry.quant_path] = view
        binding = []
        for entry, view, host in zip(record.entries, views, record.host_values):
            if not entry.bound:
                continue
            if entry.kind == "_parameters":
                host_state = getattr(host, "quant_state", None)
                if host_state is not None and id(entry.module) in quant:
                    state = nf4.clone_state(host_state, quant[id(entry.module)])
                    view = nf4.slot_weight(host, view, state)
                    view._layerstream_owner = owner_check
                else:
                    view = nn.Parameter(view, requires_grad=False)
            binding.append((entry.table, entry.name, view))
        return binding

    def _owner_check(self, index: int):
        """A check for backward: the slot a saved tensor lives in still holds this layer.

        The slot is found from the tensor's address, not remembered: under checkpointing
        the tensors backward reads come from the recompute, which may use another slot
        than the forward did.
        """
        pool, name = self.pool, self.records[index].name

        def check(tensor: torch.Tensor) -> None:
            slot = pool.slot_of_pointer(tensor.data_ptr())
            if slot is None or not pool.owns(slot, index):
                holder = None if slot is None else pool.owner[slot]
                raise SlotOwnerError(
                    f"backward of {name} reads slot {slot}, which holds layer {holder}"
                )

        return check

    def _new_planner(self, streamed_layers: int) -> PrefetchPlanner:
        return PrefetchPlanner(max(streamed_layers, 1), self.config.slots, self.config.prefetch,
                               backward_slots=self.backward.count)

    # -- the hot path --------------------------------------------------------------
    def _enter(self, index: int, phase: Phase) -> int:
        pool = self.pool
        compute = pool.compute_stream()
        if self._last_slot is not None:
            # every kernel of the previous visit (its backward ones too) is queued by now
            pool.mark_released(self._last_slot, compute)
        plan = self.planner.visit(self._dense[index], phase)
        for slot in plan.drop:
            self._free_backward_slot(slot)
        source = self._load_source
        loads = [(self._layer_of[dense], slot) for dense, slot in plan.loads]
        if self.backward.count:
            loads = [(layer, slot) for layer, slot in loads
                     if slot < pool.ring_slots or pool.allocated(slot)
                     or self.backward.borrow(pool, self.planner, slot)]
        for layer, slot in loads:
            pool.load(self.records[layer], slot, compute,
                      None if source is None else source(layer, slot))
        checker = self._checker
        if checker is not None:
            for layer, slot in loads:
                checker.after_copy(layer, slot)
        pool.acquire(plan.slot, index, compute)
        if checker is not None:
            checker.before_use(index, plan.slot)
        self._last_slot = plan.slot
        self.visits += 1
        if plan.demand:
            self.demand_loads += 1
        resident = len(self.planner.slot_of)
        if resident > self.peak_resident_layers:
            self.peak_resident_layers = resident
        return plan.slot

    def _free_backward_slot(self, slot: int) -> None:
        for key in [key for key in self._bindings if key[0] == slot]:
            del self._bindings[key]  # bindings hold views of the slot's memory
        self.pool.free(slot)

    def _run(self, layer: nn.Module, index: int, phase: Phase, args, kwargs):
        binding = self._window.get(index)
        if binding is None:
            slot = self._enter(index, phase)
            binding = self._binding(slot, index)
        else:  # kept on the device for good (resident window): no copy, no slot
            slot = -1
            self.visits += 1
        record = self.records[index]
        for table, name, tensor in binding:
            table[name] = tensor
        recording = self._recording
        if recording is not None:
            begin = recording.now()
        try:
            return layer_mod.call_unstreamed(layer, args, kwargs)
        except torch.OutOfMemoryError as exc:
            raise self.explain_oom(exc, f"in streamed layer {record.name}") from exc
        finally:
            for table, name, host in record.host_binding:
                table[name] = host
            if recording is not None:
                recording.computes.append((index, slot, phase, begin, recording.now()))

    def call_layer(self, layer: nn.Module, args, kwargs):
        index = layer._layerstream_index
        if index == 0:
            self._check_capture()
        if args and isinstance(args[0], torch.Tensor) and args[0].device != self.device:
            raise StreamingError(
                f"streamed layer {self.records[index].name} computes on {self.device} but its "
                f"input is on {args[0].device}. Move the model's resident part with "
                f"model.to('{self.device}') after stream_model (and after get_peft_model)."
            )
        if not torch.is_grad_enabled():
            return self._run(layer, index, Phase.INFERENCE, args, kwargs)
        if index == 0 and self.config.vram_budget is not None and args:
            self._check_budget(args[0])
        if index == 0 and self.backward.auto and args:
            self._decide_backward_slots(args[0])
        self._check_trainable(index)
        kwargs = self._drop_cache(kwargs)
        calls = [0]

        def checkpointed(*a, **k):
            phase = Phase.TRAIN_FORWARD if calls[0] == 0 else Phase.BACKWARD
            calls[0] += 1
            return self._run(layer, index, phase, a, k)

        return checkpoint(checkpointed, *args, use_reentrant=False, **kwargs)

    # -- checks --------------------------------------------------------------------
    def _check_capture(self) -> None:
        if torch.compiler.is_compiling():
            raise StreamingError(
                "torch.compile cannot trace a streamed layer: its weights change place on "
                "every call. Compile the model before stream_model is not supported either; "
                "run streamed layers eagerly (compile submodules that do not stream)."
            )
        if self.pool.cuda and torch.cuda.is_current_stream_capturing():
            raise StreamingError(
                "CUDA graph capture of a streamed model is not supported: a graph would "
                "freeze one slot assignment and its copies. Capture only resident parts."
            )

    def _check_budget(self, hidden: torch.Tensor) -> None:
        """Before the first training step of each batch shape: will it fit vram_budget?"""
        if hidden.dim() < 2 or (hidden.shape[0], hidden.shape[1]) in self._budget_checked:
            return
        batch, seq = int(hidden.shape[0]), int(hidden.shape[1])
        self._budget_checked.add((batch, seq))
        budget = self.config.vram_budget
        try:
            memory = plan.plan_for_model(self.model, seq, batch, slots=self.config.slots, vram_bytes=budget,
                                         stream_embeddings=self.ends is not None)
        except ValueError as exc:
            logger.warning("layerstream: vram_budget is not checked for this model: its memory cannot "
                           "be predicted (%s)", exc)
            return
        if memory.fits:
            self._fit_window(memory)
            return
        gib = 2**30
        advice = "\n".join(f"  - {line}" for line in memory.advice[1:])
        raise StreamingError(
            f"a training step of batch {batch} x {seq} tokens does not fit vram_budget="
            f"{budget / gib:.2f} GiB: the memory planner predicts a peak of "
            f"{memory.peak_vram_bytes / gib:.2f} GiB plus {memory.reserve_bytes / gib:.1f} GiB reserve "
            f"(resident part {memory.resident_bytes / gib:.2f} GiB, {memory.slots} slots "
            f"{memory.slot_bytes / gib:.2f} GiB, activations {memory.activation_bytes / gib:.2f} GiB). "
            f"Nothing has been computed yet. What would fit:\n{advice}")

    def _decide_backward_slots(self, hidden: torch.Tensor) -> None:
        streamed = len(self.records) - len(self._window)
        if self.backward.decide(self.model, hidden, streamed, self.ends is not None,
                                self.store.largest_layer_bytes) is not None:
            self._forget_slots()
            self.planner = self._new_planner(len(self._layer_of))

    # -- resident window -------------------------------------------------------------
    def _fit_window(self, memory) -> None:
        """Keep on the device as many layers as the budget leaves room for after the
        planned peak (every layer streamed) and the reserve. Decided at the first training
        step; a later batch shape may shrink the window, never grow it (no thrash)."""
        count = plan.window_size(memory.headroom_bytes, self.store.largest_layer_bytes, len(self.records))
        if self._window_decided and count >= len(self._window):
            return
        self._window_decided = True
        if count == len(self._window):
            return
        self.set_window(schedule.spread_resident(len(self.records), count))
        logger.warning(
            "layerstream: vram_budget=%.2f GiB leaves room for %d of %d layers at batch %d x %d tokens: "
            "they stay on the GPU for good, %d stream.", self.config.vram_budget / 2**30, count,
            len(self.records), memory.batch, memory.seq, len(self.records) - count)

    def set_window(self, layers) -> None:
        """Keep these layers on the device for good (one copy each, now); the rest stream.

        The host store stays the source of truth. What the slots held is forgotten, so call
        this between steps, not inside one.
        """
        keep = sorted(set(layers))
        if keep and not 0 <= keep[0] <= keep[-1] < len(self.records):
            raise ValueError(f"layer indices must be in 0..{len(self.records) - 1}, got {keep}")
        self._window = {}
        self._window_buffers = []
        for index in keep:
            record = self.records[index]
            buffer = torch.empty(max(record.nbytes, 1), dtype=torch.uint8, device=self.device)
            buffer[: record.nbytes].copy_(record.host_region)
            self._window_buffers.append(buffer)
            self._window[index] = self._make_binding(buffer, index, _always_owned)
        streamed = [i for i in range(len(self.records)) if i not in self._window]
        self._dense = [None] * len(self.records)
        for dense, index in enumerate(streamed):
            self._dense[index] = dense
        self._layer_of = streamed
        self._forget_slots()
        self.planner = self._new_planner(len(streamed))

    @property
    def window(self) -> List[int]:
        """The layers kept on the device for good (the resident window)."""
        return sorted(self._window)

    def _check_trainable(self, index: int) -> None:
        record = self.records[index]
        for entry, host, ptr in zip(record.entries, record.host_values, record.host_data_ptrs):
            if host.requires_grad:
                raise StreamingError(
                    f"{entry.qualified_name} requires grad, but streamed weights are frozen "
                    "(gradients for them would have nowhere to live). Freeze the base model, "
                    "e.g. with peft.get_peft_model(model, LoraConfig(...)), before training; "
                    "trainable tensors created before stream_model stay resident."
                )
            if host.data_ptr() != ptr:
                raise StreamingError(
                    f"{entry.qualified_name} no longer points at layerstream's host store "
                    "(its .data was replaced after stream_model, e.g. by a cast or a merge). "
                    "Do such changes before stream_model, or unstream_model first."
                )

    def _drop_cache(self, kwargs):
        """Checkpointed layers must not write a KV cache: the recompute would write twice."""
        names = [name for name in _CACHE_KWARGS if kwargs.get(name) is not None]
        if not names:
            return kwargs
        kwargs = dict(kwargs)
        for name in names:
            seq_length = getattr(kwargs[name], "get_seq_length", None)
            if seq_length is not None and seq_length() > 0:
                raise StreamingError(
                    "a KV cache holding past tokens reached a streamed layer with autograd on. "
                    "Streamed layers are checkpointed under autograd and cannot read or extend "
                    "a cache there; run generation and cached inference under torch.no_grad() "
                    "(model.generate does)."
                )
            kwargs[name] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        if not self._warned_cache:
            self._warned_cache = True
            logger.warning(
                "layerstream: streamed layers are checkpointed while autograd is on, so they do "
                "not fill the KV cache passed to them (as with transformers' gradient "
                "checkpointing). Set model.config.use_cache = False for training to silence this."
            )
        return kwargs

    def check_apply(self, fn, dtypes=None) -> None:
        """Refuse a .to()/.half()/.cuda() that would change streamed weights' dtype or device.
        ``dtypes``: the streamed dtypes to check (default: the decoder layers')."""
        for dtype in self._streamed_dtypes if dtypes is None else dtypes:
            probe = fn(torch.empty(0, dtype=dtype))
            if probe.dtype != dtype:
                raise StreamingError(
                    f"this call would cast streamed weights from {dtype} to {probe.dtype}. "
                    "Streamed weights keep the dtype they were streamed with: cast the model "
                    "before stream_model, or unstream_model, cast, and stream again."
                )
            if probe.device.type == "cuda" and probe.device != self.device:
                raise StreamingError(
                    f"the model streams to {self.device}; moving it to {probe.device} is not "
                    "supported. Stream with StreamConfig(device=...) set to the device you want."
                )
            if probe.device.type not in ("cpu", "cuda"):
                raise StreamingError(
                    f"a streamed model cannot move to {probe.device}; unstream_model first."
                )

    @contextlib.contextmanager
    def streamed_tensors_hidden(self, index: int):
        """Hide a layer's streamed tensors from ``nn.Module._apply`` while it runs.

        The ``_parameters``/``_buffers`` dicts are edited in place and restored in their
        original order: bindings hold these dict objects, and state_dict order must not
        change.
        """
        names_by_table: Dict[int, Tuple[dict, set]] = {}
        for entry in self.records[index].entries:
            if not entry.bound:
                continue
            table = entry.table
            names_by_table.setdefault(id(table), (table, set()))[1].add(entry.name)
        saved = []
        for table, names in names_by_table.values():
            original = list(table.items())
            saved.append((table, names, original))
            for name in names:
                del table[name]
        try:
            yield
        finally:
            for table, names, original in saved:
                changed = dict(table)
                table.clear()
                table.update((k, v if k in names else changed[k]) for k, v in original)

    def explain_oom(self, exc: BaseException, where: str) -> BaseException:
        """The same out-of-memory error, with what streaming holds and which budget to change.

        Same type, so code that reacts to out-of-memory (the Trainer's
        auto_find_batch_size) still does; explained once, however often it is re-raised.
        """
        if getattr(exc, "_layerstream_explained", False):
            return exc
        gib = 2**30
        slot_gib = self.pool.total_bytes / gib
        one_slot = self.pool.slot_bytes / gib
        lines = [
            str(exc), "",
            f"layerstream: the GPU ran out of memory {where}. Streaming holds {self.config.slots} slots x "
            f"{one_slot:.2f} GiB = {slot_gib:.2f} GiB on {self.device}; the rest is the resident part "
            "(embeddings, head, adapters, optimizer state) and activations. To fit:",
            "  - shorten sequences or the batch (activations and logits grow with batch x seq length);",
        ]
        if self.config.slots > 2:
            lines.append(f"  - use fewer slots: StreamConfig(slots=2) (--slots 2, stream.slots: 2) frees "
                         f"{(self.config.slots - 2) * one_slot:.2f} GiB;")
        if not any(e.kind == "quant" for r in self.records for e in r.entries):
            lines.append("  - load the model in NF4 (quantization='nf4'): a quarter of the bytes per slot;")
        if self.ends is None:
            from .ends import host_bytes

            ends_bytes = host_bytes(self.model)
            if ends_bytes:
                lines.append(f"  - keep the input embedding and head in host memory: StreamConfig(stream_embeddings=True) "
                             f"(--stream-embeddings, stream.stream_embeddings: true) frees {ends_bytes / gib:.2f} GiB, less one head "
                             "copied in for the loss;")
        lines.append("  - `layerstream plan --model <model> --vram <GPU memory> --seq <tokens>` predicts what fits.")
        explained = type(exc)("\n".join(lines))
        explained._layerstream_explained = True
        return explained

    # -- timeline ------------------------------------------------------------------
    @property
    def timeline_active(self) -> bool:
        return self._recording is not None

    def start_timeline(self) -> None:
        """Record copies, residency and layer calls from now until ``finish_timeline``."""
        if self._recording is not None:
            raise StreamingError("a timeline is already being recorded; call finish_timeline() first")
        self._recording = self.pool.recording = timeline.Recording(self.pool, self.pool.owner)

    def finish_timeline(self) -> List["timeline.Span"]:
        """Stop recording; returns the spans (waits once for the device)."""
        recording = self._recording
        if recording is None:
            raise StreamingError("no timeline is being recorded; call start_timeline() first")
        try:
            return recording.finish()
        finally:
            self._recording = self.pool.recording = None

    @contextlib.contextmanager
    def timeline(self, directory: Optional[str] = None):
        """Record the steps run inside the block; write the trace and plot to ``directory``.

        Yields a list that holds the spans once the block ends.
        """
        spans: list = []
        self.start_timeline()
        try:
            yield spans
        finally:
            spans.extend(self.finish_timeline())
        if directory is not None:
            timeline.write(spans, self.slot_rows, directory, self._timeline_title())

    @property
    def slot_rows(self) -> int:
        """Slots a timeline draws: the ring and the backward slots."""
        return self.config.slots + self.planner.backward_slots

    def _timeline_title(self) -> str:
        return (f"layerstream: {len(self.records)} layers, {self.config.slots} slots, prefetch "
                f"{self.config.prefetch}, on {self.device}; layer number on each bar")

    # -- stats ---------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters since streaming began. Reads outstanding CUDA timing events (waits)."""
        self.pool.settle()
        pool = self.pool
        return {
            "layers": len(self.records),
            "slots": self.config.slots,
            "prefetch": self.config.prefetch,
            "visits": self.visits,
            "layer_loads": pool.loads,
            "demand_loads": self.demand_loads,
            "h2d_bytes": pool.h2d_bytes,  # the layers, and the head and embedding rows when they stream
            "h2d_seconds": pool.h2d_seconds,
            "h2d_gbps": (pool.h2d_bytes / pool.h2d_seconds / 1e9) if pool.h2d_seconds else 0.0,
            "stall_seconds": pool.stall_seconds,
            "stalls": pool.stalls,
            "peak_resident_layers": self.peak_resident_layers,
            "slot_bytes": pool.ring_bytes,
            "backward_slots": self.planner.active_backward_slots,
            "backward_slot_peak_bytes": pool.borrowed_peak_bytes,
            "host_bytes": self.store.host_bytes + (self.ends.host_bytes if self.ends is not None else 0),
            "pinned": self.store.pinned,
            "device": str(self.device),
            "checksum_checks": self._checker.checks if self._checker is not None else 0,
            "window_layers": len(self._window),
            "stream_embeddings": self.ends is not None,
            **(self.ends.stats() if self.ends is not None
               else {"head_copies": 0, "head_h2d_bytes": 0, "embedding_h2d_bytes": 0}),
            **self.nf4_counts,
        }

    def summary(self) -> str:
        """A one-screen description: what streams, slots, bytes, pinning."""
        gib = 2**30
        streamed = sum(len(r.entries) for r in self.records)
        sizes = sorted({r.nbytes for r in self.records})
        size_text = (f"{sizes[0] / 2**20:.1f} MiB" if len(sizes) == 1
                     else f"{sizes[0] / 2**20:.1f}..{sizes[-1] / 2**20:.1f} MiB")
        lines = [
            "layerstream: streaming decoder layers",
            f"  stack        {self.layers_path} ({len(self.records)} layers, {streamed} tensors)",
            f"  layer size   {size_text} each",
            f"  host store   {self.store.host_bytes / gib:.3f} GiB in {len(self.store.arenas)} arena(s), "
            f"{'pinned' if self.store.pinned else 'pageable'}",
            f"  device       {self.device}: {self.config.slots} slots{self._auto_note('slots')} x "
            f"{self.pool.slot_bytes / 2**20:.1f} MiB = {self.pool.total_bytes / gib:.3f} GiB",
            f"  prefetch     {self.config.prefetch} layer(s) ahead{self._auto_note('prefetch')}",
            f"  backward     {self.backward.note(self.planner.backward_slots, self.pool.cuda)}",
        ]
        if self.ends is not None:
            lines += [f"  ends         streamed: {self.ends.describe()}",
                      "  resident     final norm, and every trainable tensor"]
        else:
            lines += ["  ends         resident (stream_embeddings=False)",
                      "  resident     embeddings, final norm, head, and every trainable tensor"]
        return "\n".join(lines)

    def _auto_note(self, name: str) -> str:
        return " (auto)" if name in self.config.automatic else ""

    def close(self) -> None:
        """Release slots and host arenas (after the model's tensors were copied out)."""
        self._bindings.clear()
        self._window = {}
        self._window_buffers = []
        self.pool.release()
        self.store.release()
        if self.ends is not None:
            self.ends.close()

    def reset_slots(self) -> None:
        """Forget what the slots hold (backward slots give their memory back); the next
        visits load on demand."""
        self._forget_slots()
        self.planner.forget()

    def _forget_slots(self) -> None:
        for key in [key for key in self._bindings if key[0] >= self.pool.ring_slots]:
            del self._bindings[key]  # views of backward slots' memory, which is given back
        self.pool.forget()
