"""Hugging Face Trainer integration: stream the Trainer's model, stats in the user's logs.

Installed once into ``transformers.Trainer`` (and so into every subclass, TRL's trainers
included) by :func:`install`, which ``layerstream.stream_model`` triggers through the
core's ``on_stream`` registry and the launcher calls directly:

- before ``Trainer.__init__`` places the model, auto-streaming (``layerstream run``,
  ``--layer_stream``) streams it if it is not streamed yet, on the Trainer's device; a
  model the launcher streamed at load time follows the Trainer's device (``use_cpu``,
  the rank's GPU) unless ``--device`` was given;
- after ``__init__``, a streamed model gets :class:`StreamStatsCallback`, which prints the
  one-screen summary at train start, records the residency timeline of one step, and
  writes it to ``output_dir`` at train end;
- ``Trainer.training_step`` of a streamed model that runs out of memory with a resident
  window shrinks the window and runs the step again, from the same gradients and random
  state, so the result is the uninterrupted one; otherwise it re-raises the error with
  what streaming holds and which budget to change;
- ``Trainer.log`` adds streaming figures to ``logs`` before the original runs, so they
  land in ``state.log_history`` and reach every ``report_to`` backend.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Optional

import torch
from torch import nn

from ..api import get_runtime, is_streamed, on_stream, stream_model
from ..config import (
    BUDGET,
    COUNT,
    DEVICE,
    DIRECTORIES,
    SIZE,
    SWITCH,
    TOKENS,
    TRISTATE,
    argparse_help,
    config_from_settings,
    setting_default_text,
    settings,
)
from ..errors import StreamingError
from ..long import chunked_loss, trl_head
from ..modules.layer import registrations
from ..plan.long_settings import AUTO_ORDER, setting_text
from ..runtime import report, timeline
from ..runtime.meter import wanted_bytes
from ..system.log import get_logger
from ..units import GiB, gib
from . import generation, launch

logger = get_logger(__name__)

PREFIX = "layerstream/"
_installed = False


class _LogWindow:
    """Differences of the runtime counters between two logging steps."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.last = runtime.stats()
        self.last_generation = generation.counters(runtime).snapshot()
        self.last_time = time.perf_counter()
        self.decisions_logged = 0  # of runtime.long_settings.decisions_said()

    def figures(self) -> dict:
        """Training's copies and stalls since the last log, without generation's (counted
        by ``integrations.generation``), which follow under ``generate_*`` when it ran."""
        now = self.runtime.stats()
        totals = generation.counters(self.runtime)
        made = totals.snapshot()
        gen = {name: made[name] - self.last_generation[name] for name in made}
        wall = max(time.perf_counter() - self.last_time - gen["seconds"], 1e-9)
        # the bandwidth of the copies timed in this interval: ``h2d_seconds`` scales the
        # process's timed copies to all bytes, a running figure whose differences are not
        timed = now["h2d_timed_bytes"] - self.last["h2d_timed_bytes"] - gen["h2d_timed_bytes"]
        seconds = now["h2d_timed_seconds"] - self.last["h2d_timed_seconds"] - gen["h2d_timed_seconds"]
        stalled = now["stall_seconds"] - self.last["stall_seconds"] - gen["stall_seconds"]
        out = {
            PREFIX + "h2d_gbps": round(timed / seconds / 1e9, 3) if timed > 0 and seconds > 0 else 0.0,
            PREFIX + "stall_fraction": round(stalled / wall, 4),
            PREFIX + "layer_loads": now["layer_loads"] - self.last["layer_loads"] - gen["layer_loads"],
            PREFIX + "peak_resident_layers": now["peak_resident_layers"],
            PREFIX + "window_layers": now["window_layers"],
            PREFIX + "oom_retries": now["oom_retries"],
            PREFIX + "alloc_retries": now["alloc_retries"] - self.last["alloc_retries"] - gen["alloc_retries"],
        }
        visits = now["expert_visits"] - self.last["expert_visits"] - gen["expert_visits"]
        if visits:
            copied_experts = now["experts_copied"] - self.last["experts_copied"] - gen["experts_copied"]
            out[PREFIX + "experts_per_visit"] = round(copied_experts / visits, 2)
        if gen["calls"]:
            out.update(_generation_figures(gen, totals.window_layers))
        self.last_generation = made
        if now["disk_layers"]:
            read = now["disk_read_bytes"] - self.last["disk_read_bytes"]
            busy = now["disk_read_seconds"] - self.last["disk_read_seconds"]
            out[PREFIX + "disk_read_bytes"] = read
            out[PREFIX + "disk_read_gbps"] = round(read / busy / 1e9, 3) if busy > 0 else 0.0
            out[PREFIX + "disk_stall_seconds"] = round(now["disk_stall_seconds"] - self.last["disk_stall_seconds"], 4)
        peak = report.peak_vram_gib(self.runtime)
        if peak is not None:
            out[PREFIX + "peak_vram_gib"] = peak
        out.update(self._new_decision())
        self.last, self.last_time = now, time.perf_counter()
        return out

    def _new_decision(self) -> dict:
        """What "auto" turned on since the last logging step (the latest set, once), and the
        plan's numbers behind it: the log history keeps each decision once."""
        said = self.runtime.long_settings.decisions_said()
        if len(said) == self.decisions_logged:
            return {}
        self.decisions_logged = len(said)
        batch, seq, decision = said[-1]
        figures = {"auto_long_tokens": batch * seq}
        for name in AUTO_ORDER:  # stream_embeddings: 1 where this decision moved the ends
            value = decision.value(name)
            figures[name] = int(value or 0)
        figures["auto_long_plan_without_gib"] = round(decision.needed_without / GiB, 3)
        figures["auto_long_plan_gib"] = round(decision.needed / GiB, 3)
        return {PREFIX + key: value for key, value in figures.items()}


