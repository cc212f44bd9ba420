"""Expert stacks kept in MXFP4, as gpt-oss is published, and dequantised where they compute.

Why: gpt-oss stores its expert projections in MXFP4, 4.25 bits a value. Dequantised to
bf16 they take almost four times as much: 5.9 GiB a layer of gpt-oss-120b, 214 GiB in all,
more host memory than the users it is for have, and four times the bytes each copy to the
GPU moves. So layerstream's loader keeps them as the checkpoint holds them: the experts
module's ``gate_up_proj`` and ``down_proj`` Parameters are replaced by the checkpoint's
``<proj>_blocks`` and ``<proj>_scales`` (uint8 buffers, streamed like any other tensor of
the layer), and each call of the module dequantises them on the device it runs on, with
the arithmetic of transformers' own ``convert_moe_packed_tensors`` (``dequantise`` says why
not by calling it), into the tensors its forward reads under the old names; they are
dropped when the call returns (autograd keeps what the backward needs, as for any tensor a
forward reads).

Exactness: each value comes from its own byte and its block's exponent (a table lookup and
a multiplication by a power of two, exact in bf16), on any device, computed as
``convert_moe_packed_tensors`` computes it, so the tensors a call reads are those
transformers' dequantising load holds, bit for bit, and the model computes what that model
computes. The tests compare both, and the function with transformers' for every byte value
and exponent.

A call dequantises the experts in groups (``GROUP_BYTES`` of output at a time) into one
tensor per projection: a group holds an int32 index per byte, its values, and the float32
product ``torch.ldexp`` makes before rounding, which for a whole gpt-oss-120b projection
would be about three times its 4.2 GiB.

A call that reads only the experts the router chose (copies by need: generation, short
passes) dequantises only theirs, into stacks of just those rows: a token step of
gpt-oss-120b then holds 4 experts' 0.19 GiB, not 128 experts' 5.9 GiB. Its forward is given
the chosen experts' positions in those stacks instead of their numbers (and the biases'
rows and the expert count to match), so it computes what it computes with every row: the
same rows, in the same order. The renumbering happens inside the module's forward, after
every forward pre-hook and before every forward hook, which see the router's own numbers.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
from torch import nn

from ..system.log import get_logger
from . import mxfp4_kernel

logger = get_logger(__name__)

PROJECTIONS = ("gate_up_proj", "down_proj")
BLOCK = 32  # values per MXFP4 block (one exponent each), 16 bytes of two values
GROUP_BYTES = 64 << 20  # dequantised output per group of experts
# what dequantising a group holds beside the stacks, in group sizes: its values and the
# float32 product torch.ldexp makes (three; the int32 index per byte, one, is freed before)
GROUP_TRANSIENTS = 3
_ATTRIBUTE = "_layerstream_packed"


class BoundTo:
    """``function`` called with ``owner`` first: a method set on one object (``owner.forward =
    BoundTo(f, owner)``). Unlike ``types.MethodType`` of a function its class lacks, it goes with
    its owner through ``copy.deepcopy`` and pickling (``torch.save(model)``), bound to the copy."""

    __slots__ = ("function", "owner")

    def __init__(self, function, owner):
        self.function = function
        self.owner = owner

    def __call__(self, *args, **kwargs):
        return self.function(self.owner, *args, **kwargs)

    def __reduce__(self):
        return (BoundTo, (self.function, self.owner))

    @property
    def __signature__(self):
        import inspect

        signature = inspect.signature(self.function)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


class PackedExperts:
    """What a packed experts module needs at each call: the dtype its projections are
    dequantised to (as the installed transformers' dequantising load gives them:
    ``dequantised_dtype``) and the shape of each ([experts, in, out], the Parameter it
    replaces)."""

    def __init__(self, dtype: torch.dtype, shapes: dict, bias_dtype: Optional[torch.dtype] = None):
        self.dtype = dtype
        self.shapes = shapes
        # the biases' dtype when packed: a later change of it is a cast of the module
        # (``model.float()``), which would have cast the dequantised Parameters too
        self.bias_dtype = bias_dtype
        # the experts the next call reads, where the runtime copied only those (None: all);
        # set by the runtime's pre-hook just before this module's forward, for that call only
        self.rows: Optional[List[int]] = None

    @property
    def experts(self) -> int:
        return self.shapes[PROJECTIONS[0]][0]

    def stack_bytes(self) -> int:
        """Every projection of every expert, dequantised."""
        return sum(int(torch.Size(shape).numel()) for shape in self.shapes.values()) * self.dtype.itemsize

    def dequantised_bytes(self) -> int:
        """What one call holds at most for its dequantisation: the stacks, and transformers'
        temporaries for the group being dequantised (what the plan counts)."""
        whole = self.stack_bytes()
        return whole + GROUP_TRANSIENTS * min(GROUP_BYTES, whole)


def packable(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module holding gpt-oss's two projections as stacks
    ``[experts, in, out]`` whose inputs divide into MXFP4 blocks."""
    params = getattr(module, "_parameters", {})
    return all(
        isinstance(params.get(proj), torch.Tensor) and params[proj].dim() == 3 and params[proj].shape[1] % BLOCK == 0
        for proj in PROJECTIONS
    )


