"""bitsandbytes NF4 weights in streamed layers: packing, slot views, routing, gate.

A streamed ``Linear4bit`` keeps its packed uint8 weight and every quant-state tensor
(absmax; with double quantisation the uint8 absmax, ``state2.absmax``, ``state2.code``
and ``offset``; the code table) in the layer's host region, and so in the slot. The host
weight keeps its own QuantState (the "host master", pointing at arena views); each slot
gets a Params4bit and a QuantState over slot memory, built once per (slot, layer).

A streamed projection never goes through bitsandbytes' ``MatMul4Bit``: that Function
keeps the packed weight on ``ctx`` rather than in ``save_for_backward``, so under
checkpointing its backward reads whatever the slot holds by then. Instead:

- with nothing to differentiate (generation, evaluation, a frozen input), it makes the
  call ``matmul_4bit`` makes without grad: the ``gemm_4bit`` op, whose dispatch picks the
  kernel; no graph is kept, so nothing refers to the slot afterwards;
- otherwise, where bitsandbytes itself would run its fused ``gemm_4bit`` kernel for this call
  (decided by :func:`fused_kernel_would_run`, which reads bitsandbytes' own dispatch
  names at call time), the projection runs through :class:`NF4Matmul`, a checkpoint-
  visible Function that saves the packed tensors, runs the same ``gemm_4bit`` op in
  forward and dequantises in backward, as ``MatMul4Bit`` does;
- and elsewhere it runs ``dequantize_4bit`` + ``F.linear`` as plain autograd ops inside
  the checkpointed region, the same computation bitsandbytes' unfused fallback does.

Each gives the same bits as an unpatched resident bitsandbytes model (on the CPU, its
portable path: see ``cpu_repacking``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..system.log import get_logger
from . import cpu_repacking, nf4_dense, swap
from .nf4_gate import fused_kernel_would_run

logger = get_logger(__name__)

# quant-state tensors, as attribute paths on a QuantState
QUANT_PATHS: Tuple[Tuple[str, ...], ...] = (
    ("absmax",),
    ("code",),
    ("offset",),
    ("state2", "absmax"),
    ("state2", "code"),
)

# what a streamed projection's calls count, by route (``streamed_nf4_forward``), and the
# weights dequantised once for a run of calls (``nf4_dense.kept``): in the runtime's stats
COUNTERS = ("nf4_function_calls", "nf4_dequant_calls", "nf4_inference_calls", "nf4_dequantisations")

MIN_BNB = "0.50.2"  # the oldest bitsandbytes whose dispatch and QuantState layout we test


def bnb_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def require_bnb(what: str) -> None:
    """Raise ImportError with the install command unless a tested bitsandbytes is there."""
    from packaging.version import Version

    if not bnb_available():
        raise ImportError(f"{what} needs bitsandbytes: pip install 'bitsandbytes>={MIN_BNB},<0.51'")
    import bitsandbytes

    found = getattr(bitsandbytes, "__version__", "0")
    if Version(found) < Version(MIN_BNB):
        raise ImportError(
            f"{what} needs bitsandbytes >= {MIN_BNB} (its 4-bit dispatch and QuantState layout are "
            f"what layerstream reads), found {found}: pip install -U 'bitsandbytes>={MIN_BNB},<0.51'"
        )


def is_linear4bit(module) -> bool:
    if not bnb_available():
        return False
    import bitsandbytes as bnb

    return isinstance(module, bnb.nn.Linear4bit)


def bnb_version() -> str:
    """The installed bitsandbytes' version (ImportError where there is none)."""
    import bitsandbytes

    return getattr(bitsandbytes, "__version__", "unknown")


def quant_tensors(state) -> list:
    """(path, tensor) for each tensor a QuantState holds."""
    out = []
    for path in QUANT_PATHS:
        obj = state
        for part in path:
            obj = getattr(obj, part, None) if obj is not None else None
        if isinstance(obj, torch.Tensor):
            out.append((path, obj))
    return out


def quant_holder(state, path: Sequence[str]):
    """The object that holds the tensor at ``path`` of a QuantState (``state2`` for a
    nested path): what to watch, or assign to, for that tensor."""
    for part in path[:-1]:
        state = getattr(state, part)
    return state


def set_quant_tensor(state, path: Sequence[str], tensor: torch.Tensor) -> None:
    setattr(quant_holder(state, path), path[-1], tensor)


