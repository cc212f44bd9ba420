"""One streamed model serves one pass at a time.

A streamed model's layers share one set of module tables, slots and prefetch schedule:
two threads computing with it at once would compute with each other's bound weights or
overwrite a slot a backward still reads, and give wrong numbers where a resident model
would not. So a forward from a thread while another thread's pass is under way is
refused with an error that says what to do. A pass is an inference forward (until its
last layer returns), or a training forward and its backward (until autograd has queued
the whole backward: ``queue_callback``); the backward's recompute runs on autograd's own
threads and is part of the pass.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from .errors import StreamingError


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
