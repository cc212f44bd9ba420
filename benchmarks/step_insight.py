"""Where one training step's time and memory go, on the GPU: a kernel table from torch's
profiler, and the tensors alive at the step's allocated peak from the caching
allocator's history, grouped by the source line that allocated them.

Why: the long-context runs are 0.82-0.85x the resident step and the memory plan is 5%
under the measured peak at 57k tokens; a step time or one peak figure cannot say which
op or which tensor. The benchmarks call these around a step; the replay of the
allocator's events is plain Python, tested on the CPU.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Optional

# frames in these files are torch's own machinery: the allocation is charged to the first
# frame outside them (a model's line, layerstream's, peft's, bitsandbytes')
_MACHINERY = ("/torch/", "<frozen", "/contextlib.py", "/functools.py", "/threading.py")
BLOCKS_PER_SOURCE = 12


def _frame_text(frame: dict) -> str:
    short = "/".join(frame.get("filename", "").split("/")[-2:])
    return f"{short}:{frame.get('line', '?')} ({frame.get('name', '?')})"


def source_of(frames: Iterable[dict]) -> str:
    """``file:line (function)`` of the innermost frame outside torch, or ``?``."""
    for frame in frames:
        name = frame.get("filename", "")
        if name and not any(part in name for part in _MACHINERY):
            return _frame_text(frame)
    return "?"


def stack_of(frames: Iterable[dict], depth: int = 14) -> List[str]:
    """The innermost ``depth`` frames, torch's included: which op, under which caller
    (a source line alone cannot tell a recompute's tensor from a backward's)."""
    return [_frame_text(frame) for frame in list(frames)[:depth]]


def live_at_peak(events: List[dict], start_allocated: int = 0) -> dict:
    """Replay a device trace (``torch.cuda.memory._snapshot()["device_traces"][d]``): the
    allocated peak and the bytes alive then, by source. Blocks allocated before the trace
    began count as ``before the trace`` (``start_allocated`` bytes; their frees lower it)."""
    live: Dict[int, tuple] = {}
    before = start_allocated
    total = peak = start_allocated
    peak_live: Dict[int, tuple] = {}
    peak_before = before
    peak_frames: tuple = ()
    for event in events:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            frames = tuple(event.get("frames", ()))
            live[addr] = (size, source_of(frames), frames)
            total += size
            if total > peak:
                peak, peak_live, peak_before, peak_frames = total, dict(live), before, frames
        elif action == "free_completed":
            if addr in live:
                total -= live.pop(addr)[0]
            else:  # a block from before the trace
                before -= size
                total -= size
    by_source: Dict[str, list] = defaultdict(lambda: [0, 0])
    blocks: Dict[str, list] = defaultdict(list)
    for size, source, frames in peak_live.values():
        by_source[source][0] += size
        by_source[source][1] += 1
        blocks[source].append((size, frames))
    rows = sorted(
        ({"source": s, "bytes": b, "blocks": n} for s, (b, n) in by_source.items()), key=lambda r: -r["bytes"]
    )
    # the largest blocks of each source, each with its stack: what the bytes are
    largest = {
        source: [
            {"bytes": size, "stack": stack_of(frames)}
            for size, frames in sorted(found, key=lambda item: -item[0])[:BLOCKS_PER_SOURCE]
        ]
        for source, found in blocks.items()
    }
    return {
        "peak_bytes": peak,
        "before_trace_bytes": peak_before,
        "by_source": rows,
        "peak_reached_by": stack_of(peak_frames, depth=24),
        "largest_blocks": largest,
    }


def begin_memory_trace(max_entries: int = 400_000) -> int:
    """Turn the allocator's history on; the bytes allocated now (``end_memory_trace``'s start)."""
    import torch

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    return start


def end_memory_trace(path: str, start: int, sources: Optional[int] = None) -> dict:
    """Turn the history off; write and return ``live_at_peak`` of what it recorded since
    ``begin_memory_trace`` (``sources``: keep that many of the largest sources)."""
    import torch

    try:
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    result = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()], start)
    result["measured_peak_bytes"] = torch.cuda.max_memory_allocated()
    if sources is not None:
        result["by_source"] = result["by_source"][:sources]
    from layerstream.system.versions import versions

    result["versions"] = versions()
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    return result


def memory_at_peak(step: Callable[[], None], path: str, max_entries: int = 400_000) -> dict:
    """Run ``step`` with the allocator's history on; write and return ``live_at_peak``."""
    start = begin_memory_trace(max_entries)
    try:
        step()
    except BaseException:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)
        raise
    return end_memory_trace(path, start)


def profile_table(step: Callable[[], None], path: str, rows: int = 40) -> Optional[str]:
    """Run ``step`` under torch's profiler; write the kernel table (by CUDA time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows)
    with open(path, "w") as handle:
        handle.write(table)
    return table
