"""The NF4 layer cache: the packed bytes of each quantised layer, written as the loader
quantises it, so that layers beyond ``host_budget`` can be read from disk (``disk.py``)
and a later load of the same checkpoint with the same settings quantises nothing.

Each layer is one file holding exactly the bytes the host store would hold for it (its
region: packed weights and quant-state tensors at the store's aligned offsets). Next to
them, a manifest records what the cache was made from (each safetensors file's name,
size, mtime and a hash of its header; the quantisation settings; the bitsandbytes
version and this layout's version) and, for each completed layer, its file, size, CRC32
and tensor layout (enough to rebuild the layer's Params4bit and QuantState objects).

Every file name carries the cache's key, a hash of that fingerprint
(``layer-00003.<key>.nf4``, ``manifest.<key>.json``): two loads with other checkpoints or
settings sharing one directory, even at the same time, never read, replace or map each
other's files. A load holds a shared lock on its key while it runs; files of other keys
are stale and are cleared with one warning, unless a load holding their lock is under way.

What is checked: the manifest against its own digest (an edited or damaged manifest is
not used: the cache is rebuilt); each layer's size and CRC32 when the loader reads it,
once, before anything uses its bytes, and its layout against the settings and the layer
(quantisation fields, shapes, the block size against the blocks its absmax holds): a
damaged or disagreeing layer is quantised again, with a warning; and that the
file the disk tier maps is the one that was checked or written (a file another load
replaced in between is used only if its CRC32 is the same). Crash safety: a layer file is
written under a temporary name, fsync'd and renamed; the manifest is rewritten the same
way after each layer, so an interrupted load leaves completed layers that the next load
reuses. Temporary files are never read. One left by a load killed mid-write (SIGKILL, a
crash, a full machine) is removed by a later load once it is provably stale: no load of
its key holds that key's lock, and the pid its name gives is not a live process here; a
file a live load may still be writing is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import struct
import tempfile
import threading
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import DiskCacheError
from ..modules import nf4
from ..system.log import get_logger
from .store import HostStore, LayerRecord

logger = get_logger(__name__)

LAYOUT_VERSION = 2  # bump when what a layer file or the manifest holds changes (2: biases in the load dtype)
DEFAULT_SUBDIRECTORY = ".layerstream-nf4"  # under the checkpoint directory, when it is writable
# the cache's own files; the key (group 1 or 2) names the fingerprint they were made from
_CACHE_FILE = re.compile(r"layer-\d{5}\.([0-9a-f]{16})\.nf4|manifest\.([0-9a-f]{16})\.json")
# a cache file being written: ``.<cache file>.<pid>.<thread>.tmp`` (the writer's pid, group 3)
_TEMPORARY_FILE = re.compile(r"\.(?:" + _CACHE_FILE.pattern + r")\.(\d+)\.\d+\.tmp")


def temporary_path(path: Path, pid: int, thread: int) -> Path:
    """Where ``path`` is written before it is renamed into place, by ``pid``'s ``thread``."""
    return path.with_name(f".{path.name}.{pid}.{thread}.tmp")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process that this one can see (a zombie counts as live)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def cache_key(source: dict) -> str:
    """A short hash of a fingerprint: the part of every cache file name that says what the
    file was made from."""
    return hashlib.blake2b(json.dumps(source, sort_keys=True).encode(), digest_size=8).hexdigest()


def manifest_name(source: dict) -> str:
    return f"manifest.{cache_key(source)}.json"


