"""Public entry points: stream_model, unstream_model, get_runtime, is_streamed."""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
from torch import nn

from . import ends as ends_mod
from . import layer as layer_mod
from . import nf4
from .config import StreamConfig, StreamConfigError
from .discovery import find_decoder_layers, layer_name, unwrap_peft
from .runtime import StreamingError, StreamRuntime
from .store import HostStore, check_host_memory

logger = logging.getLogger(__name__)

_ATTR = "_layerstream_runtime"


def _holder(model: nn.Module) -> nn.Module:
    """The module that carries the runtime: the transformers model under any PEFT wrapper."""
    return unwrap_peft(model)


def is_streamed(model: nn.Module) -> bool:
    return getattr(_holder(model), _ATTR, None) is not None or getattr(model, _ATTR, None) is not None


def get_runtime(model: nn.Module) -> StreamRuntime:
    """The StreamRuntime of a streamed model (stats, slots, store)."""
    runtime = getattr(_holder(model), _ATTR, None) or getattr(model, _ATTR, None)
    if runtime is None:
        raise StreamingError(
            f"{type(model).__name__} is not streamed; call layerstream.stream_model(model) first."
        )
    return runtime


def _check_layers_on_host(layers: nn.ModuleList, path: str, streamed) -> None:
    for index, layer in enumerate(layers):
        for name, tensor in list(layer.named_parameters()) + list(layer.named_buffers()):
            if not streamed(tensor):
                continue  # trainable or shared tensors stay resident wherever they are
            where = tensor.device
            if where.type == "meta":
                raise StreamingError(
                    f"{layer_name(path, index)}.{name} is on the meta device (no weights loaded). "
                    "Load real weights first (from_pretrained without device_map='meta', or "
                    "materialise with to_empty and load a state dict) before stream_model."
                )
            if where.type != "cpu":
                raise StreamingError(
                    f"{layer_name(path, index)}.{name} is already on {where}. stream_model takes "
                    "a model in host memory: load it on CPU (no device_map, no .to('cuda')), "
                    "stream it, then call model.to('cuda') to place the resident part."
                )


def _streamed_predicate(model: nn.Module, layers: nn.ModuleList):
    """Which layer tensors stream.

    Frozen tensors and buffers stream. In a model where nothing is frozen yet (fresh
    from from_pretrained, PEFT not applied), every layer tensor streams: PEFT freezes
    them later, and training a streamed tensor is refused with a clear error.
    Tensors shared with the resident part or with another layer stay resident.
    """
    nothing_frozen = all(p.requires_grad for p in model.parameters())
    owner: dict = {}
    for index, layer in enumerate(layers):
        for tensor in list(layer.parameters()) + list(layer.buffers()):
            owner.setdefault(id(tensor), set()).add(index)
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    outside = set()
    for module in model.modules():
        if id(module) in in_layers:
            continue
        for tensor in list(module._parameters.values()) + list(module._buffers.values()):
            if tensor is not None:
                outside.add(id(tensor))
    shared = {key for key, holders in owner.items() if len(holders) > 1} | outside

    def streamed(tensor: torch.Tensor) -> bool:
        if id(tensor) in shared:
            return False
        return nothing_frozen or not tensor.requires_grad

    return streamed


