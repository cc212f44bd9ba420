"""Public entry points: stream_model, unstream_model, get_runtime, is_streamed."""

from __future__ import annotations

from typing import Callable, List, Optional, Union

import torch
from torch import nn

from .config import StreamConfig, resolve_device
from .errors import StreamConfigError, StreamingError
from .long import chunked_loss, tiled_mlp
from .modules import changes, cpu_repacking, layer, nf4
from .modules.discovery import find_decoder_layers, layer_name, trainables_chosen, unwrap_peft
from .runtime.core import StreamRuntime
from .system.log import get_logger
from .tiers.store import LAYOUT, HostStore, check_host_memory
from .units import GiB, gib, size

logger = get_logger(__name__)

_ATTR = "_layerstream_runtime"
_ON_STREAM: List[Callable[[nn.Module], None]] = []  # integrations that want to know


def on_stream(callback: Callable[[nn.Module], None]) -> None:
    """Have ``callback(model)`` called whenever a model becomes streamed (integrations
    register here, so the core never imports them)."""
    if callback not in _ON_STREAM:
        _ON_STREAM.append(callback)


def _holder(model: nn.Module) -> nn.Module:
    """The module that carries the runtime: the transformers model under any PEFT wrapper."""
    return unwrap_peft(model)


def is_streamed(model: nn.Module) -> bool:
    return getattr(_holder(model), _ATTR, None) is not None or getattr(model, _ATTR, None) is not None


def get_runtime(model: nn.Module) -> StreamRuntime:
    """The StreamRuntime of a streamed model (stats, slots, store)."""
    runtime = getattr(_holder(model), _ATTR, None) or getattr(model, _ATTR, None)
    if runtime is None:
        raise StreamingError(f"{type(model).__name__} is not streamed; call layerstream.stream_model(model) first.")
    return runtime


def _layer_devices(layers: nn.ModuleList, path: str, streamed) -> set:
    """The devices the streamed tensors are on now (a meta tensor is refused)."""
    devices = set()
    for index, module in enumerate(layers):
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if not streamed(tensor):
                continue  # trainable or shared tensors stay resident wherever they are
            if tensor.device.type == "meta":
                raise StreamingError(
                    f"{layer_name(path, index)}.{name} is on the meta device (no weights loaded). "
                    "Load real weights first (from_pretrained without device_map='meta', or "
                    "materialise with to_empty and load a state dict) before stream_model."
                )
            devices.add(tensor.device)
    return devices


