"""Layer shapes and bytes, read from the model itself: transformers builds the model of a
config on the meta device (``modules.meta``), and each decoder layer's tensors (names,
shapes, the dtypes they load in, buffers included), the ones a 4-bit load packs to NF4
(``nf4.quantised_on_load``), and the resident part are read off it; each layer's bytes
are the host store's layout of them (``tiers.store``). Meta tensors allocate nothing, so
this is as pure as arithmetic: no weight is read and CUDA is never touched."""

from __future__ import annotations

import copy
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Tuple, Union

import torch

from ..checkpoints import mxfp4
from ..checkpoints.paths import missing_directory
from ..modules import nf4, packed_experts
from ..modules.discovery import find_decoder_layers, layer_name
from ..modules.meta import meta_model
from ..tiers.store import HostStore, region_bytes
from ..units import GiB

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

# AdamW keeps two states (exp_avg, exp_avg_sq) per trainable parameter, in its dtype.
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


# -- layer shapes, read from the meta model -----------------------------------------------
@dataclass(frozen=True)
class TensorShape:
    """One tensor a layer (or the resident part) holds, as the model loads it."""

    name: str  # path inside the layer (inside the model, for the resident part)
    shape: Tuple[int, ...]
    dtype: torch.dtype
    buffer: bool = False
    quantised: bool = False  # an nn.Linear weight a 4-bit load packs to NF4

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def stored_bytes(self, quantization: str, double_quant: bool = True) -> List[int]:
        """The tensors the host store holds for this one: NF4 pieces, or the tensor itself."""
        if quantization == "nf4" and self.quantised:
            return nf4_weight_bytes(self.numel, double_quant)
        return [self.nbytes]


@dataclass(frozen=True)
class LinearShape:
    """One ``nn.Linear`` (or ``Conv1D``) of a decoder layer: what LoRA adapts as a module."""

    name: str  # path inside the layer, as PEFT's target_modules sees it
    in_features: int
    out_features: int
    bias: bool = False
    quantised: bool = True  # its weight is packed to NF4 under quantization="nf4"


@dataclass(frozen=True)
class ParamShape:
    """A weight that is a plain Parameter, not an nn.Linear: an MoE router (experts=1,
    shape (out, in)) or a fused expert stack (shape (experts, out, in)).

    bitsandbytes leaves these in the compute dtype; PEFT can still adapt them through
    ``target_parameters`` (it maps MoE expert names onto them).
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
    """One decoder layer, as the meta model holds it.

    tensors: every tensor the host store holds for the layer, each once (parameters and
        buffers, in the store's order).
    linears: the nn.Linear modules (NF4 packs the ``quantised`` ones; "all-linear" LoRA
        targets them).
    params: routers and fused expert weights (always in the compute dtype).
    mlp_width: activation width of the MLP per token (routed experts count top_k
        times, plus a shared expert), from the config, for the working-set estimate.
    top_k: experts each token is routed to (0 in a layer without an expert stack).
    qk_norm: the attention normalises each head's query and key (their float32 copies).
    dequantised: bytes an experts call holds dequantised from MXFP4 stacks (``params`` lists
        the Parameters they stand for; the stacks are in ``tensors``), 0 where none are packed.
    """

    tensors: Tuple[TensorShape, ...]
    linears: Tuple[LinearShape, ...]
    params: Tuple[ParamShape, ...]
    mlp_width: int
    top_k: int = 0
    qk_norm: bool = False
    dequantised: int = 0

    @property
    def sparse(self) -> bool:
        return self.top_k > 0

    def stored_bytes(self, quantization: str = "none", double_quant: bool = True) -> int:
        """The layer's region in the host store, and so in a slot."""
        return region_bytes(n for tensor in self.tensors for n in tensor.stored_bytes(quantization, double_quant))


@dataclass(frozen=True)
class ModelShape:
    """What the planner reads off a config's meta model."""

    model_type: str
    layers: Tuple[LayerShape, ...]
    resident: Tuple[TensorShape, ...]  # every tensor outside the decoder layers, each once
    embedding: TensorShape  # the input embedding's weight
    head: TensorShape  # the output head's weight (the embedding's when tied)
    tied: bool


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


def attention_runs_eager(config) -> bool:
    """Whether transformers runs this model's attention eagerly by default: its class has no
    SDPA path (gpt-oss, for its attention sinks), or the config asks for "eager"."""
    asked = getattr(config, "_attn_implementation_internal", None)
    if asked is not None:
        return asked == "eager"
    try:
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ImportError, ValueError):
        return False
    return not getattr(cls, "_supports_sdpa", True)