# -- quant-state tensors as host-store entries ---------------------------------------------
# A streamed 4-bit weight's QuantState tensors are entries of their layer like its
# parameters and buffers, of this kind (a module's are "_parameters" and "_buffers"), named
# by their dotted path in the QuantState ("absmax", "state2.code"). The NF4 layer cache
# writes kind and name into its manifests: existing caches stay readable only while both
# are spelled this way.
QUANT_KIND = "quant"


def quant_name(path: Sequence[str]) -> str:
    """An entry's name for the QuantState tensor at ``path``."""
    return ".".join(path)


def quant_path(name: str) -> Tuple[str, ...]:
    """The QuantState path an entry's name stands for (the inverse of ``quant_name``)."""
    return tuple(name.split("."))


# the attribute bitsandbytes' Params4bit keeps its QuantState in
STATE_ATTRIBUTE = "quant_state"


def packed_state(tensor):
    """The QuantState of a packed 4-bit weight (bitsandbytes' Params4bit), None for any other tensor."""
    return getattr(tensor, STATE_ATTRIBUTE, None)


def is_packed(tensor) -> bool:
    """Whether ``tensor`` is a packed 4-bit weight (its bytes are not its values)."""
    return packed_state(tensor) is not None


def is_4bit_param(tensor) -> bool:
    """Whether ``tensor`` is bitsandbytes' 4-bit parameter type, packed or not yet (its
    QuantState attribute present, set or None): never a trainable float tensor."""
    return hasattr(tensor, STATE_ATTRIBUTE)


def weight_quant_state(module: nn.Module):
    """The QuantState of a module's 4-bit weight (None: its weight is not 4-bit)."""
    return packed_state(module._parameters.get("weight"))


def weight_quant_tensor(module: nn.Module, path: Sequence[str]) -> Optional[torch.Tensor]:
    """The tensor a module's 4-bit weight holds at ``path`` of its QuantState now."""
    state = weight_quant_state(module)
    return None if state is None else dict(quant_tensors(state)).get(tuple(path))


def set_weight_quant_tensor(module: nn.Module, path: Sequence[str], tensor: torch.Tensor) -> None:
    """Make a module's 4-bit weight hold ``tensor`` at ``path`` of its QuantState."""
    set_quant_tensor(module._parameters["weight"].quant_state, path, tensor)


def streams_4bit(records) -> bool:
    """Whether any streamed layer holds a 4-bit weight."""
    return any(e.is_quant_state for r in records for e in r.entries)


def weight_settings(weight) -> dict:
    """What a 4-bit weight's Params4bit and QuantState are rebuilt from besides their tensors
    (``rebuild_weight``), in JSON. The NF4 layer cache's manifests hold it: its keys stay."""
    state = weight.quant_state
    nested = getattr(state, "state2", None) if state.nested else None
    return {
        "blocksize": weight.blocksize,
        "compress_statistics": bool(weight.compress_statistics),
        "quant_type": weight.quant_type,
        "quant_storage": str(weight.quant_storage),
        "shape": list(state.shape),
        "state_blocksize": state.blocksize,
        "state_dtype": str(state.dtype),
        "state2": None
        if nested is None
        else {"blocksize": nested.blocksize, "quant_type": nested.quant_type, "dtype": str(nested.dtype)},
    }


def rebuild_weight(module: nn.Module, packed: torch.Tensor, tensors: dict, settings: dict) -> None:
    """Give ``module`` the 4-bit weight ``weight_settings`` described, over ``packed`` and
    the QuantState tensors ``tensors`` (by entry name), without quantising anything."""
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    second = settings["state2"]
    state2 = None
    if second is not None:
        state2 = QuantState(
            absmax=tensors["state2.absmax"],
            code=tensors["state2.code"],
            blocksize=second["blocksize"],
            quant_type=second["quant_type"],
            dtype=parse_dtype(second["dtype"]),
        )
    state = QuantState(
        absmax=tensors["absmax"],
        shape=torch.Size(settings["shape"]),
        code=tensors.get("code"),
        blocksize=settings["state_blocksize"],
        quant_type=settings["quant_type"],
        dtype=parse_dtype(settings["state_dtype"]),
        offset=tensors.get("offset"),
        state2=state2,
    )
    weight = Params4bit(
        packed,
        requires_grad=False,
        quant_state=state,
        blocksize=settings["blocksize"],
        compress_statistics=settings["compress_statistics"],
        quant_type=settings["quant_type"],
        quant_storage=parse_dtype(settings["quant_storage"]),
        bnb_quantized=True,
    )
    weight.module = module
    module.weight = weight


