"""Which files a checkpoint's weights are read from, and the dtype "auto" finds in them,
chosen as transformers' ``from_pretrained`` chooses them.

Why mirror it rather than pick sensibly: a directory can hold more than one set of weights
(``save_pretrained`` of an unsharded model over a sharded one leaves the old index beside
the new ``model.safetensors``; a config can name its own file in ``transformers_weights``),
and a streamed model must hold the weights the same script holds without layerstream.
transformers reads the config's ``transformers_weights`` first, then ``model.safetensors``,
then its index; "auto" takes the config's dtype, else the index's ``metadata.dtype``, else
the first floating-point tensor by name in the first file (sorted by file name).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..system.log import get_logger
from .paths import missing_directory
from .stored import LoadingError, load_pickle, read_header, read_index, transformers_can_load

logger = get_logger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SUBFOLDERS = ["*/*"]  # snapshot_download's ignore_patterns: files below the repository's top level


def resolve(model_id: str | os.PathLike, revision: str | None, allow_pickle: bool = False) -> Path:
    """The local directory of ``model_id``: itself, or the hub snapshot of its top level."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise LoadingError(f"{model_id} is a file; pass the directory that holds config.json and the weights")
    missing = missing_directory(model_id)
    if missing is not None:
        raise LoadingError(missing)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a transformers dependency
        raise LoadingError(f"{model_id} is not a local directory and huggingface_hub is missing") from exc
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"] + (["*.bin"] if allow_pickle else [])
    # the loader reads the top level only; a repository's subfolders (gpt-oss's original/, a
    # second copy of its weights) are not downloaded ("*" matches "/" in the hub's patterns)
    return Path(
        snapshot_download(str(model_id), revision=revision, allow_patterns=patterns, ignore_patterns=SUBFOLDERS)
    )


def named_file(directory: Path, config=None) -> Optional[Path]:
    """The file the config names in ``transformers_weights`` (a safetensors file or index
    inside ``directory``), else None; anything else is refused as transformers refuses it."""
    name = getattr(config, "transformers_weights", None) if config is not None else None
    if name is None:
        return None
    if not str(name).endswith((".safetensors", ".safetensors.index.json")):
        raise LoadingError(
            f"config.json's transformers_weights is {name!r}, neither a safetensors file nor a safetensors "
            "index (*.safetensors.index.json); transformers refuses it too. Name the weights file there, or "
            "remove the key."
        )
    # inside the directory by its path, not its target: the hub's snapshots are symlinks to
    # blobs elsewhere (transformers checks with abspath and commonpath too)
    base, path = os.path.abspath(directory), os.path.abspath(os.path.join(directory, name))
    if os.path.commonpath([base, path]) != base:
        raise LoadingError(f"config.json's transformers_weights ({name!r}) must name a file inside {directory}")
    return Path(path)


def weight_file(directory: Path, config=None) -> Optional[Path]:
    """The safetensors file or index transformers reads the weights from, else None."""
    named = named_file(directory, config)
    if named is not None:
        return named
    for name in (SINGLE, INDEX):
        if (directory / name).is_file():
            return directory / name
    return None


def weight_files(directory: Path, allow_pickle: bool = False, config=None) -> dict[str, Path]:
    """tensor name -> weight file, from the file transformers would read (``weight_file``).
    Pickle checkpoints are refused unless ``allow_pickle``."""
    chosen = weight_file(directory, config)
    if chosen is not None and not chosen.is_file():
        raise LoadingError(f"config.json's transformers_weights names {chosen}, which does not exist")
    if chosen is not None and chosen.name.endswith(".index.json"):
        return read_index(chosen)
    if chosen is not None:
        return {name: chosen for name in read_header(chosen)}
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
    if pickles and allow_pickle:
        return _pickle_files(directory, pickles)
    if pickles:
        raise transformers_can_load(
            LoadingError(
                f"{directory} holds only pickle weights ({', '.join(pickles[:3])}). layerstream reads "
                "safetensors by default (pickle files can run code when loaded). Convert them once with "
                "transformers (from_pretrained + save_pretrained(safe_serialization=True)) in a "
                "process you trust, or pass allow_pickle=True to read them with "
                "torch.load(weights_only=True)."
            )
        )
    raise LoadingError(f"no safetensors weights (model.safetensors or its index) in {directory}")


def _pickle_files(directory: Path, pickles: list[str]) -> dict[str, Path]:
    logger.warning(
        "layerstream: reading pickle weights from %s (allow_pickle=True) with torch.load(weights_only=True), "
        "which refuses arbitrary objects; convert them to safetensors once to load faster and without pickle.",
        directory,
    )
    index = directory / "pytorch_model.bin.index.json"
    if index.exists():
        return read_index(index)
    files: dict[str, Path] = {}
    for name in pickles:
        for key in load_pickle(directory / name):
            files[key] = directory / name
    return files


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(dtype, config=None, files=None, directory: Optional[Path] = None) -> torch.dtype:
    """A ``dtype=`` as transformers takes it: a torch dtype, its name, or "auto" (the
    checkpoint's own: its config's dtype, else what ``stored_dtype`` finds in the files;
    float32 when neither says)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if found is None and files:
            found = stored_dtype(files, directory, config)
        return resolve_dtype(found) if found is not None else torch.float32
    if isinstance(dtype, str) and dtype.replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.replace("torch.", "")]
    raise LoadingError(f"dtype={dtype!r}: use a torch dtype, one of {sorted(_DTYPES)}, or 'auto'")


_STORED = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def stored_dtype(files: dict, directory: Optional[Path] = None, config=None) -> Optional[torch.dtype]:
    """The dtype transformers' "auto" finds where the config names none: a sharded
    checkpoint's ``metadata.dtype`` in its index, else the first floating-point tensor, by
    name, of the first file (float8 and float4 passed over, as transformers does)."""
    chosen = weight_file(directory, config) if directory is not None else None
    if chosen is not None and chosen.name.endswith(".index.json"):
        try:
            metadata = json.loads(chosen.read_text()).get("metadata") or {}
        except (OSError, ValueError, AttributeError):
            metadata = {}
        if isinstance(metadata, dict) and metadata.get("dtype") is not None:
            return resolve_dtype(str(metadata["dtype"]))
    first = sorted(set(files.values()))[0]
    if first.suffix != ".safetensors":
        return None
    for _, stored in sorted(read_header(first).items()):
        if stored.floating and stored.dtype in _STORED:
            return _STORED[stored.dtype]
    return None
