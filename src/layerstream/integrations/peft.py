"""PEFT merges on streamed weights: exact, and seen by the next forward.

PEFT's ``merge``/``unmerge`` (behind ``merge_and_unload``, ``merge_adapter``,
``unmerge_adapter``, and a forward with adapters disabled on a merged model) compute the
adapters' delta where the adapters live and write it into the base layer's weight, in
place or by replacing it (4-bit weights are dequantised, merged and quantised again). A
streamed base weight lives in the host store: on a GPU the write would mix devices, and
on the host it would change the store behind the layer's device copies.

So while a streamed base layer merges, its weights are *materialised*: each becomes a
device copy of the host value, exactly what a resident model holds, PEFT's own code runs
on it unchanged (the same kernels as on a resident model, so the same bits), and the
result is written back into the host store, whose device copies are then refreshed. If
PEFT raises, the host store is left as it was. Wrapped once, on every PEFT tuner layer
class, when the first model streams; layers whose base does not stream are untouched.

A whole-model merge (``merge_adapter``, ``merge_and_unload``) walks the layers one by one;
a layer whose weights cannot be written (read from disk each time, or in a node-shared
store) would be refused only when its turn came, after the layers before it were merged
(and, under ``merge_and_unload``, their adapters dropped). So every layer is checked
before the first one merges.

DoRA reads the base weight when an adapter is added: its magnitude vector starts as the
norm of each row of the base weight. A resident model added to on a GPU takes that norm
there; under ``layerstream run`` the layers are already streamed when the client's
``get_peft_model`` runs, with their weights in the host store, so PEFT would take it on
the CPU, whose reduction rounds differently in the last bits. So DoRA's initialisation
reads device copies of the base weights (and of the adapters it combines with them),
as a resident model on that device would, and leaves the host store untouched.

What cannot train is refused as PEFT is asked for it (``inject_adapter``, behind
``get_peft_model`` and ``add_adapter``), before PEFT puts any adapter layer in: a
``modules_to_save`` module inside a streamed decoder layer (PEFT's trainable copy is a
``copy.deepcopy``, which a streamed layer's host-store weights do not allow), and adapters or
``modules_to_save`` aimed at expert stacks kept packed in MXFP4 (``modules.packed_experts``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..api import on_stream
from ..errors import StreamingError
from ..modules import nf4, packed_experts, swap
from ..modules.layer import StreamedLayer
from ..system.log import get_logger
from ..tiers.store import set_data

logger = get_logger(__name__)

_installed = False

# LoRA initialisations that take the base weight apart (PiSSA, OLoRA, CorDA, LoftQ keep
# its residual in the base layer) or only read it (MiCA, LoRA-GA); PEFT runs them where the
# base weight lives, so on a streamed layer they get device copies, as on a resident GPU
_INITS_WRITING_THE_BASE = ("pissa_init", "olora_init", "corda_init", "loftq_init")
_INITS_READING_THE_BASE = ("mica_init", "lora_ga_init")


def _tuner_classes(base: str = "BaseTunerLayer"):
    """``base`` (a class of peft.tuners.tuners_utils, or LoraLayer) and every subclass of it loaded."""
    try:
        if base == "LoraLayer":
            from peft.tuners.lora.layer import LoraLayer as root
        else:
            from peft.tuners import tuners_utils

            root = getattr(tuners_utils, base)
    except ImportError:  # pragma: no cover - peft is a dependency
        return []
    seen, todo = [root], [root]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def install() -> None:
    global _installed
    if _installed:
        return
    for cls in _tuner_classes():
        for name in ("merge", "unmerge"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_layerstream", False):
                setattr(cls, name, _materialising(method))
    for cls in _tuner_classes("LoraLayer"):
        for name in _INITS_WRITING_THE_BASE + _INITS_READING_THE_BASE:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_layerstream", False):
                writes = name in _INITS_WRITING_THE_BASE
                setattr(cls, name, _materialising(method, f"PEFT's {name}", write_back=writes))
    for cls in _dora_layer_classes():
        method = cls.__dict__.get("update_layer")
        if method is not None and not getattr(method, "_layerstream", False):
            setattr(cls, "update_layer", _initialising_on_device(method))
    for cls in _tuner_classes("BaseTuner"):
        for name in ("merge_adapter", "merge_and_unload"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_layerstream", False):
                setattr(cls, name, _checked_first(method))
        method = cls.__dict__.get("inject_adapter")
        if method is not None and not getattr(method, "_layerstream", False):
            setattr(cls, "inject_adapter", _checked_before_injection(method))
    from peft import PeftModel

    method = PeftModel.__dict__.get("get_nb_trainable_parameters")
    if method is not None and not getattr(method, "_layerstream", False):
        PeftModel.get_nb_trainable_parameters = _counting_packed_experts(method)
    _installed = True


def _counting_packed_experts(method):
    """PEFT's parameter count (behind ``print_trainable_parameters``) with the values of
    expert stacks kept packed in MXFP4, which are buffers: "all params" as for the
    dequantised model (they are frozen there too)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        trainable, total = method(self, *args, **kwargs)
        return trainable, total + packed_experts.packed_values(self)

    wrapped._layerstream = True
    return wrapped


