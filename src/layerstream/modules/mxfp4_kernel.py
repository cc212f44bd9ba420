"""MXFP4 experts dequantised in one pass on the GPU: a Triton kernel.

Why: dequantising packed experts with torch ops (``packed_experts.dequantise_with_torch``: a
table lookup per byte, ``torch.ldexp``, a transposed copy) takes 75 ms for a gpt-oss-120b
layer on an H100, and a training step does it twice a layer, about 5 s of it. This kernel
reads each packed byte once and writes the transposed ``[experts, in, out]`` stacks
directly: 9.1 ms for that layer, equal bit for bit to transformers'
``convert_moe_packed_tensors`` (``benchmarks/mxfp4_dequantise.py``,
``results/moe/mxfp4-dequantise-*.json``).

Exactness without floating-point arithmetic: an FP4 code is a sign and ``(1 + f) * 2 ** k``
(f 0 or 1/2, k -1 to 2: transformers' ``FP4_VALUES``), so its product with
``2 ** (exponent - 127)`` is that mantissa at exponent ``k + exponent - 127``. The kernel
writes those bits with integer arithmetic: a normal number, a subnormal one (down to
``2 ** -128``, which bf16 and float32 both hold) or infinity past the dtype's largest, as an
exact ``ldexp`` gives. The tests compare every byte under every exponent with transformers'
function.

Where Triton is missing, off CUDA, or for a dtype other than bf16 and float32,
``packed_experts`` uses torch ops (the same values, slower); if a kernel launch fails it says
so once and does the same from then on. The timing above is of the same kernel before it
took a table of experts (one more load a program). With ``TRITON_INTERPRET=1`` set before
Triton is imported, ``dequantise`` runs the kernel on CPU tensors (Triton's interpreter):
how it is checked on a machine without a GPU.
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's way is used
    triton = None

# outputs a program writes: 64 x 32 values of one expert and one block of inputs
BLOCK_OUT = 64
DTYPES = (torch.bfloat16, torch.float32)

if triton is not None:

    @triton.jit
    def _bits(nibble, scale, BF16: tl.constexpr):
        """The output dtype's bits (in int32) of FP4 code ``nibble`` times 2 ** (scale - 127)."""
        code = nibble & 7
        sign = nibble >> 3
        half = code & 1  # the mantissa's half (codes 3, 5, 7); code 1 (0.5) has none
        half = tl.where(code == 1, 0, half)
        power = tl.where(code == 1, -1, (code >> 1) - 1) + scale - 127  # 2 ** power * (1 + half / 2)
        if BF16:
            mantissa_bits, bias, top, sign_bit = 7, 127, 0x7F80, 15
        else:
            mantissa_bits, bias, top, sign_bit = 23, 127, 0x7F800000, 31
        normal = ((power + bias) << mantissa_bits) | (half << (mantissa_bits - 1))
        # below the smallest normal: (2 + half) * 2 ** (power - 1), in units of the smallest subnormal
        shift = tl.minimum(tl.maximum(power - 1 + bias + mantissa_bits - 1, 0), 31)
        subnormal = (2 + half) << shift
        bits = tl.where(power > bias, top, tl.where(power >= 1 - bias, normal, subnormal))
        bits = tl.where(code == 0, 0, bits)
        return bits | (sign << sign_bit)

    @triton.jit
    def _dequantise_kernel(
        blocks_ptr,
        scales_ptr,
        experts_ptr,
        out_ptr,
        outputs,
        groups,
        BLOCK_OUT: tl.constexpr,
        BF16: tl.constexpr,
        COMPACT: tl.constexpr,
    ):
        """One program: the expert ``experts[program 0]`` (written at stack row program 0 when
        ``COMPACT``, else at its own row), a tile of ``BLOCK_OUT`` outputs (program 1), one
        block of 32 inputs (program 2)."""
        index = tl.program_id(0).to(tl.int64)  # 128 experts' output passes 2**31 bytes: int64 offsets
        expert = tl.load(experts_ptr + index).to(tl.int64)
        row = index if COMPACT else expert
        tile = tl.program_id(1)
        group = tl.program_id(2)
        columns = tile * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        live = columns < outputs
        byte = tl.arange(0, 16)
        # blocks [experts, outputs, groups, 16], scales [experts, outputs, groups]
        where = ((expert * outputs + columns[:, None]) * groups + group) * 16 + byte[None, :]
        packed = tl.load(blocks_ptr + where, mask=live[:, None], other=0).to(tl.int32)
        scale = tl.load(scales_ptr + (expert * outputs + columns) * groups + group, mask=live, other=127)
        scale = scale.to(tl.int32)[:, None]
        low = _bits(packed & 15, scale, BF16)  # the byte's low half is the even input
        high = _bits(packed >> 4, scale, BF16)
        values = tl.reshape(tl.join(low, high), (BLOCK_OUT, 32))
        values = tl.trans(values)  # [32 inputs, BLOCK_OUT outputs]
        inputs = group * 32 + tl.arange(0, 32)
        # out [rows, groups * 32, outputs], as int16 (bf16) or int32 (float32) bits
        target = (row * groups * 32 + inputs[:, None]) * outputs + columns[None, :]
        tl.store(out_ptr + target, values.to(out_ptr.dtype.element_ty), mask=live[None, :])


def usable(blocks: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``packed_experts`` dequantises these blocks to ``dtype`` with the kernel:
    Triton is installed, the blocks are on a CUDA device, and the dtype is bf16 or float32."""
    return triton is not None and blocks.is_cuda and dtype in DTYPES


def dequantise(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, experts: torch.Tensor, compact: bool
) -> torch.Tensor:
    """The stacks of ``experts`` (an int64 tensor of distinct expert indices on the blocks'
    device) in ``dtype``, from blocks ``[all, out, groups, 16]`` and scales ``[all, out,
    groups]``, in one launch: ``[len(experts), in, out]`` in that order when ``compact``, else
    ``[all, in, out]`` with the other experts' rows left as allocated."""
    count, outputs, groups, _ = blocks.shape
    blocks, scales = blocks.contiguous(), scales.contiguous()
    rows = len(experts) if compact else count
    out = torch.empty(rows, groups * 32, outputs, dtype=dtype, device=blocks.device)
    if len(experts) == 0:
        return out
    bits = out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    grid = (len(experts), triton.cdiv(outputs, BLOCK_OUT), groups)
    # Triton launches on the current device and its stream: make the blocks' device current
    with torch.cuda.device(blocks.device) if blocks.is_cuda else contextlib.nullcontext():
        _dequantise_kernel[grid](
            blocks,
            scales,
            experts,
            bits,
            outputs,
            groups,
            BLOCK_OUT=BLOCK_OUT,
            BF16=dtype == torch.bfloat16,
            COMPACT=compact,
        )
    return out