def digest(body: dict) -> str:
    """The manifest's seal: a hash of what it says (its source and layers), written beside it,
    so that a manifest edited by hand or damaged is never used."""
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def header_hash(path: Path) -> str:
    """blake2b of a safetensors file's length prefix and JSON header (names, dtypes,
    shapes, offsets): cheap, and it changes with anything but the values themselves."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        return hashlib.blake2b(prefix + handle.read(length), digest_size=16).hexdigest()


def fingerprint(weight_files: Sequence[Path], settings: dict) -> dict:
    """What the cache was made from: the source files and the quantisation settings.

    Each file by name, size, mtime, header, inode and ctime: two checkpoints of the same
    shapes have equal sizes and headers, and a copy that keeps the times (``cp -p``,
    ``rsync -a``) or bytes written in place with the mtime set back keep the mtime too; the
    inode or the ctime differs. A false difference (a ``chmod``, the checkpoint copied
    elsewhere) only quantises the layers again."""
    files = []
    for path in sorted(set(weight_files)):
        stat = os.stat(path)
        files.append([path.name, stat.st_size, stat.st_mtime_ns, header_hash(path), stat.st_ino, stat.st_ctime_ns])
    return {
        "layout_version": LAYOUT_VERSION,
        "bitsandbytes": nf4.bnb_version(),
        "quantization": settings,
        "files": files,
    }


def quant_settings(quant_config, dtype: torch.dtype, device: torch.device) -> dict:
    """The settings that decide the packed bytes (the device too: CUDA and CPU kernels
    are not promised to round alike)."""
    return {
        "quant_type": quant_config.bnb_4bit_quant_type,
        "double_quant": bool(quant_config.bnb_4bit_use_double_quant),
        "quant_storage": str(quant_config.bnb_4bit_quant_storage),
        "compute_dtype": str(quant_config.bnb_4bit_compute_dtype),
        "dtype": str(dtype),
        "quantized_on": device.type,
    }


def cache_directories(setting: Optional[str], checkpoint: Path) -> List[Path]:
    """``disk_cache_dir`` as directories (a comma list stripes layer i over directory i % n);
    unset: a directory under the checkpoint when it is writable, else one under
    ~/.cache/layerstream named by a hash of the checkpoint's path (the same checkpoint
    finds the same cache, and a changed one is found stale there)."""
    if setting:
        return [Path(part.strip()).expanduser() for part in str(setting).split(",") if part.strip()]
    if os.access(checkpoint, os.W_OK):
        return [checkpoint / DEFAULT_SUBDIRECTORY]
    name = hashlib.blake2b(str(checkpoint.resolve()).encode(), digest_size=8).hexdigest()
    return [Path("~/.cache/layerstream").expanduser() / name]


def describe(layer: nn.Module, record: LayerRecord) -> dict:
    """The layout of a quantised layer: each tensor entry, and for each 4-bit weight the
    settings its Params4bit and QuantState are rebuilt with."""
    paths = {id(module): name for name, module in layer.named_modules(remove_duplicate=False)}
    entries = [
        [paths[id(e.module)], e.kind, e.name, e.offset, e.nbytes, list(e.shape), str(e.dtype)] for e in record.entries
    ]
    quantised = {}
    for entry in record.entries:
        if nf4.weight_quant_state(entry.module) is None or paths[id(entry.module)] in quantised:
            continue
        quantised[paths[id(entry.module)]] = nf4.weight_settings(entry.module.weight)
    return {"nbytes": record.nbytes, "entries": entries, "quantised": quantised}


def region_bytes(record: LayerRecord) -> torch.Tensor:
    """The layer's region as the host store lays it out, from the tensors the model holds."""
    region = torch.zeros(record.nbytes, dtype=torch.uint8)
    done = set()
    for entry in record.entries:
        if entry.offset not in done and entry.nbytes:
            done.add(entry.offset)
            value = entry.current().detach().contiguous().reshape(-1).view(torch.uint8)
            region[entry.offset : entry.offset + entry.nbytes].copy_(value)
    return region


def layout_problem(layout: dict, settings: dict, layer: nn.Module) -> Optional[str]:
    """Why ``layout`` cannot be what ``settings`` (the fingerprint's quantisation) made of
    ``layer`` (None: it can be): each 4-bit module's quantisation fields and shape, and its
    block size against the number of blocks its stored absmax holds."""
    stored = {
        (path, name): math.prod(shape)
        for path, kind, name, _, _, shape, _ in layout["entries"]
        if kind == nf4.QUANT_KIND
    }
    modules = dict(layer.named_modules())
    for path, quant in layout["quantised"].items():
        module = modules.get(path)
        if module is None or not hasattr(module, "in_features"):
            return f"it lists {path} as a 4-bit module, which the layer does not have"
        wrong = _fields_against_settings(quant, settings, module) or _blocks_against_absmax(quant, stored, path)
        if wrong:
            return f"its manifest gives {path} " + "; ".join(wrong)
    return None


def _fields_against_settings(quant: dict, settings: dict, module: nn.Module) -> List[str]:
    expected = {
        "quant_type": settings["quant_type"],
        "compress_statistics": settings["double_quant"],
        "quant_storage": settings["quant_storage"],
        "state_dtype": settings["dtype"],
        "shape": [module.out_features, module.in_features],
        "state_blocksize": quant.get("blocksize"),
    }
    wrong = [f"{key} {quant.get(key)!r}, not {value!r}" for key, value in expected.items() if quant.get(key) != value]
    if (quant.get("state2") is not None) != settings["double_quant"]:
        wrong.append(f"state2 {quant.get('state2')!r} with double_quant={settings['double_quant']}")
    return wrong


