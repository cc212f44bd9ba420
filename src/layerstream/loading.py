"""from_pretrained: load a causal LM straight into a streamed model, one layer at a time.

The model is built on the meta device; the resident part (embeddings, final norm, head)
is materialised and loaded first; then each decoder layer in turn is materialised on
the host, filled from the safetensors files, quantised to NF4 if asked (on the GPU when
there is one), and packed into the host store, which frees its unquantised weights. So
loading holds at most about one layer of unquantised weights beyond the packed store.

Before any layer is read, the whole checkpoint is checked against the model
(``checkpoint.validate_checkpoint``: every shard's header, every expected tensor's presence,
shape and kind of dtype), so a bad checkpoint is refused before anything is loaded.

A pre-quantised checkpoint is refused, except MXFP4 (gpt-oss as published), whose experts
stay in MXFP4 and are dequantised by each experts call (``modules.packed_experts``), or, asked
with ``Mxfp4Config(dequantize=True)``, are dequantised as each layer is read, with
transformers' own operation, as transformers loads it then (``checkpoints.mxfp4``).

Only safetensors are read. A hub id is resolved with huggingface_hub (config and
safetensors files only); remote code runs only with ``trust_remote_code=True``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Optional, Union

import torch
from torch import nn

from .checkpoints import mxfp4, progress
from .checkpoints.computed_buffers import compute_buffers, initialisers
from .checkpoints.conversion import for_checkpoint
from .checkpoints.files import resolve, resolve_dtype, weight_files
from .checkpoints.reader import TensorReader
from .checkpoints.stored import (
    LoadingError,
    missing_tensors_error,
    refuse_prequantized,
    transformers_can_load,
    validate_checkpoint,
)
from .config import StreamConfig
from .modules import nf4, packed_experts
from .modules.discovery import find_decoder_layers, layer_name
from .modules.meta import meta_model
from .system.log import get_logger
from .tiers import disk, nf4_cache, shared_store
from .tiers.store import HostStore, check_host_memory, plan_tiers

logger = get_logger(__name__)


__all__ = ["LoadingError", "from_pretrained"]


def _module_tensors(module: nn.Module, prefix: str, recurse: bool = True) -> dict[str, torch.Tensor]:
    """checkpoint name -> tensor, for each parameter and persistent buffer the loader fills."""
    wanted = {f"{prefix}{name}": tensor for name, tensor in module.named_parameters(recurse=recurse)}
    for mod_name, mod in module.named_modules() if recurse else [("", module)]:
        for buf_name, buffer in mod._buffers.items():
            if buffer is not None and buf_name not in mod._non_persistent_buffers_set:
                wanted[f"{prefix}{mod_name}.{buf_name}" if mod_name else f"{prefix}{buf_name}"] = buffer
    return wanted


def _resident_modules(model: nn.Module, layers: nn.ModuleList):
    """(checkpoint prefix, module) for every module outside the decoder stack."""
    stack_modules = {id(m) for layer in layers for m in layer.modules()}
    for name, module in model.named_modules():
        if id(module) not in stack_modules and module is not layers:
            yield (f"{name}." if name else ""), module


def _expected_tensors(model: nn.Module, path: str, layers: nn.ModuleList) -> dict[str, torch.Tensor]:
    """Every tensor the loader will fill, by checkpoint name, read from the meta model."""
    expected: dict[str, torch.Tensor] = {}
    for prefix, module in _resident_modules(model, layers):
        expected.update(_module_tensors(module, prefix, recurse=False))
    for index, layer in enumerate(layers):
        expected.update(_module_tensors(layer, f"{layer_name(path, index)}."))
    return expected


def _load_module(module: nn.Module, prefix: str, reader: TensorReader, owners, recurse: bool = True) -> list[str]:
    """Materialise a meta module on the host and fill it, computing the buffers no
    checkpoint holds (``owners``: from ``computed_buffers.initialisers``); returns names
    not found."""
    module.to_empty(device="cpu", recurse=recurse)
    missing = reader.fill(_module_tensors(module, prefix, recurse))
    compute_buffers(module.modules() if recurse else [module], owners)
    return missing


def _return_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise).

    Each layer's unquantised weights are freed once the layer is packed, but glibc keeps
    large freed blocks in the heap when smaller long-lived blocks sit above them; without
    a trim, resident memory would grow by a fraction of every layer loaded.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _check_host_memory(config, quantization, dtype, stream: StreamConfig, double_quant: bool, tiers=None):
    """Before reading any weight: will the host hold the store, the resident part and one
    unquantised layer (the loader's peak), and may the store be page-locked? With a disk
    tier (``tiers``) the store is the host-RAM layers and the staging ring. Returns the
    layer store's bytes (None: a layout the planner cannot size)."""
    from . import plan

    try:
        sizes = plan.layer_bytes(config, quantization or "none", dtype, double_quant)
        unquantised = max(plan.layer_bytes(config, "none", dtype))
        resident = plan.resident_bytes(config, dtype)
        # streamed embedding and head: a store of their own, page-locked with the layers'
        ends = plan.embedding_bytes(config, dtype) if stream.stream_embeddings is True else 0
    except (ValueError, AttributeError, TypeError):
        return None  # a layout the planner cannot size: loading reports its own problems
    if tiers is not None:
        sizes = [sizes[i] for i in tiers.ram]
    store = plan.loader_arena_bytes(sizes, stream.arena_bytes) + (tiers.ring_bytes if tiers is not None else 0)
    check_host_memory(store + resident + unquantised, store + ends, bool(stream.pin), "loading this model")
    return store


def _say_unquantised_weights(layers: nn.ModuleList, path: str, dtype: torch.dtype) -> None:
    """bitsandbytes' 4-bit, as transformers applies it, quantises nn.Linear weights only; a
    fused expert stack or a router is a plain Parameter and stays in the compute dtype (so
    does transformers' own 4-bit load). For a mixture of experts that is most of each layer:
    said once, with its share, so a "QLoRA" run's host memory is no surprise."""
    worst = None
    for index, layer in enumerate(layers):
        kept = [
            (f"{layer_name(path, index)}.{name}.{param_name}" if name else f"{layer_name(path, index)}.{param_name}", p)
            for name, module in layer.named_modules()
            if not isinstance(module, nn.Linear)
            for param_name, p in module.named_parameters(recurse=False)
            if p.dim() >= 2 and p.is_floating_point()
        ]
        # the weights an MXFP4 stack kept packed stands for count in the layer's total
        total = sum(p.numel() for p in layer.parameters()) + packed_experts.packed_values(layer)
        share = sum(p.numel() for _, p in kept) / total if total else 0.0
        if kept and (worst is None or share > worst[0]):
            worst = (share, kept)
    if worst is None:
        return
    share, kept = worst
    more = f" and {len(kept) - 1} more per layer" if len(kept) > 1 else ""
    logger.warning(
        "layerstream: quantization='nf4' quantises nn.Linear weights, as transformers and bitsandbytes do; "
        "%s%s are plain Parameters (fused experts, a router) and stay in %s, %.0f%% of the weights of such a "
        "layer (transformers' own 4-bit load keeps them the same way). The host memory check and "
        "`layerstream plan` count them so.",
        kept[0][0],
        more,
        str(dtype).replace("torch.", ""),
        100 * share,
    )


def _nf4_layer_bytes(config, dtype, double_quant: bool, count: int):
    """Each layer's packed NF4 bytes as the planner computes them: what the disk tier plans
    its staging ring and the host-RAM layers with, before any layer is quantised."""
    from . import plan

    try:
        sizes = plan.layer_bytes(config, "nf4", dtype, double_quant)
    except (ValueError, AttributeError, TypeError) as exc:
        sizes, why = [], str(exc)
    else:
        why = f"it counts {len(sizes)} layers, the model has {count}"
    if len(sizes) != count:
        raise LoadingError(
            f"host_budget with quantization='nf4' needs the packed size of each layer, which the planner cannot "
            f"compute for this model ({why}); leave host_budget unset or load without quantization."
        )
    return sizes


def nf4_settings(quantization_config, dtype: torch.dtype):
    """The BitsAndBytesConfig of a 4-bit NF4 load, from what a script passed; anything
    layerstream does not stream (8-bit, FP4, other quantisers) is refused by name."""
    from transformers import BitsAndBytesConfig

    if isinstance(quantization_config, dict):
        method = str(quantization_config.get("quant_method", "bitsandbytes")).lower()
        if method != "bitsandbytes":
            raise LoadingError(
                f"quantization_config names {method!r}; layerstream streams unquantised weights and "
                "bitsandbytes 4-bit NF4 (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')). "
                "Load without it, or in NF4."
            )
        quantization_config = BitsAndBytesConfig.from_dict(dict(quantization_config))
    method = str(getattr(quantization_config, "quant_method", "")).lower()
    if not isinstance(quantization_config, BitsAndBytesConfig):
        raise LoadingError(
            f"quantization_config is a {type(quantization_config).__name__} ({method or 'unknown method'}); "
            "layerstream streams unquantised weights and bitsandbytes 4-bit NF4 "
            "(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')). Load without it, or in NF4."
        )
    if quantization_config.load_in_8bit:
        raise LoadingError(
            "BitsAndBytesConfig(load_in_8bit=True): layerstream streams NF4 4-bit and unquantised "
            "weights, not 8-bit; use load_in_4bit=True with bnb_4bit_quant_type='nf4' "
            "(--load_in_4bit in TRL scripts), or no quantization_config."
        )
    if not quantization_config.load_in_4bit:
        return None
    if quantization_config.bnb_4bit_quant_type != "nf4":
        raise LoadingError(
            f"bnb_4bit_quant_type={quantization_config.bnb_4bit_quant_type!r}: layerstream streams "
            "4-bit weights in NF4 only; set bnb_4bit_quant_type='nf4'."
        )
    if quantization_config.bnb_4bit_compute_dtype is None:
        quantization_config.bnb_4bit_compute_dtype = dtype
    return quantization_config


def from_pretrained(
    model_id: Union[str, os.PathLike],
    *,
    quantization: Optional[str] = None,
    dtype=None,
    stream: Optional[StreamConfig] = None,
    trust_remote_code: bool = False,
    bnb_4bit_use_double_quant: bool = True,
    bnb_4bit_compute_dtype: Optional[torch.dtype] = None,
    revision: Optional[str] = None,
    quantize_on: Optional[Union[str, torch.device]] = None,
    allow_pickle: bool = False,
    quantization_config=None,
    attn_implementation: Optional[str] = None,
    experts_implementation: Optional[str] = None,
    torch_dtype=None,
    model_class=None,
    config=None,
    host_budget=None,
    device=None,
):
    """Load ``model_id`` (a local directory or a hub id) as a streamed causal LM.

    quantization: None (weights in ``dtype``) or "nf4" (bitsandbytes 4-bit, double
        quantisation unless ``bnb_4bit_use_double_quant=False``). The result is a 4-bit
        model as transformers would load it with BitsAndBytesConfig: PEFT wraps it with
        ``lora.Linear4bit`` and the Trainer accepts it for adapter training.
    quantization_config: a transformers BitsAndBytesConfig instead (4-bit NF4 only); for an
        MXFP4 checkpoint, also an ``Mxfp4Config``: with ``dequantize=True`` the experts are
        dequantised as each layer is read, as transformers does; otherwise they stay in MXFP4
        and each experts call dequantises them (``modules.packed_experts``), the default.
    dtype: a torch dtype, its name or "auto" (the checkpoint's own, as transformers 5
        loads by default); default "auto".
        ``torch_dtype`` is the older spelling of the same argument.
    stream: the StreamConfig (default ``StreamConfig()``).
    attn_implementation, experts_implementation: as transformers' ``from_pretrained`` takes
        them (default: transformers' choice).
    model_class: the transformers class to build (default: what AutoModelForCausalLM picks).
    config: the model's transformers config, when the caller has it (default: read from the
        checkpoint, as transformers does).
    device: where the layers run (``StreamConfig.device``): "cuda", "cuda:1", or "cpu" on a
        machine without CUDA; default the current CUDA device.
    host_budget: the host RAM the layer store may use (``StreamConfig.host_budget``: a size,
        "auto"); the layers beyond it are read from the checkpoint's files each time.
    quantize_on: where NF4 quantisation runs; default the stream device.
    allow_pickle: also read pickle checkpoints (``*.bin``), through
        ``torch.load(weights_only=True)``; refused by default.

    Raises LoadingError, before any layer is read, for a path that does not exist, a
    pre-quantised checkpoint other than MXFP4, a missing or damaged shard or index, and
    tensors that are missing or do not have exactly the model's shape (see
    ``layerstream.checkpoints.stored``).
    """
    from transformers import AutoConfig

    from .api import attach_runtime, check_long_context

    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise LoadingError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree; give one (dtype)")
    dtype = dtype if dtype is not None else torch_dtype if torch_dtype is not None else "auto"
    if quantization not in (None, "none", "nf4"):
        raise LoadingError(f"quantization={quantization!r}: use None or 'nf4'")
    if quantization == "nf4" and quantization_config is not None:
        raise LoadingError("give quantization='nf4' or quantization_config, not both")
    config_stream = stream if stream is not None else StreamConfig(device=device)
    if device is not None and stream is not None:
        config_stream = config_stream.replace(device=device)
    if host_budget is not None:
        config_stream = config_stream.replace(host_budget=host_budget)
    directory = resolve(model_id, revision, allow_pickle)
    if config is None:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    files = weight_files(directory, allow_pickle, config)
    stored_mxfp4 = mxfp4.quantization_of(directory)  # experts kept packed, or dequantised as read
    keep_packed = stored_mxfp4 is not None
    if stored_mxfp4 is None:
        try:
            refuse_prequantized(directory, files)
        except LoadingError as exc:
            raise transformers_can_load(exc) from None
    elif mxfp4.names_mxfp4(quantization_config):
        keep_packed = not mxfp4.asks_dequantise(quantization_config)  # Mxfp4Config(dequantize=True)
        quantization_config = None
    if stored_mxfp4 is not None:
        # a config of the caller's that asks to dequantise (with NF4 on top: no second quantization_config)
        keep_packed = keep_packed and not mxfp4.asks_dequantise(getattr(config, "quantization_config", None) or {})
        config = mxfp4.without_quantization(config)
    torch_dtype = resolve_dtype(dtype, config, files, directory)
    quant_config = None
    if quantization == "nf4":
        from transformers import BitsAndBytesConfig

        quant_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=bnb_4bit_compute_dtype or torch_dtype,
        )
    elif quantization_config is not None:
        quant_config = nf4_settings(quantization_config, torch_dtype)
    quantization = "nf4" if quant_config is not None else None
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if experts_implementation:
        extra["experts_implementation"] = experts_implementation
    model = meta_model(config, torch_dtype, model_class, trust_remote_code, **extra)
    quantizer = None
    if quant_config is not None:
        try:
            nf4.require_bnb("quantization='nf4'")
        except ImportError as exc:
            raise LoadingError(str(exc)) from None
        from transformers.quantizers import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(quant_config, pre_quantized=False)
        quantizer.preprocess_model(model, device_map=None, dtype=torch_dtype)
        nf4.set_unquantised_dtype(model, torch_dtype)
    bnb_4bit_use_double_quant = quant_config.bnb_4bit_use_double_quant if quant_config is not None else True
    path, layers = find_decoder_layers(model)
    packed_experts_of = packed_experts.pack_stored(layers, path, files, torch_dtype) if keep_packed else {}
    if packed_experts_of:  # the planner and the host memory check size the layers packed
        setattr(config, mxfp4.PACKED, True)
        setattr(model.config, mxfp4.PACKED, True)
    check_long_context(model, config_stream)  # before any weight is read
    if quantization == "nf4":
        _say_unquantised_weights(layers, path, torch_dtype)
    tied_head = getattr(config, "tie_word_embeddings", False)
    expected = _expected_tensors(model, path, layers)
    quantizer_of_files = mxfp4.dequantizer(stored_mxfp4) if stored_mxfp4 is not None and not packed_experts_of else None
    # transformers' renames, fused experts and MXFP4 dequantisation, per layer
    conversion = for_checkpoint(model, files, quantizer_of_files)
    validate_checkpoint(
        directory,
        files,
        expected,
        may_be_missing=[name for name in expected if tied_head and name.endswith("lm_head.weight")],
        conversion=conversion,
    )
    if packed_experts_of:
        mxfp4.say_packed(directory, packed_experts_of, len(layers))
    elif stored_mxfp4 is not None:
        dequantised = conversion.dequantised(expected) if conversion is not None else []
        mxfp4.say_dequantised(directory, {name: expected[name] for name in dequantised}, len(layers))
    packed = None
    if quantization == "nf4" and config_stream.host_budget is not None:
        packed = _nf4_layer_bytes(config, torch_dtype, bnb_4bit_use_double_quant, len(layers))
    tiers = plan_tiers(config_stream, layers, path, packed)
    store_bytes = _check_host_memory(config, quantization, torch_dtype, config_stream, bnb_4bit_use_double_quant, tiers)
    if conversion is not None and tiers is not None and tiers.disk:
        raise LoadingError(
            f"{directory} stores some tensors in another layout than the model holds them (transformers "
            "converts them while loading: renamed keys, one tensor per expert, or MXFP4 experts it dequantises), "
            "so the disk tier, which reads the model's bytes straight from the files, cannot read its layers. "
            "Raise host_budget (or "
            "leave it unset), or save the model with save_pretrained from a loaded model and stream that."
        )
    reader = TensorReader(files, conversion)

    # the resident part: every module outside the stack
    missing: list[str] = []
    owners = initialisers(model)
    for prefix, module in _resident_modules(model, layers):
        missing += _load_module(module, prefix, reader, owners, recurse=False)
    if tied_head:
        # as transformers' load ties: a head the checkpoint holds with other values than the
        # embedding stays the checkpoint's (transformers warns), one it lacks is tied
        model.tie_weights(missing_keys=set(missing), recompute_mapping=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if config_stream.stream_embeddings is True:  # refused now rather than after every layer is read
        from .runtime.embeddings import find_ends

        find_ends(model)

    quant_device = torch.device(quantize_on) if quantize_on is not None else config_stream.device
    if quant_device.type == "cuda" and not torch.cuda.is_available():
        quant_device = torch.device("cpu")
    store = HostStore(config_stream.arena_bytes, pin=bool(config_stream.pin))
    store.segment = shared_store.join_for_load(
        config_stream.share_host_store,
        tiers is not None,
        files.values(),
        {
            "dtype": str(torch_dtype),
            "quantization": quant_config.to_dict() if quant_config is not None else None,
            "quantize_on": quant_device.type,
            "arena_bytes": config_stream.arena_bytes,
            "experts": "mxfp4" if packed_experts_of else None,  # packed experts lay a layer out otherwise
        },
        needed=store_bytes,
        verify=bool(config_stream.checksum),
    )
    follower = store.segment is not None and not store.segment.builder
    with _closed_on_failure(store):  # a load that fails leaves no open files behind
        cache = None
        if tiers is not None:  # the layers the host budget does not hold are read from the files
            store.disk = disk.DiskTier(tiers, pin=bool(config_stream.pin), verify=bool(config_stream.checksum))
            if quantization == "nf4":  # ... from a cache of packed layers, written as they are quantised
                settings = nf4_cache.quant_settings(quant_config, torch_dtype, quant_device)
                if packed_experts_of:  # a layer with packed experts is laid out otherwise than a dequantised one
                    settings["experts"] = "mxfp4"
                source = nf4_cache.fingerprint(list(files.values()), settings)
                cache = nf4_cache.LayerCache(
                    nf4_cache.cache_directories(config_stream.disk_cache_dir, directory), source, len(layers)
                )
        what = "loading layers" if quantization != "nf4" else "loading and quantising layers to NF4"
        stored = lambda: sum(record.nbytes for record in store.records)
        for index, layer in progress.each_layer(enumerate(layers), len(layers), what, stored):
            prefix = f"{layer_name(path, index)}."
            if cache is not None:

                def quantise(layer=layer, prefix=prefix):
                    missing.extend(_load_module(layer, prefix, reader, owners))
                    nf4.quantise_layer(layer, quant_device, torch_dtype, quant_config)

                record, cached = cache.provide(index, prefix[:-1], layer, quantise)
                if index in tiers.disk:
                    store.disk.attach(store, record, store.disk.add_cache_file(cached, record))
                    _return_freed_memory()
                    continue
            elif tiers is not None and index in tiers.disk:
                store.disk.attach(store, HostStore.plan_layer(index, prefix[:-1], layer, lambda t: True), files)
                continue
            elif follower and quantization != "nf4":  # the bytes are in the shared store already
                layer.to_empty(device="cpu")
                record = HostStore.plan_layer(index, layer_name(path, index), layer, lambda t: True)
            else:
                missing += _load_module(layer, prefix, reader, owners)
                if quantization == "nf4":
                    nf4.quantise_layer(layer, quant_device, torch_dtype, quant_config)
                record = HostStore.plan_layer(index, layer_name(path, index), layer, lambda t: True)
            still = len(layers) - index if tiers is None else sum(1 for i in tiers.ram if i >= index)
            store.add(record, expected_bytes=record.nbytes * still)
            _return_freed_memory()
        if missing:  # validate_checkpoint refuses these up front; kept in case the two ever disagree
            raise missing_tensors_error(directory, missing)
        if store.disk is not None:
            store.disk.tune_readers()
    if store.segment is not None:
        from .tiers.store import layer_layout

        store.segment.complete([layer_layout(r) for r in store.records])
    if quantizer is not None:
        quantizer.postprocess_model(model)
        model.hf_quantizer = quantizer
    if packed_experts_of:
        packed_experts.keep_saving_packed(model, stored_mxfp4)
        packed_experts.keep_counting_packed(model)
        packed_experts.refuse_dequantised_state(model)
    model.eval()
    return attach_runtime(model, path, layers, config_stream, store.records, store)


@contextlib.contextmanager
def _closed_on_failure(store: HostStore):
    """Close the disk tier's files, and leave the shared segment (the last user removes it),
    if the load stops (a read error, a missing tensor, no room for the shared store)."""
    try:
        yield
    except BaseException:
        if store.disk is not None:
            store.disk.close()
        if store.segment is not None:
            store.segment.leave()
        raise