def _checked_before_injection(method):
    """PEFT's ``inject_adapter`` (behind ``get_peft_model``, ``add_adapter``, loading an
    adapter) after a check of what it is asked, so that what cannot train is refused before
    PEFT changes the model: its adapter layers go in before its ``modules_to_save`` copies."""

    @functools.wraps(method)
    def wrapped(self, model, adapter_name, *args, **kwargs):
        config = getattr(self, "peft_config", {}).get(adapter_name)
        if config is not None:
            refuse_untrainable_targets(model, adapter_name, config)
        return method(self, model, adapter_name, *args, **kwargs)

    wrapped._layerstream = True
    return wrapped


def refuse_untrainable_targets(model: nn.Module, adapter: str, config) -> None:
    """Refuse a PEFT config that names what would not train: expert stacks kept packed in
    MXFP4 (``packed_experts``), or a ``modules_to_save`` module inside a streamed decoder
    layer or a streamed embedding or head, whose trainable copy PEFT makes with
    ``copy.deepcopy`` (their weights live in the host store, which does not copy)."""
    packed_experts.refuse_config_on_packed(model, adapter, config)
    targets = getattr(config, "modules_to_save", None) or ()
    if not targets:
        return
    layer = None  # the streamed decoder layer the walk is in (modules come before their children)
    for name, module in model.named_modules():
        if swap.has(module, StreamedLayer):
            layer = name
        elif layer is not None and not name.startswith(f"{layer}."):
            layer = None
        target = next((t for t in targets if name.endswith(t)), None)  # PEFT's own match
        if target is None:
            continue
        if "_layerstream_ends" in module.__dict__:
            raise StreamingError(
                f"PEFT adapter {adapter!r} has modules_to_save={target!r}, which matches {name}, an embedding or "
                "head that streams (stream_embeddings): its weight stays in the host store and frozen, and PEFT's "
                "trainable copy of it (copy.deepcopy) cannot be made. To train it, stream with "
                "stream_embeddings=False; otherwise leave it out of modules_to_save."
            )
        if layer is not None:
            raise StreamingError(
                f"PEFT adapter {adapter!r} has modules_to_save={target!r}, which matches {name}, inside the "
                f"streamed decoder layer {layer}: PEFT trains a copy of such a module (copy.deepcopy), and a "
                "streamed layer's weights live in layerstream's host store, which does not copy. Adapt it "
                "with target_modules (LoRA) instead, or keep modules_to_save to modules outside the decoder "
                "layers (lm_head, embed_tokens)."
            )


