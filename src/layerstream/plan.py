"""Memory planner: will a streamed LoRA/QLoRA training run fit, and how fast can it copy?

Answers from a model's transformers config alone, before anything is downloaded or
allocated: how large each streamed layer is (the slot size and the host store), what
stays on the GPU, what the activations of one training step cost, the predicted peak
GPU memory, the host RAM needed, and how many bytes a step copies. Pure arithmetic:
no weights are read and CUDA is never touched; torch is imported for dtype sizes only.

The model of a step that the numbers follow (docs/plan.md derives each term):

- Every decoder layer streams: its frozen weights live in host arenas and are copied
  into ``slots`` GPU buffers of one largest layer each. Embeddings, the final norm, the
  head and the LoRA adapters (with their gradients and AdamW state) stay resident.
  With ``stream_embeddings`` the embedding and head live on the host too: the resident
  part is the final norm, the loss phase also holds one transient copy of the head
  weight, and a step copies the head twice (forward, backward) and the embedding rows.
- Training runs every streamed layer under activation checkpointing, so autograd keeps
  one hidden state per layer boundary, and backward recomputes one layer at a time.
- The loss (logits in fp32, their log-softmax and its gradient) and the recompute of a
  layer happen at different moments of the step, so the peak holds the larger of the two,
  on top of everything that lives for the whole step.
- A step copies every layer twice (forward, then the recompute in reverse) except the
  ``slots`` layers still in slots at each forward/backward turnaround.

Layer shapes follow the transformers modeling code of the families named in
``KNOWN_FAMILIES``; any other ``model_type`` is planned as a Llama-style layer and the
plan says so in its notes.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .config import DEFAULT_ARENA_BYTES, auto_slots
from .schedule import usable_backward_slots
from .window import margin_bytes
from .units import ALIGN, GiB, aligned, arena_sizes, parse_bytes  # noqa: F401  (parse_bytes: re-exported)

QUANTIZATIONS = ("none", "nf4")

# bitsandbytes NF4, as transformers' BitsAndBytesConfig(load_in_4bit=True,
# bnb_4bit_quant_type="nf4") creates it: 4-bit codes in blocks of 64 values, one absmax
# per block. Double quantisation stores each absmax as uint8, quantised again in blocks
# of 256 with one float32 absmax per such block, plus an offset and a 256-entry code table.
NF4_BLOCKSIZE = 64
NF4_NESTED_BLOCKSIZE = 256
NF4_CODE_BYTES = 16 * 4  # the 16-value NF4 code table (float32), one per quantised weight
NF4_NESTED_CODE_BYTES = 256 * 4  # the 8-bit dynamic code table of the nested quantisation
NF4_OFFSET_BYTES = 4  # the float32 mean subtracted from the absmax before nesting

# LoRA adapters are float32: PEFT's get_peft_model(autocast_adapter_dtype=True), the
# default, upcasts adapters of float16/bfloat16 bases to float32.
LORA_BYTES = 4
# AdamW keeps two float32 states (exp_avg, exp_avg_sq) per trainable parameter.
ADAMW_STATES = 2
# The loss holds this many fp32 logit-sized tensors at its peak: in backward, the saved
# log-softmax, the gradient arriving from nll_loss and the gradient log-softmax returns.
# Calibrated: with it the plan matches the peak measured for the Llama-3-8B shape
# (docs/performance.md) to within 1%.
LOSS_LOGIT_COPIES = 3

# backward slots (schedule.py) hold at most this many layers: each is memory the loss
# phase needs and the rest of the step does not, but the planner's activation figures are
# a few percent off at some shapes, so the borrowing stays modest
BACKWARD_SLOTS_MAX = 4
# advice suggests streaming the embedding and head when they are at least this share of
# what stays on the GPU for the whole step (Llama-3-8B bf16: 21%; 70B NF4: 25%)
STREAM_EMBEDDINGS_ADVICE_SHARE = 0.10
STREAM_EMBEDDINGS_ADVICE = "use --stream-embeddings (StreamConfig(stream_embeddings=True))"
DEFAULT_BANDWIDTH_GBPS = 55.0  # the team's measured pinned host->device bandwidth, H200
DEFAULT_RESERVE_BYTES = GiB  # CUDA context, cuBLAS workspaces, allocator slack

# families whose decoder layer this module spells out (read from their modeling code)
KNOWN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
# RMSNorm over each head's query and key (q_norm, k_norm of size head_dim)
_QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# q/k/v projections with a bias, o_proj without; the flag is `qkv_bias` where it exists
_QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")


# -- layer shapes -------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearShape:
    """One ``nn.Linear`` of a decoder layer: quantised by bitsandbytes, targeted by LoRA."""

    name: str  # path inside the layer, as PEFT's target_modules sees it
    in_features: int
    out_features: int
    bias: bool = False


@dataclass(frozen=True)
class ParamShape:
    """A weight that is a plain Parameter, not an nn.Linear: an MoE router (experts=1,
    shape (out, in)) or a fused expert stack (shape (experts, out, in)).

    transformers 5 stores experts this way, so bitsandbytes leaves them in the compute
    dtype; PEFT can still adapt them through ``target_parameters`` (see _lora_targets).
    """

    name: str
    experts: int
    in_features: int
    out_features: int

    @property
    def numel(self) -> int:
        return self.experts * self.in_features * self.out_features


@dataclass(frozen=True)
class LayerShape:
    """The tensors of one decoder layer, grouped by how they are stored and trained.

    linears: the nn.Linear modules (NF4 quantises their weights; "all-linear" LoRA
        targets them).
    params: routers and fused expert weights (always in the compute dtype).
    norms: (name, numel) of the RMSNorm weights (always in the compute dtype).
    mlp_width: activation width of the MLP per token (routed experts count top_k
        times, plus a shared expert), for the working-set estimate.
    top_k: experts each token is routed to (0 in a dense layer).
    """

    linears: Tuple[LinearShape, ...]
    params: Tuple[ParamShape, ...]
    norms: Tuple[Tuple[str, int], ...]
    mlp_width: int
    top_k: int = 0

    @property
    def sparse(self) -> bool:
        return self.top_k > 0


def _get(config, name: str, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def _text_config(config):
    """The language-model part of a config (multimodal configs nest it)."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return config


