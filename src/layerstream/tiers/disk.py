"""The disk tier: layers the host budget does not hold are read from the checkpoint's own
safetensors files (each tensor's offsets from the file's header, ``checkpoint.read_layout``;
nothing is copied out of the checkpoint) or from a layer file of the NF4 cache
(``nf4_cache``, the layer's region byte for byte) each time they are needed, into a small
ring of page-locked staging regions, far enough ahead that the read hides behind compute
(``disk_plan.ReadAhead``). A disk layer's Parameters are views of a private (copy-on-write)
memory map of those files: they keep their shapes, dtypes and values (``save_pretrained``,
``unstream_model`` and PEFT see ordinary CPU tensors) while no host RAM holds them.

Reads use direct I/O (O_DIRECT: aligned offsets, lengths and buffers, bypassing the page
cache) where the file system allows it, and buffered reads otherwise, said once. Each
layer's bytes are read in chunks by reader threads, several layers in flight. A ring region
is read into again only after the device copy that read it has completed (a CUDA event
recorded after the copy; on the host the copy is synchronous).

What is checked: before each read and again before its region is used, every file's size
and modification time against those seen at load (a file changed under the run is
refused); every read returns all its bytes (a short read is refused); an I/O error names
the file; in debug mode (``StreamConfig(checksum=True)``) each read's bytes are
checksummed against the bytes the layer had at load.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..checkpoints.stored import TORCH_DTYPE_NAMES, StoredTensor, read_layout
from ..decisions.disk import ReadAhead, ReaderChoice, Tiers, busy_seconds, pick_readers
from ..errors import DiskReadError, LoadingError, PinError, StreamingError
from ..modules import changes
from ..system import cudart
from ..system.log import get_logger
from ..units import GiB, MiB
from . import checksum as checksum_mod
from . import disk_files
from .disk_files import SourceFile, read_fully, short_read
from .store import HostStore, LayerRecord, set_data

logger = get_logger(__name__)
rank_logger = get_logger(__name__, main_process_only=False)  # facts of this rank's disk and memory

IO_ALIGN = 4096  # offsets, lengths and buffers of direct reads are multiples of this
# one read job. A reader thread needs the interpreter lock between its reads, and the training
# step's thread holds it much of the time (each hand-over can wait out the switch interval,
# 5 ms), so fewer, larger reads lose less: on the CPU machine a thread running Python cut one
# 8 MiB reader to about half its idle rate and one 32 MiB reader to about three quarters.
CHUNK_BYTES = 32 * MiB
READERS = 4  # reader threads: reads in flight at once, at most
PROBE_BYTES = 256 * MiB  # read per probe when choosing how many reads run at once


@dataclass
class _Chunk:
    """One read job: file bytes [lo, hi) and where the tensors in it go in the region."""

    file: SourceFile
    lo: int
    hi: int
    pieces: List[Tuple[int, int, int]]  # (file begin, file end, region offset)


@dataclass
class _Layer:
    record: LayerRecord
    files: List[SourceFile]
    chunks: List[_Chunk]
    gaps: List[Tuple[int, int]]  # region bytes between tensors: zeroed, so checksums agree


@dataclass
class _Region:
    data: torch.Tensor
    array: np.ndarray
    layer: Optional[int] = None
    futures: List[Future] = field(default_factory=list)
    started: float = 0.0
    reads_at_once: int = 0  # in force when the read started
    copy_done: Optional[object] = None  # a CUDA event recorded after the copy that read it


class DiskTier:
    """The staging ring, the reader threads, and each disk layer's reads."""

    def __init__(self, tiers: Tiers, pin: bool, verify: bool, readers: int = READERS):
        self.tiers = tiers
        self.verify = verify
        self.readers = readers
        self.direct = True
        self.pinned = False
        self.lookahead = ReadAhead(tiers.ring_regions)
        self.layers: Dict[int, _Layer] = {}
        self._files: Dict[Path, SourceFile] = {}
        self._hooks: list = []  # state_dict checks on the disk layers, removed at close
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="layerstream-disk")
        self.owner_pid = os.getpid()  # the reader threads live in this process, not in its forks
        self._in_flight = threading.BoundedSemaphore(readers)
        self.probed: Dict[int, float] = {}  # reads at once -> bytes/s, from tune_readers
        # how many reads run at once: at most readers; tune_readers, then the run's reads, choose
        self.choice = ReaderChoice((1, readers) if readers > 1 else (1,), readers)
        self.regions = [self._region(tiers.region_bytes, pin) for _ in range(tiers.ring_regions)]
        self._where: Dict[int, _Region] = {}  # layer -> the region it is read (or being read) into
        self._last_take: Optional[float] = None
        # counters
        self.read_bytes = 0
        self.reads = 0
        self.demand_reads = 0
        self.stall_seconds = 0.0
        self._intervals: List[Tuple[float, float]] = []
        self._busy = 0.0

    # -- set-up ----------------------------------------------------------------------
    def _region(self, nbytes: int, pin: bool) -> _Region:
        data = torch.zeros(max(nbytes, IO_ALIGN), dtype=torch.uint8)
        if pin:
            try:
                cudart.register_host(data)
                weakref.finalize(data, cudart.unregister_host, data)
                self.pinned = True
            except PinError as exc:
                rank_logger.warning(
                    "layerstream: could not page-lock the disk tier's staging ring (%s); copies from it "
                    "to the GPU are pageable (about 8x slower) and do not overlap compute.",
                    exc,
                )
        return _Region(data, data.numpy())

    def _file(self, path: Path, layout=None) -> SourceFile:
        known = self._files.get(path)
        if known is not None:
            return known
        buffered = os.open(path, os.O_RDONLY)
        fd = buffered
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                self._fall_back(f"opening {path} with O_DIRECT failed: {exc}")
        stat = os.fstat(buffered)
        mapping = mmap.mmap(buffered, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        known = self._files[path] = SourceFile(
            path, fd, buffered, (stat.st_size, stat.st_mtime_ns), *(layout or read_layout(path)), mapping
        )
        return known

    def add_cache_file(self, cached, record: LayerRecord) -> Dict[str, Path]:
        """A layer file of the NF4 cache (``nf4_cache.CachedLayer``: checked as the file the
        loader read or wrote) as a source: it holds the layer's region byte for byte, so each
        tensor sits at its region offset. Returns the tensor name -> file map ``attach`` takes."""
        path = cached.path
        tensors = {
            e.qualified_name: StoredTensor(path, TORCH_DTYPE_NAMES[e.dtype], e.shape, False) for e in record.entries
        }
        offsets = {e.qualified_name: (e.offset, e.offset + e.nbytes) for e in record.entries}
        cached.check(self._file(path, (tensors, offsets)))
        return {name: path for name in tensors}

    def attach(self, store: HostStore, record: LayerRecord, files: Dict[str, Path]) -> None:
        """Make ``record`` a disk layer: the model's tensors become views of the files' memory
        map, and the reads that bring the layer's bytes into a ring region are laid out.

        Raises LoadingError for a tensor the checkpoint does not hold as the model does
        (same dtype, same shape): the disk tier reads bytes as they are, without casting."""
        if record.nbytes > self.tiers.region_bytes:
            raise LoadingError(
                f"{record.name} holds {record.nbytes} bytes, more than the {self.tiers.region_bytes} the staging "
                "ring's regions were planned for; raise host_budget so this layer stays in host RAM."
            )
        views: Dict[int, torch.Tensor] = {}
        spans: List[Tuple[SourceFile, int, int, int]] = []  # (file, begin, end, region offset)
        record.arena_views, record.host_values = [], []
        for entry in record.entries:
            if entry.offset not in views:
                path = files.get(entry.qualified_name)
                source = self._file(path) if path is not None else None
                where = source.offsets.get(entry.qualified_name) if source is not None else None
                if where is None:
                    raise LoadingError(
                        f"{entry.qualified_name} is not in the checkpoint's safetensors files, so the disk tier "
                        "cannot read it; raise host_budget (or leave it unset) to keep this layer in host RAM."
                    )
                self._require_same(entry, source)
                begin, end = where
                raw = torch.frombuffer(source.mapping, dtype=torch.uint8, count=end - begin, offset=begin)
                views[entry.offset] = raw.view(entry.dtype).view(entry.shape) if end > begin else raw
                spans.append((source, begin, end, entry.offset))
            view = views[entry.offset]
            record.arena_views.append(view)
            record.host_values.append(_point_at(entry, view))
        HostStore._bound(record)
        used = {str(s[0].path): s[0] for s in spans}
        layer = _Layer(record, [used[name] for name in sorted(used)], [], record.uncovered())
        layer.chunks = self._chunks(spans)
        self.layers[record.index] = layer
        store.records.append(record)
        # the host tensors show the files' pages: reading them (state_dict, save_pretrained)
        # first checks that the files are the ones loaded
        self._hooks.append(record.module.register_state_dict_pre_hook(lambda *_: self._check_layer(layer)))
        if self.verify:
            record.reference_checksum = checksum_mod.checksum(self._assemble(record))
        changes.watch(record)  # before the guard: FileBacked's .data then comes first in the class
        for host in record.host_values:  # and any other read of them: a truncated file would be SIGBUS
            disk_files.guard(host, lambda: self._check_layer(layer))

    def guard_loads(self, ancestors: Sequence[nn.Module]) -> None:
        """``load_state_dict`` into the disk layers (``disk_files.LoadGuard``), from the modules
        above them (``ancestors``) and from each module in them."""
        layers = list(self.layers.values())
        modules = [*ancestors, *(module for layer in layers for module in layer.record.module.modules())]
        self._hooks += disk_files.LoadGuard(layers).install(modules)

    def _require_same(self, entry, source: SourceFile) -> None:
        wanted = TORCH_DTYPE_NAMES.get(entry.dtype)
        stored = source.tensors[entry.qualified_name]
        if wanted is None or stored.dtype != wanted or tuple(stored.shape) != tuple(entry.shape):
            raise LoadingError(
                f"{entry.qualified_name} is stored in {source.path} as {stored.dtype} {list(stored.shape)}; the model "
                f"holds it as {entry.dtype} {list(entry.shape)}. The disk tier reads bytes as they are and does not "
                "cast: load with dtype='auto' (the checkpoint's dtype), save the checkpoint in the model's dtype "
                "once (save_pretrained), or raise host_budget so this layer stays in host RAM."
            )

    def _chunks(self, spans) -> List[_Chunk]:
        """Runs of tensors contiguous in a file, cut into aligned chunks of CHUNK_BYTES."""
        chunks: List[_Chunk] = []
        runs: List[List[Tuple[SourceFile, int, int, int]]] = []
        for span in sorted(spans, key=lambda s: (str(s[0].path), s[1])):
            if runs and runs[-1][-1][0] is span[0] and runs[-1][-1][2] == span[1]:
                runs[-1].append(span)
            else:
                runs.append([span])
        for run in runs:
            source, start, end = run[0][0], run[0][1], run[-1][2]
            lo = start // IO_ALIGN * IO_ALIGN
            while lo < end:
                hi = min(lo + CHUNK_BYTES, _align_up(end))
                pieces = [(max(b, lo), min(e, hi), at + max(b, lo) - b) for _, b, e, at in run if b < hi and e > lo]
                chunks.append(_Chunk(source, lo, hi, pieces))
                lo = hi
        return chunks

    def _assemble(self, record: LayerRecord) -> torch.Tensor:
        """The layer's region as a correct read leaves it (from the memory map; debug mode)."""
        region = torch.zeros(record.nbytes, dtype=torch.uint8)
        done = set()
        for entry, view in zip(record.entries, record.arena_views):
            if entry.offset not in done and entry.nbytes:
                done.add(entry.offset)
                region[entry.offset : entry.offset + entry.nbytes].copy_(view.reshape(-1).view(torch.uint8))
        return region

    # -- reads -------------------------------------------------------------------------
    def check_unchanged(self) -> None:
        """Refuse when a checkpoint file changed since load: the disk layers' host tensors are
        views of a private map of those files, so an in-place write shows through them."""
        for layer in self.layers.values():
            self._check_layer(layer)

    @staticmethod
    def _check_layer(layer) -> None:
        for source in layer.files:
            source.check(layer.record.name)

    def holds(self, index: int) -> bool:
        return index in self.layers

    @property
    def horizon(self) -> int:
        """How many predicted visits the runtime looks through for layers to read ahead."""
        return self.tiers.ring_regions + len(self.tiers.ram) + 2

    def read_ahead(self, upcoming: Sequence[int]) -> None:
        """Start reads for the next disk layers among ``upcoming`` (predicted, in order), as
        many as the measured lookahead asks for and free regions allow."""
        wanted = [i for i in upcoming if i in self.layers][: self.lookahead.depth]
        for index in wanted:
            if index in self._where:
                continue
            region = self._free_region(block=False)
            if region is None:
                return
            self._start(index, region)

    def _free_region(self, block: bool, keep: int = -1) -> Optional[_Region]:
        for region in self.regions:
            if region.layer is None and _done(region.copy_done):
                return region
        if not block:
            return None
        # wait for the oldest copy out of the ring, else drop a read made for another layer
        for region in self.regions:
            if region.layer is None:
                _wait(region.copy_done)
                region.copy_done = None
                return region
        for region in self.regions:
            if region.layer != keep:
                for future in region.futures:
                    future.exception()
                del self._where[region.layer]
                region.layer, region.futures = None, []
                return region
        raise StreamingError("the disk tier's staging ring has no region to read into")  # pragma: no cover

    def _start(self, index: int, region: _Region) -> None:
        layer = self.layers[index]
        for source in layer.files:
            source.check(layer.record.name)
        region.layer, region.started, region.reads_at_once = index, time.perf_counter(), self.reads_at_once
        region.futures = [self._pool.submit(self._read_chunk, chunk, region.array) for chunk in layer.chunks]
        if layer.gaps:
            for begin, end in layer.gaps:
                region.array[begin:end] = 0
        self._where[index] = region

    def take(self, index: int) -> torch.Tensor:
        """The layer's bytes, read (waiting for the read if it is still under way): a region
        of the ring to copy to the device from; ``copied`` must follow the copy."""
        now = time.perf_counter()
        region = self._where.get(index)
        if region is None:
            self.demand_reads += 1
            self._start(index, self._free_region(block=True, keep=index))
            region = self._where[index]
        layer = self.layers[index]
        ended = region.started
        try:
            for future in region.futures:
                ended = max(ended, future.result())
        except OSError as exc:
            self._drop_all()
            raise self._read_error(layer, exc) from exc
        except DiskReadError:
            self._drop_all()
            raise
        done = time.perf_counter()
        stall = done - now
        self.stall_seconds += stall
        if self._last_take is not None:
            self.lookahead.visit_took(now - self._last_take)
        self._last_take = done
        self.lookahead.read_took(ended - region.started)
        self._intervals.append((region.started, ended))
        if len(self._intervals) > 256:
            self._busy += busy_seconds(self._intervals[:-16])
            self._intervals = self._intervals[-16:]
        record = layer.record
        self.reads += 1
        nbytes = sum(piece[1] - piece[0] for chunk in layer.chunks for piece in chunk.pieces)
        self.read_bytes += nbytes
        changed = self.choice.observe(region.reads_at_once, nbytes, region.started, ended)
        if changed is not None:
            self._reads_at_once(changed)
            rank_logger.info("layerstream: the disk tier now reads %d at a time (%s)", changed, self.choice)
        for source in layer.files:
            try:
                source.check(record.name)
            except DiskReadError:
                self._drop(index, region)
                raise
        staged = region.data[: record.nbytes]
        if self.verify:
            got = checksum_mod.checksum(staged)
            if got != record.reference_checksum:
                self._drop(index, region)
                files = ", ".join(str(f.path) for f in layer.files)
                raise DiskReadError(
                    f"layerstream debug checksum: the bytes read for {record.name} (layer {index}) from {files} "
                    f"differ from those it had at load (checksum {got}, expected {record.reference_checksum}): the "
                    "file was changed or damaged on disk, or the read was wrong. Check the disk and restore the "
                    "checkpoint; nothing wrong reached the GPU."
                )
        return staged

    def copied(self, index: int, stream=None) -> None:
        """The copy out of the layer's region is queued on ``stream`` (None: done already);
        the region is read into again once that copy has completed."""
        region = self._where.pop(index)
        region.layer, region.futures = None, []
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            region.copy_done = event

    def _drop_all(self) -> None:
        """After a failed read: every read under way is waited for and dropped, so a read
        for another layer that failed in the same moment (a transient error hits them all)
        is not handed to the next step; the next step reads what it needs again."""
        for index, region in list(self._where.items()):
            self._drop(index, region)

    def _drop(self, index: int, region: _Region) -> None:
        for future in region.futures:
            future.exception()
        self._where.pop(index, None)
        region.layer, region.futures = None, []

    def _read_error(self, layer: _Layer, exc: OSError) -> DiskReadError:
        files = ", ".join(str(f.path) for f in layer.files)
        return DiskReadError(
            f"reading {layer.record.name} from {files} failed ({exc}). Nothing was copied to the GPU. Check the "
            "disk (dmesg, free space, the file's permissions) and that the file is intact, or raise host_budget "
            "so the layer stays in host RAM."
        )

    # -- the reader threads ---------------------------------------------------------------
    def _bounce(self) -> Tuple[mmap.mmap, np.ndarray]:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            buffer = mmap.mmap(-1, CHUNK_BYTES + IO_ALIGN)  # page-aligned: fit for O_DIRECT
            bounce = self._local.bounce = (buffer, np.frombuffer(buffer, dtype=np.uint8))
        return bounce

    def tune_readers(self) -> int:
        """Choose how many reads run at once (at most ``readers``) from a short probe of the
        disk layers' own bytes: one read in flight and all of them, each twice, alternately, on
        different layers (some disks read slower with several reads in flight). Both run as the
        tier reads, through the same threads, so one read in flight overlaps the copies."""
        order = sorted(self.layers)
        if self.readers <= 1 or len(order) < 2:
            return self.readers
        scratch, counts = self.regions[0].array, (1, self.readers)
        timed = {count: [0, 0.0] for count in counts}
        for turn, index in enumerate(order[:4]):  # up to PROBE_BYTES of each of four layers
            count, chunks, size = counts[turn % 2], [], 0
            for chunk in (c for c in self.layers[index].chunks if size < PROBE_BYTES):
                chunks.append(chunk)
                size += sum(end - begin for begin, end, _ in chunk.pieces)
            gate = threading.BoundedSemaphore(count)
            start = time.perf_counter()
            try:
                with ThreadPoolExecutor(max_workers=self.readers) as probe:
                    list(probe.map(lambda chunk: self._read_chunk(chunk, scratch, gate), chunks))
            except OSError as exc:
                raise self._read_error(self.layers[index], exc) from exc
            timed[count][0] += size
            timed[count][1] += time.perf_counter() - start
        self.probed = {count: size / max(seconds, 1e-9) for count, (size, seconds) in timed.items()}
        self._reads_at_once(pick_readers(self.probed))
        rates = ", ".join(f"{count} at once {rate / 1e9:.2f} GB/s" for count, rate in self.probed.items())
        rank_logger.warning("layerstream: the disk tier reads %d at a time (probed: %s)", self.reads_at_once, rates)
        return self.reads_at_once

    @property
    def reads_at_once(self) -> int:
        return self.choice.current

    def _reads_at_once(self, count: int) -> None:
        self.choice.current = count
        self._in_flight = threading.BoundedSemaphore(count)

    def _read_chunk(self, chunk: _Chunk, region: np.ndarray, gate=None) -> float:
        """Read one chunk into the region; returns when it finished. The gate (as many reads
        at once as tune_readers chose) holds only the disk read: the copy out of the bounce
        buffer runs outside it, beside the next read, so one read in flight keeps the disk busy."""
        with gate or self._in_flight:
            staged = self._read_from_disk(chunk, region)
        if staged is not None:
            for begin, end, at in chunk.pieces:
                region[at : at + end - begin] = staged[begin - chunk.lo : end - chunk.lo]
        return time.perf_counter()

    def _read_from_disk(self, chunk: _Chunk, region: np.ndarray) -> Optional[np.ndarray]:
        """One chunk's disk read: with direct I/O into this thread's aligned bounce buffer
        (returned, to be copied out), else through the page cache straight into the region."""
        if self.direct and chunk.file.fd != chunk.file.buffered_fd:
            try:
                return self._read_direct(chunk)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fall_back(f"a direct read of {chunk.file.path} was refused: {exc}")
        for begin, end, at in chunk.pieces:
            read_fully(chunk.file, chunk.file.buffered_fd, memoryview(region[at : at + end - begin]), begin)
        return None

    def _read_direct(self, chunk: _Chunk) -> np.ndarray:
        buffer, array = self._bounce()
        length = chunk.hi - chunk.lo
        needed = max(end for _, end, _ in chunk.pieces) - chunk.lo
        got = os.preadv(chunk.file.fd, [memoryview(buffer)[:length]], chunk.lo)
        if got < needed:  # direct reads end early only at the end of the file
            raise short_read(chunk.file, chunk.lo, needed, got)
        return array

    def _fall_back(self, reason: str) -> None:
        with self._lock:
            if not self.direct:
                return
            self.direct = False
        logger.warning(
            "layerstream: the disk tier reads with buffered I/O instead of direct I/O (%s). Reads go through "
            "the page cache: they cost host CPU and memory bandwidth, and cached pages compete with the run "
            "for RAM. Put the checkpoint on a file system that supports O_DIRECT (ext4, xfs) for full speed.",
            reason,
        )

    # -- what the run reports ----------------------------------------------------------
    def stats(self) -> dict:
        busy = self._busy + busy_seconds(self._intervals)
        return {
            "ram_layers": len(self.tiers.ram),
            "disk_layers": len(self.tiers.disk),
            "ring_regions": self.tiers.ring_regions,
            "ring_bytes": self.tiers.ring_bytes,
            "disk_reads": self.reads,
            "disk_demand_reads": self.demand_reads,
            "disk_read_bytes": self.read_bytes,
            "disk_read_seconds": busy,
            "disk_read_gbps": self.read_bytes / busy / 1e9 if busy > 0 else 0.0,
            "disk_stall_seconds": self.stall_seconds,
            "disk_lookahead": self.lookahead.depth,
            "disk_ring_too_small": self.lookahead.ring_too_small,
            "direct_io": self.direct,
            "disk_reads_at_once": self.reads_at_once,
            "disk_reads_at_once_changes": self.choice.changes,  # rates: self.probed, self.choice.rates
        }

    def describe(self) -> str:
        tiers = self.tiers
        io = "direct I/O" if self.direct else "buffered I/O"
        pinned = "pinned" if self.pinned else "pageable"
        return (
            f"{len(tiers.ram)} layer(s) in host RAM, {len(tiers.disk)} read from disk ({io}, {self.reads_at_once} "
            f"at once) into a ring of {tiers.ring_regions} x {tiers.region_bytes / MiB:.1f} MiB = "
            f"{tiers.ring_bytes / GiB:.3f} GiB, {pinned}"
        )

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for layer in self.layers.values():
            for host in layer.record.host_values:
                disk_files.unguard(host)
        self._pool.shutdown(wait=True)
        for source in self._files.values():
            if source.fd != source.buffered_fd:
                os.close(source.fd)
            os.close(source.buffered_fd)
        self._files = {}


def _point_at(entry, view: torch.Tensor) -> torch.Tensor:
    """Make the model hold ``view`` for this entry. A Parameter still on the meta device (a
    model being loaded, not yet referenced elsewhere) is replaced by one over the view."""
    current = entry.current()
    if entry.is_quant_state:  # a tensor of a 4-bit weight's QuantState (the NF4 cache)
        entry.hold_in_quant_state(view)
        return view
    if isinstance(current, nn.Parameter):
        if current.device.type != "meta":
            set_data(current, view)
            return current
        fresh = entry.table[entry.name] = nn.Parameter(view, requires_grad=current.requires_grad)
        return fresh
    entry.table[entry.name] = view
    return view


def _align_up(value: int) -> int:
    return -(-value // IO_ALIGN) * IO_ALIGN


def _done(event) -> bool:
    return event is None or event.query()


def _wait(event) -> None:
    if event is not None:
        event.synchronize()
