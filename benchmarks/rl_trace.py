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

STOP = "decode_trace.stop"  # decode_trace.py's closing wait for the GPU, inside its trace


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


def summarise(path: str, token_steps: int = 0) -> dict:
    """The trace's figures (``path``: gzipped or not); ``token_steps``: how many token steps it holds, for the figures
    per token step (kernels launched, their busy time, the host's span, waits on the GPU)."""
    with gzip.open(path) if path.endswith(".gz") else open(path) as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    per_step = _per_token_step(events, gpu, token_steps) if token_steps else {}
    if not gpu:  # a CPU run of the harness
        return {"trace": path, **per_step}
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
        **per_step,
    }


def _per_token_step(events: list, gpu: list, steps: int) -> dict:
    """Kernels launched, their busy time, the host's span (the wall time from the first
    host event to the last: the host issuing the steps and waiting where they wait) and its
    calls that wait for the GPU (synchronisations, blocking copies), each per token step. The
    host's events from the harness's closing wait (``STOP``) on are left out; the kernels the
    GPU runs during it were issued by the steps, and count."""
    stop = min((e["ts"] for e in events if e.get("name") == STOP), default=None)  # the harness's own wait
    if stop is not None:  # the host's side of it; the kernels running then are the steps' own
        events = [e for e in events if e["ts"] < stop]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function")]
    span = (max(e["ts"] + e["dur"] for e in host) - min(e["ts"] for e in host)) / 1e3 if host else 0.0
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    waits = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in name or name in ("cudaMemcpy", "cudaStreamWaitEvent")):
            waits[name][0] += 1
            waits[name][1] += e["dur"] / 1e3
    return {
        "token_steps": steps,
        "kernels_per_token_step": len(kernels) / steps,
        "kernels_busy_ms_per_token_step": _union_ms((e["ts"], e["ts"] + e["dur"]) for e in kernels) / steps,
        "host_span_ms_per_token_step": span / steps,
        "cpu_ops_per_token_step": sum(e.get("cat") == "cpu_op" for e in events) / steps,
        "waits_per_token_step": {
            name: {"count": n / steps, "host_ms": round(ms / steps, 3)} for name, (n, ms) in sorted(waits.items())
        },
    }


if __name__ == "__main__":
    print(json.dumps([summarise(path) for path in sys.argv[1:]], indent=1))