def _streamed_predicate(model: nn.Module, layers: nn.ModuleList):
    """Which layer tensors stream.

    Frozen tensors and buffers stream. In a model where nothing is frozen yet (fresh
    from from_pretrained, PEFT not applied; statistics an architecture freezes at
    construction do not count, ``trainables_chosen``), every layer tensor streams: PEFT
    freezes them later, and training a streamed tensor is refused with a clear error.
    Tensors shared with the resident part or with another layer stay resident.
    """
    nothing_frozen = not trainables_chosen(model)
    owner: dict = {}
    for index, module in enumerate(layers):
        for tensor in list(module.parameters()) + list(module.buffers()):
            owner.setdefault(id(tensor), set()).add(index)
    in_layers = {id(m) for module in layers for m in module.modules()}
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
    A model already on a GPU is streamed too: its layer weights move into the host store
    (freeing their GPU memory), and without a ``device`` it streams to that GPU. With
    ``stream_embeddings=True`` the input embedding and output head stay in host memory
    too (see ``layerstream.runtime.embeddings``). Call ``model.to(device)`` afterwards to place a
    resident part that is still on the host.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"stream_model takes a torch.nn.Module (a transformers model, maybe wrapped by PEFT), "
            f"got {type(model).__name__}"
        )
    if config is not None and not isinstance(config, StreamConfig):
        raise TypeError(f"config must be a layerstream.StreamConfig, got {type(config).__name__}")
    if is_streamed(model):
        raise StreamingError(
            "this model is already streamed; call layerstream.unstream_model(model) before "
            "streaming it again with other settings."
        )
    _refuse_unsupported(model)
    path, layers = find_decoder_layers(model)
    _refuse_cpu_repacked(layers, path)
    streamed = _streamed_predicate(model, layers)
    devices = _layer_devices(layers, path, streamed)
    gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if config is None:
        if gpus and "device" not in overrides:
            overrides["device"] = gpus[0]
        config = StreamConfig(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    check_long_context(model, config)
    records = [HostStore.plan_layer(i, layer_name(path, i), module, streamed) for i, module in enumerate(layers)]
    if all(not r.entries for r in records):
        raise StreamingError(
            "no tensor of the decoder layers can stream: every one is trainable or shared "
            "with the resident part. Freeze the base weights (e.g. apply PEFT) first."
        )
    largest = max(r.nbytes for r in records)
    config = _automatic_slots(config, largest)
    _check_slots_fit_budget(config, largest)
    store_bytes = sum(r.nbytes for r in records)
    if config.stream_embeddings is True:
        # checked whole before any copy; the host must hold and may page-lock both stores
        from .runtime.embeddings import find_ends

        weights = [w for _, w in find_ends(model).weights()]
        ends_bytes = [w.numel() * w.element_size() for w in weights]
        from_gpu = bool(gpus) or any(w.device.type == "cuda" for w in weights)  # nothing on the host to free
        check_host_memory(
            store_bytes + sum(ends_bytes) if from_gpu else max(largest, *ends_bytes),
            store_bytes + sum(ends_bytes),
            bool(config.pin),
            "streaming this model with its embedding and head",
        )
    if nf4.streams_4bit(records):
        try:
            nf4.require_bnb("streaming a 4-bit model")
        except ImportError as exc:
            raise StreamingError(str(exc)) from None
    _check_host_budget(config, store_bytes)
    _say_held_elsewhere(model, records)
    store = HostStore(config.arena_bytes, pin=bool(config.pin))
    store.build(records, new_bytes=store_bytes if gpus else None)
    if gpus:
        if config.device.type == "cuda":
            torch.cuda.empty_cache()  # the layers' GPU memory goes back to the driver
        logger.warning(
            "layerstream: the decoder layers were on %s; their frozen weights (%.2f GiB) moved into "
            "the host store and their GPU memory was freed. Load the model on the CPU (or let "
            "`layerstream run` load it) to skip that copy.",
            ", ".join(map(str, gpus)),
            store_bytes / GiB,
        )
    return attach_runtime(model, path, layers, config, records, store)


def _say_held_elsewhere(model: nn.Module, records) -> None:
    """One warning where tensors outside the model share streamed weights' memory (taken
    before stream_model): the streamed model computes from its own copy from now on."""
    from .modules.aliases import held_elsewhere

    shared = held_elsewhere(model, records)
    if shared:
        logger.warning(
            "layerstream: %d streamed layer tensor(s) (%s%s) share their memory with tensors held outside the "
            "model, such as a state_dict(), .data or .detach() taken before stream_model, or the graph of a forward "
            "whose backward has not run. The streamed model "
            "computes from its own copy in host memory from now on: a write through those tensors does not reach "
            "it (write to the model's parameters instead), and their memory stays allocated while they are held.",
            len(shared),
            ", ".join(shared[:3]),
            ", ..." if len(shared) > 3 else "",
        )


def _refuse_unsupported(model: nn.Module) -> None:
    """Models whose streamed results are not exact, refused before anything changes: an
    encoder-decoder (its encoder and cross-attention stay outside the checks), and PEFT
    prefix tuning (its virtual tokens reach every layer as a KV cache, which a layer
    checkpointed under autograd cannot read)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise StreamingError(
            f"{type(model).__name__} is an encoder-decoder model; layerstream streams the decoder layers of "
            "decoder-only causal LMs (AutoModelForCausalLM) and is not exact for encoder-decoders. Train this "
            "model without layerstream."
        )
    for name, peft_config in (getattr(model, "peft_config", None) or {}).items():
        if str(getattr(peft_config, "peft_type", "")).endswith("PREFIX_TUNING"):
            raise StreamingError(
                f"PEFT prefix tuning (adapter {name!r}) feeds its virtual tokens to every layer as a KV cache, "
                "which a streamed layer, checkpointed under autograd, cannot read. Use prompt tuning "
                "(PromptTuningConfig) or LoRA with layerstream, or train prefix tuning without it."
            )


def _refuse_cpu_repacked(layers: nn.ModuleList, path: str) -> None:
    """4-bit weights bitsandbytes repacked for its CPU inference kernel, refused before
    anything changes: the streamed 4-bit path reads bitsandbytes' standard layout, so it would
    compute with other values. Weights it repacked and converted back stream (they equal the
    model resident), said once (``modules.cpu_repacking``)."""

    quantised = cpu_repacking.projections(layers, lambda index: layer_name(path, index))
    repacked = [name for name, module in quantised if cpu_repacking.repacked(module)]
    if repacked:
        count = f"{len(repacked)} 4-bit projections" if len(repacked) > 1 else "a 4-bit projection"
        more = ", ..." if len(repacked) > 1 else ""
        raise StreamingError(
            f"{count} of the decoder layers ({repacked[0]}{more}) hold weights bitsandbytes repacked in place "
            "for its CPU inference kernel, as its Linear4bit does when it runs in eval mode on this CPU; "
            "layerstream streams bitsandbytes' standard 4-bit layout only. Stream the model before anything "
            "runs it on the CPU: load it again and call stream_model (or hand it to the Trainer with "
            "--layer_stream) first, or load it with layerstream.from_pretrained."
        )
    changed = [name for name, module in quantised if cpu_repacking.round_tripped(module)]
    if changed:
        logger.warning(
            "layerstream: bitsandbytes repacked %d 4-bit projections of this model for its CPU kernel and "
            "converted them back (%s, ...): their block scales are rounded, no longer the loaded weights. "
            "They stream as they are, equal to this model resident; load the model again for the loaded weights.",
            len(changed),
            changed[0],
        )


def _automatic_slots(config: StreamConfig, largest_layer: int) -> StreamConfig:
    """slots='auto' takes two slots, not three, when the budget holds no more."""
    from .config import auto_slots

    budget = config.budget_bytes()
    if "slots" not in config.automatic or auto_slots(budget, largest_layer) == config.slots:
        return config
    chosen = config.replace(slots=auto_slots(budget, largest_layer))
    chosen.automatic = chosen.automatic | {"slots"}
    return chosen


def _check_slots_fit_budget(config: StreamConfig, largest_layer: int) -> None:
    budget = config.budget_bytes()
    if budget is None or config.slots * largest_layer <= budget:
        return
    fitting = budget // max(largest_layer, 1)
    advice = (
        f"use slots={fitting}" if fitting >= 2 else "load the model in NF4 (quantization='nf4'), or raise the budget"
    )
    raise StreamConfigError(
        f"{config.slots} slots of the largest layer ({size(largest_layer)} each) need "
        f"{size(config.slots * largest_layer)}, more than vram_budget={size(budget)} "
        f"before anything else is on the GPU: {advice}."
    )


def _check_host_budget(config: StreamConfig, store_bytes: int) -> None:
    """stream_model holds every layer in host RAM (its weights are already in memory, and
    no checkpoint file is known to read them from): a store beyond host_budget is refused."""
    from .decisions.disk import resolve_host_budget
    from .tiers.store import host_memory

    budget = resolve_host_budget(config.host_budget, host_memory()) if config.host_budget is not None else None
    if budget is not None and store_bytes > budget:
        raise StreamConfigError(
            f"the layer store is {gib(store_bytes)}, more than host_budget "
            f"{gib(budget)}, and stream_model keeps every layer in host RAM. Load with "
            "layerstream.from_pretrained(path, host_budget=...) to read the layers beyond the budget "
            "from the checkpoint's files, or raise host_budget."
        )


def attach_runtime(
    model: nn.Module, path: str, layers: nn.ModuleList, config: StreamConfig, records, store: HostStore
) -> nn.Module:
    """Turn a model whose layers are packed in ``store`` into a streamed model."""
    runtime = StreamRuntime(model, layers, path, config, records, store)
    holder = _holder(model)
    object.__setattr__(holder, _ATTR, runtime)
    runtime.guarded = layer.ancestors(holder, layers)
    # read when DDP iterates: the ends' records change if their data is swapped and adopted
    _hide_from_ddp(model, lambda: records + (runtime.embeddings.records if runtime.embeddings is not None else []))
    for index, module in enumerate(layers):
        layer.make_streamed(module, runtime, index)
    for module in nf4.streamed_linear4bit_modules(records):
        nf4.make_streamed(module, runtime)
    layer.guard_ancestors(runtime.guarded, runtime)
    if store.disk is not None:
        store.disk.guard_loads(runtime.guarded)
    runtime.long_settings.install(model)
    for callback in list(_ON_STREAM):
        callback(model)
    logger.info(runtime.summary())
    return model


def check_long_context(model: nn.Module, config: StreamConfig) -> None:
    """loss_chunk_tokens and mlp_tile_tokens set to a number this model cannot run exactly
    are refused before a layer is streamed (or loaded): the model is left as it was. Left at
    "auto", a setting the model cannot run stays off (``runtime.long_settings``)."""
    if isinstance(config.loss_chunk_tokens, int) and config.loss_chunk_tokens:
        chunked_loss.check(model, config.loss_chunk_tokens)
    if isinstance(config.mlp_tile_tokens, int) and config.mlp_tile_tokens:
        tiled_mlp.check(model, config.mlp_tile_tokens)


_DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"
_PEFT_PREFIX = "base_model.model."  # where a PEFT wrapper keeps the transformers model


def _hide_from_ddp(model: nn.Module, records: Callable[[], list]) -> None:
    """Keep DistributedDataParallel away from streamed tensors.

    DDP broadcasts every parameter and buffer it is not told to ignore, and refuses a
    module whose parameters sit on more than one device type; streamed tensors live on
    the host (and may be read-only pages). The names are given relative to the
    transformers model and to a PEFT wrapper around it (PEFT forwards the attribute
    lookup), and are found when DDP reads them, from the tensors' identity: PEFT applied
    after streaming renames the weights (``q_proj.weight`` becomes
    ``q_proj.base_layer.weight``).
    """
    holder = _holder(model)
    object.__setattr__(holder, _DDP_IGNORE, _StreamedTensorNames(holder, records))


class _StreamedTensorNames:
    """The names of the streamed tensors under ``holder``, as they are when iterated."""

    def __init__(self, holder: nn.Module, records):
        self._holder = holder
        self._records = records

    def __iter__(self):
        streamed = {id(entry.current()) for record in self._records() for entry in record.entries if entry.bound}
        tables = (
            self._holder.named_parameters(remove_duplicate=False),
            self._holder.named_buffers(remove_duplicate=False),
        )
        for found in tables:
            for name, tensor in found:
                if id(tensor) in streamed:
                    yield name
                    yield _PEFT_PREFIX + name


def _resident_device(model: nn.Module, runtime: StreamRuntime) -> torch.device:
    streamed_ids = {id(v) for r in runtime.records for v in r.host_values}
    if runtime.embeddings is not None:
        streamed_ids |= {id(w) for _, w in runtime.embeddings.found.weights()}
    for tensor in model.parameters():
        if id(tensor) not in streamed_ids:
            return tensor.device
    return torch.device("cpu")


def unstream_model(model: nn.Module, device: Optional[Union[str, torch.device]] = None) -> nn.Module:
    """Undo stream_model: every layer tensor gets memory of its own again.

    The layers go where the resident part is (so a model moved to CUDA comes back whole
    on CUDA), or to ``device`` when given. Names, values and Parameter objects are kept.
    Every copy is made before the model is changed, so a failure (out of memory, an
    interrupt) while copying leaves it streamed as it was; calling again finishes the job.
    The changes that follow are assignments and class swaps, each safe to make twice: if
    they are interrupted, what cannot be right on the half-changed model (a forward through
    a layer still streamed, a cast or move, a merge into the store) is refused, saying so,
    until ``unstream_model`` is called again and finishes them from the same copies.
    """
    runtime = get_runtime(model)
    if runtime.unstreaming is None:
        runtime.unstreaming = _copies_out(model, runtime, device)  # from here on, the model changes
    _commit_unstream(model, runtime, *runtime.unstreaming)
    return model


def _copies_out(model: nn.Module, runtime: StreamRuntime, device) -> tuple:
    """Every streamed tensor's value, copied where the unstreamed model will hold it; the
    model is not changed."""
    target = resolve_device(device) if device is not None else _resident_device(model, runtime)
    runtime.pool.settle()
    if runtime.disk is not None:  # the disk layers' tensors map the files: refuse changed bytes
        runtime.disk.check_unchanged()
    for record in runtime.records:  # values written since the last forward are in the store too
        if not record.fresh_deep() and runtime.store.sync(record) == LAYOUT:
            runtime.store.repack(record)
    copies = [runtime.store.copies_out(record, target) for record in runtime.records]
    ends = runtime.embeddings.copies_out(target) if runtime.embeddings is not None else None
    # a disk layer's tensors kept on the stream device (runtime/disk_changes) go with the layers
    kept = [
        (table, name, table[name].detach().to(target, copy=True)) for r in runtime.records for table, name, *_ in r.kept
    ]
    return copies, ends, kept


def _commit_unstream(model: nn.Module, runtime: StreamRuntime, copies: list, ends, kept: list) -> None:
    """Point the model at the copies and take every streamed behaviour off: plain
    assignments and class swaps, nothing that allocates. A layer still streamed refuses to
    run until the last is plain, and the modules above refuse a move until released."""
    for record, values in zip(runtime.records, copies):
        changes.unwatch(record)
        HostStore.restore(record, values)
    for table, name, value in kept:
        if isinstance(table[name], nn.Parameter):
            table[name].data = value  # the same Parameter (an optimizer may hold it)
        else:
            table[name] = value
    for module in nf4.streamed_linear4bit_modules(runtime.records):
        nf4.make_plain(module)
    if runtime.embeddings is not None:
        runtime.embeddings.restore(ends)
    runtime.long_settings.remove(model)
    for module in runtime.layers:
        layer.make_plain(module)
    for record in runtime.records:
        for entry in record.entries:
            if entry.module.__dict__.get(_ATTR) is runtime:
                entry.module.__dict__.pop(_ATTR, None)
    layer.release_ancestors(getattr(runtime, "guarded", []), runtime)  # the model holds the runtime no more
    _holder(model).__dict__.pop(_ATTR, None)
    _holder(model).__dict__.pop(_DDP_IGNORE, None)
    runtime.close()  # interrupted, the slots and arenas go when the runtime is collected
