"""The files the disk tier reads, and the host tensors that map them.

A disk layer's host tensors (what ``state_dict``, ``save_pretrained``, PEFT and the user
see) are views of a private memory map of the checkpoint's files. A map cannot stop
another process from truncating a file under it: reading a page past the file's new end
kills the process with SIGBUS, and a map cannot be made to fail more gently. So the disk
tier checks a file's size and modification time against those it had at load before
each read it makes (``SourceFile.check``), and each of those host tensors gets
``FileBacked`` mixed into its class: a torch function that reads one of them checks its
layer's files first and raises ``DiskReadError`` naming the file instead. Reading
metadata (shape, dtype, ``requires_grad``, the version counter) reads no bytes and is not
checked; nothing on the streamed step's path reads these tensors (the layers compute from
device copies of the bytes the disk tier read).

Nor can a value written into those tensors reach the device: ``LoadGuard`` leaves out of a
``load_state_dict`` the values equal to what the layer holds, and refuses any other.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, Tuple

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..checkpoints.stored import StoredTensor
from ..errors import DiskReadError, StreamingError
from ..modules import swap


@dataclass
class SourceFile:
    path: Path
    fd: int  # the descriptor reads use (O_DIRECT when allowed)
    buffered_fd: int
    fingerprint: Tuple[int, int]  # (size, mtime in ns) at load
    tensors: Dict[str, StoredTensor]
    offsets: Dict[str, Tuple[int, int]]
    mapping: mmap.mmap

    def check(self, layer: str) -> None:
        """Refuse a file that changed since it was loaded (what was read would be other bytes)."""
        stat = os.fstat(self.buffered_fd)
        now = (stat.st_size, stat.st_mtime_ns)
        if now != self.fingerprint:
            raise DiskReadError(
                f"{self.path} changed while the run used it (size/mtime {self.fingerprint} at load, {now} now), "
                f"so {layer} can no longer be read from it as it was loaded. Restore the file, or restart the "
                "run on an unchanged checkpoint (copy it first if something rewrites it)."
            )


def read_fully(source: SourceFile, fd: int, target: memoryview, offset: int) -> None:
    """pread until ``target`` is full; a read that returns nothing is a short file."""
    done, wanted = 0, len(target)
    while done < wanted:
        got = os.preadv(fd, [target[done:]], offset + done)
        if got <= 0:
            raise short_read(source, offset, wanted, done)
        done += got


def short_read(source: SourceFile, offset: int, wanted: int, got: int) -> DiskReadError:
    """A read that came back short: the file shrank after it was loaded (its check, made
    before the read started, passed). Worded like ``SourceFile.check``'s refusal, since it
    is the same event seen from a read already under way."""
    return DiskReadError(
        f"{source.path} changed while the run used it: a read of {wanted} bytes at offset {offset} returned "
        f"{got}, so the file is shorter than when it was loaded (truncated or replaced). Nothing was copied to "
        "the GPU. Restore the file, or restart the run on an unchanged checkpoint (copy it first if something "
        "rewrites it)."
    )


# -- reads of the host tensors ---------------------------------------------------------------
_CHECKS = WeakIdKeyDictionary()  # host tensor of a disk layer -> the check of its layer's files
# attribute getters that return a view of the bytes (the others read metadata only)
_VIEW_GETTERS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


class FileBacked:
    """Mixed into the class of a disk layer's host tensor: reading it checks the files first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _reads_bytes(func):
            for value in _tensors(args, kwargs):
                check = _CHECKS.get(value)
                if check is not None:
                    check()
        if not issubclass(cls, nn.Parameter):  # a buffer or quant-state tensor: results stay plain tensors
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        return super().__torch_function__(func, types, args, kwargs or {})

    @property
    def data(self):
        """``.data`` reads through an alias: checked like any other read."""
        check = _CHECKS.get(self)
        if check is not None:
            check()
        return super().data

    @data.setter
    def data(self, value):
        super(FileBacked, type(self)).data.__set__(self, value)


