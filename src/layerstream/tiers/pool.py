"""Device slots: buffers, the copy stream, ready events, owners, and copy/stall timing.

Invariants kept here:
- A slot is read only after the compute stream waited on that slot's ready event, and
  only if the slot's owner is the layer asking (``acquire`` checks both).
- A slot is overwritten only after the compute stream has passed every kernel that read
  its previous owner: each slot has a *released* event, recorded on the compute stream
  at the visit after the one that used the slot (by then every kernel of that visit,
  its backward kernels included, is queued), and a copy into the slot waits on it. The
  copy stream does not wait for compute it does not conflict with, so with one layer of
  prefetch copies still run back to back.
- No host synchronisation on the hot path: timing events are read lazily, only once
  they have completed (``event.query()``), or when stats are asked for.
- Copy time is measured on one copy in ``TIMED_COPY_EVERY`` (and on every copy while a
  timeline records) and scaled to all bytes copied: each timed copy costs two event
  records and, later, a query and an elapsed-time read, CUDA calls that cost several
  microseconds of host time each on the hot path, while one copy in sixteen measures the
  bandwidth as well as all of them.

With device "cpu" there are no streams: copies are synchronous host-to-host copies and
the same owner bookkeeping runs, which is how CI exercises the machinery.

On CUDA the copy path calls the CUDA runtime directly (``cudart``) with the raw handles
of torch's streams and events, because the equivalent torch calls cost several times
more host time per visit; without a loadable runtime it uses the torch calls.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, List, Optional, Tuple

import torch

from ..errors import SlotOwnerError
from ..system import cudart
from .store import LayerRecord

TIMED_COPY_EVERY = 16


def _materialised(event: "torch.cuda.Event", device: torch.device) -> "torch.cuda.Event":
    """torch creates an event's CUDA handle at its first record; the raw path needs it now."""
    event.record(torch.cuda.current_stream(device))
    return event


class _EventPool:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free: List[torch.cuda.Event] = []

    def get(self, materialise: bool = True) -> "torch.cuda.Event":
        """A pooled event, or a new one; ``materialise=False`` for a caller that records it at
        once itself (a new event's handle comes with its first record, which would be doubled)."""
        if self.free:
            return self.free.pop()
        event = torch.cuda.Event(enable_timing=True)
        return _materialised(event, self.device) if materialise else event

    def put(self, *events) -> None:
        self.free.extend(events)


