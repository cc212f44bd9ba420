"""One streamed model serves one pass at a time.

A streamed model's layers share one set of module tables, slots and prefetch schedule:
two threads computing with it at once would compute with each other's bound weights or
overwrite a slot a backward still reads, and give wrong numbers where a resident model
would not. So a forward from a thread while another thread's pass is under way is
refused with an error that says what to do. A pass is an inference forward (until its
last layer returns), or a training forward and its backward (until autograd has queued
the whole backward: ``queue_callback``); the backward's recompute runs on autograd's own
threads and is part of the pass. A pass is not traced by torch.compile or captured in a
CUDA graph (``refuse_capture``).

A pass stopped by an exception leaves nothing behind either (``checkpoint``): no
saved-tensor hooks of the checkpoint it was inside.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from ..errors import StreamingError


class Pass:
    """A forward pass under way (and, for training, its backward), and the thread it is for."""

    __slots__ = ("thread", "kind", "backward")

    def __init__(self, thread: int, kind: str):
        self.thread, self.kind, self.backward = thread, kind, False


def claim(current: Optional[Pass], index: int, kind: str) -> Optional[Pass]:
    """The pass under way after a forward visit of layer ``index`` from this thread;
    refused while another thread's pass is under way."""
    thread = threading.get_ident()
    if current is not None and current.thread != thread:
        raise StreamingError(
            f"this streamed model is in use by another thread (a {current.kind} pass is under "
            "way) and one streamed model serves one pass at a time. Use it from one thread, "
            "guard it with a lock (a training step holds it until its backward ends), or load "
            "a second model for the other thread."
        )
    if index == 0 or current is None:
        return Pass(thread, kind)
    return current


def refuse_capture(cuda: bool) -> None:
    """A pass cannot be traced or captured: a streamed layer's weights change place on every
    call, and a graph would freeze one slot assignment and its copies."""
    if torch.compiler.is_compiling():
        raise StreamingError(
            "torch.compile cannot trace a streamed layer: its weights change place on "
            "every call. Compile the model before stream_model is not supported either; "
            "run streamed layers eagerly (compile submodules that do not stream)."
        )
    if cuda and torch.cuda.is_current_stream_capturing():
        raise StreamingError(
            "CUDA graph capture of a streamed model is not supported: a graph would "
            "freeze one slot assignment and its copies. Capture only resident parts."
        )


def in_backward(runtime) -> None:
    """At a backward recompute: the training pass ends when autograd's whole backward has
    been queued (not when this layer's recompute returns: its backward follows)."""
    current = runtime._pass
    if current is None or current.kind != "train" or current.backward:
        return
    current.backward = True

    def ended():
        if runtime._pass is current:
            runtime._pass = None

    torch.autograd.Variable._execution_engine.queue_callback(ended)


def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
    preserve_rng_state=True, **kwargs)``, and when ``function`` raises, the checkpoint's
    saved-tensor hooks are popped at once.

    The recompute runs with the random state the forward found (the CPU's, and that of the
    devices of the tensors in ``args``: a layer's hidden states), so dropout draws the
    forward's masks; and it takes no numbers from the stream the step draws from, so a
    streamed run takes the random numbers a resident run takes, in the same order.

    Before torch 2.13 a non-reentrant checkpoint whose function raises leaves its generator
    suspended inside the hooks' ``with``: the hooks stay on autograd's process-wide stack
    until the traceback that holds the generator is freed (a caught exception kept alive by
    a retry loop, a logger or a test), and every forward in the process meanwhile saves its
    tensors into that dead checkpoint (a later model's backward: CheckpointError, metadata
    of shape [0] on the CPU). Closing the generator runs its ``with`` exits now.
    """
    try:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    except BaseException as exc:
        _close_checkpoints(exc.__traceback__)
        raise


def _close_checkpoints(trace) -> None:
    """Close the suspended generators of torch's checkpoint frames in ``trace``."""
    while trace is not None:
        frame = trace.tb_frame
        if frame.f_code.co_filename == torch_checkpoint.__file__ and frame.f_code.co_name == "checkpoint":
            for value in list(frame.f_locals.values()):
                if inspect.isgenerator(value) and value.gi_frame is not None:
                    value.close()
        trace = trace.tb_next


@contextlib.contextmanager
def outside_inference_mode():
    """Run the runtime's own bookkeeping outside ``torch.inference_mode`` (grad still off).

    The runtime keeps what it makes while a call runs (slot views bound to layers, the
    window's buffers, adapters moved to the device) for later calls: made under inference
    mode they would be inference tensors, which a later training step cannot save for
    backward, so one generation under inference mode would stop the model from training
    again. The layer's own computation still runs in the caller's inference mode (a KV
    cache made in inference mode is written in place, which only inference mode allows)."""
    if not torch.is_inference_mode_enabled():
        yield False
        return
    with torch.inference_mode(False), torch.no_grad():  # inference_mode(False) alone turns grad on
        yield True
