"""Layer shapes and bytes, from a transformers config alone: what each decoder layer holds,
how large it is in each dtype and in NF4, what stays resident. Pure arithmetic."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import List, Tuple, Union

import torch

from ..checkpoints.paths import missing_directory
from ..units import GiB, aligned

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
    names = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
    }
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


def layer_bytes(config, quantization: str = "none", dtype=torch.bfloat16, double_quant: bool = True) -> List[int]:
    """Bytes of each decoder layer's frozen weights as the host store and a slot hold them.

    One entry per layer (MoE models with ``mlp_only_layers`` or ``decoder_sparse_step``
    mix sizes). Every tensor is rounded up to the store's 512-byte alignment. With
    ``quantization="nf4"`` the nn.Linear weights are 4-bit with their quant state;
    biases, norms, routers and fused expert weights stay in ``dtype``.
    """
    _check_quantization(quantization)
    elem = dtype_bytes(dtype)
    return [
        sum(aligned(n) for n in _tensor_bytes(shape, quantization, elem, double_quant))
        for shape in layer_shapes(config)
    ]


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
    missing = missing_directory(path)
    if missing is not None:  # a mistyped path: the hub would answer with a repo id error
        raise FileNotFoundError(missing)
    return AutoConfig.from_pretrained(path)
