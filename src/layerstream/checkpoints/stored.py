"""Checks a whole checkpoint against the model before the loader reads any weight.

The loader fills one layer at a time, and it opens a shard only when it reaches the first
tensor it needs there. A shard that is missing, cut short or damaged would therefore be
found only after earlier layers were read and quantised, and a tensor of the wrong shape
that broadcasts ([1, 64] into [64, 64]) would be copied silently into every row. So every
shard's header is read first (headers only, no tensor data, each file once) and every
tensor the model expects is looked up there: present, exactly the expected shape, and a
floating-point tensor where the model has one.

Pickle checkpoints (``allow_pickle=True``) have no header to check; their tensors' shapes
and dtypes come from ``torch.load(mmap=True)``, which maps the file without reading it.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import LoadingError

# safetensors refuses headers larger than this; a larger length means the file is not one
MAX_HEADER_BYTES = 100 * 2**20
FETCH_AGAIN = "download or save the checkpoint again"
MISMATCH_ADVICE = (
    "the weights do not match config.json: use the config.json saved with these weights, or save the model again"
)
# safetensors dtype -> (bits per element, floating point)
SAFETENSORS_DTYPES = {
    "BOOL": (8, False),
    "U8": (8, False),
    "I8": (8, False),
    "U16": (16, False),
    "I16": (16, False),
    "U32": (32, False),
    "I32": (32, False),
    "U64": (64, False),
    "I64": (64, False),
    "C64": (64, False),
    "F4": (4, True),
    "F6_E2M3": (6, True),
    "F6_E3M2": (6, True),
    "F8_E4M3": (8, True),
    "F8_E5M2": (8, True),
    "F8_E8M0": (8, True),
    "F16": (16, True),
    "BF16": (16, True),
    "F32": (32, True),
    "F64": (64, True),
}


def _holds_every_value(target: torch.dtype, stored) -> bool:
    """Whether every value of the integer (or bool) dtype ``stored`` is one of ``target``'s."""
    if stored is None or target.is_floating_point or target.is_complex:
        return False
    if stored == target:
        return True

    def bounds(dtype):
        return (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)

    (low, high), (target_low, target_high) = bounds(stored), bounds(target)
    return target_low <= low and high <= target_high


def _integer_dtype(stored: str):
    """The torch dtype of a non-floating stored dtype (a safetensors name, or torch's in a
    pickle checkpoint); None where torch has none (a complex tensor)."""
    return _STORED_INTEGERS.get(stored, getattr(torch, stored, None))


