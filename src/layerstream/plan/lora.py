"""PEFT's LoRA targets, emulated from layer shapes: which modules and Parameters an
adapter of rank r adds to (``target_modules`` as PEFT resolves it), and how many
parameters that is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from .shapes import KNOWN_FAMILIES, LayerShape, LinearShape, ParamShape, _get, _text_config  # noqa: F401


@dataclass
class LoraTargets:
    """What LoRA adapts in one layer: nn.Linear modules, and Parameters with the rank
    multiplier PEFT gives them (2 for a fused gate_up stack: one rank per fused branch)."""

    linears: List[LinearShape] = field(default_factory=list)
    params: List[Tuple[ParamShape, int]] = field(default_factory=list)

    def params_count(self, rank: int) -> int:
        """LoRA parameters: r*(in+out) per linear; for a Parameter of ``experts``
        stacked (out, in) matrices, lora_A is (r*experts, in) and lora_B (out, r*experts)."""
        count = sum(rank * (lin.in_features + lin.out_features) for lin in self.linears)
        return count + sum(rank * mult * p.experts * (p.in_features + p.out_features) for p, mult in self.params)


# PEFT 0.21 rewrites LoRA targets of MoE models whose experts transformers 5 fused into
# Parameters (peft/utils/transformers_weight_conversion.py): the old expert/router
# module names become target_parameters, "all-linear" included. Keyed by model_type:
# old name -> fused Parameter, and the names fused into one stack.
_PEFT_MOE_TARGETS: Dict[str, Tuple[Dict[str, str], Tuple[str, ...]]] = {
    "mixtral": (
        {
            "gate": "mlp.gate.weight",
            "w1": "mlp.experts.gate_up_proj",
            "w3": "mlp.experts.gate_up_proj",
            "w2": "mlp.experts.down_proj",
        },
        ("w1", "w3"),
    ),
    "qwen3_moe": (
        {
            "gate": "mlp.gate.weight",
            "gate_proj": "mlp.experts.gate_up_proj",
            "up_proj": "mlp.experts.gate_up_proj",
            "down_proj": "mlp.experts.down_proj",
        },
        ("gate_proj", "up_proj"),
    ),
    # qwen2_moe itself is absent from PEFT 0.21's table: its experts are not adapted
}


def _lora_targets(config, shapes: Sequence[LayerShape], targets: str) -> List[LoraTargets]:
    """What LoRA adapts in each layer, following PEFT 0.21's ``get_peft_model``.

    ``targets`` is "all-linear" or comma-separated names; a name matches a module path
    that equals it or ends with "." + name, as PEFT's ``target_modules`` list does.
    "all-linear" takes every nn.Linear of the decoder layers (the head is excluded and
    is not in a layer anyway). For the MoE families in ``_PEFT_MOE_TARGETS``, PEFT maps
    the expert and router names onto the fused Parameters and drops them from the module
    targets, so "all-linear" adapts attention, the router and every expert, and no
    dense-layer MLP of ``mlp_only_layers``.
    """
    model_type = getattr(_text_config(config), "model_type", "")
    every = sorted({lin.name.rsplit(".", 1)[-1] for shape in shapes for lin in shape.linears})
    all_linear = targets.strip().lower() == "all-linear"
    names = every if all_linear else [t.strip() for t in targets.split(",") if t.strip()]
    if not names:
        raise ValueError("lora_targets is empty; use 'all-linear' or names such as 'q_proj,v_proj'")
    mapping, fused = _PEFT_MOE_TARGETS.get(model_type, ({}, ()))
    if all_linear:
        names = sorted(set(names) | set(mapping))
    param_names = {mapping[n] for n in names if n in mapping}
    present = [n for n in fused if n in names]
    if 0 < len(present) < len(fused):
        raise ValueError(
            f"LoRA target(s) {', '.join(present)} need {', '.join(sorted(set(fused) - set(present)))} "
            f"too: {model_type} fuses them into one expert Parameter (PEFT refuses this)"
        )
    module_names = [n for n in names if n not in mapping]

    def matches(path: str, candidates) -> bool:
        return any(path == n or path.endswith("." + n) for n in candidates)

    chosen = []
    for shape in shapes:
        layer = LoraTargets([lin for lin in shape.linears if matches(lin.name, module_names)])
        for param in shape.params:
            if param.name in param_names:
                mult = len(fused) if param.name.endswith("gate_up_proj") else 1
                layer.params.append((param, mult))
        chosen.append(layer)
    if not all_linear:
        for name in names:
            hit = name in mapping and any(layer.params for layer in chosen)
            hit = hit or any(matches(lin.name, [name]) for layer in chosen for lin in layer.linears)
            if not hit:
                raise ValueError(
                    f"LoRA target {name!r} matches nothing in this model's decoder layers; "
                    f"their linear layers are: {', '.join(every)}"
                )
    return chosen


def plan_notes(model_type, shapes, adapted, lora_rank, lora_targets, quantization) -> List[str]:
    """What a reader of the plan should know about how it was made."""
    notes: List[str] = []
    if model_type not in KNOWN_FAMILIES:
        notes.append(
            f"model_type {model_type!r} is not one the planner spells out "
            f"({', '.join(KNOWN_FAMILIES)}): its layers were sized as Llama-style "
            "layers (q/k/v/o, gated MLP, two RMSNorms)"
        )
    expert_lora = sum(
        layer.params_count(lora_rank) - LoraTargets(layer.linears).params_count(lora_rank) for layer in adapted
    )
    if expert_lora:
        notes.append(
            f"PEFT adapts the fused experts and routers under lora_targets={lora_targets!r} "
            f"({expert_lora / 1e6:.1f}M of the LoRA parameters), and each recomputed layer "
            "holds its merged expert weights; name attention modules only (e.g. "
            "'q_proj,k_proj,v_proj,o_proj') to leave the experts frozen"
        )
    if quantization == "nf4" and any(shape.sparse for shape in shapes):
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
