"""The NF4 layer cache: the packed bytes of each quantised layer, written as the loader
quantises it, so that layers beyond ``host_budget`` can be read from disk (``disk.py``)
and a later load of the same checkpoint with the same settings quantises nothing.

Each layer is one file holding exactly the bytes the host store would hold for it (its
region: packed weights and quant-state tensors at the store's aligned offsets). Next to
them, ``manifest.json`` records what the cache was made from (each safetensors file's
name, size, mtime and a hash of its header; the quantisation settings; the bitsandbytes
version and this layout's version) and, for each completed layer, its file, size, CRC32
and tensor layout (enough to rebuild the layer's Params4bit and QuantState objects).

What is checked: the fingerprint when the cache is opened (a different one: the cache is
stale, is cleared with one warning and rebuilt); each layer's size and CRC32 when the
loader reads it, once, before anything uses its bytes (a damaged layer is quantised
again, with a warning). Crash safety: a layer file is written under a temporary name,
fsync'd and renamed; the manifest is rewritten the same way after each layer, so an
interrupted load leaves completed layers that the next load reuses.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .errors import DiskCacheError
from .log import get_logger
from .store import HostStore, LayerRecord

logger = get_logger(__name__)

LAYOUT_VERSION = 1  # bump when what a layer file or the manifest holds changes
MANIFEST = "manifest.json"
DEFAULT_SUBDIRECTORY = ".layerstream-nf4"  # under the checkpoint directory, when it is writable


def header_hash(path: Path) -> str:
    """blake2b of a safetensors file's length prefix and JSON header (names, dtypes,
    shapes, offsets): cheap, and it changes with anything but the values themselves."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        return hashlib.blake2b(prefix + handle.read(length), digest_size=16).hexdigest()


