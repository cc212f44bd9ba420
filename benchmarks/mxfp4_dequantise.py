"""How long one packed experts call spends dequantising, at gpt-oss's real shapes.

A streamed gpt-oss layer keeps its experts in MXFP4 and dequantises them at each experts
call; a training step with gradient checkpointing does it twice a layer. This times that
call for a whole layer (both projections, every expert) three ways, after checking each
against transformers' values bit for bit:

- layerstream's (``layerstream.modules.packed_experts.dequantise``): on the GPU its one-pass
  Triton kernel (``mxfp4_kernel``), elsewhere torch ops;
- torch ops alone (``packed_experts.dequantise_with_torch``, the fallback: a table of each
  byte's two values kept on the device, one lookup per byte, the transposition written
  straight into the stacks);
- transformers' ``convert_moe_packed_tensors`` on the same groups of experts (which builds its
  table from a Python list at each call and returns a transposed copy).

    python benchmarks/mxfp4_dequantise.py                 # GPU; gpt-oss-20b and 120b layers
    python benchmarks/mxfp4_dequantise.py --device cpu --experts 4   # the check only

``results/moe/mxfp4-dequantise-a8e6cad.json`` was measured before layerstream took the kernel:
its ``layerstream`` is today's torch ops and its ``triton`` today's kernel.
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

from layerstream.modules import mxfp4_kernel, packed_experts  # noqa: E402

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
    ways = {"layerstream": packed_experts.dequantise, "torch_ops": packed_experts.dequantise_with_torch}
    for _, blocks, scales in rows:  # exactness first: NaN and infinity where they come out, too
        theirs = through_transformers(blocks, scales, dtype)
        for way, function in ways.items():
            ours = function(blocks, scales, dtype)
            if not torch.equal(theirs.view(torch.int16), ours.view(torch.int16)):
                raise SystemExit(f"{name}: {way}'s values differ from transformers'")
            del ours
        del theirs
    out_bytes = sum(b.shape[0] * b.shape[1] * b.shape[2] * 32 * dtype.itemsize for _, b, _ in rows)

    def run(function):
        return lambda: [function(b, s, dtype) for _, b, s in rows]

    now = timed(run(through_transformers), repeats, device)
    row = dict(
        shape=name,
        experts=experts,
        device=device,
        layerstream_way="kernel" if mxfp4_kernel.usable(rows[0][1], dtype) else "torch ops",
        dequantised_gib=out_bytes / 2**30,
        exact=True,
        transformers_ms=statistics.median(now[1:] or now) * 1e3,
        transformers_ms_all=[t * 1e3 for t in now],
    )
    for way, function in ways.items():
        times = timed(run(function), repeats, device)
        best = statistics.median(times[1:] or times)
        row.update(
            {f"{way}_ms": best * 1e3, f"{way}_gbps": out_bytes / best / 1e9, f"{way}_ms_all": [t * 1e3 for t in times]}
        )
    row["speedup"] = row["transformers_ms"] / row["layerstream_ms"]
    row["transformers_gbps"] = out_bytes / (row["transformers_ms"] / 1e3) / 1e9
    return row


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