def parse_dtype(text: str) -> torch.dtype:
    """A torch dtype from its ``str`` ("torch.bfloat16"), as the NF4 cache's manifests hold it."""
    value = getattr(torch, text.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {text}")
    return value


def clone_state(state, tensors: dict):
    """A QuantState like ``state`` whose tensors are ``tensors[path]``."""
    from bitsandbytes.functional import QuantState

    state2 = None
    if state.nested:
        s2 = state.state2
        state2 = QuantState(
            absmax=tensors[("state2", "absmax")],
            code=tensors[("state2", "code")],
            blocksize=s2.blocksize,
            quant_type=s2.quant_type,
            dtype=s2.dtype,
        )
    return QuantState(
        absmax=tensors[("absmax",)],
        shape=state.shape,
        code=tensors.get(("code",)),
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=state.dtype,
        offset=tensors.get(("offset",)),
        state2=state2,
    )


def slot_weight(host_weight, data: torch.Tensor, state):
    """A Params4bit over slot memory, mirroring the host weight's settings."""
    from bitsandbytes.nn import Params4bit

    return Params4bit(
        data,
        requires_grad=False,
        quant_state=state,
        blocksize=host_weight.blocksize,
        compress_statistics=host_weight.compress_statistics,
        quant_type=host_weight.quant_type,
        quant_storage=host_weight.quant_storage,
        bnb_quantized=True,
    )


# -- the routes ----------------------------------------------------------------------------
def _gemm_4bit(x, packed, state, bias):
    """bitsandbytes' gemm_4bit op, called exactly as MatMul4Bit.forward calls it."""
    if not state.nested:
        return torch.ops.bitsandbytes.gemm_4bit.default(
            x, packed, state.shape, state.absmax, state.blocksize, state.quant_type, bias=bias
        )
    if state.state2.blocksize != 256:
        raise NotImplementedError("nested quantization with state2.blocksize != 256 is not supported")
    return torch.ops.bitsandbytes.gemm_4bit.default(
        x,
        packed,
        state.shape,
        state.state2.absmax,
        state.blocksize,
        state.quant_type,
        bias=bias,
        absmax_8bit=state.absmax,
        absmax_code=state.state2.code,
        absmax_offset=state.offset,
    )


def dequantized_linear(x, packed, state, bias):
    """dequantize_4bit + F.linear, as bitsandbytes' unfused gemm_4bit fallback computes it."""
    return F.linear(x, nf4_dense.dequantised_weight(packed, state, x.dtype), bias)


class NF4Matmul(torch.autograd.Function):
    """The fused projection, with its packed tensors visible to checkpointing.

    Everything backward needs goes through ``save_for_backward``, so activation
    checkpointing recomputes it (from the slot the recompute fetched) instead of keeping a
    reference into a slot that later copies overwrite. Backward checks that the slot still
    belongs to the layer before reading it.
    """

    @staticmethod
    def forward(ctx, x, packed, absmax, code, offset, absmax2, code2, bias, state, owner):
        out = _gemm_4bit(x, packed.view(-1, 1), state, bias)
        ctx.state = _StateTemplate(state)
        ctx.owner = owner
        ctx.grad_dtype_bias = None if bias is None else bias.dtype
        ctx.save_for_backward(packed, absmax, code, offset, absmax2, code2)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grads = [None] * 10
        need_x, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[7]
        if not (need_x or need_bias):
            return tuple(grads)
        packed, absmax, code, offset, absmax2, code2 = ctx.saved_tensors
        if ctx.owner is not None:
            ctx.owner(packed)
        if need_bias:
            grads[7] = grad_output.sum(0, dtype=ctx.grad_dtype_bias)
        if need_x:
            from bitsandbytes.functional import dequantize_4bit

            state = ctx.state.build(absmax, code, offset, absmax2, code2)
            grads[0] = torch.matmul(grad_output, dequantize_4bit(packed.view(-1, 1), state).to(grad_output.dtype))
        return tuple(grads)


class _StateTemplate:
    """The non-tensor fields of a QuantState (no reference to slot memory is kept)."""

    def __init__(self, state):
        self.shape, self.blocksize, self.quant_type, self.dtype = (
            state.shape,
            state.blocksize,
            state.quant_type,
            state.dtype,
        )
        self.nested = state.nested
        s2 = state.state2 if state.nested else None
        self.state2 = None if s2 is None else (s2.blocksize, s2.quant_type, s2.dtype)

    def build(self, absmax, code, offset, absmax2, code2):
        from bitsandbytes.functional import QuantState

        state2 = None
        if self.nested:
            blocksize, quant_type, dtype = self.state2
            state2 = QuantState(absmax=absmax2, code=code2, blocksize=blocksize, quant_type=quant_type, dtype=dtype)
        return QuantState(
            absmax=absmax,
            shape=self.shape,
            code=code,
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=offset,
            state2=state2,
        )


def streamed_nf4_forward(module, x: torch.Tensor, owner=None, counters: Optional[dict] = None):
    """Linear4bit.forward for a streamed weight: same dtype handling, routed as
    ``bitsandbytes.matmul_4bit`` routes it. Without anything to differentiate, its gemm_4bit
    op as that function calls it (bitsandbytes' own dispatch between its fused kernel and
    dequantise + linear); with one, the checkpoint-visible Function where the op would run
    its fused kernel or where the weight was quantised from another dtype than the compute
    dtype (bitsandbytes' backward dequantises to the stored dtype and casts, which a weight
    dequantised straight to the compute dtype does not round the same), else dequantise +
    linear as autograd sees them.

    bitsandbytes' CPU inference repacking (AVX512-BF16) is not applied: it rewrites the
    weight in place, which would rewrite the host store.
    """
    weight = module.weight
    state = weight.quant_state
    if x.device.type == "cpu":
        cpu_repacking.note_portable_path(module, x)
    if not module.compute_type_is_set:
        module.set_compute_type(x)
        module.compute_type_is_set = True
    inp_dtype = x.dtype
    if module.compute_dtype is not None:
        x = x.to(module.compute_dtype)
    bias = module.bias
    if bias is not None:
        bias = bias.to(x.dtype).to(module.compute_dtype) if module.compute_dtype is not None else bias.to(x.dtype)
    stored_as_computed = state.dtype == x.dtype  # else bitsandbytes' backward casts a dequantised copy
    if (
        nf4_dense.active()
        and stored_as_computed
        and x.numel()
        and not fused_kernel_would_run(x, state.shape, state.blocksize)
    ):
        # a run of calls on this weight (the tiled MLP's tiles): the route bitsandbytes takes
        # here is dequantise + linear, on a weight dequantised once for the run
        if counters is not None:
            counters["nf4_dequant_calls"] += 1
        dense = nf4_dense.kept(module, weight.data.view(-1, 1), state, x.dtype, counters)
        return F.linear(x, dense, bias).to(inp_dtype)
    if not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))):
        # nothing to differentiate (generation, a frozen input): bitsandbytes' own call,
        # as matmul_4bit makes it without grad; nothing keeps a reference into the slot
        if counters is not None:
            counters["nf4_inference_calls"] += 1
        if x.numel() == 0:  # as matmul_4bit answers an empty input
            return torch.empty((*x.shape[:-1], state.shape[0]), dtype=x.dtype, device=x.device).to(inp_dtype)
        out = _gemm_4bit(x, weight.data.view(-1, 1), state, bias)
    elif not stored_as_computed or fused_kernel_would_run(x, state.shape, state.blocksize):
        if counters is not None:
            counters["nf4_function_calls"] += 1
        nested = state.nested
        out = NF4Matmul.apply(
            x,
            weight.data,
            state.absmax,
            state.code,
            state.offset if nested else None,
            state.state2.absmax if nested else None,
            state.state2.code if nested else None,
            bias,
            state,
            owner,
        )
    else:
        if counters is not None:
            counters["nf4_dequant_calls"] += 1
        out = dequantized_linear(x, weight.data.view(-1, 1), state, bias)
    return out.to(inp_dtype)