def _checked_first(method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        refuse_unwritable_layers(self.model)
        return method(self, *args, **kwargs)

    wrapped._layerstream = True
    return wrapped


def _runtime_of(module) -> object:
    """The runtime streaming ``module`` (a base layer), or None."""
    return getattr(module, "__dict__", {}).get("_layerstream_runtime") if module is not None else None


def refuse_unwritable_layers(model: nn.Module) -> None:
    """Raise, before anything is merged, if any tuner layer of ``model`` has a streamed base
    whose weights cannot be written (the same refusal its own merge would raise later)."""
    for module in model.modules():
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else None
        runtime = _runtime_of(base)
        found = runtime.entries_of(base) if runtime is not None else None
        if found:
            runtime.refuse_host_write(found[0].index, "a merge")


def _materialising(method, change: str = "a merge", write_back: bool = True):
    """``method`` of a tuner layer run with its streamed base as device copies: what it
    leaves in them is written into the host store (``write_back``), else they are dropped."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        base = self.get_base_layer() if hasattr(self, "get_base_layer") else None
        runtime = _runtime_of(base)
        if runtime is None or getattr(base, "_layerstream_materialised", False):
            return method(self, *args, **kwargs)
        with materialised(runtime, base, change) if write_back else device_copies(runtime, base):
            return method(self, *args, **kwargs)

    wrapped._layerstream = True
    return wrapped


def _dora_layer_classes():
    """PEFT's DoRA layers, whose ``update_layer`` takes the base weight's norm."""
    try:
        from peft.tuners.lora import dora
    except ImportError:  # pragma: no cover - peft is a dependency
        return []
    return [cls for cls in vars(dora).values() if isinstance(cls, type) and cls.__name__.startswith("Dora")]


class _BaseWeight(nn.Module):
    """The base layer's weight alone, as DoRA's initialisation reads it. PEFT deep-copies a
    4-bit base layer before dequantising it, and a streamed layer does not deep-copy (its
    weights are in the host store); this stand-in holds the same weight and copies."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def _initialising_on_device(method):
    """DoRA's ``update_layer`` reading the streamed base weight where a resident model's
    would be: on the streaming device, with the adapters it combines with it there."""

    @functools.wraps(method)
    def wrapped(self, *, base_layer, lora_A, lora_B, scaling, **kwargs):
        runtime = _runtime_of(base_layer)
        if (
            runtime is None
            or getattr(base_layer, "_layerstream_materialised", False)
            or not runtime.entries_of(base_layer)
        ):
            return method(self, base_layer=base_layer, lora_A=lora_A, lora_B=lora_B, scaling=scaling, **kwargs)
        home = lora_A.device  # where PEFT leaves the magnitude: with the adapters
        on_device = runtime.device.type != "cpu"
        with device_copies(runtime, base_layer) if on_device else contextlib.nullcontext():
            result = method(
                self,
                base_layer=_BaseWeight(base_layer.weight),
                lora_A=lora_A.to(runtime.device),
                lora_B=lora_B.to(runtime.device),
                scaling=scaling,
                **kwargs,
            )
        magnitude = getattr(self, "weight", None)
        if isinstance(magnitude, nn.Parameter) and magnitude.device != home and not kwargs.get("place_on_cpu"):
            self.weight = nn.Parameter(magnitude.detach().to(home), requires_grad=magnitude.requires_grad)
        return result

    wrapped._layerstream = True
    return wrapped


def _bind_device_copies(runtime, record, positions) -> dict:
    """Give each of the layer's weights that holds its host tensor a device copy; return
    position -> the tensor the table held (a slot view while the layer runs)."""
    device = runtime.device
    bound = {}
    for position in positions:
        entry = record.entries[position]
        if not entry.bound:
            continue
        current = entry.table.get(entry.name)
        host = record.host_values[position]
        bound[position] = current
        slot = None if current is host else runtime.pool.slot_of_pointer(current.data_ptr())
        if slot is not None:  # inside the layer's call: expert rows copied by need, all of them now
            runtime.experts.complete(record.index, slot)
        if current is host:  # outside the layer's own call: give it a device copy
            if nf4.is_packed(host):
                entry.table[entry.name] = nf4.device_weight(host, device)
            else:
                set_data(host, record.arena_views[position].to(device, copy=True))
    return bound


@contextlib.contextmanager
def device_copies(runtime, module: nn.Module):
    """``module``'s streamed weights as device copies for the block, for code that only
    reads them; the host tensors are bound again afterwards and nothing is written."""
    found = runtime.entries_of(module)
    if not found:
        yield
        return
    record, positions = found
    bound = _bind_device_copies(runtime, record, positions)
    object.__setattr__(module, "_layerstream_materialised", True)
    try:
        yield
    finally:
        _put_back(record, positions, bound)
        module.__dict__.pop("_layerstream_materialised", None)


@contextlib.contextmanager
def materialised(runtime, module: nn.Module, change: str = "a merge"):
    """``module``'s streamed weights as device copies for the block; what the block left
    in them is written into the host store afterwards (nothing, if it raised). A store
    that cannot be written is refused first, naming ``change``."""
    found = runtime.entries_of(module)
    if not found:
        yield
        return
    record, positions = found
    runtime.refuse_host_write(record.index, change)
    bound = _bind_device_copies(runtime, record, positions)
    object.__setattr__(module, "_layerstream_materialised", True)
    try:
        yield
    except BaseException:
        _put_back(record, positions, bound)
        raise
    else:
        _write_back(runtime, record, positions, bound)
    finally:
        module.__dict__.pop("_layerstream_materialised", None)


def _put_back(record, positions, bound) -> None:
    for position in positions:
        entry, host = record.entries[position], record.host_values[position]
        if position in bound and bound[position] is host:
            entry.table[entry.name] = host
            set_data(host, record.arena_views[position])


def _write_back(runtime, record, positions, bound) -> None:
    """Copy what the merge left into the arena views (and, inside the layer's own call,
    into the slot views the rest of the call reads), then refresh the layer's device copies."""
    for position in positions:
        entry = record.entries[position]
        if not entry.bound:
            continue
        host = record.host_values[position]
        now = entry.table.get(entry.name)
        values = _values(entry, record, position, now)
        for at, value in values:
            target = record.arena_views[at]
            if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
                _put_back(record, positions, bound)
                raise RuntimeError(
                    f"a merge changed the shape or dtype of {record.entries[at].qualified_name}; "
                    "layerstream cannot stream it so: unstream_model before merging"
                )
            with torch.no_grad():
                target.copy_(value.detach())
        if bound[position] is host:  # outside the layer's call: the host tensor goes back in
            entry.table[entry.name] = host
            set_data(host, record.arena_views[position])
        elif now is not bound[position]:  # replaced inside the call: the slot view takes the values
            slot = dict(_values(entry, record, position, bound[position]))
            for at, value in values:
                with torch.no_grad():
                    slot[at].copy_(value.detach())
            entry.table[entry.name] = bound[position]
    inside = any(bound[p] is not record.host_values[p] for p in bound)
    runtime.refresh_after_write(record.index, device_copy_current=inside)


def _values(entry, record, position, weight):
    """(position in the record, tensor) of a bound weight and of the quant-state tensors
    riding on it, as ``weight`` holds them."""
    out = [(position, weight.data)]
    state = nf4.packed_state(weight)
    if state is not None:
        tensors = dict(nf4.quant_tensors(state))
        for other, candidate in enumerate(record.entries):
            if candidate.is_quant_state and candidate.module is entry.module:
                out.append((other, tensors[candidate.quant_path]))
    return out


on_stream(lambda model: install())
