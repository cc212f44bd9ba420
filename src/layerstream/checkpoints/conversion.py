"""Checkpoint names to the model's, by transformers' own conversion mapping, layer by layer.

Why: transformers 5 keeps some models in memory in another layout than their checkpoints
hold. A mixture of experts is stored one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``) and held fused (``mlp.experts.gate_up_proj``); other
types rename keys or change prefixes. transformers converts while it loads, with a mapping
per model type (``conversion_mapping``) and operations (stack the experts, concatenate
gate and up, ...). layerstream's loader reads one layer at a time, so it applies the same
mapping per layer: for each of the layer's tensors, the checkpoint names it comes from, read
and converted by transformers' own operations, and nothing of any other layer.

A pre-quantised checkpoint that transformers dequantises while loading (gpt-oss's MXFP4,
``checkpoints.mxfp4``) is read the same way: its quantizer adds converters from the stored
names (``*_blocks``, ``*_scales``) to the model's parameters, whose operation dequantises.

The names are matched once, from the meta model and the checkpoint's index, before any
tensor is read: a tensor the model needs that no checkpoint name maps to is refused then.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..errors import LoadingError


class Conversion:
    """Which checkpoint names fill each of the model's tensors.

    ``source``: model name -> the one checkpoint name it is read from (renamed or not).
    ``groups``: the first model name of a converted group -> (transformers' converter, its
    (source pattern, checkpoint name) pairs in checkpoint order); ``produced``: every model
    name a group fills -> the group's first name; ``per_expert``: the groups transformers'
    MXFP4 dequantisation fills, converted an expert at a time. ``quantizer``: transformers'
    quantizer of a pre-quantised checkpoint it dequantises (its converters join the mapping)."""

    def __init__(self, model: nn.Module, checkpoint_names: Iterable[str], quantizer=None):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        from .mxfp4 import dequantises

        if quantizer is None:
            mapping = get_model_conversion_mapping(model)
        else:
            mapping = get_model_conversion_mapping(model, hf_quantizer=quantizer)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        meta = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None)
        self.model = model
        self.source: Dict[str, str] = {}
        self.groups: Dict[str, Tuple[object, List[Tuple[str, str]]]] = {}
        self.produced: Dict[str, str] = {}
        self.per_expert: set = set()
        for key in sorted(checkpoint_names, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if target not in meta and key in meta:
                target, pattern = rename_source_key(key, [], [], prefix, meta)
            if target not in meta:
                continue  # a tensor the model does not have (transformers ignores it too)
            if pattern is None:
                self.source.setdefault(target, key)
                continue
            converter = by_pattern[pattern]
            self.groups.setdefault(target, (converter, []))[1].append((pattern, key))
            if quantizer is not None and dequantises(converter):
                self.per_expert.add(target)
            for other in converter.target_patterns:
                self.produced[target.replace(converter.target_patterns[0], other)] = target
        twice = sorted(name for name in self.source if name in self.produced)
        if twice:  # transformers fails on such a checkpoint; reading either copy would be a guess
            name = twice[0]
            _, sources = self.groups[self.produced[name]]
            raise LoadingError(
                f"the checkpoint holds {name} ({len(twice)} such tensors in all) twice: stored under that name, "
                f"and as {sources[0][1]} and {len(sources) - 1} more that transformers converts into it. "
                "transformers cannot load it either; keep one of the two layouts in the files (save_pretrained "
                "of a loaded model writes one)."
            )

    @property
    def changes_names(self) -> bool:
        """Whether any model name is filled from another checkpoint name or by a converter."""
        return bool(self.groups) or any(target != key for target, key in self.source.items())

    def provides(self, name: str) -> bool:
        return name in self.source or name in self.produced

    def dequantised(self, names: Iterable[str]) -> List[str]:
        """Those of ``names`` transformers' MXFP4 dequantisation fills."""
        return [n for n in names if self.produced.get(n) in self.per_expert]

    def converted(self, names: Iterable[str]) -> List[str]:
        """Those of ``names`` a converter fills (their bytes are not the checkpoint's)."""
        return [n for n in names if n in self.produced]

    def _convert(self, first: str, values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        template, sources = self.groups[first]
        converter = copy.deepcopy(template)
        for pattern, key in sources:
            converter.add_tensor(first, key, pattern, values.pop(key))
        out = converter.convert(first, model=self.model, config=getattr(self.model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}

    def check(self, expected: Dict[str, torch.Tensor], stored_shape: Callable[[str], Tuple[int, ...]]) -> List[str]:
        """Problems with the converted ``expected`` tensors, found before any data is read:
        each group converted on meta tensors of its checkpoint tensors' stored shapes (an
        expert missing or of another size gives another shape)."""
        problems = []
        firsts = list(dict.fromkeys(self.produced[name] for name in expected if name in self.produced))
        for first in firsts:
            _, sources = self.groups[first]
            meta = {key: torch.empty(stored_shape(key), device="meta") for _, key in sources}
            try:
                out = self._convert(first, meta)
            except Exception as exc:  # noqa: BLE001 - any failure of transformers' operation is the problem
                problems.append(f"{sources[0][1]} and {len(sources) - 1} more do not convert to {first} ({exc})")
                continue
            for name, value in out.items():
                if name in expected and tuple(value.shape) != tuple(expected[name].shape):
                    problems.append(
                        f"{name}, converted from {sources[0][1]} and {len(sources) - 1} more, has shape "
                        f"{list(value.shape)}, the model expects {list(expected[name].shape)}"
                    )
            problems += [
                f"{name} is not made by converting {sources[0][1]} and {len(sources) - 1} more"
                for name in expected
                if self.produced.get(name) == first and name not in out
            ]
        return problems

    def converted_values(
        self, names: Iterable[str], read: Callable[[List[str]], Dict[str, torch.Tensor]]
    ) -> Iterator[Tuple[str, Optional[slice], torch.Tensor, str]]:
        """(model name, part, value, what it was converted from) for the converted ``names``:
        each group's checkpoint tensors are read (``read``: names -> tensors) and converted by
        transformers' operations, once per group, or, for the MXFP4 dequantisation, once per
        expert; ``part`` is the slice of the model's tensor (its first dimension) the value
        fills: that expert, or None for all of it. An output outside ``names`` is refused."""
        names = set(names)
        for first in dict.fromkeys(self.produced[name] for name in names if name in self.produced):
            _, sources = self.groups[first]
            origin = f"converted from {sources[0][1]} and {len(sources) - 1} more"
            values = read([key for _, key in sources])
            if first in self.per_expert:
                count = next(iter(values.values())).shape[0]
                parts = ((slice(e, e + 1), {key: v[e : e + 1] for key, v in values.items()}) for e in range(count))
            else:
                parts = iter([(None, values)])
            for part, inputs in parts:
                for name, value in self._convert(first, inputs).items():
                    if name not in names:
                        raise LoadingError(
                            f"{name} ({origin}) is not held by the layer being loaded; load with transformers "
                            "(AutoModelForCausalLM.from_pretrained) and call layerstream.stream_model"
                        )
                    yield name, part, value, origin


def for_checkpoint(model: nn.Module, checkpoint_names: Iterable[str], quantizer=None) -> Optional[Conversion]:
    """The conversion for ``model`` from a checkpoint with these names; None where every
    name is the model's own (the common case: nothing to convert). ``quantizer``: see
    ``Conversion``."""
    names = list(checkpoint_names)
    try:
        conversion = Conversion(model, names, quantizer)
    except ImportError:  # a transformers without conversion mappings: names are read as they are
        return None
    return conversion if conversion.changes_names else None
