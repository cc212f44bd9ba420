"""A candidate for dequantising MXFP4 experts in one pass on the GPU (a Triton kernel), for
``mxfp4_dequantise.py`` to check against transformers' values and time. Not used by
layerstream: it moves into ``packed_experts`` only if the GPU shows it exact and faster.

Each program takes one expert, one block of 32 inputs and a tile of outputs: it reads the
tile's 16 bytes per output and their exponent and writes the transposed ``[experts, in, out]``
layout directly: one read of the packed bytes, one write of the output. Each value's bits are
built with integer arithmetic, no floating-point operation at all: an FP4 code is a sign and
(1 + f) * 2 ** k (f 0 or 1/2, k -1 to 2: the values of transformers' ``FP4_VALUES``), so its
product with 2 ** (exponent - 127) is that mantissa at exponent k + exponent - 127, exact:
a normal number, a subnormal one (down to 2 ** -128, which bf16 and float32 both hold), or
infinity past the dtype's largest, as an exact ``ldexp`` gives (torch's on the CPU does:
``ldexp(0.5, 128)`` is 2 ** 127 there). Whether torch's ldexp on CUDA agrees at the extreme
exponents is what the benchmark's count of differing values says.

    TRITON_INTERPRET=1 python ...   # Triton's interpreter runs the kernel on the CPU
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU machine: no Triton
    triton = None

if triton is not None:

    @triton.jit
    def _bits(nibble, scale, BF16: tl.constexpr):
        """The output dtype's bits (in int32) of FP4 code ``nibble`` times 2 ** (scale - 127)."""
        code = nibble & 7
        sign = nibble >> 3
        half = code & 1  # the mantissa's half (codes 3, 5, 7), none for code 1 (0.5)
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
        out_ptr,
        outputs,
        groups,
        BLOCK_OUT: tl.constexpr,
        BF16: tl.constexpr,
    ):
        expert = tl.program_id(0).to(tl.int64)  # the output of 128 experts passes 2**31 elements
        tile = tl.program_id(1)
        group = tl.program_id(2)
        rows = tile * BLOCK_OUT + tl.arange(0, BLOCK_OUT)  # output columns of this tile
        live = rows < outputs
        byte = tl.arange(0, 16)
        # blocks [experts, outputs, groups, 16], scales [experts, outputs, groups]
        where = ((expert * outputs + rows[:, None]) * groups + group) * 16 + byte[None, :]
        packed = tl.load(blocks_ptr + where, mask=live[:, None], other=0).to(tl.int32)
        scale = tl.load(scales_ptr + (expert * outputs + rows) * groups + group, mask=live, other=127)
        scale = scale.to(tl.int32)[:, None]
        low = _bits(packed & 15, scale, BF16)
        high = _bits(packed >> 4, scale, BF16)
        values = tl.join(low, high)  # [BLOCK_OUT, 16, 2]: inputs 2j and 2j + 1
        values = tl.reshape(values, (BLOCK_OUT, 32))
        values = tl.trans(values)  # [32, BLOCK_OUT]
        inputs = group * 32 + tl.arange(0, 32)
        # out [experts, groups * 32, outputs], as int16 (bf16) or int32 (float32) bits
        target = (expert * groups * 32 + inputs[:, None]) * outputs + rows[None, :]
        tl.store(out_ptr + target, values.to(out_ptr.dtype.element_ty), mask=live[None, :])


def available(device: str) -> bool:
    """Triton is here, and the device is CUDA or Triton's interpreter runs kernels on the CPU."""
    return triton is not None and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def dequantise(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[experts, in, out]`` in bf16 or float32 from blocks ``[experts, out, groups, 16]`` and
    scales ``[experts, out, groups]``, one kernel launch for the whole stack."""
    experts, outputs, groups, half = blocks.shape
    assert half == 16 and dtype in (torch.bfloat16, torch.float32)
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(experts, groups * 32, outputs, dtype=dtype, device=blocks.device)
    bits = out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    block_out = 64
    grid = (experts, triton.cdiv(outputs, block_out), groups)
    _dequantise_kernel[grid](blocks, scales, bits, outputs, groups, BLOCK_OUT=block_out, BF16=dtype == torch.bfloat16)
    return out