def _attention_dims(config) -> Tuple[int, int, int, int]:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(_get(config, "num_key_value_heads", heads))
    head_dim = int(_get(config, "head_dim", hidden // heads))
    return hidden, heads, kv_heads, head_dim


def _num_experts(config) -> int:
    # mixtral and qwen3_moe map num_experts onto num_local_experts; qwen2_moe has num_experts
    return int(_get(config, "num_local_experts", _get(config, "num_experts", 0)) or 0)


def _is_sparse(config, index: int) -> bool:
    """Whether layer ``index`` has a mixture-of-experts MLP (the rule of Qwen2/3-MoE's
    decoder layer; Mixtral has no mlp_only_layers/decoder_sparse_step, so every layer)."""
    experts = _num_experts(config)
    if experts <= 0:
        return False
    mlp_only = _get(config, "mlp_only_layers", []) or []
    step = int(_get(config, "decoder_sparse_step", 1) or 1)
    return index not in mlp_only and (index + 1) % step == 0


def layer_shapes(config) -> List[LayerShape]:
    """The shape of every decoder layer of ``config``, in order."""
    config = _text_config(config)
    hidden, heads, kv_heads, head_dim = _attention_dims(config)
    model_type = getattr(config, "model_type", "")
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    if model_type in _QKV_BIAS_FAMILIES:
        qkv_bias, o_bias = bool(_get(config, "qkv_bias", True)), False
    else:
        qkv_bias = o_bias = bool(_get(config, "attention_bias", False))
    attention = (
        LinearShape("self_attn.q_proj", hidden, q_dim, qkv_bias),
        LinearShape("self_attn.k_proj", hidden, kv_dim, qkv_bias),
        LinearShape("self_attn.v_proj", hidden, kv_dim, qkv_bias),
        LinearShape("self_attn.o_proj", q_dim, hidden, o_bias),
    )
    norms = [("input_layernorm.weight", hidden), ("post_attention_layernorm.weight", hidden)]
    if model_type in _QK_NORM_FAMILIES:
        norms += [("self_attn.q_norm.weight", head_dim), ("self_attn.k_norm.weight", head_dim)]

    intermediate = int(config.intermediate_size)
    mlp_bias = bool(_get(config, "mlp_bias", False))
    dense_mlp = _gated_mlp("mlp", hidden, intermediate, mlp_bias)
    shapes = []
    for index in range(int(config.num_hidden_layers)):
        if not _is_sparse(config, index):
            shapes.append(LayerShape(attention + dense_mlp, (), tuple(norms), intermediate))
            continue
        experts = _num_experts(config)
        expert_width = int(_get(config, "moe_intermediate_size", intermediate))
        top_k = int(_get(config, "num_experts_per_tok", 2))
        params = (
            ParamShape("mlp.gate.weight", 1, hidden, experts),  # router, no bias
            ParamShape("mlp.experts.gate_up_proj", experts, hidden, 2 * expert_width),
            ParamShape("mlp.experts.down_proj", experts, expert_width, hidden),
        )
        linears = attention
        width = top_k * expert_width
        shared = int(_get(config, "shared_expert_intermediate_size", 0) or 0)
        if shared:  # Qwen2-MoE: an always-on expert and its sigmoid gate
            linears += _gated_mlp("mlp.shared_expert", hidden, shared, False)
            linears += (LinearShape("mlp.shared_expert_gate", hidden, 1),)
            width += shared
        shapes.append(LayerShape(linears, params, tuple(norms), width, top_k))
    return shapes


def _gated_mlp(prefix: str, hidden: int, width: int, bias: bool) -> Tuple[LinearShape, ...]:
    return (
        LinearShape(f"{prefix}.gate_proj", hidden, width, bias),
        LinearShape(f"{prefix}.up_proj", hidden, width, bias),
        LinearShape(f"{prefix}.down_proj", width, hidden, bias),
    )


# -- bytes --------------------------------------------------------------------------------
def dtype_bytes(dtype) -> int:
    return parse_dtype(dtype).itemsize


def parse_dtype(dtype) -> torch.dtype:
    """torch.bfloat16, "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating-point dtype")
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
             "fp32": torch.float32, "float": torch.float32}
    key = str(dtype).lower().removeprefix("torch.")
    if key not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return names[key]


def nf4_weight_bytes(numel: int, double_quant: bool = True) -> List[int]:
    """The tensors bitsandbytes keeps for one NF4 weight of ``numel`` values, in bytes:
    packed codes (two per byte), absmax, and the quant state's code tables and offset."""
    blocks = math.ceil(numel / NF4_BLOCKSIZE)
    sizes = [math.ceil(numel / 2), NF4_CODE_BYTES]
    if double_quant:
        nested = math.ceil(blocks / NF4_NESTED_BLOCKSIZE)
        sizes += [blocks, nested * 4, NF4_OFFSET_BYTES, NF4_NESTED_CODE_BYTES]
    else:
        sizes.append(blocks * 4)
    return sizes


def _tensor_bytes(shape: LayerShape, quantization: str, elem: int, double_quant: bool) -> List[int]:
    sizes = []
    for linear in shape.linears:
        numel = linear.in_features * linear.out_features
        if quantization == "nf4":
            sizes += nf4_weight_bytes(numel, double_quant)
        else:
            sizes.append(numel * elem)
        if linear.bias:  # biases stay in the compute dtype under NF4
            sizes.append(linear.out_features * elem)
    sizes += [param.numel * elem for param in shape.params]
    sizes += [numel * elem for _, numel in shape.norms]
    return sizes


def _check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return quantization


def layer_bytes(config, quantization: str = "none", dtype=torch.bfloat16,
                double_quant: bool = True) -> List[int]:
    """Bytes of each decoder layer's frozen weights as the host store and a slot hold them.

    One entry per layer (MoE models with ``mlp_only_layers`` or ``decoder_sparse_step``
    mix sizes). Every tensor is rounded up to the store's 512-byte alignment. With
    ``quantization="nf4"`` the nn.Linear weights are 4-bit with their quant state;
    biases, norms, routers and fused expert weights stay in ``dtype``.
    """
    _check_quantization(quantization)
    elem = dtype_bytes(dtype)
    return [sum(aligned(n) for n in _tensor_bytes(shape, quantization, elem, double_quant))
            for shape in layer_shapes(config)]


def embedding_bytes(config, dtype=torch.bfloat16) -> int:
    """The input embedding and, when untied, the head: what ``stream_embeddings`` keeps on
    the host (bitsandbytes never quantises these)."""
    return _embedding_matrices(config) * head_bytes(config, dtype)


def _embedding_matrices(config) -> int:
    """1 when the head is tied to the input embedding, else 2."""
    return 1 if _get(_text_config(config), "tie_word_embeddings", False) else 2


def head_bytes(config, dtype=torch.bfloat16) -> int:
    """One vocab x hidden matrix: the head, and with ``stream_embeddings`` its transient
    device copy during the loss."""
    config = _text_config(config)
    return int(config.vocab_size) * int(config.hidden_size) * dtype_bytes(dtype)


def resident_bytes(config, dtype=torch.bfloat16, stream_embeddings: bool = False) -> int:
    """Embeddings, final norm and head; the final norm alone when the embedding and head
    stream."""
    norm = int(_text_config(config).hidden_size) * dtype_bytes(dtype)
    return norm if stream_embeddings else embedding_bytes(config, dtype) + norm


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
        return count + sum(rank * mult * p.experts * (p.in_features + p.out_features)
                           for p, mult in self.params)


# PEFT 0.21 rewrites LoRA targets of MoE models whose experts transformers 5 fused into
# Parameters (peft/utils/transformers_weight_conversion.py): the old expert/router
# module names become target_parameters, "all-linear" included. Keyed by model_type:
# old name -> fused Parameter, and the names fused into one stack.
_PEFT_MOE_TARGETS: Dict[str, Tuple[Dict[str, str], Tuple[str, ...]]] = {
    "mixtral": ({"gate": "mlp.gate.weight", "w1": "mlp.experts.gate_up_proj",
                 "w3": "mlp.experts.gate_up_proj", "w2": "mlp.experts.down_proj"}, ("w1", "w3")),
    "qwen3_moe": ({"gate": "mlp.gate.weight", "gate_proj": "mlp.experts.gate_up_proj",
                   "up_proj": "mlp.experts.gate_up_proj", "down_proj": "mlp.experts.down_proj"},
                  ("gate_proj", "up_proj")),
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
        raise ValueError(f"LoRA target(s) {', '.join(present)} need {', '.join(sorted(set(fused) - set(present)))} "
                         f"too: {model_type} fuses them into one expert Parameter (PEFT refuses this)")
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
                raise ValueError(f"LoRA target {name!r} matches nothing in this model's decoder layers; "
                                 f"their linear layers are: {', '.join(every)}")
    return chosen


# -- the plan -----------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """Predicted memory and copy cost of one streamed LoRA training step. Bytes are ints."""

    model_type: str
    num_layers: int
    seq: int
    batch: int
    quantization: str
    dtype: str
    lora_rank: int
    lora_targets: str
    # streamed layers
    layer_bytes: List[int]
    max_layer_bytes: int
    host_store_bytes: int
    # resident on the GPU for the whole step
    resident_bytes: int
    lora_params: int
    lora_bytes: int  # adapter weights (fp32)
    lora_grad_bytes: int
    optimizer_bytes: int
    slots: int
    slots_auto: bool
    slot_bytes: int
    backward_slots: int  # extra slots, late backward to early next forward (the loss's memory)
    # activations
    boundary_bytes: int  # one hidden state per layer boundary (checkpointing keeps these)
    layer_working_bytes: int  # one layer's recompute + backward
    loss_bytes: int  # logits in fp32 and their gradients
    # totals
    peak_vram_bytes: int
    vram_bytes: int
    reserve_bytes: int
    host_ram_bytes: int  # peak: model loaded by transformers, then stream_model
    host_steady_bytes: int  # the store alone, after model.to(device)
    loader_store_bytes: int  # arenas as layerstream.from_pretrained allocates them
    loader_ram_bytes: int  # peak: layerstream.from_pretrained, then LoRA
    # copies
    layers_copied_per_step: int
    copy_bytes_per_step: int
    bandwidth_gbps: float
    copy_seconds_per_step: float
    fits: bool
    # stream_embeddings: embedding and head on the host, the head copied in for the loss
    stream_embeddings: bool = False
    head_copy_bytes: int = 0  # the transient device copy of the head weight (loss phase)
    ends_host_bytes: int = 0  # the embedding and head weights in host memory
    ends_copy_bytes_per_step: int = 0  # two head copies and the embedding rows (in copy_bytes_per_step)
    advice: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def static_bytes(self) -> int:
        """What lives on the GPU for the whole step."""
        return (self.resident_bytes + self.slot_bytes + self.lora_bytes + self.lora_grad_bytes
                + self.optimizer_bytes + self.boundary_bytes)

    @property
    def loss_phase_bytes(self) -> int:
        """The loss, and the head weight copied in for it when the head streams."""
        return self.loss_bytes + self.head_copy_bytes

    @property
    def activation_bytes(self) -> int:
        """What grows with batch x seq: boundary states plus the larger transient phase."""
        return self.boundary_bytes + max(self.loss_bytes, self.layer_working_bytes)

    @property
    def needed_bytes(self) -> int:
        return self.peak_vram_bytes + self.reserve_bytes

    @property
    def headroom_bytes(self) -> int:
        """Budget left after the peak and the reserve (negative: the shortfall)."""
        return self.vram_bytes - self.needed_bytes

    @property
    def window_layers(self) -> int:
        """Layers a ``vram_budget`` of this plan's budget keeps on the GPU for good (the
        resident window), as the runtime sizes it when its steps use what this plan
        predicts: whole layers in the headroom less the window's margin."""
        if not self.fits:
            return 0
        return window_size(self.headroom_bytes - margin_bytes(self.vram_bytes), self.max_layer_bytes, self.num_layers)

    def window_copies(self) -> Tuple[int, int]:
        """(layers, bytes) copied per step with that window; its layers are the ones
        ``schedule.spread_resident`` picks."""
        from .schedule import spread_resident

        kept = set(spread_resident(self.num_layers, self.window_layers))
        streamed = [size for index, size in enumerate(self.layer_bytes) if index not in kept]
        return _copies(streamed, self.slots, usable_backward_slots(self.backward_slots, len(streamed), self.slots))

    @property
    def largest_tokens(self) -> int:
        """The most batch x seq tokens whose activations fit beside everything else
        (activations grow linearly with tokens); 0 when there is no room."""
        per_token = self.activation_bytes / (self.batch * self.seq)
        room = self.vram_bytes - self.reserve_bytes - (self.peak_vram_bytes - self.activation_bytes)
        return int(room // per_token) if room > 0 else 0

    @property
    def largest_batch(self) -> int:
        """The largest batch at this seq that fits; 0 when not even one sequence does."""
        return self.largest_tokens // self.seq


def window_size(headroom_bytes: int, largest_layer_bytes: int, num_layers: int) -> int:
    """How many layers the resident window holds: whole largest layers in the headroom a
    VRAM budget leaves after the planned peak and the reserve (StreamRuntime uses it too)."""
    return int(min(num_layers, max(0, headroom_bytes // max(largest_layer_bytes, 1))))


def _copies(sizes: Sequence[int], slots: int, backward_slots: int = 0) -> Tuple[int, int]:
    """Layers and bytes copied per steady-state training step. Forward starts with the
    first ``slots + backward_slots`` layers left in slots by the previous backward;
    backward starts with the ``slots`` last layers left by forward (backward slots are
    empty at the loss). Every other visit copies its layer."""
    layers = len(sizes)
    kept_forward = min(layers, slots + backward_slots)
    kept_backward = min(layers, slots)
    return ((layers - kept_forward) + (layers - kept_backward),
            sum(sizes[kept_forward:]) + sum(sizes[: layers - kept_backward]))


def backward_slot_count(loss_phase_bytes: int, working_bytes: int, lora_bytes: int,
                        slot_bytes: int, streamed_layers: int, slots: int) -> int:
    """How many backward slots fit in memory the loss phase needs and the rest of the
    step does not: the loss phase less one layer's recompute and backward, the adapters'
    gradients and the optimizer's temporaries (two more adapter-sized tensors) that come
    while backward slots hold layers. None when a layer's working set, not the loss, sets
    the peak (the memory would raise it); never more than ``usable_backward_slots``."""
    room = loss_phase_bytes - working_bytes - 3 * lora_bytes
    if room <= 0 or slot_bytes <= 0:
        return 0
    return usable_backward_slots(int(min(BACKWARD_SLOTS_MAX, room // slot_bytes)), streamed_layers, slots)


def loader_arena_bytes(sizes: Sequence[int], arena_bytes: int) -> int:
    """Host bytes of the arenas ``layerstream.from_pretrained`` allocates (HostStore.add)."""
    return sum(arena_sizes(list(sizes), arena_bytes))


def _working_bytes(config, shape: LayerShape, adapted: LoraTargets, tokens: int,
                   elem: int, dequantised: bool = False) -> int:
    """Activation memory of one layer while backward recomputes and differentiates it.

    Per token, what autograd keeps for a transformers decoder layer (sdpa or flash
    attention):
    - the input of each of the two RMSNorms in float32 (they upcast), and q/k in float32
      under Qwen3's per-head norms;
    - q, k, v and the attention output in the compute dtype;
    - the MLP's gate, up and gated product in the compute dtype; in an MoE layer routed
      experts count top_k times, plus the gathered input and the output of every routed
      copy, plus the router's float32 logits and probabilities;
    - for each LoRA-adapted nn.Linear, PEFT's float32 copy of its input (the adapter is
      float32, the activations are not).
    Per layer: a LoRA-adapted Parameter (expert stack, router) is merged as W + B@A by
    PEFT's ParamWrapper on every call, and autograd keeps the merged weight. With
    ``dequantised`` (NF4 layers in training), every nn.Linear's weight in the compute
    dtype: a streamed NF4 projection at training sizes is dequantize_4bit + F.linear as
    ordinary autograd ops (nf4.dequantized_linear), and autograd keeps the dequantised
    weight for the input gradient.

    Checked against allocation traces of streamed training steps on CPU (dense and MoE
    layers, bf16 and fp32): within 5% (docs/plan.md).
    """
    config = _text_config(config)
    hidden, heads, kv_heads, head_dim = _attention_dims(config)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    per_token = 2 * 4 * hidden
    if getattr(config, "model_type", "") in _QK_NORM_FAMILIES:
        per_token += 4 * (q_dim + kv_dim)
    per_token += (2 * q_dim + 2 * kv_dim) * elem
    per_token += 3 * shape.mlp_width * elem
    if shape.sparse:
        per_token += 2 * shape.top_k * hidden * elem + 2 * 4 * _num_experts(config)
    per_token += LORA_BYTES * sum(lin.in_features for lin in adapted.linears)
    merged = sum(param.numel for param, _ in adapted.params) * elem
    if dequantised:
        merged += sum(lin.in_features * lin.out_features for lin in shape.linears) * elem
    return tokens * per_token + merged


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _build(config, seq: int, batch: int, vram_bytes: int, quantization: str, dtype,
           lora_rank: int, slots: Optional[int], bandwidth_gbps: float, lora_targets: str,
           reserve_bytes: int, double_quant: bool, arena_bytes: int,
           stream_embeddings: bool = False, backward_slots: Optional[int] = 0) -> MemoryPlan:
    """A plan without advice (advice itself is computed from alternative plans)."""
    config = _text_config(config)
    seq, batch = _positive_int("seq", seq), _positive_int("batch", batch)
    vram_bytes = _positive_int("vram_bytes", vram_bytes)
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an integer >= 0 (0: no adapters), got {lora_rank!r}")
    if not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth_gbps must be > 0, got {bandwidth_gbps!r}")
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes!r}")
    if slots is not None:
        _positive_int("slots", slots)
        if slots < 2:
            raise ValueError(f"slots={slots}: streaming needs at least 2 slots")
    if backward_slots is not None and (isinstance(backward_slots, bool) or not isinstance(backward_slots, int)
                                       or backward_slots < 0):
        raise ValueError(f"backward_slots must be an integer >= 0 or None (auto), got {backward_slots!r}")
    _check_quantization(quantization)
    dtype = parse_dtype(dtype)
    elem = dtype.itemsize
    model_type = getattr(config, "model_type", "") or "unknown"

    shapes = layer_shapes(config)
    sizes = layer_bytes(config, quantization, dtype, double_quant)
    adapted = (_lora_targets(config, shapes, lora_targets) if lora_rank
               else [LoraTargets() for _ in shapes])
    lora_params = sum(layer.params_count(lora_rank) for layer in adapted)
    tokens = batch * seq
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)

    if not isinstance(stream_embeddings, bool):
        raise ValueError(f"stream_embeddings must be True or False, got {stream_embeddings!r}")
    resident = resident_bytes(config, dtype, stream_embeddings)
    all_resident = resident_bytes(config, dtype)  # on the host until model.to(device), streamed or not
    head_copy = head_bytes(config, dtype) if stream_embeddings else 0
    # the ends' host store: each matrix at the store's alignment
    ends_host = _embedding_matrices(config) * aligned(head_bytes(config, dtype)) if stream_embeddings else 0
    ends_copies = 2 * head_copy + (tokens * hidden * elem if stream_embeddings else 0)
    lora_bytes = lora_grads = lora_params * LORA_BYTES  # gradients take the adapters' dtype
    optimizer = lora_params * 4 * ADAMW_STATES
    boundary = len(shapes) * tokens * hidden * elem
    working = max(_working_bytes(config, shape, layer, tokens, elem, dequantised=quantization == "nf4")
                  for shape, layer in zip(shapes, adapted))
    loss = LOSS_LOGIT_COPIES * tokens * vocab * 4
    max_layer = max(sizes)
    # everything but the slots; gradients are counted for the whole step (they outlive
    # backward when gradients accumulate over micro-batches)
    fixed = resident + lora_bytes + lora_grads + optimizer + boundary + max(loss + head_copy, working)

    slots_auto = slots is None
    if slots_auto:
        # what StreamConfig(slots="auto") takes, with the room the budget leaves the slots
        slots = auto_slots(vram_bytes - reserve_bytes - fixed, max_layer)
    peak = fixed + slots * max_layer
    if backward_slots is None:
        backward_slots = backward_slot_count(loss + head_copy, working, lora_bytes, max_layer, len(sizes), slots)
    else:
        backward_slots = usable_backward_slots(backward_slots, len(sizes), slots)
    copied_layers, copied_bytes = _copies(sizes, slots, backward_slots)
    copied_bytes += ends_copies
    store = sum(sizes)
    loader_store = loader_arena_bytes(sizes, arena_bytes)
    unquantised = max(layer_bytes(config, "none", dtype)) if quantization != "none" else max_layer

    notes = []
    if model_type not in KNOWN_FAMILIES:
        notes.append(f"model_type {model_type!r} is not one the planner spells out "
                     f"({', '.join(KNOWN_FAMILIES)}): its layers were sized as Llama-style "
                     "layers (q/k/v/o, gated MLP, two RMSNorms)")
    expert_lora = sum(layer.params_count(lora_rank) - LoraTargets(layer.linears).params_count(lora_rank)
                      for layer in adapted)
    if expert_lora:
        notes.append(f"PEFT adapts the fused experts and routers under lora_targets={lora_targets!r} "
                     f"({expert_lora / 1e6:.1f}M of the LoRA parameters), and each recomputed layer "
                     "holds its merged expert weights; name attention modules only (e.g. "
                     "'q_proj,k_proj,v_proj,o_proj') to leave the experts frozen")
    if quantization == "nf4" and any(shape.sparse for shape in shapes):
        notes.append("MoE expert weights and routers stay in the compute dtype under NF4: "
                     "bitsandbytes quantises nn.Linear modules only")
    if quantization == "nf4":
        notes.append("NF4 host RAM assumes layers are quantised as they load: "
                     "layerstream.from_pretrained(quantization='nf4'), or transformers with "
                     "BitsAndBytesConfig and device_map='cpu'")

    return MemoryPlan(
        model_type=model_type, num_layers=len(sizes), seq=seq, batch=batch,
        quantization=quantization, dtype=str(dtype).removeprefix("torch."),
        lora_rank=lora_rank, lora_targets=lora_targets,
        layer_bytes=sizes, max_layer_bytes=max_layer, host_store_bytes=store,
        resident_bytes=resident, lora_params=lora_params, lora_bytes=lora_bytes,
        lora_grad_bytes=lora_grads, optimizer_bytes=optimizer,
        slots=slots, slots_auto=slots_auto, slot_bytes=slots * max_layer, backward_slots=backward_slots,
        boundary_bytes=boundary, layer_working_bytes=working, loss_bytes=loss,
        peak_vram_bytes=peak, vram_bytes=vram_bytes, reserve_bytes=reserve_bytes,
        # stream_model copies the loaded layers into its arenas one at a time (each
        # layer's own memory is freed once it is copied) and page-locks afterwards, so
        # at the peak the store and one loaded layer (or one embedding matrix, copied into
        # the ends' store the same way) coexist; embeddings, head and adapters are on the
        # host too until model.to(device)
        host_ram_bytes=store + max(max_layer, head_copy) + all_resident + lora_bytes,
        host_steady_bytes=store + ends_host,
        # from_pretrained loads the resident part, then one layer at a time (unquantised,
        # then packed); PEFT's adapters come after loading, on the host until .to(device)
        loader_store_bytes=loader_store,
        loader_ram_bytes=loader_store + all_resident + max(unquantised, lora_bytes, head_copy),
        layers_copied_per_step=copied_layers, copy_bytes_per_step=copied_bytes,
        bandwidth_gbps=float(bandwidth_gbps),
        copy_seconds_per_step=copied_bytes / (bandwidth_gbps * 1e9),
        fits=peak + reserve_bytes <= vram_bytes, notes=notes,
        stream_embeddings=stream_embeddings, head_copy_bytes=head_copy, ends_host_bytes=ends_host,
        ends_copy_bytes_per_step=ends_copies,
    )


def make_plan(config, seq: int, batch: int, vram_bytes: int, quantization: str = "none",
              dtype=torch.bfloat16, lora_rank: int = 16, slots: Optional[int] = None,
              bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS, lora_targets: str = "all-linear",
              reserve_bytes: int = DEFAULT_RESERVE_BYTES, double_quant: bool = True,
              arena_bytes: int = DEFAULT_ARENA_BYTES, stream_embeddings: bool = False,
              backward_slots: Optional[int] = 0) -> MemoryPlan:
    """Plan a streamed LoRA training step of ``batch`` x ``seq`` tokens on a GPU of
    ``vram_bytes``.

    slots: None picks the largest count in 2..8 (at most the number of layers) that fits;
        when none fits, 2, and the plan does not fit.
    reserve_bytes: kept free for what torch's allocator statistics do not count (CUDA
        context, library workspaces, fragmentation). The plan fits when
        ``peak_vram_bytes + reserve_bytes <= vram_bytes``.
    bandwidth_gbps: pinned host->device GB/s (1e9 bytes/s). The default is the team's
        measurement on an H200; measure your own machine and pass it.
    double_quant: NF4 with double quantisation (bnb_4bit_use_double_quant).
    arena_bytes: StreamConfig.arena_bytes (host RAM of layerstream.from_pretrained).
    stream_embeddings: StreamConfig.stream_embeddings: the input embedding and head stay
        in host memory; the loss phase holds one transient copy of the head weight.
    backward_slots: StreamConfig.backward_slots (default 0); None: as many as the loss
        phase's memory holds (``backward_slot_count``), what the runtime's "auto" takes
        when the caching allocator uses expandable segments.

    A plan that does not fit carries ``advice``: what to change, and by how much.
    """
    args = dict(config=config, seq=seq, batch=batch, vram_bytes=vram_bytes,
                quantization=quantization, dtype=dtype, lora_rank=lora_rank, slots=slots,
                bandwidth_gbps=bandwidth_gbps, lora_targets=lora_targets,
                reserve_bytes=reserve_bytes, double_quant=double_quant, arena_bytes=arena_bytes,
                stream_embeddings=stream_embeddings, backward_slots=backward_slots)
    plan = _build(**args)
    if not plan.fits:
        plan.advice = _advice(plan, args)
    return plan


def plan_for_model(model, seq: int, batch: int, slots: Optional[int] = None,
                   vram_bytes: int = 1 << 50, stream_embeddings: bool = False,
                   backward_slots: Optional[int] = 0) -> MemoryPlan:
    """The plan of a live (possibly PEFT-wrapped) model: its config, 4-bit state, compute
    dtype, and LoRA rank and targets; ``stream_embeddings`` as the model streams (or would).
    Reads attributes only; raises ValueError when the adapters cannot be described to the
    planner (regex targets, several adapters)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("the model has no transformers config")
    quantization = "nf4" if getattr(model, "is_loaded_in_4bit", False) else "none"
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = embeddings.weight.dtype if embeddings is not None else torch.bfloat16
    rank, targets = 0, "all-linear"
    peft_configs = getattr(model, "peft_config", None) or {}
    if len(peft_configs) > 1:
        raise ValueError("several adapters: plan each with `layerstream plan`")
    for peft_config in peft_configs.values():
        rank = int(getattr(peft_config, "r", 0))
        modules = getattr(peft_config, "target_modules", None)
        if isinstance(modules, str) and modules.lower() != "all-linear":
            raise ValueError(f"LoRA target_modules is a pattern ({modules!r})")
        if modules and not isinstance(modules, str):
            targets = ",".join(sorted(modules))
    return make_plan(config, seq=seq, batch=batch, vram_bytes=vram_bytes, quantization=quantization,
                     dtype=dtype, lora_rank=rank, slots=slots, lora_targets=targets,
                     stream_embeddings=stream_embeddings, backward_slots=backward_slots)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def _advice(plan: MemoryPlan, args: dict) -> List[str]:
    """What would make ``plan`` fit, each with what it saves and whether it is enough."""
    short = -plan.headroom_bytes
    out = [f"short by {_gib(short)}: predicted peak {_gib(plan.peak_vram_bytes)} + reserve "
           f"{_gib(plan.reserve_bytes)} > budget {_gib(plan.vram_bytes)}"]

    def verdict(saved: int) -> str:
        return "enough on its own" if saved >= short else f"not enough alone, still {_gib(short - saved)} short"

    if plan.quantization == "none":
        nf4 = _build(**dict(args, quantization="nf4", slots=plan.slots))
        saved = plan.peak_vram_bytes - nf4.peak_vram_bytes
        out.append(f"use --quantization nf4: layers shrink from {_gib(plan.max_layer_bytes)} to "
                   f"{_gib(nf4.max_layer_bytes)}, saving {_gib(saved)} over {plan.slots} slots "
                   f"({verdict(saved)})")
    if plan.slots > 2:
        saved = (plan.slots - 2) * plan.max_layer_bytes
        out.append(f"use fewer slots: --slots 2 saves {_gib(saved)} ({verdict(saved)})")
    ends = embedding_bytes(args["config"], args["dtype"])
    if not plan.stream_embeddings and ends >= STREAM_EMBEDDINGS_ADVICE_SHARE * plan.static_bytes:
        streamed = _build(**dict(args, stream_embeddings=True, slots=plan.slots))
        saved = plan.peak_vram_bytes - streamed.peak_vram_bytes
        if saved > 0:
            out.append(f"{STREAM_EMBEDDINGS_ADVICE}: the input embedding and head ({_gib(ends)}) stay in "
                       f"host memory, saving {_gib(saved)} ({verdict(saved)}); the head "
                       f"({_gib(streamed.head_copy_bytes)}) is then copied to the GPU twice per step")
    # activations grow linearly with batch x seq; find the largest that fits
    max_tokens = plan.largest_tokens
    if max_tokens // plan.batch >= 1:
        out.append(f"reduce --seq to {max_tokens // plan.batch} or less: activations and logits take "
                   f"{_gib(plan.activation_bytes)} at seq {plan.seq} x batch {plan.batch}")
    if plan.batch > 1 and plan.largest_batch >= 1:
        out.append(f"reduce --batch to {plan.largest_batch} or less at seq {plan.seq}")
    if max_tokens < plan.batch:
        out.append(f"everything but the activations already takes "
                   f"{_gib(plan.peak_vram_bytes - plan.activation_bytes + plan.reserve_bytes)} "
                   "with the reserve: no seq or batch fits without other changes")
    out.append(f"or use a GPU with at least {_gib(plan.needed_bytes)} for this plan as it is")
    return out


def speed_hints(plan: MemoryPlan) -> List[str]:
    """Ways a plan that fits could copy less per token. The copies of a micro-batch are
    a floor under its step time; at batch 1 they can exceed the compute
    (docs/performance.md: Llama-3-8B bf16 at 1 x 2048 tokens runs at 0.70x resident,
    at 4 x 2048 at 0.99x)."""
    if not plan.fits or plan.layers_copied_per_step == 0:
        return []
    hints = []
    window = plan.window_layers
    if window >= plan.num_layers:
        hints.append(f"every layer fits in {_gib(plan.vram_bytes)} beside the rest: with "
                     f"vram_budget={_gib(plan.vram_bytes)} (StreamConfig(vram_budget=...), stream.vram_budget) "
                     "the resident window keeps them all and nothing is copied per step")
    elif window:
        layers, nbytes = plan.window_copies()
        hints.append(
            f"with vram_budget={_gib(plan.vram_bytes)} (StreamConfig(vram_budget=...), stream.vram_budget) "
            f"the resident window keeps {window} of {plan.num_layers} layers on the GPU: {layers} layer "
            f"copies per step instead of {plan.layers_copied_per_step}, "
            f"{nbytes / (plan.bandwidth_gbps * 1e9):.3f} s at {plan.bandwidth_gbps:g} GB/s")
    backward = backward_slot_count(plan.loss_phase_bytes, plan.layer_working_bytes, plan.lora_bytes,
                                   plan.max_layer_bytes, plan.num_layers, plan.slots)
    if backward > plan.backward_slots:
        hints.append(f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, {backward} backward slots "
                     f"(StreamConfig(backward_slots='auto'), the default) reuse the loss's memory outside "
                     f"the loss: {backward} layer copies fewer per step, the peak unchanged")
    largest = plan.largest_batch
    if largest > plan.batch:
        hints.append(
            f"every micro-batch copies the streamed layers again (forward, then backward's "
            f"recompute): batch {largest} fits at seq {plan.seq} and carries {largest / plan.batch:.0f}x "
            f"the tokens for the same copies, so raise per_device_train_batch_size before "
            f"gradient_accumulation_steps")
    return hints


# -- text ---------------------------------------------------------------------------------
def format_plan(plan: MemoryPlan) -> str:
    """The plan as a one-screen table, sizes in GiB."""
    lines = []
    width = 50

    def row(label: str, nbytes: Optional[float] = None, extra: str = "") -> None:
        value = f"{nbytes / GiB:9.2f} GiB" if nbytes is not None else " " * 13
        lines.append(f"  {label:<{width}}{value}{('  ' + extra) if extra else ''}")

    sizes = sorted(set(plan.layer_bytes))
    per_layer = (f"{_gib(sizes[0])}" if len(sizes) == 1
                 else f"{_gib(sizes[0])} to {_gib(sizes[-1])}")
    lora = (f"r={plan.lora_rank} on {plan.lora_targets}" if plan.lora_rank else "no LoRA")
    lines.append(f"layerstream plan: {plan.model_type}, {plan.num_layers} layers, "
                 f"seq {plan.seq} x batch {plan.batch}, {plan.dtype}"
                 f"{', NF4' if plan.quantization == 'nf4' else ''}, {lora}")
    lines.append("")
    lines.append("GPU memory")
    if plan.stream_embeddings:
        row("final norm (embeddings and head stream)", plan.resident_bytes)
    else:
        row("embeddings, final norm, head (resident)", plan.resident_bytes)
    slots_how = "auto" if plan.slots_auto else "--slots"
    row(f"slots: {plan.slots} x {_gib(plan.max_layer_bytes)} ({slots_how})", plan.slot_bytes)
    if plan.backward_slots:
        row(f"backward slots: {plan.backward_slots} x {_gib(plan.max_layer_bytes)} (not at the peak)",
            plan.backward_slots * plan.max_layer_bytes, "outside the loss")
    row(f"LoRA: {plan.lora_params / 1e6:.1f}M fp32 params, grads, AdamW",
        plan.lora_bytes + plan.lora_grad_bytes + plan.optimizer_bytes)
    row(f"hidden states at {plan.num_layers} layer boundaries", plan.boundary_bytes)
    # the loss and a layer's recompute happen at different moments: only the larger counts
    loss_peak = plan.loss_phase_bytes >= plan.layer_working_bytes
    row(f"loss: fp32 logits x{LOSS_LOGIT_COPIES}" + ("" if loss_peak else " (not at the peak)"),
        plan.loss_bytes)
    if plan.head_copy_bytes:
        row("head weight copied in for the loss" + ("" if loss_peak else " (not at the peak)"),
            plan.head_copy_bytes)
    row("one layer's recompute + backward" + (" (not at the peak)" if loss_peak else ""),
        plan.layer_working_bytes)
    row("predicted peak VRAM", plan.peak_vram_bytes)
    row("reserve: CUDA context, workspaces, fragmentation", plan.reserve_bytes)
    verdict = (f"fits, {_gib(plan.headroom_bytes)} to spare" if plan.fits
               else f"DOES NOT FIT, short by {_gib(-plan.headroom_bytes)}")
    row("budget (--vram)", plan.vram_bytes, verdict)
    lines.append("")
    lines.append("Host memory")
    row(f"host store: {plan.num_layers} layers of {per_layer}", plan.host_store_bytes)
    if plan.stream_embeddings:
        row("embeddings and head (--stream-embeddings)", plan.ends_host_bytes)
    row("host RAM needed: transformers load + stream_model", plan.host_ram_bytes,
        f"after .to(device): {_gib(plan.host_steady_bytes)}")
    row("host RAM needed: layerstream.from_pretrained", plan.loader_ram_bytes,
        f"after .to(device): {_gib(plan.loader_store_bytes + plan.ends_host_bytes)}")
    lines.append("")
    lines.append("Copies per training step")
    timing = f"{plan.copy_seconds_per_step:.3f} s at {plan.bandwidth_gbps:g} GB/s"
    ends = plan.ends_copy_bytes_per_step
    kept_forward = plan.slots + plan.backward_slots
    how = (f"2 x ({plan.num_layers} - {plan.slots} slots)" if not plan.backward_slots
           else f"{plan.num_layers} - {kept_forward} + {plan.num_layers} - {plan.slots}")
    row(f"{plan.layers_copied_per_step} layer copies ({how})"
        if plan.num_layers > plan.slots else "0 layer copies (every layer stays in a slot)",
        plan.copy_bytes_per_step - ends, "" if ends else timing)
    if ends:
        row("2 head copies (forward, backward), embedding rows", ends)
        row("all copies", plan.copy_bytes_per_step, timing)
    for item in speed_hints(plan):
        lines.extend(textwrap.wrap(f"speed: {item}", width=88, subsequent_indent="       "))
    for note in plan.notes:
        lines.extend(textwrap.wrap(f"note: {note}", width=88, subsequent_indent="      "))
    if plan.advice:
        lines.append("")
        lines.append("To make it fit:")
        for item in plan.advice:
            lines.extend(textwrap.wrap(f"- {item}", width=88, initial_indent="  ", subsequent_indent="    "))
    return "\n".join(lines)


# -- input parsing ------------------------------------------------------------------------
def load_config(model: Union[str, os.PathLike]):
    """A transformers config from a config.json file (any name), a local directory
    holding config.json, or a hub id (downloads config.json only)."""
    from transformers import AutoConfig

    path = os.fspath(model)
    if os.path.isfile(path):
        with open(path) as handle:
            try:
                values = json.load(handle)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise ValueError(f"{path} has no 'model_type'; is it a transformers config.json?")
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"directory {path} holds no config.json")
        return AutoConfig.from_pretrained(path)
    if path.endswith(".json"):
        raise FileNotFoundError(f"no such config file: {path}")
    return AutoConfig.from_pretrained(path)
