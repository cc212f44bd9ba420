"""How much of a profiled step's host-to-device copying overlaps compute.

Reads a torch.profiler Chrome trace (.json or .json.gz, as throughput.py --trace writes)
and reports, for the copies of at least --min-us each (the layer copies): their count and
total time, GPU kernel busy time, the copy time during which some kernel ran, and the
longest gaps between copies (where the copy stream waited).

    python benchmarks/trace_overlap.py benchmarks/results/throughput/trace-llama3-8b-none-3x2.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(a, b) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def summarise(events: list, min_us: float = 1000.0) -> dict:
    spans = [e for e in events if e.get("ph") == "X"]
    copies = sorted(
        (
            (e["ts"], e["ts"] + e["dur"])
            for e in spans
            if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and e["dur"] >= min_us
        )
    )
    kernels = _union((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "kernel")
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    copy_us = sum(end - start for start, end in copies)
    gaps = sorted((copies[i + 1][0] - copies[i][1] for i in range(len(copies) - 1)), reverse=True)
    return {
        "copies": len(copies),
        "copy_ms": copy_us / 1e3,
        "kernel_busy_ms": sum(end - start for start, end in kernels) / 1e3,
        "copy_overlapping_compute_ms": _overlap(_union(copies), kernels) / 1e3,
        "overlap_fraction": (_overlap(_union(copies), kernels) / copy_us) if copy_us else 0.0,
        "gpu_span_ms": ((max(e for _, e in gpu) - min(s for s, _ in gpu)) / 1e3) if gpu else 0.0,
        "largest_copy_gaps_ms": [round(g / 1e3, 2) for g in gaps[:5]],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--min-us", type=float, default=1000.0, help="shorter copies are not layer copies")
    args = parser.parse_args()
    print(json.dumps(summarise(load(args.trace), args.min_us), indent=1))


if __name__ == "__main__":
    main()