def _reads_bytes(func) -> bool:
    if getattr(func, "__name__", None) != "__get__":
        return True
    return getattr(getattr(func, "__self__", None), "__name__", None) in _VIEW_GETTERS


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for value in (*args, *(kwargs or {}).values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                yield item


def guard(tensor: torch.Tensor, check: Callable[[], None]) -> None:
    """Check the files (``check``) before each read of ``tensor``."""
    _CHECKS[tensor] = check
    swap.swap_in(tensor, FileBacked)


def unguard(tensor: torch.Tensor) -> None:
    _CHECKS.pop(tensor, None)
    swap.swap_out(tensor, FileBacked)


# -- loads into the host tensors -------------------------------------------------------------
class LoadGuard:
    """``load_state_dict`` into disk layers. Their host tensors map the checkpoint's files
    and the layers compute from what the disk tier reads from those files, so a value
    written into them would never reach the device. A value equal to the layer's, byte for
    byte (``model.load_state_dict(model.state_dict())``), is left out of the load: nothing is
    written (a write would also copy the mapped pages into RAM) and the key is not reported
    missing. Any other value is refused, at the first module of the load that holds a disk
    layer's tensor, before any tensor under it is loaded."""

    def __init__(self, layers):
        self.layers = layers  # disk.py's _Layer objects: record, files
        self._left_out: Tuple[list, set] = ([], set())  # (the load's missing_keys, keys left out)

    def install(self, modules) -> list:
        handles = []
        for module in {id(m): m for m in modules}.values():
            handles.append(module.register_load_state_dict_pre_hook(self._before))
            handles.append(module.register_load_state_dict_post_hook(self._after))
        return handles

    def _before(self, module, state_dict, prefix, local_metadata, strict, missing_keys, *_) -> None:
        paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        equal, changed = [], []
        for layer in self.layers:
            for entry, host in zip(layer.record.entries, layer.record.host_values):
                path = paths.get(id(entry.module))
                key = None if path is None or not entry.bound else f"{prefix}{path}{'.' if path else ''}{entry.name}"
                value = state_dict.get(key) if key is not None else None
                if value is None or tuple(value.shape) != tuple(host.shape):  # a shape torch itself refuses
                    continue
                (equal if value is host or _same_bytes(value, host) else changed).append((key, layer))
        if changed:
            raise _load_refused(changed)
        if self._left_out[0] is not missing_keys:  # a new load_state_dict call
            self._left_out = (missing_keys, set())
        for key, _ in equal:
            del state_dict[key]
            self._left_out[1].add(key)

    def _after(self, module, incompatible) -> None:
        missing, left_out = self._left_out
        if missing is incompatible.missing_keys and left_out:
            missing[:] = [key for key in missing if key not in left_out]


def _same_bytes(value: torch.Tensor, host: torch.Tensor) -> bool:
    """Whether ``host.copy_(value)`` would leave ``host``'s bytes as they are."""
    with torch.no_grad():
        new = value.detach().to(device="cpu", dtype=host.dtype).contiguous().reshape(-1)
        return torch.equal(new.view(torch.uint8), host.detach().reshape(-1).view(torch.uint8))


def _load_refused(changed) -> StreamingError:
    keys = ", ".join(key for key, _ in changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    layers = sorted({layer.record.name for _, layer in changed})
    files = sorted({str(f.path) for _, layer in changed for f in layer.files})
    return StreamingError(
        f"load_state_dict would change {keys}: the disk tier reads {', '.join(layers)} from {', '.join(files)} "
        "each time (host_budget), so new values would never reach the GPU. Nothing was loaded. Load them into a "
        "model that keeps the layers in host RAM (host_budget unset or larger), or save them as a checkpoint "
        "(save_pretrained) and load that with host_budget."
    )
