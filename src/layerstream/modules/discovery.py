"""Find the decoder-layer stack of a causal LM, plain or PEFT-wrapped.

Found by what the layers are, not by a table of attribute paths per architecture: the
stack is the longest ``nn.ModuleList`` whose items are all decoder layers, where a
decoder layer is an instance of ``transformers.GradientCheckpointingLayer`` or of a
class named in the model's ``_no_split_modules``. The search starts at the model's
decoder (``get_decoder()``) when it has one, so a multimodal model's vision tower is not
mistaken for its language stack.
"""

from __future__ import annotations

import copy
import weakref
from typing import Iterable, List, Tuple

import torch
from torch import nn

from ..errors import NoDecoderStackError

try:  # present in every transformers release we support; guarded for clarity of errors
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover
    GradientCheckpointingLayer = None


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        try:
            return get_base()
        except Exception:  # a model whose get_base_model is something else
            return model
    return model


def trainables_chosen(model: nn.Module, counted=lambda param: True) -> bool:
    """Whether what trains has been chosen (by PEFT or by hand): a PEFT model, or some
    parameter ``counted`` accepts frozen that the model's own class does not freeze when it is
    built (``frozen_when_built``: ERNIE-4.5-MoE's and Laguna's expert-score correction bias,
    AFMoE's expert bias say nothing of what the user trains)."""
    if unwrap_peft(model) is not model:
        return True
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad and counted(p)]
    # the class is built only where something is frozen: a fresh model (nothing is) pays nothing
    return bool(frozen) and not frozenset(frozen) <= frozen_when_built(model)


_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def frozen_when_built(model: nn.Module) -> frozenset:
    """The names of the parameters ``model``'s class freezes as it builds them, from an
    instance built on the meta device from its config (empty where it cannot be built so)."""
    if model in _BUILT:
        return _BUILT[model]
    config = getattr(model, "config", None)
    names: frozenset = frozenset()
    if config is not None:
        try:
            with torch.device("meta"):
                fresh = type(model)(copy.deepcopy(config))
            names = frozenset(n for n, p in fresh.named_parameters() if not p.requires_grad)
        except Exception:  # noqa: BLE001 - a class built otherwise: every frozen parameter counts
            names = frozenset()
    _BUILT[model] = names
    return names


def describe_family(model: nn.Module) -> str:
    """The model's class and transformers model type, as a refusal names them:
    "MixtralForCausalLM (model type 'mixtral')"."""
    inner = unwrap_peft(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    name = type(inner).__name__  # a class swapped in by layerstream keeps the model's class name
    return f"{name} (model type {model_type!r})" if model_type else name


def _no_split_names(model: nn.Module) -> set:
    names = set()
    for module in model.modules():
        value = getattr(module, "_no_split_modules", None)
        if isinstance(value, (list, tuple, set)):
            names.update(str(v) for v in value)
    return names


def _is_decoder_layer(module: nn.Module, class_names: set) -> bool:
    if GradientCheckpointingLayer is not None and isinstance(module, GradientCheckpointingLayer):
        return True
    return type(module).__name__ in class_names


def _candidates(root: nn.Module, class_names: set) -> Iterable[Tuple[str, nn.ModuleList]]:
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if all(_is_decoder_layer(item, class_names) for item in module):
                yield name, module


def find_decoder_layers(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """Return (dotted path from ``model``, the ModuleList of decoder layers)."""
    base = unwrap_peft(model)
    class_names = _no_split_names(base)
    search_root: nn.Module = base
    get_decoder = getattr(base, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except Exception:
            decoder = None
        if isinstance(decoder, nn.Module):
            search_root = decoder
    found: List[Tuple[str, nn.ModuleList]] = list(_candidates(search_root, class_names))
    if not found and search_root is not base:
        search_root = base
        found = list(_candidates(base, class_names))
    if not found:
        raise NoDecoderStackError(
            f"layerstream found no decoder-layer stack in {type(base).__name__}: it looked for an "
            "nn.ModuleList whose items are all transformers.GradientCheckpointingLayer "
            f"instances or classes named in _no_split_modules ({sorted(class_names) or 'none'}), "
            "under model.get_decoder() and then the whole model. Streaming supports causal LMs "
            "whose decoder layers form one ordered stack."
        )
    best_name, best = max(found, key=lambda item: len(item[1]))
    return _path_from(model, best), best


def _path_from(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise NoDecoderStackError("the decoder stack is not reachable from the model")  # pragma: no cover


def layer_name(path: str, index: int) -> str:
    return f"{path}.{index}" if path else str(index)


def on_mlp_side(name: str) -> bool:
    """Whether a decoder layer's part, named from the layer down (``mlp.up_proj``,
    ``self_attn.q_proj``), is on the MLP's side of the layer (an expert's or router's too):
    everything outside the attention module."""
    first = name.split(".", 1)[0].lower()
    return "attn" not in first and "attention" not in first
