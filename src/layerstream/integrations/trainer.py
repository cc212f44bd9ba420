"""Hugging Face Trainer integration: stream the Trainer's model, stats in the user's logs.

Three pieces, installed once into ``transformers.Trainer`` (and so into every subclass,
TRL's trainers included) by :func:`install`:

- before ``Trainer.__init__`` places the model, an *auto-stream* setting (from
  ``layerstream run`` or ``StreamingArguments``) streams it, if it is not streamed yet;
- after ``__init__``, a streamed model gets :class:`StreamStatsCallback`, which prints the
  one-screen summary at train start (with the planner's predicted peak VRAM), records
  the residency timeline of one step, and writes it to ``output_dir`` at train end;
- ``Trainer.training_step`` re-raises a CUDA out-of-memory error of a streamed model
  with what streaming holds and which budget to change;
- ``Trainer.log`` adds streaming figures to ``logs`` before the original runs, so they
  land in ``state.log_history`` and reach every ``report_to`` backend (a callback's
  ``on_log`` would be too late: callbacks see ``logs`` after ``log_history`` was written).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import plan, timeline
from ..api import get_runtime, is_streamed, stream_model
from ..config import StreamConfig, int_or_auto
from ..runtime import StreamingError

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
            PREFIX + "window_layers": now["window_layers"],
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


def _on_the_trainers_device(config: StreamConfig, training_args) -> StreamConfig:
    """Under ``accelerate launch``/torchrun each rank trains on its own GPU, which the
    Trainer's arguments know (``args.device`` sets it up) and the launcher flags, parsed
    before the ranks chose their devices, do not: stream to the Trainer's GPU."""
    if config.device.type != "cuda" or training_args is None:
        return config
    device = getattr(training_args, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda" and device != config.device:
        return dataclasses.replace(config, device=device)
    return config


def install() -> None:
    """Wrap Trainer.__init__, Trainer.training_step and Trainer.log once (idempotent)."""
    global _installed
    if _installed:
        return
    from transformers import Trainer

    original_init, original_log = Trainer.__init__, Trainer.log
    original_training_step = Trainer.training_step

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        if _auto_stream is not None and model is not None and not is_streamed(model):
            training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
            stream_model(model, _on_the_trainers_device(_auto_stream, training_args))
        original_init(self, *args, **kwargs)
        if self.model is not None and is_streamed(self.model) and self.args.n_gpu > 1:
            raise StreamingError(
                f"this process sees {self.args.n_gpu} GPUs, so the Trainer would wrap the streamed model "
                "in nn.DataParallel, which copies it to every GPU on each step; streamed layers stay "
                f"on {get_runtime(self.model).device}. Launch one process per GPU "
                "(accelerate launch --num_processes N, or torchrun), or make one GPU visible "
                "with CUDA_VISIBLE_DEVICES.")
        if self.model is not None and is_streamed(self.model):
            self._layerstream_window = _LogWindow(get_runtime(self.model))  # counts from here
            if not any(isinstance(cb, StreamStatsCallback) for cb in self.callback_handler.callbacks):
                self.add_callback(StreamStatsCallback())

    @functools.wraps(original_log)
    def log(self, logs, *args, **kwargs):
        if "loss" in logs or "eval_loss" in logs:  # training and evaluation logging steps
            logs.update(_streaming_figures(self))
        return original_log(self, logs, *args, **kwargs)

    @functools.wraps(original_training_step)
    def training_step(self, *args, **kwargs):
        try:
            return original_training_step(self, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if self.model is None or not is_streamed(self.model):
                raise
            raise get_runtime(self.model).explain_oom(exc, "in a training step") from exc

    Trainer.__init__ = __init__
    Trainer.log = log
    Trainer.training_step = training_step
    _installed = True


try:
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover
    _CallbackBase = object


def predicted_vram(model, args) -> str:
    """The summary's predicted-peak line, from the memory planner."""
    runtime = get_runtime(model)
    batch = int(getattr(args, "per_device_train_batch_size", 1) or 1)
    seq = getattr(args, "max_length", None) or getattr(args, "max_seq_length", None)
    try:
        if seq:
            peak = plan.plan_for_model(model, int(seq), batch, slots=runtime.config.slots,
                                       stream_embeddings=runtime.ends is not None).peak_vram_bytes
            return f"  predicted    peak VRAM {peak / 2**30:.2f} GiB at batch {batch} x {seq} tokens"
        short, long = (plan.plan_for_model(model, n, batch, slots=runtime.config.slots,
                                           stream_embeddings=runtime.ends is not None).peak_vram_bytes
                       for n in (512, 2048))
        return (f"  predicted    peak VRAM {short / 2**30:.2f} GiB at batch {batch} x 512 tokens, "
                f"{long / 2**30:.2f} GiB at x 2048")
    except ValueError as exc:
        return f"  predicted    peak VRAM not planned ({exc}); see `layerstream plan`"


class StreamStatsCallback(_CallbackBase):
    """Prints what streams at train start; records one step's residency timeline and
    writes it (trace JSON, and a PNG plot with matplotlib) to ``output_dir`` at train end.

    The recorded step is the fifth optimizer step, or the last one of a shorter run: the
    first steps also fill cold slots and pay one-time kernel and allocator warm-up.
    """

    RECORDED_STEP = 4  # zero-based

    def __init__(self) -> None:
        self._runtime = None
        self._spans = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._runtime, self._spans = None, None
        if model is None or not is_streamed(model):
            return
        runtime = get_runtime(model)
        if runtime.timeline_active:
            runtime.finish_timeline()  # left armed by a run that raised mid-step
        if state.is_world_process_zero:
            logger.warning("\n%s\n%s", runtime.summary(), predicted_vram(model, args))

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self._spans is not None or self._runtime is not None or model is None or not is_streamed(model):
            return
        if state.global_step == self._recorded_step(state):
            self._runtime = get_runtime(model)
            self._runtime.start_timeline()

    def on_step_end(self, args, state, control, **kwargs):
        if self._runtime is not None and self._spans is None:
            self._spans = self._runtime.finish_timeline()

    def on_train_end(self, args, state, control, **kwargs):
        runtime, spans = self._runtime, self._spans
        self._runtime = self._spans = None
        if runtime is None:
            return
        if spans is None:  # training stopped inside the recorded step
            if runtime.timeline_active:
                runtime.finish_timeline()
            return
        if state.is_world_process_zero and args.output_dir:
            written = timeline.write(spans, runtime.slot_rows, args.output_dir, runtime._timeline_title())
            logger.warning("layerstream: residency timeline of step %d written to %s",
                           self._recorded_step(state) + 1, ", ".join(written))

    def _recorded_step(self, state) -> int:
        return max(0, min(self.RECORDED_STEP, state.max_steps - 1))


@dataclass
class StreamingArguments:
    """HfArgumentParser flags: ``--layer_stream`` streams the model of every Trainer the
    script builds, with the given slots and prefetch (and, with
    ``--layer_stream_embeddings``, its input embedding and head too)."""

    layer_stream: bool = field(default=False, metadata={"help": "stream decoder layers from host memory"})
    layer_stream_slots: str = field(default="auto", metadata={"help": "GPU slots (one layer each), >= 2, or auto"})
    layer_stream_prefetch: str = field(
        default="auto", metadata={"help": "layers copied ahead, >= 1 and < slots, or auto (slots - 1)"})
    layer_stream_device: Optional[str] = field(
        default=None, metadata={"help": "cuda (default when available) or cpu"})
    layer_stream_embeddings: bool = field(
        default=False, metadata={"help": "keep the input embedding and head in host memory too"})
    layer_stream_backward_slots: str = field(
        default="auto", metadata={"help": "extra slots used only outside the loss, >= 0, or auto"})

    def __post_init__(self):
        if self.layer_stream:
            enable_auto_stream(self.to_config())

    def to_config(self) -> StreamConfig:
        return StreamConfig(slots=int_or_auto(self.layer_stream_slots, "layer_stream_slots"),
                            prefetch=int_or_auto(self.layer_stream_prefetch, "layer_stream_prefetch"),
                            device=self.layer_stream_device, stream_embeddings=self.layer_stream_embeddings,
                            backward_slots=int_or_auto(self.layer_stream_backward_slots,
                                                       "layer_stream_backward_slots"))
