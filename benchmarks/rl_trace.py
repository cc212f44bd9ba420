"""Where a profiled ``generate`` call's time went, from the Chrome trace ``rl.py
--profile-generate`` writes: the call's span on the GPU, the time some kernel ran (the
union over streams), the copies by stream and direction, and the host's CUDA runtime calls.
A span far longer than its kernels' busy time means the host, not the GPU or the copies,
set the pace (decoding is launch-bound).

    python benchmarks/rl_trace.py results/rl/profile/generate-8GiB-b64.json.gz [...] > summary.json
"""

from __future__ import annotations

import collections
import gzip
import json
import sys


def _union_ms(intervals) -> float:
    busy, current = 0.0, None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                busy += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        busy += current[1] - current[0]
    return busy / 1e3


def summarise(path: str) -> dict:
    events = [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    copies = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        if e["cat"] == "gpu_memcpy":
            key = f"stream {e['args'].get('stream')}: {e['name']}"
            copies[key][0] += 1
            copies[key][1] += e["dur"] / 1e3
    runtime = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e["dur"] / 1e3
    slowest = sorted(runtime.items(), key=lambda item: -item[1][1])[:6]
    return {
        "trace": path,
        "gpu_span_ms": (end - start) / 1e3,
        "kernels_busy_ms": _union_ms((e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel"),
        "copies": {key: {"count": n, "ms": round(ms, 1)} for key, (n, ms) in sorted(copies.items())},
        "runtime_calls": {name: {"count": n, "host_ms": round(ms, 1)} for name, (n, ms) in slowest},
        "longest_memcpy_call_ms": max(
            (e["dur"] / 1e3 for e in events if e.get("name") == "cudaMemcpyAsync"), default=0
        ),
    }


if __name__ == "__main__":
    print(json.dumps([summarise(path) for path in sys.argv[1:]], indent=1))