# -- the streamed projection, and quantising on load -------------------------------------
class StreamedLinear4bit:
    """Mixed in front of a bitsandbytes Linear4bit whose weight streams: routes its
    matmul around MatMul4Bit (above)."""

    def forward(self, x):
        weight = self.weight
        return streamed_nf4_forward(
            self, x, getattr(weight, "_layerstream_owner", None), self._layerstream_runtime.nf4_counts
        )


def streamed_linear4bit_modules(records) -> list:
    """The Linear4bit modules whose packed weight streams."""
    modules = {id(e.module): e.module for r in records for e in r.entries if e.is_quant_state}
    return list(modules.values())


def make_streamed(module: nn.Module, runtime) -> None:
    swap.swap_in(module, StreamedLinear4bit)
    object.__setattr__(module, "_layerstream_runtime", runtime)


def make_plain(module: nn.Module) -> None:
    swap.swap_out(module, StreamedLinear4bit)
    module.__dict__.pop("_layerstream_runtime", None)


def quantised_on_load(model: nn.Module, skip_modules: Optional[Sequence[str]] = None) -> dict:
    """name -> module of each module a 4-bit bitsandbytes load packs (what transformers'
    quantizer, run by ``from_pretrained`` on its meta model, swaps for a ``Linear4bit``):
    an exact ``nn.Linear`` or a ``Conv1D`` whose name the skip list does not match. The
    skip list and the matching are transformers' own (``get_modules_to_not_convert``: the
    head, tied weights, the last parameter, ``_keep_in_fp32_modules``, ``skip_modules`` =
    ``llm_int8_skip_modules``; ``should_convert_module``), so this needs no bitsandbytes
    and works on a meta model."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = HfQuantizer.get_modules_to_not_convert(
        model, list(skip_modules) if skip_modules is not None else None, getattr(model, "_keep_in_fp32_modules", None)
    )
    return {
        name: module
        for name, module in model.named_modules()
        if (type(module) is nn.Linear or isinstance(module, Conv1D)) and should_convert_module(name, skip)
    }


def set_unquantised_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """After transformers' quantizer swapped in Linear4bit skeletons: their weights arrive
    unquantised in ``dtype`` (checkpoint values), and their biases load in ``dtype`` (as
    transformers' 4-bit load keeps them), not in the fp32 the skeleton made."""
    for module in model.modules():
        if is_linear4bit(module):
            module.weight.data = torch.empty_like(module.weight.data, dtype=dtype)
            if module.bias is not None and module.bias.is_floating_point():
                module.bias.data = torch.empty_like(module.bias.data, dtype=dtype)


def quantise_layer(layer: nn.Module, device: torch.device, dtype: torch.dtype, quant_config) -> None:
    """Quantise every Linear4bit weight of a host layer (on ``device``), back on the host,
    with the settings transformers would use for ``quant_config`` (a BitsAndBytesConfig)."""
    import bitsandbytes as bnb

    settings = dict(
        quant_type=quant_config.bnb_4bit_quant_type,
        compress_statistics=quant_config.bnb_4bit_use_double_quant,
        quant_storage=quant_config.bnb_4bit_quant_storage,
    )
    for module in layer.modules():
        if isinstance(module, bnb.nn.Linear4bit) and not getattr(module.weight, "bnb_quantized", False):
            quantised = bnb.nn.Params4bit(module.weight.data.to(dtype), requires_grad=False, **settings)
            quantised = quantised.to(device)
            if device.type != "cpu":
                quantised.quant_state.to("cpu")
                quantised = bnb.nn.Params4bit(
                    quantised.data.cpu(),
                    requires_grad=False,
                    quant_state=quantised.quant_state,
                    blocksize=quantised.blocksize,
                    compress_statistics=quantised.compress_statistics,
                    quant_type=quantised.quant_type,
                    quant_storage=quantised.quant_storage,
                    bnb_quantized=True,
                )
            quantised.module = module
            module.weight = quantised


def device_weight(host_weight, device: torch.device):
    """A copy of a streamed host Params4bit on ``device``, with a QuantState of its own
    (what a resident 4-bit weight looks like, for code that needs one: PEFT's merges)."""
    state = host_weight.quant_state
    tensors = {path: tensor.to(device, copy=True) for path, tensor in quant_tensors(state)}
    packed = host_weight.data.to(device, copy=True)
    weight = slot_weight(host_weight, packed, clone_state(state, tensors))
    weight.module = getattr(host_weight, "module", None)
    return weight