def fingerprint(weight_files: Sequence[Path], settings: dict) -> dict:
    """What the cache was made from: the source files and the quantisation settings."""
    import bitsandbytes

    files = []
    for path in sorted(set(weight_files)):
        stat = os.stat(path)
        files.append([path.name, stat.st_size, stat.st_mtime_ns, header_hash(path)])
    return {
        "layout_version": LAYOUT_VERSION,
        "bitsandbytes": getattr(bitsandbytes, "__version__", "unknown"),
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


def _dtype(text: str) -> torch.dtype:
    value = getattr(torch, text.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {text}")
    return value


def describe(layer: nn.Module, record: LayerRecord) -> dict:
    """The layout of a quantised layer: each tensor entry, and for each 4-bit weight the
    settings its Params4bit and QuantState are rebuilt with."""
    paths = {id(module): name for name, module in layer.named_modules(remove_duplicate=False)}
    entries = [
        [paths[id(e.module)], e.kind, e.name, e.offset, e.nbytes, list(e.shape), str(e.dtype)] for e in record.entries
    ]
    quantised = {}
    for entry in record.entries:
        weight = entry.module._parameters.get("weight")
        state = getattr(weight, "quant_state", None)
        if state is None or paths[id(entry.module)] in quantised:
            continue
        nested = getattr(state, "state2", None) if state.nested else None
        quantised[paths[id(entry.module)]] = {
            "blocksize": weight.blocksize,
            "compress_statistics": bool(weight.compress_statistics),
            "quant_type": weight.quant_type,
            "quant_storage": str(weight.quant_storage),
            "shape": list(state.shape),
            "state_blocksize": state.blocksize,
            "state_dtype": str(state.dtype),
            "state2": None
            if nested is None
            else {"blocksize": nested.blocksize, "quant_type": nested.quant_type, "dtype": str(nested.dtype)},
        }
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


def restore(layer: nn.Module, layout: dict, data: torch.Tensor) -> None:
    """Give a meta layer the tensors ``layout`` describes, as views of ``data`` (a layer
    file's bytes): the quantised layer as ``nf4.quantise_layer`` left it, without
    quantising."""
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    views: Dict[int, torch.Tensor] = {}
    by_module: Dict[str, Dict[Tuple[str, str], torch.Tensor]] = {}
    for module_path, kind, name, offset, nbytes, shape, dtype in layout["entries"]:
        if offset not in views:
            views[offset] = data[offset : offset + nbytes].view(_dtype(dtype)).view(shape)
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
        if quant is None:
            continue
        second = quant["state2"]
        state2 = None
        if second is not None:
            state2 = QuantState(
                absmax=tensors[("quant", "state2.absmax")],
                code=tensors[("quant", "state2.code")],
                blocksize=second["blocksize"],
                quant_type=second["quant_type"],
                dtype=_dtype(second["dtype"]),
            )
        state = QuantState(
            absmax=tensors[("quant", "absmax")],
            shape=torch.Size(quant["shape"]),
            code=tensors.get(("quant", "code")),
            blocksize=quant["state_blocksize"],
            quant_type=quant["quant_type"],
            dtype=_dtype(quant["state_dtype"]),
            offset=tensors.get(("quant", "offset")),
            state2=state2,
        )
        weight = Params4bit(
            tensors[("_parameters", "weight")],
            requires_grad=False,
            quant_state=state,
            blocksize=quant["blocksize"],
            compress_statistics=quant["compress_statistics"],
            quant_type=quant["quant_type"],
            quant_storage=_dtype(quant["quant_storage"]),
            bnb_quantized=True,
        )
        weight.module = module
        module.weight = weight


def crc32(data: torch.Tensor) -> int:
    return zlib.crc32(memoryview(data.numpy())) & 0xFFFFFFFF


class LayerCache:
    """One checkpoint's cache: the manifest, and each layer's file."""

    def __init__(self, directories: Sequence[Path], source: dict):
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
        self.manifest_path = self.directories[0] / MANIFEST
        self._open()

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
        if found.get("source") != self.source:
            logger.warning(
                "layerstream: the NF4 layer cache in %s was made from another checkpoint or other settings "
                "(files, quantisation or layout changed); clearing it and quantising again.",
                ", ".join(map(str, self.directories)),
            )
            for entry in found.get("layers", {}).values():
                Path(entry.get("file", "")).unlink(missing_ok=True)
            self.manifest_path.unlink(missing_ok=True)
            return
        self.layers = dict(found.get("layers", {}))

    def path(self, index: int) -> Path:
        return self.directories[index % len(self.directories)] / f"layer-{index:05d}.nf4"

    def read(self, index: int) -> Optional[Tuple[torch.Tensor, dict]]:
        """A completed layer's bytes and layout, checked against the manifest; None when it
        is not there or is damaged (said once per layer: it is quantised again)."""
        entry = self.layers.get(str(index))
        path = self.path(index)
        if entry is None or entry.get("file") != str(path):
            return None
        try:
            size = os.stat(path).st_size
            if size != entry["nbytes"]:
                return self._damaged(index, path, f"it holds {size} bytes, the manifest {entry['nbytes']}")
            data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            return self._damaged(index, path, f"it cannot be read ({exc})")
        if crc32(data) != entry["crc32"]:
            return self._damaged(index, path, "its CRC32 differs from the manifest's")
        return data, entry["layout"]

    def _damaged(self, index: int, path: Path, why: str) -> None:
        logger.warning(
            "layerstream: NF4 layer cache file %s is damaged (%s); quantising layer %d again.", path, why, index
        )
        self.layers.pop(str(index), None)
        return None

    def write(self, index: int, data: torch.Tensor, layout: dict) -> Path:
        """Write one layer's bytes (temp name, fsync, rename), then record it in the manifest."""
        path = self.path(index)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            _write_file(temporary, memoryview(data.numpy()))
            os.replace(temporary, path)
            _fsync_directory(path.parent)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise self._write_error(path.parent, exc) from exc
        self.layers[str(index)] = {"file": str(path), "nbytes": data.numel(), "crc32": crc32(data), "layout": layout}
        self._save()
        return path

    def _save(self) -> None:
        temporary = self.manifest_path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
        text = json.dumps({"source": self.source, "layers": self.layers}, indent=1).encode()
        try:
            _write_file(temporary, memoryview(text))
            os.replace(temporary, self.manifest_path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
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
    ) -> Tuple[LayerRecord, Path]:
        """The quantised layer, from the cache when it holds it intact, else by ``quantise``
        (which loads and quantises the meta layer in place), written to the cache."""
        cached = self.read(index)
        if cached is not None:
            data, layout = cached
            restore(layer, layout, data)
            record = HostStore.plan_layer(index, name, layer, lambda t: True)
            if describe(layer, record) == layout:
                return record, self.path(index)
            raise DiskCacheError(  # a bug, not a stale cache: the fingerprint matched
                f"layer {index} rebuilt from {self.path(index)} does not have the layout it was written with; "
                f"delete {', '.join(map(str, self.directories))} and load again."
            )
        quantise()
        record = HostStore.plan_layer(index, name, layer, lambda t: True)
        return record, self.write(index, region_bytes(record), describe(layer, record))


def _write_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
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
