"""What generation streams, counted apart from training.

An online RL trainer (TRL's GRPO, RLOO) generates completions inside its training step, so
the runtime's counters mix the two: a token step of decoding copies every streamed layer for
a few tokens of compute, a training pass for thousands. ``generate`` on a streamed model
(transformers' ``GenerationMixin.generate``, wrapped once when the first model streams) adds
what it copied, stalled and took to a ``GenerationCounters`` of the runtime; the Trainer's
logs show those figures next to training's, and training's without them.

The same wrapper lets the resident window size itself around a call in a process that has
not trained yet (``ResidentWindow.before_generation``), from the tokens the call caches.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from ..api import get_runtime, is_streamed, on_stream
from ..errors import StreamingError
from ..modules.layer import CACHE_KWARGS
from ..runtime.meter import wanted_bytes
from ..runtime.passes import outside_inference_mode
from ..system.log import get_logger

logger = get_logger(__name__)

_ATTR = "_layerstream_generation"
_installed = False
COUNTED = (
    "layer_loads",
    "h2d_bytes",
    "h2d_seconds",
    "h2d_timed_bytes",
    "h2d_timed_seconds",
    "stall_seconds",
    "expert_visits",
    "experts_copied",
    "alloc_retries",
)


@dataclasses.dataclass
class GenerationCounters:
    """Totals over every ``generate`` call on one streamed model since it streamed."""

    calls: int = 0
    seconds: float = 0.0
    layer_loads: int = 0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    h2d_timed_bytes: int = 0  # the copies that were timed, and their time: the bandwidth
    h2d_timed_seconds: float = 0.0
    stall_seconds: float = 0.0
    expert_visits: int = 0  # calls of a mixture-of-experts layer's experts
    experts_copied: int = 0
    alloc_retries: int = 0  # the CUDA allocator's retries (freeing its cache to allocate)
    window_layers: int = 0  # the resident window when the last call ended
    active: bool = False  # inside a call (a nested generate counts once)

    def snapshot(self) -> dict:
        return {name: getattr(self, name) for name in ("calls", "seconds", *COUNTED)}


def counters(runtime) -> GenerationCounters:
    """The runtime's generation counters (zeros before its first ``generate``)."""
    found = runtime.__dict__.get(_ATTR)
    if found is None:
        found = GenerationCounters()
        runtime.__dict__[_ATTR] = found
    return found


def cached_tokens(model, args: tuple, kwargs: dict) -> int:
    """The tokens a ``generate`` call caches at most: batch x (prompt + new tokens), from
    its input ids and generation settings (0 where they do not say)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not hasattr(ids, "shape") or len(ids.shape) != 2:
        return 0
    batch, prompt = int(ids.shape[0]), int(ids.shape[1])
    settings = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens") or getattr(settings, "max_new_tokens", None)
    if new is None:
        longest = kwargs.get("max_length") or getattr(settings, "max_length", None) or prompt
        new = max(0, int(longest) - prompt)
    copies = kwargs.get("num_return_sequences") or getattr(settings, "num_return_sequences", None) or 1
    return batch * int(copies) * (prompt + int(new))


class RandomState:
    """The process's random state (the CPU's, and the streaming device's) where a call or a
    Trainer step began: put back to run it again after an out-of-memory error, so it draws
    the numbers a run that never failed draws."""

    def __init__(self, runtime):
        self.device = runtime.device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(runtime.device) if runtime.pool.cuda else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def _not_run_again(args: tuple, kwargs: dict) -> str:
    """Why a ``generate`` call that ran out of memory cannot simply run again ("" where it
    can): a streamer has printed the first tokens already, and a KV cache the caller passed
    in holds the tokens the failed attempt added (a second attempt would decode after them,
    and give other tokens than a call that never failed)."""
    from transformers.generation.streamers import BaseStreamer

    if kwargs.get("streamer") is not None or any(isinstance(arg, BaseStreamer) for arg in args):
        return "its streamer has printed the first tokens already"
    passed = [name for name in CACHE_KWARGS if kwargs.get(name) is not None]
    if passed:
        return (
            f"the {passed[0]} it was given holds the tokens the failed attempt added; run it again with a fresh cache"
        )
    return ""


def _run_again_after_oom(original, model, runtime, args: tuple, kwargs: dict):
    """``generate``; where it runs out of memory with a resident window, the window shrinks
    and the call runs again from the random state it began with, so its tokens are those
    of a call that never failed (as a Trainer step is run again). Not where a second
    attempt could not be the same call (``_not_run_again``): the error says why."""
    while True:
        start = RandomState(runtime)
        try:
            return original(model, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if not runtime.resident_window.can_give_back():
                raise runtime.explain_oom(exc, "in generate") from exc
            why = _not_run_again(args, kwargs)
            if why:
                explained = runtime.explain_oom(exc, "in generate")
                refused = type(explained)(
                    f"{explained}\n\nlayerstream: generate is not run again with a smaller window: {why}."
                )
                refused._layerstream_explained = True
                raise refused from exc
            wanted = wanted_bytes(exc) or 0
        # outside the except block: the failed call's frames and tensors are gone
        if not runtime.resident_window.recover_from_oom(wanted):
            raise StreamingError(
                "layerstream: generate ran out of memory and the resident window cannot shrink further"
            )
        logger.warning(
            "layerstream: generate ran out of memory; the resident window now holds %d layers and the call runs again.",
            len(runtime.window),
        )
        start.restore()


def _counted(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if not is_streamed(self):
            return original(self, *args, **kwargs)
        runtime = get_runtime(self)
        totals = counters(runtime)
        if totals.active:
            return original(self, *args, **kwargs)
        before, start = runtime.stats(), time.perf_counter()
        totals.active = True
        tokens = cached_tokens(self, args, kwargs)
        # inside a Trainer's recorded step (TRL's GRPO and RLOO generate in it), one span
        with runtime.summarised("generate"):
            if tokens:
                with outside_inference_mode():  # the window's buffers outlive this call
                    runtime.resident_window.before_generation(tokens)
            try:
                return _run_again_after_oom(original, self, runtime, args, kwargs)
            finally:
                with outside_inference_mode():
                    runtime.resident_window.after_generation()
                totals.active = False
                after = runtime.stats()
                totals.calls += 1
                totals.seconds += time.perf_counter() - start
                for name in COUNTED:
                    setattr(totals, name, getattr(totals, name) + after[name] - before[name])
                totals.window_layers = after["window_layers"]

    generate._layerstream = True
    return generate


def install() -> None:
    """Wrap transformers' ``generate`` once (idempotent)."""
    global _installed
    if _installed:
        return
    from transformers.generation.utils import GenerationMixin

    if not getattr(GenerationMixin.generate, "_layerstream", False):
        GenerationMixin.generate = _counted(GenerationMixin.generate)
    _installed = True


on_stream(lambda model: install())