class SlotPool:
    """``slots`` ring buffers allocated now, and ``backward_slots`` buffers allocated when
    a copy first goes into them and freed when the planner drops them (see schedule)."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int, backward_slots: int = 0):
        self.device = device
        self.cuda = device.type == "cuda"
        self.slot_bytes = slot_bytes
        self.ring_slots = slots
        slots += backward_slots
        self.buffers: List[Optional[torch.Tensor]] = [
            torch.empty(max(slot_bytes, 1), dtype=torch.uint8, device=device) if slot < self.ring_slots else None
            for slot in range(slots)
        ]
        self.owner: List[Optional[int]] = [None] * slots
        # per slot: the expert rows a layer copied by need holds, per experts module (None:
        # its whole region)
        self.rows_present: List[Optional[dict]] = [None] * slots
        self.borrowed_peak_bytes = 0  # the most backward-slot memory held at once
        self._destinations: dict = {}  # (slot, nbytes) -> view of the slot buffer
        self.recording = None  # a timeline.Recording while one step is being recorded
        # counters
        self.loads = 0
        self.h2d_bytes = 0
        self._timed_bytes = 0  # bytes of the timed copies that have completed
        self._timed_seconds = 0.0  # and the time they took
        self.stall_seconds = 0.0
        self.stalls = 0
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.ready = [torch.cuda.Event() for _ in range(slots)]
            # per slot: how far the compute stream had been queued when the slot's last
            # reader was done being queued; copies into the slot wait on it
            self.released = [torch.cuda.Event() for _ in range(slots)]
            self._device_index = device.index
            self._streams: dict = {}
            self._events = _EventPool(device)
            # (start, end, kind, bytes) timing pairs not yet read; kind "copy" or "stall"
            self._pending: Deque[Tuple[torch.cuda.Event, torch.cuda.Event, str, int]] = deque()
            self._rt = cudart.runtime()
            if self._rt is not None:
                for event in (*self.ready, *self.released):
                    _materialised(event, device)
                self._ready_handles = [event.cuda_event for event in self.ready]
                self._released_handles = [event.cuda_event for event in self.released]
                self._copy_handle = self.copy_stream.cuda_stream

    @property
    def h2d_seconds(self) -> float:
        """Time all copies took: the timed copies' time, scaled by bytes to every copy."""
        if not self._timed_bytes:
            return 0.0
        return self._timed_seconds * self.h2d_bytes / self._timed_bytes

    @property
    def timed_bytes(self) -> int:
        """Bytes of the copies that were timed (one in ``TIMED_COPY_EVERY``) and completed."""
        return self._timed_bytes

    @property
    def timed_seconds(self) -> float:
        """The time those copies took: an interval's bandwidth is its share of both."""
        return self._timed_seconds

    def _timed(self, seconds: float, nbytes: int) -> None:
        self._timed_seconds += seconds
        self._timed_bytes += nbytes

    @property
    def total_bytes(self) -> int:
        """Slot memory held now (the ring, and backward slots while they hold a layer)."""
        return sum(b.numel() for b in self.buffers if b is not None)

    @property
    def ring_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers[: self.ring_slots] if b is not None)

    # -- backward slots ------------------------------------------------------------
    def allocated(self, slot: int) -> bool:
        return self.buffers[slot] is not None

    def allocate(self, slot: int) -> None:
        """Give a backward slot its memory, from the caching allocator on the compute stream.

        The memory may have been freed by the compute stream a moment ago, so the slot's
        released event is recorded there now: the copy into it waits for those readers.
        """
        self.buffers[slot] = torch.empty(max(self.slot_bytes, 1), dtype=torch.uint8, device=self.device)
        self.borrowed_peak_bytes = max(self.borrowed_peak_bytes, self.total_bytes - self.ring_bytes)
        if self.cuda:
            self.mark_released(slot)

    def free(self, slot: int) -> None:
        """Return a backward slot's memory to the caching allocator.

        Called once every kernel that reads the slot is queued on the compute stream; the
        copy that filled it completed before those kernels ran (they waited on it), so the
        allocator may hand the memory out again in that stream's order.
        """
        if slot < self.ring_slots:
            raise ValueError(f"slot {slot} is a ring slot; only backward slots are freed")
        self.buffers[slot] = None
        self.owner[slot] = None
        self.rows_present[slot] = None
        for key in [key for key in self._destinations if key[0] == slot]:
            del self._destinations[key]

    # -- copies --------------------------------------------------------------------
    def compute_stream(self) -> Optional[int]:
        """The raw handle of the stream layers compute on now (None on the host).

        A raw handle, not a torch Stream: building a Stream object on every visit costs
        more host time than the rest of the visit's CUDA calls.
        """
        if not self.cuda:
            return None
        return torch._C._cuda_getCurrentRawStream(self._device_index)

    def _torch_stream(self, raw: int):
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def _direct(self) -> bool:
        """Whether the runtime can be called directly (it needs our device to be current)."""
        return self._rt is not None and torch._C._cuda_getDevice() == self._device_index

    def load(
        self,
        record: LayerRecord,
        slot: int,
        compute: Optional[int] = None,
        source: Optional[torch.Tensor] = None,
        ranges: Optional[List[Tuple[int, int]]] = None,
    ) -> None:
        """Copy a layer's region into a slot. ``source`` overrides the region (tests).

        ``ranges``: only these (begin, end) bytes of the region, the rest of the slot left
        as it was: a mixture-of-experts layer whose expert rows are copied by need, once its
        router has chosen (``rows_present`` then says which rows the slot holds).
        """
        src = record.host_region if source is None else source
        nbytes = record.nbytes
        dst = self._destinations.get((slot, nbytes))
        if dst is None:
            dst = self._destinations[(slot, nbytes)] = self.buffers[slot][:nbytes]
        pieces = [(0, nbytes)] if ranges is None else ranges
        copied = sum(end - begin for begin, end in pieces)
        self.owner[slot] = record.index
        self.rows_present[slot] = None if ranges is None else {}
        self.loads += 1
        self.h2d_bytes += copied
        timed = self.recording is not None or self.loads % TIMED_COPY_EVERY == 1
        if not self.cuda:
            start = time.perf_counter()
            for begin, end in pieces:
                dst[begin:end].copy_(src[begin:end])
            stop = time.perf_counter()
            if timed:
                self._timed(stop - start, copied)
            if self.recording is not None:
                self.recording.copies.append((record.index, slot, start, stop))
            return
        if compute is None:
            compute = self.compute_stream()
        start, end = (self._events.get(), self._events.get()) if timed else (None, None)
        if self._direct():
            rt, stream = self._rt, self._copy_handle
            rt.wait(stream, self._released_handles[slot])  # the previous owner's readers are done
            if timed:
                rt.record(start.cuda_event, stream)
            for begin, stop in pieces:
                rt.copy_h2d(dst.data_ptr() + begin, src.data_ptr() + begin, stop - begin, stream)
            if timed:
                rt.record(end.cuda_event, stream)
            rt.record(self._ready_handles[slot], stream)
        else:
            self._load_with_torch(dst, src, slot, self._torch_stream(compute), start, end, pieces)
        if not timed:
            return
        self._pend_copy(start, end, copied)
        if self.recording is not None:
            self.recording.copies.append((record.index, slot, start, end))

    def _load_with_torch(self, dst, src, slot, compute, start, end, pieces) -> None:
        stream = self.copy_stream
        stream.wait_event(self.released[slot])
        torch.cuda.set_stream(stream)
        try:
            if start is not None:
                start.record(stream)
            for begin, stop in pieces:
                dst[begin:stop].copy_(src[begin:stop], non_blocking=True)
            if end is not None:
                end.record(stream)
            self.ready[slot].record(stream)
        finally:
            torch.cuda.set_stream(compute)

    def fetch(self, src: torch.Tensor) -> torch.Tensor:
        """A transient device copy of a host tensor, outside the slots (the streamed head
        weight, gathered embedding rows), counted and timed with the slot copies.

        Issued on the current (compute) stream: the caller computes with it right away and
        drops it, and the caching allocator reuses its memory in that stream's order.
        """
        nbytes = src.numel() * src.element_size()
        self.h2d_bytes += nbytes
        if not self.cuda:
            start = time.perf_counter()
            out = src.detach().clone()
            self._timed(time.perf_counter() - start, nbytes)
            return out
        stream = torch.cuda.current_stream(self.device)
        start, end = self._events.get(), self._events.get()
        start.record(stream)
        out = src.detach().to(self.device, non_blocking=True)
        end.record(stream)
        self._pend_copy(start, end, nbytes)
        return out

    def _pend_copy(self, start, end, nbytes: int) -> None:
        """Queue a timed copy's events, reading those already complete now and then."""
        self._pending.append((start, end, "copy", nbytes))
        if len(self._pending) > 64:
            self._drain(block=False)

    def mark_released(self, slot: int, compute: Optional[int] = None) -> None:
        """Mark the slot's readers so far as the ones a copy into it must wait for.

        Called at the visit after the one that used the slot: every kernel that reads
        it, forward or backward, is queued on the compute stream by then.
        """
        if not self.cuda:
            return
        if compute is None:
            compute = self.compute_stream()
        if self._direct():
            self._rt.record(self._released_handles[slot], compute)
        else:
            self.released[slot].record(self._torch_stream(compute))

    def acquire(self, slot: int, layer: int, compute: Optional[int] = None) -> None:
        """Make the compute stream wait for the slot's copy; check the owner first."""
        if self.owner[slot] != layer:
            raise SlotOwnerError(
                f"layer {layer} asked for slot {slot}, which holds layer {self.owner[slot]}: "
                "the slot was overwritten or bound to the wrong layer"
            )
        if not self.cuda:
            return
        if compute is None:
            compute = self.compute_stream()
        if self._direct():
            rt, ready = self._rt, self._ready_handles[slot]
            if rt.done(ready):
                return
            start, end = self._events.get(), self._events.get()
            rt.record(start.cuda_event, compute)
            rt.wait(compute, ready)
            rt.record(end.cuda_event, compute)
        else:
            ready = self.ready[slot]
            if ready.query():
                return
            stream = self._torch_stream(compute)
            start, end = self._events.get(), self._events.get()
            start.record(stream)
            stream.wait_event(ready)
            end.record(stream)
        self._pending.append((start, end, "stall", 0))
        self.stalls += 1

    def owns(self, slot: int, layer: int) -> bool:
        return self.owner[slot] == layer

    def slot_of_pointer(self, pointer: int) -> Optional[int]:
        """The slot whose buffer contains this device address (None: not slot memory)."""
        for slot, buffer in enumerate(self.buffers):
            if buffer is None:
                continue
            start = buffer.data_ptr()
            if start <= pointer < start + buffer.numel():
                return slot
        return None

    # -- lazy timing ---------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        pending, rt = self._pending, self._rt
        while pending:
            start, end, kind, nbytes = pending[0]
            if block:
                end.synchronize()
            elif not (rt.done(end.cuda_event) if rt is not None else end.query()):
                break
            pending.popleft()
            if rt is not None:
                seconds = rt.elapsed_ms(start.cuda_event, end.cuda_event) / 1000.0
            else:
                seconds = start.elapsed_time(end) / 1000.0
            if kind == "copy":
                self._timed(seconds, nbytes)
            else:
                self.stall_seconds += seconds
            if self.recording is None:  # a recording reads its events later
                self._events.put(start, end)

    def settle(self) -> None:
        """Read every outstanding timing event (waits for them; not for the hot path)."""
        if self.cuda:
            self._drain(block=True)

    def release(self) -> None:
        """Free the slot buffers (the pool is unusable afterwards)."""
        self.settle()
        self._destinations.clear()
        self.buffers = []

    def forget(self) -> None:
        """Treat every slot as empty (after a fault or when layers were rebuilt); backward
        slots give their memory back."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self.owner = [None] * len(self.buffers)
        self.rows_present = [None] * len(self.buffers)
        for slot in range(self.ring_slots, len(self.buffers)):
            if self.buffers[slot] is not None:
                self.free(slot)
