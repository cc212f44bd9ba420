"""LoRA's adapters as PEFT makes them: PEFT's own injection (``inject_adapter_in_model``
with ``LoraConfig(target_modules=..., r=...)``, as a training run applies it) on the
config's meta model, one decoder layer of each kind, so which modules and Parameters it
adapts, and how many parameters that adds, are PEFT's answer for any family transformers
builds. Meta tensors allocate nothing."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Tuple

import torch
from torch import nn

from ..modules.discovery import find_decoder_layers
from ..modules.packed_experts import PROJECTIONS
from .shapes import LayerShape, LinearShape, ParamShape, _text_config, build_meta_model, parse_dtype


@dataclass
class LoraTargets:
    """What LoRA adapts in one layer: nn.Linear modules, Parameters (PEFT's
    ``target_parameters``: fused expert stacks, routers), and the LoRA parameters it adds
    (``count``; ``param_count`` of them adapt the Parameters)."""

    linears: List[LinearShape] = field(default_factory=list)
    params: List[ParamShape] = field(default_factory=list)
    count: int = 0
    param_count: int = 0


_COUNTED: "OrderedDict[tuple, Tuple[List[LoraTargets], int]]" = OrderedDict()
_COUNTED_KEPT = 16  # (config, targets, rank) whose adapters are remembered: advice plans again and again


def lora_adapters(
    config, shapes: List[LayerShape], targets: str, rank: int, dtype=torch.bfloat16, parameters="", rank_pattern=()
):
    """(what LoRA of rank ``rank`` adapts in each decoder layer, all its parameters,
    adapters outside the layers included), following PEFT's ``inject_adapter_in_model``.

    ``targets`` is "all-linear" or comma-separated names, as PEFT's ``target_modules``
    takes them (a name matches a module path that equals it or ends with "." + name; PEFT
    maps the expert and router names of MoE families whose experts transformers fuses onto
    the fused Parameters). A name that matches nothing, or a set PEFT refuses, is refused
    here as ValueError. ``parameters``: PEFT's ``target_parameters``, comma-separated ("":
    none named; PEFT still chooses some for "all-linear"); ``rank_pattern``: PEFT's, as
    (pattern, rank) pairs."""
    if not rank:
        return [LoraTargets() for _ in shapes], 0
    config = _text_config(config)
    dtype = parse_dtype(dtype)
    named = sorted({p.strip() for p in (parameters or "").split(",") if p.strip()})
    ranks = tuple(sorted((str(p), int(r)) for p, r in (rank_pattern or ())))
    key = (
        type(config).__name__,
        config.to_json_string(use_diff=False),
        dtype,
        targets.strip(),
        rank,
        tuple(named),
        ranks,
    )
    if key not in _COUNTED:
        _COUNTED[key] = _count(config, dtype, targets, rank, shapes, named, dict(ranks))
        while len(_COUNTED) > _COUNTED_KEPT:
            _COUNTED.popitem(last=False)
    _COUNTED.move_to_end(key)
    layers, total = _COUNTED[key]
    return [LoraTargets(list(t.linears), list(t.params), t.count, t.param_count) for t in layers], total


def _target_names(targets: str):
    if targets.strip().lower() == "all-linear":
        return "all-linear"
    if targets.strip().lower() == "none":  # no module: the adapters are target_parameters' alone
        return []
    names = [t.strip() for t in targets.split(",") if t.strip()]
    if not names:
        raise ValueError("lora_targets is empty; use 'all-linear' or names such as 'q_proj,v_proj'")
    return names


def _kind(layer: nn.Module) -> tuple:
    """What PEFT sees of a layer: its modules' paths and classes, its tensors' shapes."""
    return tuple(
        (
            name,
            type(module).__name__,
            tuple(
                (key, tuple(t.shape), t.dtype)
                for key, t in (*module._parameters.items(), *module._buffers.items())
                if t is not None
            ),
        )
        for name, module in layer.named_modules()
    )


def _one_layer_of_each_kind(config, dtype):
    """The meta model with its decoder stack cut to one layer of each kind, and for each
    of the original layers the position of its kind's layer in the cut stack."""
    model = build_meta_model(config, dtype)
    path, layers = find_decoder_layers(model)
    kinds: "OrderedDict[tuple, int]" = OrderedDict()
    chosen, position = [], []
    for layer in layers:
        kind = _kind(layer)
        if kind not in kinds:
            kinds[kind] = len(chosen)
            chosen.append(layer)
        position.append(kinds[kind])
    parent, _, attribute = path.rpartition(".")
    setattr(model.get_submodule(parent), attribute, nn.ModuleList(chosen))
    return model, position


def _inject(model: nn.Module, names, rank: int, parameters=(), rank_pattern=None) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    lora = LoraConfig(
        r=rank, target_modules=names, target_parameters=list(parameters) or None, rank_pattern=rank_pattern or {}
    )
    with warnings.catch_warnings():  # what PEFT says about a training run's settings (Conv1D's
        warnings.simplefilter("ignore")  # fan_in_fan_out) is said again when the run applies it
        inject_adapter_in_model(lora, model, low_cpu_mem_usage=True)