def stream_model(model: nn.Module, config: Optional[StreamConfig] = None, **overrides) -> nn.Module:
    """Stream ``model``'s decoder layers in place and return the same model.

    The layers' frozen weights move into host arenas (pinned when the device is CUDA);
    a pool of ``config.slots`` device buffers receives each layer just before it runs.
    With ``stream_embeddings=True`` the input embedding and output head stay in host
    memory too (see ``layerstream.ends``). Call ``model.to(device)`` afterwards to place
    the resident part.
    """
    if config is None:
        config = StreamConfig(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    if not isinstance(config, StreamConfig):
        raise TypeError(f"config must be a layerstream.StreamConfig, got {type(config).__name__}")
    if is_streamed(model):
        raise StreamingError(
            "this model is already streamed; call layerstream.unstream_model(model) before "
            "streaming it again with other settings."
        )
    path, layers = find_decoder_layers(model)
    streamed = _streamed_predicate(model, layers)
    _check_layers_on_host(layers, path, streamed)
    records = [HostStore.plan_layer(i, layer_name(path, i), layer, streamed) for i, layer in enumerate(layers)]
    empty = [r.name for r in records if not r.entries]
    if len(empty) == len(records):
        raise StreamingError(
            "no tensor of the decoder layers can stream: every one is trainable or shared "
            "with the resident part. Freeze the base weights (e.g. apply PEFT) first."
        )
    largest = max(r.nbytes for r in records)
    config = _automatic_slots(config, largest)
    _check_slots_fit_budget(config, largest)
    if config.stream_embeddings:
        # checked whole before any copy; the host must hold and may page-lock both stores
        ends_weights = [w for _, w in ends_mod.find_ends(model).weights()]
        ends_bytes = [w.numel() * w.element_size() for w in ends_weights]
        check_host_memory(max(largest, *ends_bytes),
                          sum(r.nbytes for r in records) + sum(ends_bytes), bool(config.pin),
                          "streaming this model with its embedding and head")
    if any(e.kind == "quant" for r in records for e in r.entries):
        try:
            nf4.require_bnb("streaming a 4-bit model")
        except ImportError as exc:
            raise StreamingError(str(exc)) from None
    store = HostStore(config.arena_bytes, pin=bool(config.pin))
    store.build(records)
    return attach_runtime(model, path, layers, config, records, store)


def _automatic_slots(config: StreamConfig, largest_layer: int) -> StreamConfig:
    """slots='auto' takes two slots, not three, when the budget holds no more."""
    budget = config.vram_budget
    if "slots" not in config.automatic or budget is None or config.slots * largest_layer <= budget:
        return config
    chosen = config.replace(slots=2)
    chosen.automatic = chosen.automatic | {"slots"}
    return chosen


def _check_slots_fit_budget(config: StreamConfig, largest_layer: int) -> None:
    budget = config.vram_budget
    if budget is None or config.slots * largest_layer <= budget:
        return
    gib = 2**30
    fitting = budget // max(largest_layer, 1)
    advice = (f"use slots={fitting}" if fitting >= 2 else
              "load the model in NF4 (quantization='nf4'), or raise the budget")
    raise StreamConfigError(
        f"{config.slots} slots of the largest layer ({largest_layer / gib:.2f} GiB each) need "
        f"{config.slots * largest_layer / gib:.2f} GiB, more than vram_budget={budget / gib:.2f} GiB "
        f"before anything else is on the GPU: {advice}.")


def attach_runtime(model: nn.Module, path: str, layers: nn.ModuleList, config: StreamConfig,
                   records, store: HostStore) -> nn.Module:
    """Turn a model whose layers are packed in ``store`` into a streamed model."""
    runtime = StreamRuntime(model, layers, path, config, records, store)
    if config.stream_embeddings:
        runtime.ends = ends_mod.stream_ends(model, runtime)
    object.__setattr__(_holder(model), _ATTR, runtime)
    _hide_from_ddp(model, records + (runtime.ends.records if runtime.ends is not None else []))
    _install_trainer_integration()
    for index, layer in enumerate(layers):
        layer_mod.make_streamed(layer, runtime, index)
    for module in _streamed_linear4bit(records):
        layer_mod.make_streamed_linear4bit(module, runtime)
    logger.info(runtime.summary())
    return model


_DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"
_PEFT_PREFIX = "base_model.model."  # where a PEFT wrapper keeps the transformers model


def _hide_from_ddp(model: nn.Module, records) -> None:
    """Keep DistributedDataParallel away from streamed tensors.

    DDP broadcasts every parameter and buffer it is not told to ignore, and refuses a
    module whose parameters sit on more than one device type; streamed tensors live on
    the host. The names are given relative to the transformers model and to a PEFT
    wrapper around it (PEFT forwards the attribute lookup), so DDP finds them whichever
    of the two it wraps, whether PEFT came before or after streaming.
    """
    holder = _holder(model)
    prefix = next((name + "." for name, module in model.named_modules() if module is holder and name), "")
    names = set()
    for record in records:
        for entry in record.entries:
            if entry.bound:
                relative = entry.qualified_name[len(prefix):] if entry.qualified_name.startswith(prefix) else entry.qualified_name
                names.update((relative, _PEFT_PREFIX + relative))
    object.__setattr__(holder, _DDP_IGNORE, sorted(names))


def _install_trainer_integration() -> None:
    """A streamed model handed to a Trainer reports its stats with no further code."""
    try:
        from .integrations.trainer import install
    except ImportError:  # transformers without Trainer support
        return
    install()


def _streamed_linear4bit(records) -> list:
    """The Linear4bit modules whose packed weight streams."""
    modules = {id(e.module): e.module for r in records for e in r.entries if e.kind == "quant"}
    return list(modules.values())


def _resident_device(model: nn.Module, runtime: StreamRuntime) -> torch.device:
    streamed_ids = {id(v) for r in runtime.records for v in r.host_values}
    if runtime.ends is not None:
        streamed_ids |= {id(w) for _, w in runtime.ends.found.weights()}
    for tensor in model.parameters():
        if id(tensor) not in streamed_ids:
            return tensor.device
    return torch.device("cpu")


def unstream_model(model: nn.Module, device: Optional[Union[str, torch.device]] = None) -> nn.Module:
    """Undo stream_model: every layer tensor gets memory of its own again.

    The layers go where the resident part is (so a model moved to CUDA comes back whole
    on CUDA), or to ``device`` when given. Names, values and Parameter objects are kept.
    """
    runtime = get_runtime(model)
    target = torch.device(device) if device is not None else _resident_device(model, runtime)
    runtime.pool.settle()
    for record in runtime.records:
        copies = {}
        for entry, host in zip(record.entries, record.host_values):
            fresh = copies.get(entry.offset)
            if fresh is None:
                fresh = host.detach().to(target, copy=True)
                copies[entry.offset] = fresh
            if entry.kind == "quant":
                nf4.set_quant_tensor(entry.module.weight.quant_state, entry.quant_path, fresh)
            elif isinstance(host, nn.Parameter):
                host.data = fresh
            else:
                entry.table[entry.name] = fresh
    for module in _streamed_linear4bit(runtime.records):
        layer_mod.make_plain(module)
    for layer in runtime.layers:
        layer_mod.make_plain(layer)
    if runtime.ends is not None:
        runtime.ends.restore(target)
    runtime.close()
    _holder(model).__dict__.pop(_ATTR, None)
    _holder(model).__dict__.pop(_DDP_IGNORE, None)
    return model
