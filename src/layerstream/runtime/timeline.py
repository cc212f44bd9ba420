"""Residency timeline of one step: when each copy ran, what each slot held, when each
layer computed. Written as a Chrome/Perfetto trace and as a PNG plot.

Recording is armed for one step at a time. While armed, the slot pool keeps each copy's
timing events (instead of recycling them) and the runtime brackets each layer call with
two more; at ``finish`` the host waits once for the device and turns every event into
milliseconds since the step began. On the host device, times are ``perf_counter``
readings. Nothing is recorded, and the hot path does one ``is None`` check, when no
recording is armed.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from ..errors import StreamingError
from ..system.log import get_logger

logger = get_logger(__name__)

TRACE_NAME = "layerstream-trace.json"
PLOT_NAME = "layerstream-timeline.png"


@dataclass
class Span:
    row: str  # "compute", "copy", or "slot N"
    kind: str  # "forward", "backward", "inference", "copy", "hold"
    layer: int
    slot: int
    start_ms: float
    end_ms: float


class Recording:
    """Raw marks of one step; ``finish`` turns them into spans."""

    def __init__(self, pool, owners: List[Optional[int]]):
        self.pool = pool
        self.cuda = pool.cuda
        self.initial_owners = list(owners)
        self.copies: list = []  # (layer, slot, start mark, end mark)
        self.computes: list = []  # (layer, slot, phase, start mark, end mark)
        # calls drawn as one span each (``TimelineRecorder.summarised``): (copies recorded
        # before it, kind, start mark, end mark, what each slot holds after it)
        self.summarised_calls: list = []
        self.base = self.now()

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = self.pool._events.get(materialise=False)  # recorded once, here
        event.record(torch.cuda.current_stream(self.pool.device))
        return event

    def _ms(self, mark) -> float:
        if self.cuda:
            return self.base.elapsed_time(mark)
        return (mark - self.base) * 1000.0

    def finish(self) -> List[Span]:
        end = self.now()
        if self.cuda:
            torch.cuda.synchronize(self.pool.device)
        step_end = self._ms(end)
        spans: List[Span] = []
        holds = {slot: (owner, 0.0) for slot, owner in enumerate(self.initial_owners) if owner is not None}
        calls = iter(self.summarised_calls)
        call = next(calls, None)
        for position, (layer, slot, start, stop) in enumerate(self.copies):
            while call is not None and call[0] == position:
                self._summarise(call, holds, spans)
                call = next(calls, None)
            begin = self._ms(start)
            if slot in holds:
                held, since = holds[slot]
                spans.append(Span(f"slot {slot}", "hold", held, slot, since, begin))
            spans.append(Span("copy", "copy", layer, slot, begin, self._ms(stop)))
            holds[slot] = (layer, begin)
        while call is not None:
            self._summarise(call, holds, spans)
            call = next(calls, None)
        for slot, (held, since) in holds.items():
            spans.append(Span(f"slot {slot}", "hold", held, slot, since, step_end))
        for layer, slot, phase, start, stop in self.computes:
            spans.append(
                Span("compute", phase.value.replace("train_", ""), layer, slot, self._ms(start), self._ms(stop))
            )
        return sorted(spans, key=lambda s: (s.start_ms, s.row))

    def _summarise(self, call: tuple, holds: dict, spans: List[Span]) -> None:
        """One summarised call: a span on the compute row; the slots' holds end where it
        begins (its own copies are not drawn) and start again, from what each slot holds
        after it, where it ends."""
        _, kind, start, stop, owners = call
        begin, end = self._ms(start), self._ms(stop)
        for slot, (held, since) in holds.items():
            spans.append(Span(f"slot {slot}", "hold", held, slot, since, begin))
        holds.clear()
        holds.update({slot: (owner, end) for slot, owner in enumerate(owners) if owner is not None})
        spans.append(Span("compute", kind, -1, -1, begin, end))


class TimelineRecorder:
    """The runtime's timeline surface (a mixin of ``StreamRuntime``: its ``_recording``
    and ``pool``)."""

    _recording: Optional[Recording] = None

    @property
    def timeline_active(self) -> bool:
        return self._recording is not None

    def start_timeline(self) -> None:
        """Record copies, residency and layer calls from now until ``finish_timeline``."""
        if self._recording is not None:
            raise StreamingError("a timeline is already being recorded; call finish_timeline() first")
        self._recording = self.pool.recording = Recording(self.pool, self.pool.owner)

    def finish_timeline(self) -> List[Span]:
        """Stop recording; returns the spans (waits once for the device)."""
        recording = self._recording
        if recording is None:
            raise StreamingError("no timeline is being recorded; call start_timeline() first")
        try:
            return recording.finish()
        finally:
            self._recording = self.pool.recording = None

    def timeline(self, directory: Optional[str] = None):
        """Record the steps run inside the block; write the trace and plot to ``directory``.
        Yields a list that holds the spans once the block ends."""
        return recorded(self, directory)

    @contextlib.contextmanager
    def summarised(self, kind: str):
        """Inside a recorded step, draw the block as one span of ``kind`` (a ``generate``
        call: its token steps would take two marks per layer each, most of the step's marks
        and host time, for a picture no one can read): nothing in it is marked. Outside a
        recording, nothing."""
        recording = self._recording
        if recording is None:
            yield
            return
        start = recording.now()
        self._recording = self.pool.recording = None
        try:
            yield
        finally:
            self._recording = self.pool.recording = recording
            recording.summarised_calls.append(
                (len(recording.copies), kind, start, recording.now(), list(self.pool.owner))
            )


def chrome_trace(spans: List[Span], slots: int) -> dict:
    """Trace Event Format (open in https://ui.perfetto.dev or chrome://tracing)."""
    rows = ["compute", "copy"] + [f"slot {s}" for s in range(slots)]
    tid = {row: i for i, row in enumerate(rows)}
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "layerstream"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid[row], "args": {"name": row}} for row in rows]
    events += [
        {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid[row], "args": {"sort_index": tid[row]}}
        for row in rows
    ]
    for span in spans:
        name = {
            "copy": f"copy layer {span.layer} -> slot {span.slot}",
            "hold": f"layer {span.layer}",
            "generate": _LEGEND["generate"],
        }.get(span.kind, f"{span.kind} layer {span.layer}")
        events.append(
            {
                "ph": "X",
                "pid": 1,
                "tid": tid[span.row],
                "name": name,
                "cat": span.kind,
                "ts": span.start_ms * 1000.0,
                "dur": max(span.end_ms - span.start_ms, 0.0) * 1000.0,
                "args": {"layer": span.layer, "slot": span.slot},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


_COLOURS = {
    "forward": "#3a7bd5",
    "backward": "#d5563a",
    "inference": "#3a9d5d",
    "generate": "#9fcfae",
    "copy": "#8e6bbf",
    "hold": "#d9d9d9",
}
_LEGEND = {
    "forward": "forward",
    "backward": "backward (recompute)",
    "inference": "inference",
    "generate": "generate (token steps not drawn)",
    "copy": "copy",
    "hold": "slot holds layer",
}


def plot(spans: List[Span], slots: int, path: str, title: str = "") -> bool:
    """Draw the timeline as a PNG; False (and one warning) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning(
            "layerstream: the residency plot needs matplotlib (pip install 'layerstream[plot]'); wrote the trace only"
        )
        return False
    rows = ["compute", "copy"] + [f"slot {s}" for s in range(slots)]
    y = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    end = max((s.end_ms for s in spans), default=1.0)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.55 * len(rows)))
    bars: dict = {}  # (row, kind) -> its spans' (start, width): one call draws them all
    for span in spans:
        width = max(span.end_ms - span.start_ms, end * 1e-4)
        bars.setdefault((span.row, span.kind), []).append((span.start_ms, width))
    for (row, kind), ranges in bars.items():
        ax.broken_barh(
            ranges,
            (y[row] - 0.4, 0.8),
            facecolors=_COLOURS.get(kind, "#999999"),
            edgecolors="white" if kind == "hold" else "none",
            linewidth=0.5,
        )
    for span in spans:
        width = max(span.end_ms - span.start_ms, end * 1e-4)
        if width > end / 80:
            ax.text(
                span.start_ms + width / 2,
                y[span.row],
                "generate" if span.kind == "generate" else str(span.layer),
                ha="center",
                va="center",
                fontsize=6,
                color="black" if span.kind == "hold" else "white",
            )
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_xlim(0, end)
    ax.set_xlabel("ms since the step began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLOURS[kind]) for kind in _LEGEND]
    ax.legend(
        handles,
        list(_LEGEND.values()),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 - 0.02 * len(rows)),
        ncol=6,
        fontsize=8,
        frameon=False,
    )
    ax.set_title(title or "layerstream: one step, layer number on each bar", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(spans: List[Span], slots: int, directory: str, title: str = "") -> List[str]:
    """Write the trace (and the plot when matplotlib is there) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    written = []
    trace_path = os.path.join(directory, TRACE_NAME)
    with open(trace_path, "w") as handle:
        json.dump(chrome_trace(spans, slots), handle)
    written.append(trace_path)
    plot_path = os.path.join(directory, PLOT_NAME)
    if plot(spans, slots, plot_path, title):
        written.append(plot_path)
    return written


@contextlib.contextmanager
def recorded(runtime, directory: Optional[str] = None):
    """Record the steps run inside the block; write the trace and plot to ``directory``.
    Yields a list that holds the spans once the block ends."""
    spans: list = []
    runtime.start_timeline()
    try:
        yield spans
    finally:
        spans.extend(runtime.finish_timeline())
    if directory is not None:
        write(spans, runtime.slot_rows, directory, title(runtime))


def title(runtime) -> str:
    """The plot's title for a streamed model."""
    return (
        f"layerstream: {len(runtime.records)} layers, {runtime.config.slots} slots, prefetch "
        f"{runtime.config.prefetch}, on {runtime.device}; layer number on each bar"
    )
