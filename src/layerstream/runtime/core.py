"""StreamRuntime: ties the store, the slot pool and the prefetch schedule to a model's layers.

One runtime per streamed model, reachable with ``layerstream.get_runtime(model)``.
The per-visit path (``call_layer`` -> ``run_layer`` -> ``_enter``) is the hot path: it checks
the layer's tensors are the ones its device copies were made from (``LayerRecord.fresh``),
asks the schedule for the slot and the copies to issue, makes the compute stream wait,
swaps dictionary entries, and calls the layer. It allocates nothing per visit beyond the
schedule's small lists, and never waits on the host.

Three components own the rest of the runtime's state, each in a module of its own: the
resident window (layers held on the GPU for good, sized from measured memory at
training-step boundaries: ``window``), the activation offloader and when a pass uses it
(``offload_policy``), and the long-sequence settings each step runs with (``long_settings``).
The runtime hands them what they need and plans its slots when the window changes.
Counters, the start-up summary and out-of-memory advice are in ``report``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..config import StreamConfig
from ..decisions.schedule import Phase, PrefetchSchedule
from ..errors import ForkedChildError, StreamingError
from ..modules import bindings, changes, nf4, packed_experts, swap
from ..modules import layer as layer_mod
from ..system.log import get_logger
from ..tiers import checksum
from ..tiers.pool import SlotPool
from ..tiers.store import LAYOUT, SAME, HostStore, LayerRecord
from . import meter, passes, report, timeline
from .backward_slots import BackwardSlots
from .budget_check import BudgetCheck
from .disk_changes import DiskChanges
from .ends_on_demand import EndsOnDemand
from .experts import ExpertsByNeed
from .long_settings import LongSettingsPolicy
from .offload_policy import OffloadPolicy
from .window import ResidentWindow

logger = get_logger(__name__)


class StreamRuntime(timeline.TimelineRecorder):
    def __init__(
        self,
        model: nn.Module,
        layers: nn.ModuleList,
        layers_path: str,
        config: StreamConfig,
        records: List[LayerRecord],
        store: HostStore,
    ):
        self.model = model
        self.layers = layers
        self.layers_path = layers_path
        self.config = config
        self.device = config.device
        self.records = records
        self.store = store
        self.disk = store.disk  # the layers read from disk each time (disk.DiskTier), or None
        self.disk_changes = DiskChanges(self.device, store)  # their changed norms and biases, kept on the device
        self.backward = BackwardSlots(config)
        self.pool = SlotPool(
            config.device, config.slots, store.largest_layer_bytes, backward_slots=self.backward.capacity
        )
        self.prefetch = self._new_prefetch(len(records))
        self.resident_window = ResidentWindow(
            model, records, store, self.device, meter.for_runtime(self), self._restream, self.reset_slots
        )
        self.last_shape: Tuple[int, int] = (1, 1)
        self._last_slot: Optional[int] = None  # the slot of the previous streamed visit
        # (slot, layer) -> [(table, name, slot tensor)], built on first use, then reused
        self._bindings: Dict[Tuple[int, int], list] = {}
        self._streamed_dtypes = {e.dtype for r in records for e in r.entries}
        self._pass = None  # passes.Pass: the pass under way, and whose
        self.unstreaming = None  # unstream_model's copies while it changes the model (api)
        self.visits = 0
        self.demand_loads = 0
        self.peak_resident_layers = 0
        self.refreshed_layers = 0  # device copies dropped because the model's tensors changed
        self._warned_cache = False
        self._warned_placed = False
        self._placed_at = 0  # layer.registrations() when tensors were last placed
        self.nf4_counts = dict.fromkeys(nf4.COUNTERS, 0)  # the streamed NF4 routes' calls
        self._recording = None  # timeline.Recording while a step is recorded
        self._inference_mode = False  # the layer being called was called under torch.inference_mode
        self.budget_check = BudgetCheck()  # an explicit vram_budget, checked per step shape
        self._checker = checksum.SlotChecker(self.pool, records) if config.checksum else None
        self._by_module: Dict[int, Tuple[LayerRecord, List[int]]] = {}
        for record in records:
            changes.watch(record)
            self._index_modules(record)
        self.offload_policy = OffloadPolicy(
            config, self.device, len(records), store, lambda: getattr(self.embeddings, "store", None)
        )
        self.experts = ExpertsByNeed(records, self.pool, enabled=not config.checksum)  # whole slots under checksums
        self._packed_projections = packed_experts.projection_names(model)  # MXFP4 stacks' Parameter names
        self.pass_offloader = None  # the offloader of the training pass under way, or None
        self.pass_tiles = None  # the MLP tiles by length the training pass under way began with
        self.embeddings = None  # embeddings.StreamedEnds once the embedding and head stream
        if config.stream_embeddings is True:
            from .embeddings import stream_embeddings

            self.embeddings = stream_embeddings(model, self)
        self.long_settings = LongSettingsPolicy(model, config, self.offload_policy, EndsOnDemand(self))
        if self._checker is not None:
            logger.warning("layerstream: debug checksums on (checksum=True, LAYERSTREAM_CHECKSUM=1): every copy waits")

    def _new_prefetch(self, streamed_layers: int) -> PrefetchSchedule:
        return PrefetchSchedule(
            max(streamed_layers, 1), self.config.slots, self.config.prefetch, backward_slots=self.backward.count
        )

    def _restream(self, streamed_layers: int) -> None:
        """The layers that stream changed (the window, or the backward slots): what the
        slots hold is forgotten and the schedule plans for ``streamed_layers`` layers."""
        self._forget_slots()
        self.prefetch = self._new_prefetch(streamed_layers)

    def _replace_config(self, **changes) -> None:
        """A new config for the runtime and the components that read it."""
        self.config = self.config.replace(**changes)
        self.offload_policy.config = self.long_settings.config = self.config

    # -- binding -------------------------------------------------------------------
    def _binding(self, slot: int, index: int) -> list:
        key = (slot, index)
        binding = self._bindings.get(key)
        if binding is None:
            buffer = self.pool.buffers[slot]
            binding = self._bindings[key] = bindings.make(self.records[index], buffer, self._owner_check(index))
        return binding

    def _owner_check(self, index: int):
        return bindings.owner_check(self.pool, index, self.records[index].name)

    # -- the hot path --------------------------------------------------------------
    def _enter(self, index: int, phase: Phase) -> int:
        pool = self.pool
        compute = pool.compute_stream()
        if self._last_slot is not None:
            # every kernel of the previous visit (its backward ones too) is queued by now
            pool.mark_released(self._last_slot, compute)
        window = self.resident_window
        visit = self.prefetch.visit(window.position_of[index], phase)
        for slot in visit.drop:
            self._free_backward_slot(slot)
        loads = [(window.streamed[dense], slot) for dense, slot in visit.loads]
        if self.backward.count:
            loads = [
                (layer, slot)
                for layer, slot in loads
                if slot < pool.ring_slots or pool.allocated(slot) or self.backward.borrow(pool, self.prefetch, slot)
            ]
        try:
            for layer, slot in loads:
                self._load(layer, slot, compute)
        except BaseException:  # a read failed: the planner placed layers no copy brought
            self.reset_slots()
            raise
        if self.disk is not None:
            self._read_ahead(index, phase)
        checker = self._checker
        if checker is not None:
            for layer, slot in loads:
                checker.after_copy(layer, slot)
        pool.acquire(visit.slot, index, compute)
        if checker is not None:
            checker.before_use(index, visit.slot)
        self._last_slot = visit.slot
        if visit.demand:
            self.demand_loads += 1
        resident = len(self.prefetch.slot_of)
        if resident > self.peak_resident_layers:
            self.peak_resident_layers = resident
        return visit.slot

    def _load(self, layer: int, slot: int, compute) -> None:
        record = self.records[layer]
        if record.host_region is not None:
            ranges = self.experts.load_ranges(layer)
            if ranges is None:
                self.pool.load(record, slot, compute)
                self.experts.loaded_whole(layer)
            else:
                self.pool.load(record, slot, compute, ranges=ranges)
            return
        if os.getpid() != self.disk.owner_pid:
            raise ForkedChildError(self.disk.owner_pid)
        self.pool.load(record, slot, compute, source=self.disk.take(layer))  # a disk layer
        self.disk.copied(layer, self.pool.copy_stream if self.pool.cuda else None)

    def _read_ahead(self, index: int, phase: Phase) -> None:
        """Start disk reads for the layers the schedule will load next (not those in slots)."""
        prefetch, window = self.prefetch, self.resident_window
        upcoming = prefetch.upcoming(window.position_of[index], phase, self.disk.horizon)
        self.disk.read_ahead([window.streamed[dense] for dense in upcoming if dense not in prefetch.slot_of])

    def _free_backward_slot(self, slot: int) -> None:
        for key in [key for key in self._bindings if key[0] == slot]:
            del self._bindings[key]  # bindings hold views of the slot's memory
        self.pool.free(slot)

    def run_layer(self, layer: nn.Module, index: int, phase: Phase, args, kwargs):
        record = self.records[index]
        if not record.fresh():
            self._refresh(index, phase)
        self.visits += 1
        binding = self.resident_window.bindings.get(index)
        if binding is None:
            slot = self._enter(index, phase)
            binding = self._binding(slot, index)
        else:  # kept on the device for good (resident window): no copy, no slot
            slot = -1
        for table, name, tensor in binding:
            table[name] = tensor
        recording = self._recording
        if recording is not None:
            begin = recording.now()
        try:
            if self._inference_mode:  # the caller's inference mode again, for the computation
                with torch.inference_mode():
                    return layer_mod.call_unstreamed(layer, args, kwargs)
            return layer_mod.call_unstreamed(layer, args, kwargs)
        except torch.OutOfMemoryError as exc:
            raise report.explain_oom(self, exc, f"in streamed layer {record.name}") from exc
        finally:
            for table, name, host in record.host_binding:
                table[name] = host
            if recording is not None:
                recording.computes.append((index, slot, phase, begin, recording.now()))

    def call_layer(self, layer: nn.Module, args, kwargs):
        if not torch.is_inference_mode_enabled():  # the common case: nothing to enter on the hot path
            return self._call_layer(layer, args, kwargs)
        with passes.outside_inference_mode():
            self._inference_mode = True
            try:
                return self._call_layer(layer, args, kwargs)
            finally:
                self._inference_mode = False

    def _call_layer(self, layer: nn.Module, args, kwargs):
        self.refuse_half_unstreamed("run a forward")
        index = layer._layerstream_index
        if args and isinstance(args[0], torch.Tensor) and args[0].device != self.device:
            raise StreamingError(
                f"streamed layer {self.records[index].name} computes on {self.device} but its "
                f"input is on {args[0].device}. Move the model's resident part with "
                f"model.to('{self.device}') after stream_model (and after get_peft_model)."
            )
        training = torch.is_grad_enabled()
        self._claim(index, "train" if training else "inference")
        try:
            if index == 0:
                self._start_pass(args[0] if args else None, training)
            if not training:
                layer_mod.refuse_unfilled_cache(kwargs)
                return self.run_layer(layer, index, Phase.INFERENCE, args, kwargs)
            kwargs = self._drop_cache(kwargs)
            offloader = self.pass_offloader  # this layer's backward uses it, whatever was switched since
            tiles = self.pass_tiles  # and tiles as its forward did
            calls = [0]

            def checkpointed(*a, **k):
                phase = Phase.TRAIN_FORWARD if calls[0] == 0 else Phase.BACKWARD
                calls[0] += 1
                replay = contextlib.nullcontext()
                if phase is Phase.BACKWARD:
                    self._in_backward()
                    if offloader is not None and index == len(self.records) - 1:
                        offloader.prefetch_newest()  # the kept last layer: backward starts
                    replay = self.long_settings.replaying(tiles)
                with replay:
                    return layer_mod.refuse_second_order(self.run_layer(layer, index, phase, a, k), layer)

            if offloader is not None and offloader.offloads(index) and args and isinstance(args[0], torch.Tensor):
                with offloader.saving(args[0]):  # the input checkpointing saves goes to the host
                    return passes.checkpoint(checkpointed, *args, **kwargs)
            return passes.checkpoint(checkpointed, *args, **kwargs)
        except BaseException:
            self._pass = None  # an abandoned pass holds nothing another thread must wait for
            raise
        finally:
            if not training and index == len(self.records) - 1:
                self._pass = None

    def _claim(self, index: int, kind: str) -> None:
        self._pass = passes.claim(self._pass, index, kind)

    def _in_backward(self) -> None:
        passes.in_backward(self)
        self.resident_window.step_reached_backward()

    # -- at the start of each pass -----------------------------------------------------
    def _start_pass(self, hidden: Optional[torch.Tensor], training: bool) -> None:
        passes.refuse_capture(self.pool.cuda)
        for record in self.records:  # changes made between passes, quant states included
            if not record.fresh_deep():
                self._refresh(record.index, Phase.TRAIN_FORWARD, pass_start=True)
        self.disk_changes.report()
        if self._placed_at != layer_mod.registrations():  # adapters may have come since
            self._place_resident_tensors()
        self.pass_offloader = None
        self.pass_tiles = None
        self.experts.start_pass(hidden)
        if self._packed_projections:  # adapters meant for them, refused before they compute
            packed_experts.refuse_adapters_on_packed(self.model, self._packed_projections)
        if not training:
            return
        self._check_trainable()
        if hidden is None or hidden.dim() < 2:
            return
        self.last_shape = (int(hidden.shape[0]), int(hidden.shape[1]))
        tokens = self.last_shape[0] * self.last_shape[1]
        self.long_settings.pass_starts()
        decision = self.long_settings.decision(tokens)  # the MLP tiles, before any MLP runs
        self.pass_offloader = self.offload_policy.for_pass(hidden, self.last_shape, decision)
        self.pass_tiles = self.long_settings.tiles_of_pass()
        if isinstance(self.config.vram_budget, int):
            self.budget_check.check(self, *self.last_shape)
        self.long_settings.say(self.last_shape, self.pass_offloader is not None)  # for a step that runs
        self.long_settings.start_step(decision)  # the ends move for it
        self.resident_window.size_for_step(tokens, hidden.numel() * hidden.element_size(), self.long_settings.ends)
        if self.backward.auto:
            self._decide_backward_slots(hidden)

    def _place_resident_tensors(self) -> None:
        self._placed_at = layer_mod.registrations()
        moved = layer_mod.place_resident_tensors(self.records, self.device)
        if moved and not self._warned_placed:
            self._warned_placed = True
            logger.warning(
                "layerstream: moved %d tensors of streamed layers (adapters added after streaming) "
                "from the host to %s, where the layers run",
                moved,
                self.device,
            )

    def _check_trainable(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # flags only: no Python dispatch (disk_files) per tensor
            for record in self.records:
                for entry, host in zip(record.entries, record.host_values):
                    if host.requires_grad:
                        raise StreamingError(report.trainable_streamed_tensor(entry.qualified_name))

    def _decide_backward_slots(self, hidden: torch.Tensor) -> None:
        streamed = len(self.resident_window.streamed)
        if self.backward.decide(self, hidden, streamed) is not None:
            self._restream(streamed)

    # -- the model's tensors changed -------------------------------------------------------
    def _refresh(self, index: int, phase: Phase, pass_start: bool = False) -> None:
        """The layer's tensors changed since its device copies were made: take the change
        into the host store and drop (or refresh) the copies; refused where it would mix
        weights within one computation."""
        record = self.records[index]
        if phase is Phase.BACKWARD:
            raise StreamingError(
                f"a weight of {record.name} changed between its forward and its backward; its "
                "backward would differ from the forward it differentiates (autograd refuses the "
                "same for a resident weight it saved). Change weights between steps."
            )
        if not (pass_start and self.unstreaming is None and self.disk_changes.keep(record)):
            self.refuse_host_write(index, report.what_changed(record))
            outcome = self.store.sync(record)
            if outcome == SAME:
                return
            if outcome == LAYOUT:
                if not pass_start:
                    raise StreamingError(
                        f"a weight of {record.name} changed shape or dtype during a forward pass; do it "
                        "between passes, or unstream_model first."
                    )
                self.store.repack(record)
                self._streamed_dtypes = {e.dtype for r in self.records for e in r.entries}
                if record.nbytes > self.pool.slot_bytes:
                    self._rebuild_pool()
        changes.watch(record)
        self._index_modules(record)
        self.experts.restack(record)
        self.refreshed_layers += 1
        for key in [key for key in self._bindings if key[1] == index]:
            del self._bindings[key]
        if self._checker is not None:
            self._checker.forget(index)
        self._drop_device_copy(index)

    def _index_modules(self, record: LayerRecord) -> None:
        """Which entries each module of the layer owns (PEFT merges ask), and a way back from
        the module to this runtime."""
        for key in [k for k, (r, _) in self._by_module.items() if r is record]:
            del self._by_module[key]
        for position, entry in enumerate(record.entries):
            self._by_module.setdefault(id(entry.module), (record, []))[1].append(position)
            object.__setattr__(entry.module, "_layerstream_runtime", self)

    def entries_of(self, module: nn.Module) -> Optional[Tuple[LayerRecord, List[int]]]:
        """The record of the layer ``module`` belongs to and the positions of its entries."""
        return self._by_module.get(id(module))

    def refuse_host_write(self, index: int, change: str) -> None:
        """A write into a disk layer would not reach the GPU, one into a node-shared store
        would write other ranks' read-only pages: refused before anything is written."""
        self.refuse_half_unstreamed("take a write into its weights")
        name = self.records[index].name
        if self.store.segment is not None:
            raise StreamingError(report.shared_store_write(name, change))
        if self.disk is not None and self.disk.holds(index):
            raise StreamingError(report.disk_layer_write(name, change, self.device))

    def refuse_half_unstreamed(self, what: str) -> None:
        """An unstream_model interrupted after its copies were made left some modules plain
        and others streamed: what would compute or write through the streamed ones is refused."""
        if self.unstreaming is not None:
            raise StreamingError(
                "layerstream.unstream_model(model) was interrupted while it changed this model: some "
                f"modules are plain again and others still streamed, so it cannot {what}. Call "
                "layerstream.unstream_model(model) again: it finishes from the copies it already made."
            )

    def refresh_after_write(self, index: int, device_copy_current: bool = False) -> None:
        """layerstream itself wrote new values into a layer's host region (a PEFT merge):
        the device copies follow (``device_copy_current``: the copy in use was written too)."""
        self.refuse_host_write(index, "a write into it")
        record = self.records[index]
        record.snapshot()
        self.refreshed_layers += 1
        if self._checker is not None:
            self._checker.forget(index)
        if not device_copy_current:
            self._drop_device_copy(index)

    def _drop_device_copy(self, index: int) -> None:
        window = self.resident_window
        if window.holds(index):
            window.copy_to_device(index)
        elif window.position_of[index] is not None:
            slot = self.prefetch.slot_of.get(window.position_of[index])
            if slot is not None:
                self.prefetch.drop(window.position_of[index])
                self.pool.owner[slot] = None

    def _rebuild_pool(self) -> None:
        """New slots (for a layer that grew, its tensors changed dtype; on another device):
        between passes."""
        self.pool.release()
        self._bindings.clear()
        self._last_slot = None
        self.pool = SlotPool(
            self.device, self.config.slots, self.store.largest_layer_bytes, backward_slots=self.backward.capacity
        )
        if self._checker is not None:
            self._checker = checksum.SlotChecker(self.pool, self.records)
        self.experts.pool = self.pool
        self.prefetch = self._new_prefetch(len(self.resident_window.streamed))
        self.resident_window.restart_sizing()
        if self.embeddings is not None:
            self.embeddings.pool = self.pool

    # -- checks --------------------------------------------------------------------
    def _drop_cache(self, kwargs):
        kwargs, warned = layer_mod.without_cache(kwargs, self._warned_cache)
        self._warned_cache = warned
        return kwargs

    def check_apply(self, fn, dtypes=None) -> None:
        """Refuse a .to()/.half()/.cuda() that would change streamed weights' dtype or device.
        ``dtypes``: the streamed dtypes to check (default: the decoder layers' and the
        streamed embedding's)."""
        self.refuse_half_unstreamed("be cast or moved")
        if dtypes is None:
            dtypes = self._streamed_dtypes | (self.embeddings.dtypes if self.embeddings is not None else set())
        layer_mod.refuse_cast_or_move(fn, dtypes, self.device)

    def hidden_from_apply(self, index: int):
        """Hide a layer's streamed tensors from ``nn.Module._apply`` while it runs."""
        tables: Dict[int, Tuple[dict, set]] = {}
        for entry in self.records[index].entries:
            if entry.bound:
                tables.setdefault(id(entry.table), (entry.table, set()))[1].add(entry.name)
        return swap.tensors_hidden(tables.values())

    # -- timeline (the recording itself: timeline.TimelineRecorder) -----------------
    @property
    def slot_rows(self) -> int:
        """Slots a timeline draws: the ring and the backward slots."""
        return self.config.slots + self.prefetch.backward_slots

    # -- the components' surface -------------------------------------------------------
    @property
    def window(self) -> List[int]:
        """The layers kept on the device for good (the resident window)."""
        return self.resident_window.layers

    def set_window(self, layers) -> None:
        """Keep these layers on the device for good, the rest stream (``ResidentWindow``);
        between steps, not inside one."""
        self.resident_window.set_window(layers)

    def set_offload_activations(self, value) -> None:
        """Change offload_activations from the next pass on (a benchmark compares both on one
        model). A pass under way finishes as it started: its backward brings its inputs back
        through the offloader it began with, whose host arena is released once idle."""
        self._replace_config(offload_activations=value)
        self.offload_policy.setting_changed()
        self.long_settings.forget_decisions()

    def memory_plan(self, batch: int, seq: int, vram_bytes: int = 1 << 50, backward_slots=0, offload=None):
        """The planner's plan of this model as it streams, with the long-sequence settings a
        batch x seq step takes; ``offload``: offload_activations (None: as this pass runs)."""
        offload = self.pass_offloader is not None if offload is None else offload
        return self.long_settings.memory_plan(batch, seq, vram_bytes, backward_slots, offload)

    # -- counters and text -----------------------------------------------------------
    def stats(self) -> dict:
        return report.stats(self)  # counters since streaming began; waits for timing events

    def summary(self) -> str:
        """A one-screen description: what streams, slots, bytes, pinning."""
        return report.summary(self)

    def explain_oom(self, exc: BaseException, where: str) -> BaseException:
        return report.explain_oom(self, exc, where)

    # -- lifetime --------------------------------------------------------------------
    def move_to(self, device) -> None:
        """Stream to another device from now on (the Trainer trains elsewhere than the
        model was loaded for): new slots there, the window dropped, the host store kept."""
        from ..config import resolve_device

        device = resolve_device(device)
        if device == self.device:
            return
        self.set_window([])
        self._replace_config(device=device, pin=self.config.pin and device.type == "cuda")
        self.device = device
        self.backward = BackwardSlots(self.config)
        self._rebuild_pool()
        self.resident_window.move_to(device, meter.for_runtime(self))
        self.offload_policy.move_to(device)
        self._placed_at = 0  # adapters follow at the next pass
        if self.embeddings is not None:
            self.embeddings.device = device

    def close(self) -> None:
        """Release slots and host arenas (after the model's tensors were copied out)."""
        self._bindings.clear()
        self.resident_window.release()
        self.pool.release()
        self.store.release()
        if self.disk is not None:
            self.disk.close()
        self.offload_policy.close()
        self.experts.close()
        if self.embeddings is not None:
            self.embeddings.close()

    def reset_slots(self) -> None:
        """Forget what the slots hold (backward slots give their memory back); the next
        visits load on demand."""
        self._forget_slots()
        self.prefetch.forget()

    def _forget_slots(self) -> None:
        for key in [key for key in self._bindings if key[0] >= self.pool.ring_slots]:
            del self._bindings[key]  # views of backward slots' memory, which is given back
        self.pool.forget()
        self._last_slot = None