def eager_scores_bytes(config, batch: int, seq: int, elem: int) -> int:
    """What one layer's eager attention keeps for its backward beyond what SDPA keeps: the
    scores, batch x heads x seq x seq, as softmax's float32 output and the weights in the
    compute dtype (0 where the attention is not eager)."""
    if not attention_runs_eager(config):
        return 0
    _, heads, _, _ = _attention_dims(config)
    return batch * heads * seq * seq * (4 + elem)


def _num_experts(config) -> int:
    # mixtral and qwen3_moe map num_experts onto num_local_experts; qwen2_moe has num_experts
    return int(_get(config, "num_local_experts", _get(config, "num_experts", 0)) or 0)


_SHAPES: "OrderedDict[tuple, ModelShape]" = OrderedDict()
_SHAPES_KEPT = 16  # configs whose shapes are remembered (a plan and its advice ask many times)


def model_shape(config, dtype=torch.bfloat16) -> ModelShape:
    """The layers and resident part of ``config``'s model with weights in ``dtype``, built
    on the meta device once per (config, dtype)."""
    config = _text_config(config)
    dtype = parse_dtype(dtype)
    key = (type(config).__name__, config.to_json_string(use_diff=False), dtype)
    if key not in _SHAPES:
        _SHAPES[key] = _measure(config, dtype)
        while len(_SHAPES) > _SHAPES_KEPT:
            _SHAPES.popitem(last=False)
    _SHAPES.move_to_end(key)
    return _SHAPES[key]


def build_meta_model(config, dtype):
    """``config``'s causal LM on the meta device, weights in ``dtype``; ValueError when
    transformers has no model for it. Built from a copy: from_config writes the dtype into
    the config it is given, and the caller's (a live model's) stays as it was."""
    try:
        return meta_model(copy.deepcopy(config), dtype)
    except (ValueError, KeyError, ImportError, AssertionError) as exc:  # transformers' refusals
        model_type = getattr(config, "model_type", None)
        raise ValueError(
            f"the planner builds the model from its transformers config, and transformers builds no "
            f"causal LM for model_type {model_type!r} ({exc})"
        ) from None


def _measure(config, dtype: torch.dtype) -> ModelShape:
    model = build_meta_model(config, dtype)
    path, layers = find_decoder_layers(model)
    if mxfp4.keeps_packed(config):  # as the loader keeps an MXFP4 checkpoint's experts
        packed_experts.pack_every(layers, dtype)
    quantised = {id(module.weight) for module in nf4.quantised_on_load(model).values()}
    in_layers = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    shapes = tuple(
        _layer_shape(config, layer, layer_name(path, index), quantised) for index, layer in enumerate(layers)
    )
    resident, seen = [], set()
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in in_layers and id(tensor) not in seen:
                seen.add(id(tensor))
                resident.append(TensorShape(name, tuple(tensor.shape), tensor.dtype, kind == "buffer"))
    embedding = model.get_input_embeddings().weight
    head_module = model.get_output_embeddings()
    head = embedding if head_module is None else head_module.weight
    as_shape = lambda name, t: TensorShape(name, tuple(t.shape), t.dtype)
    return ModelShape(
        model_type=getattr(config, "model_type", "") or "unknown",
        layers=shapes,
        resident=tuple(resident),
        embedding=as_shape("embedding", embedding),
        head=as_shape("head", head),
        tied=head is embedding,
    )