def _blocks_against_absmax(quant: dict, stored: dict, path: str) -> List[str]:
    """The absmax the file holds has one value per block: a block size that disagrees with
    its count would dequantise with the wrong scales."""
    blocks = -(-math.prod(quant["shape"]) // quant["blocksize"])
    if stored.get((path, "absmax")) != blocks:
        return [f"blocksize {quant['blocksize']} ({blocks} blocks) but {stored.get((path, 'absmax'))} absmax values"]
    nested = quant["state2"]
    if nested is not None and stored.get((path, "state2.absmax")) != -(-blocks // nested["blocksize"]):
        return [f"a nested blocksize {nested['blocksize']} that disagrees with its stored absmax"]
    return []


def restore(layer: nn.Module, layout: dict, data: torch.Tensor) -> None:
    """Give a meta layer the tensors ``layout`` describes, over ``data`` (a layer file's
    bytes): the quantised layer as ``nf4.quantise_layer`` left it, without quantising.

    Each tensor gets a storage of its own over its bytes, not a view of ``data``: views
    share their base's version counter, so a write to one tensor (peft's cast of a norm
    through ``.data``) would look like a write to every tensor of the layer."""
    views: Dict[int, torch.Tensor] = {}
    by_module: Dict[str, Dict[Tuple[str, str], torch.Tensor]] = {}
    array = data.numpy()
    for module_path, kind, name, offset, nbytes, shape, dtype in layout["entries"]:
        if offset not in views:
            raw = torch.frombuffer(array[offset : offset + nbytes], dtype=torch.uint8) if nbytes else data[:0].clone()
            views[offset] = raw.view(nf4.parse_dtype(dtype)).view(shape)
        by_module.setdefault(module_path, {})[(kind, name)] = views[offset]
    for module_path, tensors in by_module.items():
        module = layer.get_submodule(module_path)
        quant = layout["quantised"].get(module_path)
        for (kind, name), view in tensors.items():
            if kind == "_buffers":
                module._buffers[name] = view
            elif kind == "_parameters" and not (quant is not None and name == "weight"):
                current = module._parameters[name]
                module._parameters[name] = nn.Parameter(view, requires_grad=current.requires_grad)
        if quant is not None:
            state_tensors = {name: view for (kind, name), view in tensors.items() if kind == nf4.QUANT_KIND}
            nf4.rebuild_weight(module, tensors[("_parameters", "weight")], state_tensors, quant)


def crc32(data) -> int:
    """CRC32 of a uint8 tensor, or of anything that offers its bytes (an mmap)."""
    return zlib.crc32(memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data) & 0xFFFFFFFF


def _identity(stat: os.stat_result) -> Tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


@dataclass(frozen=True)
class CachedLayer:
    """A layer file as the loader checked or wrote it: what the disk tier must map."""

    path: Path
    identity: Tuple[int, int, int, int]  # device, inode, size, mtime of the checked file
    crc32: int

    def check(self, opened) -> None:
        """Refuse the file the disk tier opened (``opened``: its descriptor and memory map)
        unless it is the one checked, or one with the same bytes (another load with the
        same settings may have replaced it in between)."""
        if _identity(os.fstat(opened.buffered_fd)) == self.identity or crc32(opened.mapping) == self.crc32:
            return
        raise DiskCacheError(
            f"the NF4 layer cache file {self.path} was replaced with other bytes while this load used it "
            "(another process writing the same cache directory). Load again, or give each run its own "
            "disk_cache_dir."
        )


class LayerCache:
    """One checkpoint's cache: the manifest, and each layer's file."""

    def __init__(self, directories: Sequence[Path], source: dict, layers: Optional[int] = None):
        """``layers``: how many the model has (None: unknown). Unless the cache holds them all,
        the load writes some: a directory that cannot be written is refused now, before any
        layer is quantised."""
        self.directories = list(directories)
        self.source = source
        self.layers: Dict[str, dict] = {}
        for directory in self.directories:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DiskCacheError(
                    f"cannot create the NF4 layer cache directory {directory} ({exc}). Point disk_cache_dir at a "
                    "writable directory, or raise host_budget so every layer stays in host RAM."
                ) from exc
        self.key = cache_key(source)
        self.manifest_path = self.directories[0] / manifest_name(source)
        self._clear_stale_temporaries()  # before taking our own lock, which would keep ours from being proved stale
        self._lock = self._hold(self.key, fcntl.LOCK_SH)  # while this object lives: until the load ends
        if self._lock is not None:
            weakref.finalize(self, os.close, self._lock)
        self._clear_other_keys()
        self._open()
        if layers is None or any(str(index) not in self.layers for index in range(layers)):
            for directory in self.directories:
                _require_writable(directory)

    def _hold(self, key: str, operation: int) -> Optional[int]:
        """A lock on ``key`` (shared: a load uses it; exclusive: no load does), or None
        when a non-blocking one is not granted or the directory cannot be written (no load
        writes there then: a complete cache is read without one, a load that must write is
        refused by ``_require_writable``)."""
        directory = self.directories[0]
        lock = directory / f".lock.{key}"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise self._write_error(directory, exc) from exc
            try:
                fd = os.open(lock, os.O_RDONLY)
            except OSError:
                return None
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _clear_stale_temporaries(self) -> None:
        """Remove the temporary files that loads killed mid-write left (they are never read, but
        each can be as large as a layer): those of a key no load holds the lock of, written by a
        pid that is not alive. A load under way holds its key's lock from start to end, so no
        file it is writing is removed; when one is, nothing of its key is."""
        found: Dict[str, List[Tuple[Path, int]]] = {}
        for directory in self.directories:
            try:
                names = list(directory.iterdir())
            except OSError:
                continue
            for path in names:
                match = _TEMPORARY_FILE.fullmatch(path.name)
                if match:
                    found.setdefault(match[1] or match[2], []).append((path, int(match[3])))
        removed = 0
        for key, paths in found.items():
            fd = self._hold(key, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                continue  # a load of that key is under way (or the directory cannot be written)
            try:
                for path, pid in paths:
                    if not _alive(pid):
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
                            removed += 1
            finally:
                os.close(fd)
        if removed:
            logger.info(
                "layerstream: removed %d temporary file(s) that interrupted loads left in the NF4 layer cache (%s).",
                removed,
                ", ".join(map(str, self.directories)),
            )

    def _clear_other_keys(self) -> None:
        """Remove the files of other keys (another checkpoint, or other settings): stale,
        unless a load of that key is under way (it holds its lock), whose files stay."""
        others: Dict[str, List[Path]] = {}
        for directory in self.directories:
            for path in directory.iterdir():
                match = _CACHE_FILE.fullmatch(path.name)
                key = match and (match[1] or match[2])
                if key and key != self.key:
                    others.setdefault(key, []).append(path)
        cleared = False
        for key, paths in others.items():
            fd = self._hold(key, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                continue
            try:
                for path in paths:
                    path.unlink(missing_ok=True)
            finally:
                os.close(fd)
            cleared = True
        if cleared:
            logger.warning(
                "layerstream: the NF4 layer cache in %s was made from another checkpoint or other settings "
                "(files, quantisation or layout changed); clearing it and quantising again.",
                ", ".join(map(str, self.directories)),
            )

    def _open(self) -> None:
        try:
            found = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning(
                "layerstream: the NF4 layer cache manifest %s is unreadable (%s); rebuilding the cache.",
                self.manifest_path,
                exc,
            )
            return
        body = {"source": found.get("source"), "layers": found.get("layers")}
        if found.get("digest") != digest(body) or body["source"] != self.source:
            logger.warning(
                "layerstream: the NF4 layer cache manifest %s was edited or damaged (it does not match its own "
                "digest, or the settings its name says); not using it: quantising again.",
                self.manifest_path,
            )
            return
        self.layers = dict(body["layers"] or {})

    def path(self, index: int) -> Path:
        return self.directories[index % len(self.directories)] / f"layer-{index:05d}.{self.key}.nf4"

    def read(self, index: int, layer: nn.Module) -> Optional[Tuple[torch.Tensor, dict, CachedLayer]]:
        """A completed layer's bytes and layout, checked against the manifest (and the layout
        against the settings and ``layer``), and the file they were read from; None when it
        is not there, is damaged or disagrees (said once per layer: it is quantised again)."""
        entry = self.layers.get(str(index))
        path = self.path(index)
        if entry is None or entry.get("file") != str(path):
            return None
        try:
            problem = layout_problem(entry["layout"], self.source["quantization"], layer)
        except (KeyError, TypeError, ValueError) as exc:
            problem = f"its manifest entry is malformed ({exc!r})"
        if problem is not None:
            return self._damaged(index, path, problem)
        try:
            with open(path, "rb") as handle:
                identity = _identity(os.fstat(handle.fileno()))
                if identity[2] != entry["nbytes"]:
                    return self._damaged(index, path, f"it holds {identity[2]} bytes, the manifest {entry['nbytes']}")
                data = torch.empty(identity[2], dtype=torch.uint8)
                if handle.readinto(memoryview(data.numpy())) != identity[2]:
                    return self._damaged(index, path, "it was cut short while being read")
        except OSError as exc:
            return self._damaged(index, path, f"it cannot be read ({exc})")
        if crc32(data) != entry["crc32"]:
            return self._damaged(index, path, "its CRC32 differs from the manifest's")
        return data, entry["layout"], CachedLayer(path, identity, entry["crc32"])

    def _damaged(self, index: int, path: Path, why: str) -> None:
        logger.warning(
            "layerstream: NF4 layer cache file %s is damaged (%s); quantising layer %d again.", path, why, index
        )
        self.layers.pop(str(index), None)
        return None

    def write(self, index: int, data: torch.Tensor, layout: dict) -> CachedLayer:
        """Write one layer's bytes (temp name, fsync, rename), then record it in the manifest."""
        path = self.path(index)
        temporary = temporary_path(path, os.getpid(), threading.get_ident())
        try:
            identity = _write_file(temporary, memoryview(data.numpy()))
            os.replace(temporary, path)
            _fsync_directory(path.parent)
        except OSError as exc:
            _remove(temporary)
            raise self._write_error(path.parent, exc) from exc
        checksum = crc32(data)
        self.layers[str(index)] = {"file": str(path), "nbytes": data.numel(), "crc32": checksum, "layout": layout}
        self._save()
        return CachedLayer(path, identity, checksum)

    def _save(self) -> None:
        temporary = temporary_path(self.manifest_path, os.getpid(), threading.get_ident())
        body = {"source": self.source, "layers": self.layers}
        text = json.dumps({**body, "digest": digest(body)}, indent=1).encode()
        try:
            _write_file(temporary, memoryview(text))
            os.replace(temporary, self.manifest_path)
        except OSError as exc:
            _remove(temporary)
            raise self._write_error(self.manifest_path.parent, exc) from exc

    @staticmethod
    def _write_error(directory: Path, exc: OSError) -> DiskCacheError:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        what = "is full" if full else "cannot be written"
        return DiskCacheError(
            f"the NF4 layer cache directory {directory} {what} ({exc}). The layers written so far are kept and "
            "reused by the next load; no partly written layer is. Free space there, point disk_cache_dir at "
            "another directory (a comma list stripes the cache over several), or raise host_budget so fewer "
            "layers are read from disk."
        )

    def provide(
        self, index: int, name: str, layer: nn.Module, quantise: Callable[[], None]
    ) -> Tuple[LayerRecord, CachedLayer]:
        """The quantised layer, from the cache when it holds it intact, else by ``quantise``
        (which loads and quantises the meta layer in place), written to the cache; and the
        file that holds it."""
        cached = self.read(index, layer)
        if cached is not None:
            data, layout, file = cached
            restore(layer, layout, data)
            record = HostStore.plan_layer(index, name, layer, lambda t: True)
            if describe(layer, record) == layout:
                return record, file
            raise DiskCacheError(  # a bug, not a stale cache: the fingerprint matched
                f"layer {index} rebuilt from {self.path(index)} does not have the layout it was written with; "
                f"delete {', '.join(map(str, self.directories))} and load again."
            )
        quantise()
        record = HostStore.plan_layer(index, name, layer, lambda t: True)
        return record, self.write(index, region_bytes(record), describe(layer, record))


def _require_writable(directory: Path) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".layerstream-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DiskCacheError(
            f"the NF4 layer cache directory {directory} cannot be written ({exc}), and this load must write "
            "quantised layers there; it stops before quantising any. Point disk_cache_dir at a writable directory, "
            "make this one writable, or raise host_budget so every layer stays in host RAM. (A cache that already "
            "holds every layer for this checkpoint and these settings is read from a read-only directory.)"
        ) from exc


def _remove(path: Path) -> None:
    """Remove a temporary file, if the directory lets us (the error that brought us here is the one to raise)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _write_file(path: Path, data: memoryview) -> Tuple[int, int, int, int]:
    """Write and fsync ``data``; the written file's identity (a rename keeps it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
        return _identity(os.fstat(fd))
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
