"""Reading named tensors from a checkpoint's files into the model's tensors, a module at a
time: each file is opened (mapped) only while one module's tensors are read, so mapped pages
do not pile up, and a tensor that no longer reads as it was checked is refused by name."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from .conversion import Conversion
from .stored import PICKLE_SUFFIXES, LoadingError, load_pickle


class TensorReader:
    """Reads named tensors from the safetensors files; each file is opened (mapped) only
    while the tensors of one module are read, so mapped pages do not pile up."""

    def __init__(self, files: dict[str, Path], conversion: Optional[Conversion] = None):
        self.files = files
        self.conversion = conversion

    def fill(self, targets: dict[str, torch.Tensor]) -> list[str]:
        """Copy each named tensor into its target, one at a time; returns names not found.
        With a ``conversion``, a model name is read from the checkpoint name it maps to,
        and converted groups (fused experts) through transformers' operations.

        A file or tensor that fails to read (changed or damaged since it was checked)
        raises LoadingError naming both."""
        conversion = self.conversion
        converted = conversion.converted(targets) if conversion is not None else []
        plain = {
            (conversion.source.get(name, name) if conversion is not None else name): (name, targets[name])
            for name in targets
            if name not in converted
        }
        missing = [name for key, (name, _) in plain.items() if key not in self.files]
        found = {key: value for key, value in plain.items() if key in self.files}

        def copy_in(key, value, path):
            name, target = found[key]
            copy_into(target, value, name, path)

        self._each(list(found), copy_in)
        if converted:
            with torch.no_grad():
                for name, part, value, origin in conversion.converted_values(converted, self.read):
                    target = targets[name] if part is None else targets[name][part]
                    copy_into(target, value, f"{name} ({origin})")
        return missing

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The named checkpoint tensors, as stored."""
        out: dict[str, torch.Tensor] = {}
        self._each(keys, lambda key, value, path: out.__setitem__(key, value))
        return out

    def _each(self, keys: list[str], take) -> None:
        """``take(key, tensor, path)`` for each checkpoint name, file by file."""
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = defaultdict(list)
        for key in keys:
            by_file[self.files[key]].append(key)
        with torch.no_grad():
            for path, names in by_file.items():
                if path.suffix in PICKLE_SUFFIXES:  # allow_pickle=True
                    tensors = load_pickle(path)
                    for name in names:
                        take(name, tensors[name], path)
                    del tensors
                    continue
                try:
                    handle = safe_open(str(path), framework="pt")
                except (SafetensorError, OSError, RuntimeError) as exc:
                    raise _unreadable(names[0], path, exc) from exc
                with handle:
                    for name in names:
                        try:
                            value = handle.get_tensor(name)
                        except (SafetensorError, OSError, RuntimeError) as exc:
                            raise _unreadable(name, path, exc) from exc
                        take(name, value, path)
                        del value


def _unreadable(name: str, path: Path, exc: BaseException) -> LoadingError:
    return LoadingError(
        f"{name} in {path} cannot be read ({exc}); the file was damaged or changed after "
        "it was checked: download or save the checkpoint again"
    )


def copy_into(target: torch.Tensor, value: torch.Tensor, name: str = "a tensor", path: Path | None = None) -> None:
    """Floating-point values are cast to the target's dtype; any other shape than the
    target's is refused, since copy_ would broadcast a [1, n] value into every row."""
    if value.shape != target.shape:
        where = f" in {path}" if path is not None else ""
        raise LoadingError(f"{name}{where} has shape {list(value.shape)}, the model expects {list(target.shape)}")
    target.copy_(value.to(target.dtype) if value.is_floating_point() else value)
