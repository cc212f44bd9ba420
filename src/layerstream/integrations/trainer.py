"""Hugging Face Trainer integration: stream the Trainer's model, stats in the user's logs.

Three pieces, installed once into ``transformers.Trainer`` (and so into every subclass,
TRL's trainers included) by :func:`install`:

- before ``Trainer.__init__`` places the model, an *auto-stream* setting (from
  ``layerstream run`` or ``StreamingArguments``) streams it, if it is not streamed yet;
- after ``__init__``, a streamed model gets :class:`StreamStatsCallback`, which prints the
  one-screen summary at train start;
- ``Trainer.log`` adds streaming figures to ``logs`` before the original runs, so they
  land in ``state.log_history`` and reach every ``report_to`` backend (a callback's
  ``on_log`` would be too late: callbacks see ``logs`` after ``log_history`` was written).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..api import get_runtime, is_streamed, stream_model
from ..config import StreamConfig

logger = logging.getLogger(__name__)

PREFIX = "layerstream/"
_auto_stream: Optional[StreamConfig] = None
_installed = False


def enable_auto_stream(config: StreamConfig) -> None:
    """Stream the model of every Trainer built from now on (``layerstream run``)."""
    global _auto_stream
    _auto_stream = config
    install()


def disable_auto_stream() -> None:
    global _auto_stream
    _auto_stream = None


class _LogWindow:
    """Differences of the runtime counters between two logging steps."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.last = runtime.stats()
        self.last_time = time.perf_counter()

    def figures(self) -> dict:
        now = self.runtime.stats()
        wall = max(time.perf_counter() - self.last_time, 1e-9)
        copied = now["h2d_bytes"] - self.last["h2d_bytes"]
        seconds = now["h2d_seconds"] - self.last["h2d_seconds"]
        out = {
            PREFIX + "h2d_gbps": round(copied / seconds / 1e9, 3) if seconds > 0 else 0.0,
            PREFIX + "stall_fraction": round((now["stall_seconds"] - self.last["stall_seconds"]) / wall, 4),
            PREFIX + "layer_loads": now["layer_loads"] - self.last["layer_loads"],
            PREFIX + "peak_resident_layers": now["peak_resident_layers"],
        }
        if self.runtime.pool.cuda:
            out[PREFIX + "peak_vram_gib"] = round(torch.cuda.max_memory_allocated(self.runtime.device) / 2**30, 3)
        self.last, self.last_time = now, time.perf_counter()
        return out


def _streaming_figures(trainer) -> dict:
    model = trainer.model
    if model is None or not is_streamed(model):
        return {}
    window = getattr(trainer, "_layerstream_window", None)
    runtime = get_runtime(model)
    if window is None or window.runtime is not runtime:
        window = _LogWindow(runtime)
        trainer._layerstream_window = window
    return window.figures()


def install() -> None:
    """Wrap Trainer.__init__ and Trainer.log once (idempotent)."""
    global _installed
    if _installed:
        return
    from transformers import Trainer

    original_init, original_log = Trainer.__init__, Trainer.log

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        if _auto_stream is not None and model is not None and not is_streamed(model):
            stream_model(model, _auto_stream)
        original_init(self, *args, **kwargs)
        if self.model is not None and is_streamed(self.model):
            self._layerstream_window = _LogWindow(get_runtime(self.model))  # counts from here
            if not any(isinstance(cb, StreamStatsCallback) for cb in self.callback_handler.callbacks):
                self.add_callback(StreamStatsCallback())

    @functools.wraps(original_log)
    def log(self, logs, *args, **kwargs):
        if "loss" in logs or "eval_loss" in logs:  # training and evaluation logging steps
            logs.update(_streaming_figures(self))
        return original_log(self, logs, *args, **kwargs)

    Trainer.__init__ = __init__
    Trainer.log = log
    _installed = True


try:
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover
    _CallbackBase = object


class StreamStatsCallback(_CallbackBase):
    """Prints what streams at train start (slots, bytes, device) once per training run."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and is_streamed(model) and state.is_world_process_zero:
            logger.warning("\n%s", get_runtime(model).summary())


@dataclass
class StreamingArguments:
    """HfArgumentParser flags: ``--layer_stream`` streams the model of every Trainer the
    script builds, with the given slots and prefetch."""

    layer_stream: bool = field(default=False, metadata={"help": "stream decoder layers from host memory"})
    layer_stream_slots: int = field(default=3, metadata={"help": "GPU slots (one layer each), >= 2"})
    layer_stream_prefetch: int = field(default=1, metadata={"help": "layers copied ahead, >= 1 and < slots"})
    layer_stream_device: Optional[str] = field(
        default=None, metadata={"help": "cuda (default when available) or cpu"})

    def __post_init__(self):
        if self.layer_stream:
            enable_auto_stream(self.to_config())

    def to_config(self) -> StreamConfig:
        return StreamConfig(slots=self.layer_stream_slots, prefetch=self.layer_stream_prefetch,
                            device=self.layer_stream_device)
