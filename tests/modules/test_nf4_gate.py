"""The fused-kernel gate agrees with bitsandbytes' own gemm_4bit dispatch.

bitsandbytes' CUDA ops module does not import on a CPU-only torch, so the tests read its
source: the registered CUDA gemm_4bit function is compiled on its own, with a fake ops
table standing in for the CUDA heuristics and the two kernels it can call, and its
decision is compared with layerstream's gate over a grid of shapes.
"""

import ast
import itertools
from pathlib import Path
from types import SimpleNamespace

import bitsandbytes as bnb
import pytest
import torch

from layerstream.modules import nf4_gate

CUDA_OPS = Path(bnb.__file__).parent / "backends" / "cuda" / "ops.py"


def _tree():
    return ast.parse(CUDA_OPS.read_text())


def _dispatch_function():
    """bitsandbytes' registered CUDA gemm_4bit, compiled against fakes."""
    for node in _tree().body:
        if isinstance(node, ast.FunctionDef) and any(
            "bitsandbytes::gemm_4bit" in ast.unparse(d) and "cuda" in ast.unparse(d) for d in node.decorator_list
        ):
            node.decorator_list = []
            module = ast.Module(body=[node], type_ignores=[])
            return node.name, compile(module, str(CUDA_OPS), "exec")
    raise AssertionError("bitsandbytes no longer registers a CUDA gemm_4bit in backends/cuda/ops.py")


def test_bitsandbytes_still_exposes_the_names_the_gate_reads():
    assigned = {
        t.id
        for node in ast.walk(_tree())
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    missing = [name for name in nf4_gate.GATE_NAMES if name not in assigned]
    assert not missing, f"bitsandbytes moved {missing}: update layerstream.modules.nf4_gate.fused_kernel_would_run"
    _dispatch_function()


def _bnb_dispatch(ops):
    name, code = _dispatch_function()
    namespace = {
        "torch": torch,
        "Optional": __import__("typing").Optional,
        "Sequence": __import__("typing").Sequence,
        "warn": lambda *a, **k: None,
        "_gemm_4bit_custom_max_m": ops._gemm_4bit_custom_max_m,
        "_gemm_4bit_use_custom_fn": ops._gemm_4bit_use_custom_fn,
        "_dequant_linear_fallback": lambda *a, **k: "fallback",
        "_gemm_4bit_kernel_impl": lambda *a, **k: "fused",
    }
    exec(code, namespace)
    dispatch = namespace[name]
    return lambda x, shape, blocksize: dispatch(x, None, shape, None, blocksize, "nf4") == "fused"


def _fake_ops(max_m):
    # a stand-in heuristic with the shape of bitsandbytes' own: depends on all five inputs
    def use_custom(device_index, dtype, M, N, K):
        return M <= (4 if dtype == torch.float32 else 64) and (N * K) % 3 != 1

    return SimpleNamespace(_gemm_4bit_custom_max_m=max_m, _gemm_4bit_use_custom_fn=use_custom)


GRID = list(
    itertools.product(
        [1, 3, 4, 16, 64, 65, 1536, 1537],  # M
        [64, 96],  # N
        [64, 100, 128],  # K (100: not a multiple of the blocksize)
        [torch.bfloat16, torch.float16, torch.float32],
        [64, 128],  # blocksize
        [2, 3],  # input rank
    )
)


@pytest.mark.parametrize("max_m", [1536, 256])
def test_gate_agrees_with_bitsandbytes_dispatch(max_m):
    ops = _fake_ops(max_m)
    bnb_decision = _bnb_dispatch(ops)
    for M, N, K, dtype, blocksize, rank in GRID:
        x = torch.empty((M, K) if rank == 2 else (1, M, K), dtype=dtype)
        ours = nf4_gate.fused_kernel_would_run(x, (N, K), blocksize, ops=ops)
        theirs = bnb_decision(x, (N, K), blocksize)
        assert ours == theirs, f"M={M} N={N} K={K} {dtype} blocksize={blocksize} rank={rank}"


def test_gate_is_off_on_the_cpu_without_an_ops_table():
    x = torch.empty(1, 64, dtype=torch.bfloat16)
    assert nf4_gate.fused_kernel_would_run(x, (64, 64), 64) is False


def test_missing_names_fall_toward_the_function_and_warn_once(caplog, monkeypatch):
    monkeypatch.setattr(nf4_gate, "_warned_gate", False)
    x = torch.empty(1, 64, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="layerstream"):
        assert nf4_gate.fused_kernel_would_run(x, (64, 64), 64, ops=SimpleNamespace()) is True
        assert nf4_gate.fused_kernel_would_run(x, (64, 64), 64, ops=SimpleNamespace()) is True
    assert caplog.text.count("cannot read bitsandbytes' gemm_4bit dispatch") == 1
