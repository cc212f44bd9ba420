"""Which tensors of a streamed layer are expert stacks that may be copied by need.

transformers 5 stores a mixture-of-experts layer's experts as stacked tensors (one row per
expert: ``gate_up_proj`` [experts, ...], ``down_proj``, and their biases) in an experts
module called as ``experts(hidden_states, top_k_index, top_k_weights)`` after the router
has chosen. Its implementations (eager, ``batched_mm``, ``grouped_mm``) read only the rows
of the experts in ``top_k_index``. Rows of the other experts may then hold anything: they
are never read.

That holds only where the experts module is the one reader of its stacks, so by-need
copying is limited to the experts classes checked to be called that way by their layer
(``CHECKED``) and to the implementations that index by expert (``INDEXING``). Anything
else (another implementation, a stack PEFT merges with an adapter, which reads every row)
copies every row before the experts run.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
from torch import nn

from .packed_experts import packed_of

# experts classes whose decoder layer reads the stacks only by calling the module, with the
# chosen experts as its second argument
CHECKED = frozenset(
    {
        "MixtralExperts",
        "Qwen2MoeExperts",
        "Qwen3MoeExperts",
        "GptOssExperts",
        "OlmoeExperts",
        # the routed experts of GLM-4.5 (-Air), DeepSeek-V3 and dots.llm1 beside their shared
        # experts (a module of its own, always copied), Qwen3-Next, Granite-MoE, ERNIE-4.5
        "Glm4MoeExperts",
        "DeepseekV3Experts",
        "Dots1Experts",
        "Qwen3NextExperts",
        "GraniteMoeExperts",
        "Ernie4_5_MoeExperts",
    }
)
# transformers' experts implementations that read only the rows of the chosen experts
INDEXING = frozenset({"eager", "batched_mm", "grouped_mm"})
_CHOSEN_NAMES = ("top_k_index", "router_indices")


@dataclasses.dataclass
class ExpertStacks:
    """The expert stacks of one experts module of a streamed layer.

    positions: indices into the layer record's entries, one per stacked tensor (its first
        dimension is the expert).
    by_need: whether its rows may be copied by need (a checked class, not wrapped by a PEFT
        tuner, in the host store); otherwise they are always copied whole.
    """

    module: nn.Module
    experts: int
    top_k: int
    positions: List[int]
    by_need: bool


def find(record) -> List[ExpertStacks]:
    """The expert stacks of a streamed layer's record: every module with a number of
    experts and a matrix per expert (its biases, a row per expert, go with it)."""
    by_module = {}
    for position, entry in enumerate(record.entries):
        module = entry.module
        experts = getattr(module, "num_experts", None)
        # MXFP4 stacks kept packed are buffers (``packed_experts``): a row per expert too
        stacked = entry.kind == "_parameters" or (entry.kind == "_buffers" and packed_of(module) is not None)
        if not stacked or not isinstance(experts, int) or experts < 2:
            continue
        if len(entry.shape) >= 2 and entry.shape[0] == experts:
            by_module.setdefault(id(module), (module, entry.qualified_name, []))[2].append(position)
    return [
        ExpertStacks(
            module,
            int(module.num_experts),
            _top_k(module),
            positions,
            by_need=record.host_region is not None and _top_k(module) > 0 and _checked(module, name),
        )
        for module, name, positions in by_module.values()
        # a router's weight has a row per expert too, but no matrix per expert
        if any(len(record.entries[p].shape) >= 3 for p in positions)
    ]


def _checked(module: nn.Module, qualified_name: str) -> bool:
    return (
        type(module).__name__ in CHECKED
        and ".base_layer." not in f".{qualified_name}"  # wrapped by a PEFT tuner: it reads every row
    )


def _top_k(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    return int(getattr(config, "num_experts_per_tok", 0) or 0)


def reads_only_chosen(module: nn.Module) -> bool:
    """Whether this call of the experts module reads only the chosen experts' rows: an
    indexing implementation, and no parametrization (PEFT's adapter on the stack merges
    the whole tensor)."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None) or "eager"
    return implementation in INDEXING and not nn.utils.parametrize.is_parametrized(module)


def chosen(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The chosen experts' indices of an experts call, or None where the call does not
    carry them the known way."""
    if len(args) >= 2 and isinstance(args[1], torch.Tensor):
        return args[1]
    for name in _CHOSEN_NAMES:
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    return None