def _layer_shape(config, layer: torch.nn.Module, name: str, quantised: set) -> LayerShape:
    """One layer: its tensors as the host store lays them out (``HostStore.plan_layer``),
    its linears and plain-Parameter weights, and the config's activation widths."""
    from transformers.pytorch_utils import Conv1D

    record = HostStore.plan_layer(0, name, layer, lambda t: True)
    tensors, offsets = [], set()
    for entry in record.entries:
        if entry.offset in offsets:  # a tensor shared inside the layer is stored once
            continue
        offsets.add(entry.offset)
        packed = entry.kind == "_parameters" and id(entry.current()) in quantised
        local = entry.qualified_name[len(name) + 1 :]
        tensors.append(TensorShape(local, entry.shape, entry.dtype, entry.kind == "_buffers", packed))
    linears, params, dequantised = [], [], 0
    for module_name, module in layer.named_modules():
        if type(module) is torch.nn.Linear or isinstance(module, Conv1D):
            weight = module.weight  # (out, in); a Conv1D's is (in, out)
            in_out = tuple(weight.shape) if isinstance(module, Conv1D) else tuple(weight.shape[::-1])
            linears.append(LinearShape(module_name, *in_out, module.bias is not None, id(weight) in quantised))
            continue
        weights = [(n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False) if p.is_floating_point()]
        packed = packed_experts.packed_of(module)
        if packed is not None:  # MXFP4 stacks: the Parameters they stand for
            weights += list(packed.shapes.items())
            dequantised += packed.dequantised_bytes()
        for param_name, shape in weights:
            if len(shape) >= 2:
                full = f"{module_name}.{param_name}" if module_name else param_name
                out_features, in_features = shape[-2:]
                params.append(ParamShape(full, math.prod(shape[:-2]), in_features, out_features))
    top_k = int(_get(config, "num_experts_per_tok", 2)) if any(p.experts > 1 for p in params) else 0
    mlp = [linear.out_features for linear in linears if linear.name.startswith("mlp.")]
    width = int(_get(config, "intermediate_size", 0) or 0) or max(mlp, default=0)  # GPT-2 has no intermediate_size
    if top_k:
        width = top_k * int(_get(config, "moe_intermediate_size", width))
        width += int(_get(config, "shared_expert_intermediate_size", 0) or 0)
    qk_norm = any(t.name.endswith(("q_norm.weight", "k_norm.weight")) for t in tensors)
    return LayerShape(tuple(tensors), tuple(linears), tuple(params), width, top_k, qk_norm, dequantised)


def layer_shapes(config, dtype=torch.bfloat16) -> List[LayerShape]:
    """The shape of every decoder layer of ``config``, in order."""
    return list(model_shape(config, dtype).layers)


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


def _check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return quantization


def layer_bytes(config, quantization: str = "none", dtype=torch.bfloat16, double_quant: bool = True) -> List[int]:
    """Bytes of each decoder layer's frozen tensors as the host store and a slot hold them.

    One entry per layer (MoE models with ``mlp_only_layers`` or ``decoder_sparse_step``
    mix sizes). Every tensor is rounded up to the store's 512-byte alignment. With
    ``quantization="nf4"`` the weights a 4-bit load packs are 4-bit with their quant state;
    biases, norms, buffers, routers and fused expert weights stay as they load.
    """
    _check_quantization(quantization)
    return [shape.stored_bytes(quantization, double_quant) for shape in model_shape(config, dtype).layers]


def _ends(config, dtype) -> List[TensorShape]:
    """The input embedding and, when untied, the head."""
    shape = model_shape(config, dtype)
    return [shape.embedding] if shape.tied else [shape.embedding, shape.head]


def embedding_bytes(config, dtype=torch.bfloat16) -> int:
    """The input embedding and, when untied, the head: what ``stream_embeddings`` keeps on
    the host (bitsandbytes never quantises these)."""
    return sum(matrix.nbytes for matrix in _ends(config, dtype))


def ends_host_bytes(config, dtype=torch.bfloat16) -> int:
    """The embedding and head's host store under ``stream_embeddings``: each matrix a region
    of its own."""
    return sum(region_bytes([matrix.nbytes]) for matrix in _ends(config, dtype))


def head_bytes(config, dtype=torch.bfloat16) -> int:
    """The head's weight: with ``stream_embeddings`` its transient device copy during the
    loss."""
    return model_shape(config, dtype).head.nbytes


def resident_bytes(config, dtype=torch.bfloat16, stream_embeddings: bool = False) -> int:
    """Everything outside the decoder layers (embeddings, final norm, head, the rotary
    embedding's buffers); without the embedding and head when they stream."""
    total = sum(tensor.nbytes for tensor in model_shape(config, dtype).resident)
    return total - embedding_bytes(config, dtype) if stream_embeddings else total


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