def _count(
    config, dtype: torch.dtype, targets: str, rank: int, shapes, parameters=(), rank_pattern=None
) -> Tuple[List[LoraTargets], int]:
    names = _target_names(targets)
    if names != "all-linear" and names:
        _refuse_names_matching_nothing(config, dtype, names, shapes)
    model, position = _one_layer_of_each_kind(config, dtype)
    try:
        _inject(model, names, rank, parameters, rank_pattern)
    except ValueError as exc:
        raise ValueError(f"lora_targets={targets!r}: PEFT refuses them for this model: {exc}") from None
    _, layers = find_decoder_layers(model)
    kinds = [_layer_targets(layer) for layer in layers]
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    outside = total - sum(kind.count for kind in kinds)
    chosen = [kinds[index] for index in position]
    return chosen, sum(layer.count for layer in chosen) + outside


def _refuse_names_matching_nothing(config, dtype, names: List[str], shapes) -> None:
    """PEFT takes a list of which one name matches: each must adapt something alone."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    model, _ = _one_layer_of_each_kind(config, dtype)
    modules = [key for key, _ in model.named_modules()]
    for name in names:
        if any(check_target_module_exists(LoraConfig(target_modules=[name]), key) for key in modules):
            continue
        try:  # an MoE name PEFT maps onto a fused Parameter matches no module
            _inject(_one_layer_of_each_kind(config, dtype)[0], [name], 1)
        except ValueError:
            linear = sorted({lin.name.rsplit(".", 1)[-1] for shape in shapes for lin in shape.linears})
            packed = any(shape.dequantised for shape in shapes) and name.endswith(PROJECTIONS)
            why = (
                " (its experts stay packed in MXFP4, with no Parameter to adapt: LoRA on them needs the "
                "dequantised load, Mxfp4Config(dequantize=True), and PEFT's target_parameters)"
                if packed
                else ""
            )
            raise ValueError(
                f"LoRA target {name!r} matches nothing in this model{why}; its decoder layers' linear layers are: "
                f"{', '.join(linear)}"
            ) from None


def _unwrapped(path: str) -> str:
    return ".".join(part for part in path.split(".") if part != "base_layer")


def _lora_numel(module: nn.Module) -> int:
    """The parameters of this adapter's own LoRA matrices (nested wrappers count apart)."""
    return sum(
        p.numel() for name, child in module.named_children() if name.startswith("lora_") for p in child.parameters()
    )


def _layer_targets(layer: nn.Module) -> LoraTargets:
    from peft.tuners.lora import LoraLayer, ParamWrapper

    adapted = LoraTargets()
    for path, module in layer.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        numel = _lora_numel(module)
        adapted.count += numel
        if isinstance(module, ParamWrapper):
            param = module.get_param()
            out_features, in_features = param.shape[-2:]
            name = f"{_unwrapped(path)}.{module.parameter_name}"
            adapted.params.append(
                ParamShape(name, int(torch.Size(param.shape[:-2]).numel()), in_features, out_features)
            )
            adapted.param_count += numel
        else:
            adapted.linears.append(LinearShape(_unwrapped(path), module.in_features, module.out_features))
    return adapted


def plan_notes(shapes, adapted, lora_targets, quantization) -> List[str]:
    """What a reader of the plan should know about how it was made."""
    notes: List[str] = []
    expert_lora = sum(layer.param_count for layer in adapted)
    if expert_lora:
        notes.append(
            f"PEFT adapts the fused experts and routers under lora_targets={lora_targets!r} "
            f"({expert_lora / 1e6:.1f}M of the LoRA parameters), and each recomputed layer "
            "holds its merged expert weights; name attention modules only (e.g. "
            "'q_proj,k_proj,v_proj,o_proj') to leave the experts frozen"
        )
    if any(shape.dequantised for shape in shapes):
        notes.append(
            "the expert stacks stay in MXFP4 as the checkpoint stores them (host store, copies) and each "
            "experts call dequantises them where it runs (counted in the layer's recompute + backward), as "
            "layerstream.from_pretrained and `layerstream run` load them; transformers' own load dequantises "
            "them, so the 'transformers load + stream_model' host RAM holds them in the compute dtype: plan "
            "that route (or Mxfp4Config(dequantize=True)) with dequantize: true in the config's quantization_config"
        )
    if quantization == "nf4" and any(shape.params and not shape.dequantised for shape in shapes):
        notes.append(
            "MoE expert weights and routers stay in the compute dtype under NF4: "
            "bitsandbytes quantises nn.Linear modules only"
        )
    if quantization == "nf4":
        notes.append(
            "NF4 host RAM assumes layers are quantised as they load: "
            "layerstream.from_pretrained(quantization='nf4'), or transformers with "
            "BitsAndBytesConfig and device_map='cpu'"
        )
    return notes
