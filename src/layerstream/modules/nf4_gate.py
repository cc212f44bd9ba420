"""Would bitsandbytes run its fused gemm_4bit kernel for this call? The gate that sends a
streamed NF4 projection that trains through layerstream's checkpoint-visible Function
(``nf4.NF4Matmul``) exactly where bitsandbytes' own CUDA dispatch would pick that kernel.

The dispatch's names are private to bitsandbytes, so they are read at call time; where
they are missing the gate answers True (the Function is always correct, maybe slower) and
says so once.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..system.log import get_logger

logger = get_logger(__name__)

# names bitsandbytes' CUDA gemm_4bit dispatch uses to pick its fused kernel
GATE_NAMES = ("_gemm_4bit_custom_max_m", "_gemm_4bit_use_custom_fn")

_warned_gate = False


def _cuda_ops():
    try:
        from bitsandbytes.backends.cuda import ops
    except Exception:  # CPU-only torch builds cannot import it
        return None
    return ops


def _warn_gate_once(reason: str) -> None:
    global _warned_gate
    if not _warned_gate:
        _warned_gate = True
        logger.warning(
            "layerstream: cannot read bitsandbytes' gemm_4bit dispatch (%s); every streamed NF4 "
            "projection on CUDA that trains now goes through layerstream's checkpoint-visible Function. "
            "Results stay exact; training-sized calls may be slower. Pin bitsandbytes to a "
            "tested version (0.50.x) to restore the usual routing.",
            reason,
        )


def fused_kernel_would_run(x: torch.Tensor, shape: Sequence[int], blocksize: int, ops=None) -> bool:
    """Would bitsandbytes' gemm_4bit op run its fused kernel for this call?

    Mirrors the CUDA dispatch of bitsandbytes 0.50: M = numel // K; above
    ``_gemm_4bit_custom_max_m`` or with K not a multiple of the blocksize it falls back to
    dequantize + linear, else ``_gemm_4bit_use_custom_fn(device, dtype, M, N, K)`` decides.
    On the CPU gemm_4bit is always dequantize + linear. Where the names are missing the
    answer is True: the Function is correct in every case, only possibly slower.
    """
    if x.device.type != "cuda" and ops is None:
        return False
    if ops is None:
        ops = _cuda_ops()
        if ops is None:
            _warn_gate_once("bitsandbytes.backends.cuda.ops does not import")
            return True
    max_m = getattr(ops, GATE_NAMES[0], None)
    use_custom = getattr(ops, GATE_NAMES[1], None)
    if max_m is None or use_custom is None:
        _warn_gate_once(f"{', '.join(GATE_NAMES)} not found")
        return True
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    N = shape[0]
    if M > max_m:
        return False
    if K % blocksize != 0:
        return False
    return bool(use_custom(x.device.index, x.dtype, M, N, K))