# safetensors names of the torch dtypes a layer file may hold (the disk tier, the NF4 cache)
TORCH_DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# the integer dtypes by their safetensors names: those above, and the wider unsigned ones
_STORED_INTEGERS = {
    **{name: dtype for dtype, name in TORCH_DTYPE_NAMES.items() if not dtype.is_floating_point},
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
PICKLE_SUFFIXES = (".bin", ".pt")  # read only with allow_pickle=True
PREQUANTIZED_MARKERS = (".weight.absmax", ".weight.quant_map", ".weight.quant_state.")


class StoredTensor(NamedTuple):
    """What a checkpoint says about one tensor, read without its data."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    floating: bool


def read_index(index: Path) -> dict[str, Path]:
    """tensor name -> shard, from a ``*.index.json`` file (which must be JSON with a weight_map)."""
    try:
        content = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoadingError(f"{index} is not valid JSON ({exc}); {FETCH_AGAIN}") from None
    mapping = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(file, str) for file in mapping.values()):
        raise LoadingError(f"{index} has no weight_map (tensor name -> shard file); {FETCH_AGAIN}")
    return {name: index.parent / file for name, file in mapping.items()}


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor a safetensors file holds, from its header alone (``_parse``)."""
    return _parse(path)[0]


def read_layout(path: Path) -> tuple[dict[str, StoredTensor], dict[str, tuple[int, int]]]:
    """What ``read_header`` gives, and tensor name -> (first byte, end) in the file: where
    the disk tier reads each tensor's bytes (no copy of the checkpoint)."""
    return _parse(path)


def _parse(path: Path) -> tuple[dict[str, StoredTensor], dict[str, tuple[int, int]]]:
    """Every tensor a safetensors file holds and where its bytes are, from its header alone.

    The format: an 8-byte little-endian header length, a JSON header (per tensor: dtype,
    shape and data_offsets into the data that follows; an optional ``__metadata__``), then
    the tensors' bytes, contiguous. A file that safetensors would refuse when the loader
    opens it is refused here, before any layer is read.
    """
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(0)
            length = struct.unpack("<Q", handle.read(8))[0] if size >= 8 else None
            if length is None or length > MAX_HEADER_BYTES or 8 + length > size:
                raise LoadingError(
                    f"{path} is truncated or not a safetensors file ({size} bytes, too short "
                    f"for its header); {FETCH_AGAIN}"
                )
            raw = handle.read(length)
    except OSError as exc:
        raise LoadingError(f"{path} cannot be read ({exc}); {FETCH_AGAIN}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoadingError(f"{path}: the safetensors header is not valid JSON ({exc}); {FETCH_AGAIN}") from None
    if not isinstance(header, dict):
        raise LoadingError(f"{path}: the safetensors header is not a JSON object; {FETCH_AGAIN}")
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name], span = _entry(path, name, entry)
        spans.append((span, name))
    data_bytes = size - 8 - length
    needed = max((end for (_, end), _ in spans), default=0)
    if needed > data_bytes:
        raise LoadingError(f"{path} is truncated: {size} bytes, its header needs {8 + length + needed}; {FETCH_AGAIN}")
    covered = 0
    for (begin, end), name in sorted(spans):
        if begin != covered:
            raise LoadingError(
                f"{path}: tensor {name}'s data_offsets overlap another tensor or leave a gap; {FETCH_AGAIN}"
            )
        covered = end
    if covered != data_bytes:
        raise LoadingError(f"{path} has {data_bytes - covered} bytes after its last tensor; {FETCH_AGAIN}")
    start = 8 + length
    return tensors, {name: (start + begin, start + end) for (begin, end), name in spans}


def _entry(path: Path, name: str, entry) -> tuple[StoredTensor, tuple[int, int]]:
    """One header entry, checked: a known dtype, a shape, and data_offsets of dtype x shape bytes."""

    def refuse(problem: str) -> LoadingError:
        return LoadingError(f"{path}: tensor {name} {problem}; {FETCH_AGAIN}")

    if not isinstance(entry, dict):
        raise refuse("has a header entry that is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise refuse(f"has dtype {dtype!r}, which safetensors does not define")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise refuse(f"has shape {shape!r}, not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise refuse(f"has data_offsets {offsets!r}, not [begin, end]")
    bits, floating = SAFETENSORS_DTYPES[dtype]
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * bits != 8 * (offsets[1] - offsets[0]):
        raise refuse(
            f"has data_offsets {offsets} ({offsets[1] - offsets[0]} bytes), but {dtype} x {shape} "
            f"needs {numel * bits / 8:g} bytes"
        )
    return StoredTensor(path, dtype, tuple(shape), floating), (offsets[0], offsets[1])


def load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A pickle checkpoint through torch's restricted unpickler, memory-mapped (lazy)."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise LoadingError(
            f"{path} cannot be read with torch.load(weights_only=True, mmap=True) ({exc}); "
            f"{FETCH_AGAIN}, or convert it to safetensors"
        ) from None


def _read_pickle_entries(path: Path) -> dict[str, StoredTensor]:
    return {
        name: StoredTensor(path, str(value.dtype).replace("torch.", ""), tuple(value.shape), value.is_floating_point())
        for name, value in load_pickle(path).items()
        if isinstance(value, torch.Tensor)
    }


def is_prequantized(directory: Path, files: dict[str, Path]) -> bool:
    """Whether the checkpoint is already quantised (see ``prequantized_evidence``)."""
    return prequantized_evidence(directory, files) is not None


def prequantized_evidence(directory: Path, files: dict[str, Path]) -> str | None:
    """Why the checkpoint looks already quantised, or None: its config.json carries a
    quantization_config, or it holds bitsandbytes quant-state tensors (``*.weight.absmax``,
    ``*.weight.quant_state.*``). The loader reads unquantised weights only and quantises them itself."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = None  # transformers reports an unreadable config.json itself
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if quantization:
        method = quantization.get("quant_method", "unknown method") if isinstance(quantization, dict) else "?"
        return f"config.json has a quantization_config ({method})"
    for name in files:
        if any(marker in name for marker in PREQUANTIZED_MARKERS):
            return f"it holds quantisation state such as {name}"
    return None


def refuse_prequantized(directory: Path, files: dict[str, Path]) -> None:
    """Refuse an already quantised checkpoint: its tensors are not the weights the model
    expects. The loader calls this for every checkpoint but MXFP4 (``checkpoints.mxfp4``),
    whose experts it dequantises as transformers does."""
    evidence = prequantized_evidence(directory, files)
    if evidence is not None:
        raise LoadingError(
            f"{directory} is a pre-quantised checkpoint ({evidence}); pre-quantised checkpoints "
            "other than MXFP4 (gpt-oss, kept packed or dequantised) are not read by layerstream's loader: "
            "load the unquantised checkpoint with quantization='nf4', or, where only this one is published, "
            "load it with transformers on the host (AutoModelForCausalLM.from_pretrained(..., device_map='cpu')) "
            "and call layerstream.stream_model; `layerstream run` does that for a script by itself"
        )


def transformers_can_load(error: LoadingError) -> LoadingError:
    """Mark an error for a checkpoint transformers' own loader reads (the launcher then
    loads it that way, on the host, and streams it)."""
    error.transformers_can_load = True
    return error


def missing_tensors_error(directory: Path, missing: list[str]) -> LoadingError:
    """The error for tensors the model needs that the checkpoint lacks."""
    if any(".experts." in name for name in missing):
        return transformers_can_load(
            LoadingError(
                f"{directory} stores mixture-of-experts weights in a layout that transformers' conversion "
                "mapping for this model does not map to the model's experts. Load with "
                "AutoModelForCausalLM.from_pretrained(..., device_map='cpu') and call layerstream.stream_model "
                "instead."
            )
        )
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    return LoadingError(
        f"{len(missing)} tensors were not found in {directory}: {', '.join(missing[:5])}{more}; {MISMATCH_ADVICE}"
    )


def _stored(stored: dict[Path, dict[str, StoredTensor]], files: dict[str, Path], name: str) -> StoredTensor:
    found = stored[files[name]].get(name)
    if found is None:
        raise LoadingError(
            f"the index puts {name} in {files[name]}, which does not hold it (the index and "
            f"the shards come from different saves); {FETCH_AGAIN}"
        )
    return found


def validate_checkpoint(
    directory: Path,
    files: dict[str, Path],
    expected: dict[str, torch.Tensor],
    may_be_missing: Collection[str] = (),
    conversion=None,
) -> None:
    """Refuse the checkpoint unless every expected tensor can be loaded as it is.

    files: tensor name -> file, as the loader will read them. expected: tensor name -> the
    (meta) tensor it fills, with the exact shape and dtype the model has. may_be_missing:
    names the model can do without (a head tied to the embeddings). conversion: where
    transformers' mapping renames or converts (``layerstream.checkpoints.conversion``), a renamed
    tensor is checked under its checkpoint name, and a converted one is checked for its
    sources here and for its shape once converted. Each file's header is read once; no
    tensor data is read.
    """
    converted: dict[str, torch.Tensor] = {}
    if conversion is not None:
        converted = {name: tensor for name, tensor in expected.items() if name in conversion.produced}
        expected = {conversion.source.get(name, name): t for name, t in expected.items() if name not in converted}
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in files.items():
        by_file[path].append(name)
    stored: dict[Path, dict[str, StoredTensor]] = {}
    for path, names in sorted(by_file.items()):
        if not path.is_file():
            raise LoadingError(
                f"{path.name} holds {len(names)} tensors (such as {names[0]}) but is not in "
                f"{directory}: download the missing shard again"
            )
        stored[path] = _read_pickle_entries(path) if path.suffix in PICKLE_SUFFIXES else read_header(path)
    missing = [name for name in expected if name not in files and name not in may_be_missing]
    if missing:
        raise missing_tensors_error(directory, missing)
    problems = []
    for name, target in expected.items():
        if name not in files:
            continue
        found = _stored(stored, files, name)
        if found.shape != tuple(target.shape):
            problems.append(
                f"{name} in {found.file.name} has shape {list(found.shape)}, the model expects {list(target.shape)}"
            )
        elif found.floating != target.is_floating_point():
            kind = "a floating-point" if target.is_floating_point() else "a non-floating"
            problems.append(
                f"{name} in {found.file.name} is stored as {found.dtype}, the model expects "
                f"{kind} tensor ({str(target.dtype).replace('torch.', '')})"
            )
        elif not found.floating and not _holds_every_value(target.dtype, _integer_dtype(found.dtype)):
            # an integer copied into a dtype that cannot hold all its values (MXFP4's scales,
            # unsigned exponents, as int8) would mean another value than transformers reads;
            # widening (a table stored as int32 for an int64 buffer) keeps every value
            problems.append(
                f"{name} in {found.file.name} is stored as {found.dtype}, the model expects "
                f"{str(target.dtype).replace('torch.', '')}"
            )
    if converted:
        problems += conversion.check(converted, lambda key: _stored(stored, files, key).shape)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise LoadingError(f"{directory} does not fit the model: {'; '.join(problems[:5])}{more}; {MISMATCH_ADVICE}")
