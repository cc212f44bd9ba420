"""How long one packed experts call spends dequantising, at gpt-oss's real shapes.

A streamed gpt-oss layer keeps its experts in MXFP4 and dequantises them at each experts
call; a training step with gradient checkpointing does it twice a layer. This times that
call for a whole layer (both projections, every expert), as layerstream does it
(``layerstream.modules.packed_experts.dequantise``: a table of each byte's two values kept
on the device, one lookup per byte, the transposition written straight into the stacks)
and by calling transformers' ``convert_moe_packed_tensors`` on the same groups of experts
(which builds its table from a Python list at each call, a copy to the device that waits for
the stream, and returns a transposed copy). The two results are compared bit for bit before
they are timed.

    python benchmarks/mxfp4_dequantise.py                 # GPU; gpt-oss-20b and 120b layers
    python benchmarks/mxfp4_dequantise.py --device cpu --experts 4   # the check only

``results/moe/mxfp4-dequantise-9a8f9a1.json`` was measured before layerstream took this way: its
``candidate`` is today's ``packed_experts.dequantise`` and its ``transformers`` the one here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import mxfp4_triton  # noqa: E402

from layerstream.modules import packed_experts  # noqa: E402

SHAPES = {  # experts, hidden, intermediate (configs/shapes)
    "gpt-oss-20b": (32, 2880, 2880),
    "gpt-oss-120b": (128, 2880, 2880),
}


def through_transformers(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[experts, in, out]: transformers' function on groups of ``packed_experts.GROUP_BYTES``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    experts, outputs, groups, half = blocks.shape
    inputs = groups * half * 2
    out = torch.empty(experts, inputs, outputs, dtype=dtype, device=blocks.device)
    step = max(1, packed_experts.GROUP_BYTES // (inputs * outputs * dtype.itemsize))
    for start in range(0, experts, step):
        end = min(start + step, experts)
        out[start:end].copy_(convert_moe_packed_tensors(blocks[start:end], scales[start:end], dtype=dtype))
    return out


def timed(function, repeats: int, device: str) -> list:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def layer(name: str, experts: int, device: str, repeats: int) -> dict:
    _, hidden, intermediate = SHAPES[name]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for proj, (inputs, outputs) in {
        "gate_up_proj": (hidden, 2 * intermediate),
        "down_proj": (intermediate, hidden),
    }.items():
        groups = inputs // packed_experts.BLOCK
        blocks = torch.randint(0, 256, (experts, outputs, groups, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(112, 130, (experts, outputs, groups), dtype=torch.uint8, generator=generator)
        scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every exponent once
        rows.append((proj, blocks.to(device), scales.to(device)))
    dtype = torch.bfloat16
    for _, blocks, scales in rows:  # exactness first: NaN and infinity where they come out, too
        theirs = through_transformers(blocks, scales, dtype)
        ours = packed_experts.dequantise(blocks, scales, dtype)
        if not torch.equal(theirs.view(torch.int16), ours.view(torch.int16)):
            raise SystemExit(f"{name}: layerstream's values differ from transformers'")
        del theirs, ours
    out_bytes = sum(b.shape[0] * b.shape[1] * b.shape[2] * 32 * dtype.itemsize for _, b, _ in rows)

    def run(function):
        return lambda: [function(b, s, dtype) for _, b, s in rows]

    now = timed(run(through_transformers), repeats, device)
    new = timed(run(packed_experts.dequantise), repeats, device)
    median_now, median_new = statistics.median(now[1:] or now), statistics.median(new[1:] or new)
    return dict(
        triton_candidate(rows, dtype, run, repeats, device, out_bytes),
        shape=name,
        experts=experts,
        device=device,
        dequantised_gib=out_bytes / 2**30,
        transformers_ms=median_now * 1e3,
        layerstream_ms=median_new * 1e3,
        transformers_gbps=out_bytes / median_now / 1e9,
        layerstream_gbps=out_bytes / median_new / 1e9,
        speedup=median_now / median_new,
        exact=True,
        transformers_ms_all=[t * 1e3 for t in now],
        layerstream_ms_all=[t * 1e3 for t in new],
    )


def triton_candidate(rows: list, dtype, run, repeats: int, device: str, out_bytes: int) -> dict:
    """``mxfp4_triton``'s one-pass kernel where Triton and CUDA are here: bit for bit against
    transformers (which values differ, if any), then timed. Never raises: a failure is a
    field of the row."""
    if not mxfp4_triton.available(device):
        return dict(triton="not available here")
    try:
        differing = 0
        for _, blocks, scales in rows:
            theirs = through_transformers(blocks, scales, dtype).view(torch.int16)
            ours = mxfp4_triton.dequantise(blocks, scales, dtype).view(torch.int16)
            differing += int((theirs != ours).sum())
        found = dict(triton_exact=differing == 0, triton_values_differing=differing)
        times = timed(run(mxfp4_triton.dequantise), repeats, device)
        best = statistics.median(times[1:] or times)
        return dict(
            found, triton_ms=best * 1e3, triton_gbps=out_bytes / best / 1e9, triton_ms_all=[t * 1e3 for t in times]
        )
    except Exception as error:  # noqa: BLE001
        return dict(triton_error=f"{type(error).__name__}: {error}"[:2000])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--experts", type=int, default=None, help="experts per layer (default: the shape's)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default=None, help="a JSON file for the rows")
    args = parser.parse_args(argv)
    rows = []
    for name, (experts, _, _) in SHAPES.items():
        row = layer(name, args.experts or experts, args.device, args.repeats)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