def _generation_figures(gen: dict, window_layers: int) -> dict:
    """What the ``generate`` calls since the last log copied, stalled and took."""
    timed, seconds = gen["h2d_timed_bytes"], gen["h2d_timed_seconds"]
    return {
        PREFIX + "generate_calls": gen["calls"],
        PREFIX + "generate_seconds": round(gen["seconds"], 3),
        PREFIX + "generate_layer_loads": gen["layer_loads"],
        PREFIX + "generate_h2d_gbps": round(timed / seconds / 1e9, 3) if timed > 0 and seconds > 0 else 0.0,
        PREFIX + "generate_stall_fraction": round(gen["stall_seconds"] / max(gen["seconds"], 1e-9), 4),
        PREFIX + "generate_window_layers": window_layers,
        PREFIX + "generate_alloc_retries": gen["alloc_retries"],
        **(
            {PREFIX + "generate_experts_per_visit": round(gen["experts_copied"] / gen["expert_visits"], 2)}
            if gen["expert_visits"]
            else {}
        ),
    }


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


def _trainer_device(training_args) -> Optional[torch.device]:
    device = getattr(training_args, "device", None) if training_args is not None else None
    return device if isinstance(device, torch.device) else None


def _auto_stream(model, training_args) -> None:
    """Auto-streaming at Trainer.__init__: stream the model, or move a model streamed at
    load time to the Trainer's device (the launcher did not know it then)."""
    if not launch.active() or not isinstance(model, nn.Module):
        return
    device = _trainer_device(training_args)
    if not is_streamed(model):
        stream_model(model, launch.config_for(device))
        return
    runtime = get_runtime(model)
    if device is not None and not launch.explicit_device() and device != runtime.device:
        if device.type == "cpu" or device.type == "cuda":
            logger.warning(
                "layerstream: the Trainer trains on %s; the model streamed to %s at load time moves there.",
                device,
                runtime.device,
            )
            runtime.move_to(device)
            if device.type == "cpu":
                model.to("cpu")


def _parameters(trainer, model: nn.Module) -> list:
    """``list(model.parameters())``, walked again only when the model changed or a parameter
    was registered anywhere since (``layer.registrations``): walking every module of a PEFT
    model costs milliseconds, which a short training step notices. Held weakly, so a deleted
    adapter's tensors are not kept alive; a change no registration sees (a module built
    earlier attached mid-run) is caught when a step runs out of memory (``_StepState.same``)."""
    registered = registrations()
    cached = trainer.__dict__.get("_layerstream_parameters")
    if cached is None or cached[0] is not model or cached[1] != registered:
        refs = [weakref.ref(p) for p in model.parameters()]
        cached = trainer._layerstream_parameters = (model, registered, refs)
    return [p for p in (ref() for ref in cached[2]) if p is not None]