def pack(module: nn.Module, dtype: torch.dtype) -> PackedExperts:
    """Replace the module's projections (on the meta device: before loading) by MXFP4 blocks
    and scales laid out as the checkpoint stores them, and dequantise them at each call.

    A projection ``[experts, in, out]`` is stored transposed: blocks ``[experts, out, in / 32,
    16]`` and scales ``[experts, out, in / 32]``."""
    shapes = {}
    for proj in PROJECTIONS:
        param = module._parameters.pop(proj)
        experts, inputs, outputs = param.shape
        shapes[proj] = (experts, inputs, outputs)
        groups = (experts, outputs, inputs // BLOCK)
        module.register_buffer(f"{proj}_blocks", torch.empty(*groups, BLOCK // 2, dtype=torch.uint8, device="meta"))
        module.register_buffer(f"{proj}_scales", torch.empty(*groups, dtype=torch.uint8, device="meta"))
    bias = module._parameters.get(f"{PROJECTIONS[0]}_bias")
    packed = PackedExperts(dequantised_dtype(dtype), shapes, bias.dtype if isinstance(bias, torch.Tensor) else None)
    setattr(module, _ATTRIBUTE, packed)
    # the module's own forward, wrapped: it runs after every pre-hook (the runtime's, which
    # copies the slot's rows, and the user's), so the stacks it dequantises are complete
    module.forward = BoundTo(_forward, module)
    return packed


def pack_every(root: nn.Module, dtype: torch.dtype) -> None:
    """Pack every packable experts module under ``root`` (a meta model or layer): the model
    as the loader keeps an MXFP4 checkpoint, for the planner and the benchmarks' builders."""
    for module in [m for m in root.modules() if packable(m)]:
        pack(module, dtype)


def pack_stored(layers: nn.ModuleList, path: str, files, dtype: torch.dtype) -> dict:
    """Keep the experts of an MXFP4 checkpoint packed: every experts module of the meta
    ``layers`` whose blocks the checkpoint's ``files`` (name -> file) hold. Returns name ->
    PackedExperts."""
    from .discovery import layer_name

    packed = {}
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            prefix = f"{layer_name(path, index)}.{name}"
            if packable(module) and f"{prefix}.gate_up_proj_blocks" in files:
                packed[prefix] = pack(module, dtype)
    return packed


def packed_values(module: nn.Module) -> int:
    """The values of the Parameters the packed stacks inside ``module`` stand for."""
    return sum(int(torch.Size(shape).numel()) for _, _, p in packed_modules(module) for shape in p.shapes.values())


def packed_of(module: nn.Module) -> Optional[PackedExperts]:
    return getattr(module, _ATTRIBUTE, None)


def packed_modules(model: nn.Module):
    """(name, module, PackedExperts) for every packed experts module of ``model``."""
    for name, module in model.named_modules():
        packed = packed_of(module)
        if packed is not None:
            yield name, module, packed


def dequantised_bytes(model: nn.Module) -> int:
    """The most one packed experts call of ``model`` holds dequantised (0: none packed)."""
    return max((packed.dequantised_bytes() for _, _, packed in packed_modules(model)), default=0)


def dequantise(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    rows: Optional[List[int]] = None,
    compact: bool = False,
) -> torch.Tensor:
    """``[experts, in, out]`` in ``dtype`` from MXFP4 blocks and scales, on their device. With
    ``rows``, only those experts': the others' rows are left as allocated, or, ``compact``,
    left out (``[len(rows), in, out]``, the rows in ascending order).

    On the GPU in one pass (``mxfp4_kernel``), elsewhere with torch ops
    (``dequantise_with_torch``): the same values, bit for bit."""
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: blocks are "
            f"[experts, outputs, groups, {BLOCK // 2}] and scales [experts, outputs, groups]"
        )
    experts = blocks.shape[0]
    if _kernel_failed is None and mxfp4_kernel.usable(blocks, dtype):
        index = _every_expert(experts, blocks.device) if rows is None else ascending(rows, experts)
        if not isinstance(index, torch.Tensor):
            index = torch.tensor(index, dtype=torch.int64).to(blocks.device)
        try:
            return mxfp4_kernel.dequantise(blocks, scales, dtype, index, compact=compact or rows is None)
        except torch.OutOfMemoryError:
            raise  # the step's to handle (a smaller window, the explanation), not the kernel's
        except Exception as error:  # a Triton that cannot build or launch the kernel here
            _say_kernel_failed(error)
    return dequantise_with_torch(blocks, scales, dtype, rows, compact)


_kernel_failed: Optional[str] = None
_EVERY_EXPERT: dict = {}


def _every_expert(experts: int, device: torch.device) -> torch.Tensor:
    """``arange(experts)`` on ``device``, made once (the kernel's expert index of a whole call)."""
    key = (experts, str(device))
    if key not in _EVERY_EXPERT:
        _EVERY_EXPERT[key] = torch.arange(experts, dtype=torch.int64, device=device)
    return _EVERY_EXPERT[key]


def _say_kernel_failed(error: BaseException) -> None:
    """Once, loudly: the kernel failed, so every later call dequantises with torch ops
    (the same values, about eight times as long a layer)."""
    global _kernel_failed
    _kernel_failed = f"{type(error).__name__}: {error}"
    logger.warning(
        "layerstream: the MXFP4 dequantising kernel failed (%s); packed experts now dequantise "
        "with torch ops: the same values, several times slower per layer",
        _kernel_failed.splitlines()[0][:300],
    )


def dequantise_with_torch(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    rows: Optional[List[int]] = None,
    compact: bool = False,
) -> torch.Tensor:
    """``dequantise`` with torch ops, a group of experts at a time (``GROUP_BYTES``).

    The arithmetic of transformers' ``convert_moe_packed_tensors``, value for value: its FP4
    table, the byte's low half first, ``torch.ldexp`` by the block's exponent less 127. It
    is done here rather than by calling that function because that function is a third of a
    gpt-oss training step: it builds its table from a Python list at every call (a copy to
    the device each time), looks each half-byte up separately into strided halves, and
    returns a transposed copy the caller copies again. Here the table of a byte's two values
    stays on the device, each byte is looked up once, and the transposition is written
    straight into the stacks: 1.5 times as fast on an H200 (gpt-oss-120b, a whole layer: 56
    against 85 ms; ``benchmarks/mxfp4_dequantise.py``). Tests compare every byte value and
    exponent with transformers' function, bit for bit."""
    experts, outputs, groups, half = blocks.shape
    inputs = groups * BLOCK
    chosen = range(experts) if rows is None else ascending(rows, experts)
    out = torch.empty(len(chosen) if compact else experts, inputs, outputs, dtype=dtype, device=blocks.device)
    table = _byte_values(dtype, blocks.device)
    per_expert = inputs * outputs * dtype.itemsize
    step = max(1, GROUP_BYTES // max(per_expert, 1))
    at = 0
    for first, past in _runs(chosen):
        for start in range(first, past, step):
            end = min(start + step, past)
            values = table[blocks[start:end].reshape(-1).to(torch.int32)].view(-1, 2 * half)
            torch.ldexp(values, scales[start:end].reshape(-1, 1).to(torch.int32) - 127, out=values)
            place = at if compact else start
            out[place : place + end - start].copy_(values.view(end - start, outputs, inputs).transpose(1, 2))
            at += end - start
    return out


_BYTE_VALUES: dict = {}


def _byte_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 2]``: the two FP4 values of each byte (low half first) from transformers' own
    table, kept on ``device`` once made (1 KiB per dtype and device)."""
    key = (dtype, str(device))
    if key not in _BYTE_VALUES:
        from transformers.integrations.mxfp4 import FP4_VALUES

        table = torch.tensor(FP4_VALUES, dtype=dtype)
        byte = torch.arange(256)
        _BYTE_VALUES[key] = torch.stack([table[byte & 15], table[byte >> 4]], dim=-1).to(device)
    return _BYTE_VALUES[key]


def ascending(rows, experts: int) -> List[int]:
    """``rows`` (ints, or integer tensors of any shape) as distinct expert indices, ascending;
    an index outside ``[0, experts)`` is refused here rather than read out of bounds."""
    if isinstance(rows, torch.Tensor):
        rows = rows.reshape(-1).tolist()
    chosen = sorted({int(row) for row in rows})
    if chosen and (chosen[0] < 0 or chosen[-1] >= experts):
        raise ValueError(f"expert rows must lie in [0, {experts}); got {chosen[0]}..{chosen[-1]}")
    return chosen


def _runs(rows) -> List[Tuple[int, int]]:
    """Sorted rows as [first, past) runs of consecutive ones."""
    runs: List[Tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def keeps_choice(hook) -> bool:
    """Whether a forward pre-hook is known to change nothing a call reads: one marked
    ``_layerstream_keeps_choice`` (a hook that only observes the routing)."""
    return getattr(hook, "_layerstream_keeps_choice", False) is True


def dequantised_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype transformers' dequantising load gives the experts of a model loaded in
    ``dtype``: the Parameter's own where its ``dequantize_convertops`` takes one (newer
    releases), else ``convert_moe_packed_tensors``' default (bfloat16, whatever the model's
    dtype: transformers 5.17 leaves a float32 model with bfloat16 experts)."""
    import inspect

    from transformers.integrations import mxfp4

    function = getattr(mxfp4, "dequantize_convertops", None)
    if function is None:  # a release that moved it: its load is not known here
        _say_dtype_unknown(dtype)
        return dtype
    if "dtype" in inspect.signature(function).parameters:
        return dtype
    return inspect.signature(mxfp4.convert_moe_packed_tensors).parameters["dtype"].default


@functools.lru_cache(maxsize=None)
def _say_dtype_unknown(dtype: torch.dtype) -> None:
    """Once per dtype, not once per experts module packed."""
    logger.warning(
        "layerstream: this transformers has no mxfp4.dequantize_convertops, so which dtype its dequantising "
        "load gives MXFP4 experts is not known here; the packed experts dequantise to the load dtype, %s.",
        dtype,
    )


def compute_dtype(module: nn.Module, packed: PackedExperts, proj: str) -> torch.dtype:
    """The dtype a projection is dequantised to: the load's (``dequantised_dtype``) until the
    module is cast (``model.float()`` on a model no longer streamed, seen as its bias's dtype
    changing), then the cast's, as the dequantised Parameter would follow it."""
    bias = module._parameters.get(f"{proj}_bias")
    if isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dtype != packed.bias_dtype:
        return bias.dtype
    return packed.dtype


def _forward(module: nn.Module, *args, **kwargs):
    """The experts module's forward on its projections dequantised from the blocks and scales
    bound now (a streamed layer's are in its slot by then), under the names the forward
    reads; they are the module's no more once the call returns, or raises."""
    packed = packed_of(module)
    rows, packed.rows = packed.rows, None
    chosen = _renumbering(module, packed, rows, args, kwargs)
    with torch.no_grad():
        for proj in PROJECTIONS:
            module.__dict__[proj] = dequantise(
                module._buffers[f"{proj}_blocks"],
                module._buffers[f"{proj}_scales"],
                compute_dtype(module, packed, proj),
                rows,
                compact=chosen is not None,
            )
    bound = list(PROJECTIONS)
    try:
        if chosen is not None:
            args, kwargs = _renumber(module, packed, chosen, args, kwargs, bound)
        return type(module).forward(module, *args, **kwargs)
    finally:
        for name in bound:
            module.__dict__.pop(name, None)
        if chosen is not None:
            module.__dict__["num_experts"] = packed.experts


_INDICES = ("router_indices", "top_k_index")  # the experts' second argument, as gpt-oss and transformers name it
_WEIGHTS = ("routing_weights", "top_k_weights")  # and its third


def _renumbering(module: nn.Module, packed: PackedExperts, rows, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The chosen experts, ascending, where this call may compute on stacks of only their rows:
    fewer than all, chosen by indices beside weights by position (of the same shape, so
    renumbering the experts leaves the weights as they are)."""
    if rows is None or getattr(module, "_is_expert_parallel", False):
        return None
    chosen = ascending(rows, packed.experts)
    indices, weights = _argument(args, kwargs, 1, _INDICES), _argument(args, kwargs, 2, _WEIGHTS)
    if len(chosen) >= packed.experts or indices is None or weights is None or weights.shape != indices.shape:
        return None
    return torch.tensor(chosen, dtype=indices.dtype, device=indices.device)


def _argument(args: tuple, kwargs: dict, position: int, names: Tuple[str, ...]) -> Optional[torch.Tensor]:
    found = args[position] if len(args) > position else next((kwargs[n] for n in names if n in kwargs), None)
    return found if isinstance(found, torch.Tensor) else None


def _renumber(module: nn.Module, packed: PackedExperts, chosen: torch.Tensor, args, kwargs, bound: list):
    """The call's expert numbers as positions among ``chosen``; the module's expert count and
    its other per-expert tensors (the biases) cut to those rows for the call (``bound``: the
    names bound, dropped after it)."""
    experts = packed.experts
    position = torch.full((experts,), len(chosen), dtype=chosen.dtype, device=chosen.device)
    position[chosen] = torch.arange(len(chosen), dtype=chosen.dtype, device=chosen.device)
    for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[0] == experts:
            if name.endswith(("_blocks", "_scales")):
                continue
            module.__dict__[name] = tensor.index_select(0, chosen.to(tensor.device))
            bound.append(name)
    module.__dict__["num_experts"] = len(chosen)
    if len(args) > 1:
        args = (args[0], position[args[1]], *args[2:])
    else:
        name = next(name for name in _INDICES if name in kwargs)
        kwargs = {**kwargs, name: position[kwargs[name]]}
    return args, kwargs


# -- what the model no longer has: its experts' Parameters -----------------------------------
def projection_names(model: nn.Module) -> set:
    """The names of the Parameters ``model``'s packed experts stand for."""
    return {f"{name}.{proj}" for name, _, _ in packed_modules(model) for proj in PROJECTIONS}


def refuse_adapters_on_packed(model: nn.Module, names: set) -> None:
    """Every PEFT adapter of ``model`` checked by ``refuse_config_on_packed`` (``names``:
    ``projection_names``)."""
    for adapter, config in (getattr(model, "peft_config", None) or {}).items():
        refuse_config_on_packed(model, adapter, config, names)


def refuse_config_on_packed(model: nn.Module, adapter: str, config, names: Optional[set] = None) -> None:
    """A PEFT config that would train a packed expert stack, refused with what to load instead:
    ``target_parameters`` naming one finds no Parameter there and, beside other targets, is
    left out without a word; ``modules_to_save`` naming the experts module or a module holding
    it (PEFT's match: a module name ending with the entry) trains a copy whose stacks are
    packed buffers, so only its biases would train."""
    names = projection_names(model) if names is None else names
    if not names:
        return
    advice = (
        "(it has no such Parameter, so PEFT would leave it out without a word). For LoRA on the experts "
        "load with quantization_config=Mxfp4Config(dequantize=True); otherwise target the attention only."
    )
    for target in getattr(config, "target_parameters", None) or ():
        if any(name == target or name.endswith(f".{target}") for name in names):
            raise PackedExpertsError(
                f"PEFT adapter {adapter!r} targets {target!r}, an expert stack this model keeps packed in MXFP4 {advice}"
            )
    holders = {name.rsplit(".", 1)[0] for name in names}  # the experts modules
    holders |= {holder[:at] for holder in list(holders) for at in range(len(holder)) if holder[at] == "."}
    for target in getattr(config, "modules_to_save", None) or ():
        found = sorted(holder for holder in holders if holder.endswith(target))
        if found:
            raise PackedExpertsError(
                f"PEFT adapter {adapter!r} has modules_to_save={target!r}, which matches {found[0]}, holding "
                "expert stacks this model keeps packed in MXFP4: PEFT's trainable copy would train only their "
                "biases. To train the experts load with quantization_config=Mxfp4Config(dequantize=True); "
                "otherwise leave them out of modules_to_save."
            )


class PackedExpertsError(ValueError):
    """Something asked of a packed experts module that only its dequantised Parameters allow."""


def keep_counting_packed(model: nn.Module) -> None:
    """``num_parameters`` of a model with packed experts counts the Parameters they stand for,
    as it does for the dequantised model: the Trainer's ``total_flos`` (6 x parameters x
    tokens) and a script's own count are then those of the model the user loaded, not of one
    without its experts. Bound to the model, as ``keep_saving_packed``."""
    model.num_parameters = BoundTo(_num_parameters, model)


def refuse_dequantised_state(model: nn.Module) -> None:
    """``load_state_dict`` of a state dict holding dequantised expert stacks (``gate_up_proj``,
    ``down_proj``: saved from transformers' dequantised model) is refused before anything is
    loaded: torch would copy every other tensor, then raise for these or, with
    ``strict=False``, leave the experts as they were without a word."""
    model.register_load_state_dict_pre_hook(_refuse_dequantised_keys)


def _refuse_dequantised_keys(model: nn.Module, state_dict, prefix: str, *args) -> None:
    found = sorted(key for key in (f"{prefix}{name}" for name in projection_names(model)) if key in state_dict)
    if found:
        raise PackedExpertsError(
            f"the state dict holds {found[0]} (and {len(found) - 1} more expert stacks) dequantised, which this "
            "model keeps packed in MXFP4 (as *_blocks and *_scales): nothing was loaded. Load the model with "
            "quantization_config=Mxfp4Config(dequantize=True) to load dequantised experts, or leave them out of "
            "the state dict."
        )


def _num_parameters(model: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    counted = type(model).num_parameters(model, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    return counted if only_trainable else counted + packed_values(model)  # frozen, as the dequantised stacks are


def keep_saving_packed(model: nn.Module, quantization: dict) -> None:
    """``save_pretrained`` of a model with packed experts writes what gpt-oss publishes: the
    blocks and scales, and a config.json whose ``quantization_config`` says so (``quantization``:
    the checkpoint's), so transformers and layerstream load it back as it was. With the
    attention in NF4 as well no one quantization_config describes the model: refused, with
    what to save instead. Bound to the model (a copy of the model saves itself)."""
    model._layerstream_mxfp4 = dict(quantization)
    model.save_pretrained = BoundTo(_save_packed, model)


def _save_packed(model: nn.Module, *args, **kwargs):
    from ..checkpoints import mxfp4

    config = model.config
    if getattr(model, "hf_quantizer", None) is not None or getattr(config, "quantization_config", None):
        raise PackedExpertsError(
            "this model keeps its experts in MXFP4 and its attention in NF4: no one quantization_config "
            "describes that, so save_pretrained would write a checkpoint nothing loads back. Save the "
            "adapters (PeftModel.save_pretrained, as the Trainer does), or load without NF4 to save the "
            "whole model in MXFP4."
        )
    marked = getattr(config, mxfp4.PACKED, False)
    config.quantization_config = dict(model._layerstream_mxfp4)
    if marked:
        delattr(config, mxfp4.PACKED)
    try:
        return type(model).save_pretrained(model, *args, **kwargs)
    finally:
        del config.quantization_config
        if marked:
            setattr(config, mxfp4.PACKED, True)