class _StepState:
    """What a training step started from, to run it again after an out-of-memory error:
    the random state (dropout), and the gradients (none yet, or a host copy while the
    window is new). Without gradients to go back to, the step cannot be rerun."""

    def __init__(self, parameters: list, runtime):
        self.random = generation.RandomState(runtime)
        self.params = [p for p in parameters if p.requires_grad]
        grads = [p.grad for p in self.params]
        self.none = all(g is None for g in grads)
        self.saved = None
        if not self.none and runtime.resident_window.is_new():
            self.saved = [None if g is None else g.detach().to("cpu", copy=True) for g in grads]

    @property
    def restorable(self) -> bool:
        return self.none or self.saved is not None

    def same(self, model: nn.Module) -> bool:
        """Whether the model's trainable parameters are the ones this state holds (else the
        step cannot be put back as it started)."""
        return [id(p) for p in model.parameters() if p.requires_grad] == [id(p) for p in self.params]

    def restore(self, device) -> None:
        self.random.restore()
        for param, saved in zip(self.params, self.saved or [None] * len(self.params)):
            param.grad = None if saved is None else saved.to(param.device)


def _training_step_with_retry(original, trainer, model, args, kwargs):
    if not trainer.__dict__.get("_layerstream_loss_checked"):
        trainer._layerstream_loss_checked = True
        warn_fused_loss(trainer)
    runtime = get_runtime(trainer.model) if trainer.model is not None and is_streamed(trainer.model) else None
    if runtime is None:
        return original(trainer, model, *args, **kwargs)
    window = runtime.resident_window
    # where the window is sized (a budget), the step's start may grow it or bring the ends
    # back: what the step started from is kept, so that it can run again with less
    state = _StepState(_parameters(trainer, trainer.model), runtime) if window.meter is not None else None
    while True:
        wanted = None
        try:
            return original(trainer, model, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if state is None or not state.restorable or not window.can_give_back() or not state.same(trainer.model):
                raise runtime.explain_oom(exc, "in a training step") from exc
            wanted = wanted_bytes(exc) or 0
        # outside the except block: the failed step's frames and tensors are gone
        if not window.recover_from_oom(wanted):
            raise StreamingError(
                "layerstream: a training step ran out of memory and the resident window "
                "cannot shrink further; see the advice above"
            )
        logger.warning(
            "layerstream: a training step ran out of memory; the resident window now holds %d "
            "layers and the step runs again from where it started.",
            len(runtime.window),
            main_process_only=False,
        )
        state.restore(runtime.device)


def check_activation_offloading(runtime, training_args) -> None:
    """Other ways of offloading activations meet streamed layers, which checkpoint themselves:
    transformers' ``offload`` checkpointing option never reaches them, so it is refused; TRL's
    ``activation_offloading`` already moves their checkpointed inputs, so it is refused beside
    ``offload_activations=True`` and keeps ``"auto"`` off."""
    if training_args is None:
        return
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        options = getattr(training_args, name, None)
        if isinstance(options, dict) and options.get("offload"):
            raise StreamingError(
                f"{name}={{'offload': True}} does not reach streamed layers: layerstream checkpoints them "
                "itself, so transformers' offloading wrapper never runs for them. Remove 'offload' and use "
                "layerstream's offload_activations=True (StreamConfig, layerstream run --offload-activations, "
                "--layer_stream_offload_activations true, stream.offload_activations: true)."
            )
    if not getattr(training_args, "activation_offloading", False) or runtime.offload_policy.offloader is None:
        return
    if runtime.config.offload_activations is True:
        raise StreamingError(
            "TRL's activation_offloading and layerstream's offload_activations would both move the streamed "
            "layers' checkpointed inputs to host memory. Use one: offload_activations=True (copies on "
            "layerstream's copy stream with a lookahead in backward, host memory in one arena, checked "
            "before the first step) with activation_offloading=False, or activation_offloading=True alone."
        )
    logger.warning(
        "layerstream: offload_activations='auto' stays off: TRL's activation_offloading already moves the "
        "streamed layers' checkpointed inputs to host memory"
    )
    runtime.set_offload_activations(False)


def check_generation_backend(training_args, runtime=None) -> None:
    """TRL's online trainers (GRPO, RLOO, ...) can generate with vLLM (``use_vllm=True``),
    which loads its own copy of every weight onto a GPU and does not stream: a model that
    needs streaming does not fit it, and its weights would not be the streamed ones.
    Refused in the Trainer's ``__init__``, before vLLM starts or a step runs.

    With ``use_transformers_continuous_batching=True`` and ``bf16``/``fp16``, TRL casts the
    whole model to that dtype before each generation (``model.to(torch.bfloat16)``), which
    streamed weights of another dtype refuse: said here, before the first step generates,
    rather than at that cast."""
    _check_continuous_batching_cast(training_args, runtime)
    if getattr(training_args, "use_vllm", False):
        raise StreamingError(
            "use_vllm=True generates with vLLM, which loads its own full copy of the model's weights onto "
            "a GPU and does not stream layers, so a model that needs layerstream does not fit it. Set "
            "use_vllm=False (--use_vllm false): generation then runs through transformers' generate on the "
            "streamed model, each layer copied once per token step for the whole batch."
        )


def _check_continuous_batching_cast(training_args, runtime) -> None:
    if runtime is None or not getattr(training_args, "use_transformers_continuous_batching", False):
        return
    flag = (
        "bf16" if getattr(training_args, "bf16", False) else "fp16" if getattr(training_args, "fp16", False) else None
    )
    if flag is None:
        return
    dtype = torch.bfloat16 if flag == "bf16" else torch.float16
    name = str(dtype).split(".")[-1]
    try:
        runtime.check_apply(lambda t: t.to(dtype) if t.is_floating_point() else t)  # as Module.to casts
    except StreamingError as exc:
        raise StreamingError(
            f"use_transformers_continuous_batching=True with {flag}=True: TRL casts the whole model to {dtype} "
            "before each continuous-batching generate, and streamed weights keep the dtype they were loaded "
            f"in, so the first step would stop at that cast. Load the model in {dtype} (--dtype {name}, or "
            f"model_init_kwargs={{'dtype': '{name}'}}), or set {flag}=False, or "
            "use_transformers_continuous_batching=False (generation then runs through transformers' generate "
            "on the streamed model)."
        ) from exc


def warn_fused_loss(trainer) -> None:
    """TRL's trainers give their models a fused log-prob head (``trl_head``) after
    ``Trainer.__init__``, and its loss is the one that runs: a loss_chunk_tokens the user set
    is said to be bypassed, once, at the first training step. Left at "auto" (0 here) there is
    nothing to say: the plan counts TRL's loss and never turns the chunked loss on beside it."""
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        tokens = chunked_loss.chunk_tokens(model) if isinstance(model, nn.Module) else None
        if tokens and (trl_head.installed(model) or trl_head.metrics_only(model)):
            trl_head.warn_bypassed(model, tokens)


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
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _auto_stream(model, training_args)
        if isinstance(model, nn.Module) and is_streamed(model):
            check_generation_backend(training_args, get_runtime(model))
            check_activation_offloading(get_runtime(model), training_args)
        original_init(self, *args, **kwargs)
        trl_head.note_trainer(self)  # TRL's SFT with label smoothing: full logits, not its fused head
        if self.model is not None and self.args.use_liger_kernel and chunked_loss.applied(self.model):
            chunked_loss.warn_liger()  # Liger bound its fused forward to the model: it computes the loss
        if self.model is not None and is_streamed(self.model) and self.args.n_gpu > 1:
            raise StreamingError(
                f"this process sees {self.args.n_gpu} GPUs, so the Trainer would wrap the streamed model "
                "in nn.DataParallel, which copies it to every GPU on each step; streamed layers stay "
                f"on {get_runtime(self.model).device}. Launch one process per GPU "
                "(accelerate launch --num_processes N, or torchrun), or make one GPU visible "
                "with CUDA_VISIBLE_DEVICES."
            )
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
    def training_step(self, model, *args, **kwargs):
        return _training_step_with_retry(original_training_step, self, model, args, kwargs)

    Trainer.__init__ = __init__
    Trainer.log = log
    Trainer.training_step = training_step
    _installed = True


on_stream(lambda model: install())
launch.on_enable(install)

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
            # before the first pass no offloader is running: plan with what the step will run
            offload = bool(runtime.long_settings.settings_for(batch * int(seq))["offload_activations"])
            peak = runtime.memory_plan(batch, int(seq), offload=offload).peak_vram_bytes
            line = f"  predicted    peak VRAM {gib(peak)} at batch {batch} x {seq} tokens, every layer streamed"
            return line + _auto_long_text(runtime.long_settings.decision(batch * int(seq)))
        short, long = (runtime.memory_plan(batch, n).peak_vram_bytes for n in (512, 2048))
        return (
            f"  predicted    peak VRAM {gib(short)} at batch {batch} x 512 tokens, "
            f"{gib(long)} at x 2048, every layer streamed"
        )
    except ValueError as exc:
        return f"  predicted    peak VRAM not planned ({exc}); see `layerstream plan`"


def _auto_long_text(decision) -> str:
    """What "auto" turns on at the predicted length, and why (nothing when none)."""
    if not decision.on:
        return ""
    turned = ", ".join(setting_text(name, value) for name, value in decision.on)
    return (
        f", with {turned} (auto: the plan needs {gib(decision.needed_without)} without them, "
        f"over the {gib(decision.limit)} kept under)"
    )


class StreamStatsCallback(_CallbackBase):
    """Prints what streams at train start; records one step's residency timeline and
    writes it (trace JSON, and a PNG plot with matplotlib) to ``output_dir`` at train end.

    The recorded step is the fifth optimizer step, or the last one of a shorter run: the
    first steps also fill cold slots, size the resident window and pay one-time kernel
    and allocator warm-up.
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
        if runtime.long_settings.autocast is None:  # the Trainer's steps run under autocast with bf16/fp16
            runtime.long_settings.autocast = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
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
            written = timeline.write(spans, runtime.slot_rows, args.output_dir, timeline.title(runtime))
            logger.warning(
                "layerstream: residency timeline of step %d written to %s",
                self._recorded_step(state) + 1,
                ", ".join(written),
            )

    def _recorded_step(self, state) -> int:
        return max(0, min(self.RECORDED_STEP, state.max_steps - 1))


# -- StreamingArguments: HfArgumentParser fields derived from the StreamConfig fields ------
def argument_name(setting_name: str) -> str:
    """--layer_stream_<setting>; stream_embeddings reads --layer_stream_embeddings."""
    return "layer_stream_" + (setting_name[len("stream_") :] if setting_name.startswith("stream_") else setting_name)


_ARGUMENT_TYPES = {
    COUNT: str,
    SIZE: str,
    BUDGET: str,
    DEVICE: Optional[str],
    DIRECTORIES: Optional[str],
    TRISTATE: Optional[bool],
    TOKENS: Optional[str],
    SWITCH: str,
}


def _streaming_arguments_class():
    fields = [
        (
            "layer_stream",
            bool,
            dataclasses.field(
                default=False,
                metadata={
                    "help": "stream the decoder layers of every model the script loads or trains, from host memory"
                },
            ),
        )
    ]
    for setting in settings():
        metadata = {"help": argparse_help(setting)}
        if setting.metadata["kind"] == SWITCH:  # the flag alone: true, as on `layerstream run`
            metadata.update(nargs="?", const="true")
        fields.append(
            (
                argument_name(setting.name),
                _ARGUMENT_TYPES[setting.metadata["kind"]],
                dataclasses.field(default=setting_default_text(setting), metadata=metadata),
            )
        )

    def __post_init__(self):
        values = self.settings()  # a bad value is refused here, with or without --layer_stream
        if self.layer_stream:
            launch.enable(values)
            return
        given = [
            "--" + argument_name(s.name)
            for s in settings()
            if getattr(self, argument_name(s.name)) != setting_default_text(s)
        ]
        if given:  # settings for a streaming that is off: said, not ignored without a word
            logger.warning(
                "layerstream: %s given without --layer_stream: nothing streams unless the script passes them "
                "on itself (StreamingArguments.to_config()); add --layer_stream to stream every model.",
                ", ".join(given),
            )

    def settings_(self) -> dict:
        """The launcher settings these flags give (StreamConfig field -> parsed value)."""
        from ..config import parse_setting

        return {
            s.name: parse_setting(s.name, getattr(self, argument_name(s.name)), "--" + argument_name(s.name))
            for s in settings()
        }

    def to_config(self):
        values = self.settings()
        if values.get("device") is None:
            values["device"] = launch.default_device()
        return config_from_settings({}, **values)

    namespace = {
        "__post_init__": __post_init__,
        "settings": settings_,
        "to_config": to_config,
        "__doc__": "HfArgumentParser flags: ``--layer_stream`` streams every model the script loads "
        "or trains; ``--layer_stream_<setting>`` for each StreamConfig setting.",
    }
    cls = dataclasses.make_dataclass("StreamingArguments", fields, namespace=namespace)
    cls.__module__ = "layerstream"
    return cls


StreamingArguments = _streaming_arguments_class()
