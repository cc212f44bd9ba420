"""offload_activations: each streamed layer's checkpointed input lives in host memory
between its forward and its recompute.

Non-reentrant checkpointing saves a layer's inputs once, outside the region it
recomputes (``_NoopSaveInputs``); everything inside the region is recomputed. Around
each layer's checkpoint call the runtime installs ``saved_tensors_hooks`` whose pack
hook takes only that layer's hidden-state input: it is copied device-to-host on a copy
stream of its own (after the compute stream produced it; the allocator keeps the
device memory until the copy is done, ``record_stream``) and autograd keeps the host
handle instead of the tensor. In backward, the unpack hook of layer i makes the compute
stream wait for layer i's copy back and issues the copies of the next
``OFFLOAD_LOOKAHEAD`` layers in backward order, so they overlap layer i's recompute and
backward, as the weight copies do. A copy back lands in memory allocated on the compute
stream, which waits for the copy before any use; so when the copy is freed its block
returns to the compute stream at once (a ``record_stream`` on the copy stream would keep
it until that stream passes the next copy, one more input on the device at the peak).
A copy back that is dropped unused makes the stream it was allocated on wait for it
first. The last ``OFFLOAD_KEPT_LAYERS`` layers' inputs stay
on the device: their backward comes right after the loss.

Host side: the bytes go into one large arena (page-locked with ``cudaHostRegister`` on
CUDA, like the weight store) carved at aligned offsets, sized for the pass before its
first layer runs and checked against the host's memory then. Regions are reused once no
handle of the previous pass is alive (autograd frees handles with the graph); a second
pass before a backward gets an arena of its own. A copy is a copy of bits, so results
are those of the run without offloading. In debug mode (``StreamConfig.checksum``)
every input is checksummed when it leaves the device and again when it is back.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import List, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..config import OFFLOAD_KEPT_LAYERS, OFFLOAD_LOOKAHEAD, offloaded_layers
from ..errors import ActivationChecksumError, HostMemoryError, PinError
from ..system import cudart, memory_limits
from ..system.log import get_logger
from ..tiers.checksum import checksum
from ..tiers.store import host_memory
from ..units import ALIGN, GiB, MiB, aligned

logger = get_logger(__name__)


class _Arena:
    """One host buffer carved at aligned offsets; page-locked when asked and possible."""

    def __init__(self, nbytes: int, pin: bool):
        self.buffer = torch.empty(max(nbytes, ALIGN), dtype=torch.uint8)
        self.used = 0
        self.pinned = False
        self._finalizer = None
        if pin:
            try:
                cudart.register_host(self.buffer)
            except PinError as exc:
                logger.warning(
                    "layerstream: could not page-lock %.2f GiB of host memory for offloaded activations (%s); "
                    "their copies run from pageable memory: slower, and they do not overlap compute. Raise "
                    "the locked-memory limit (ulimit -l) or free host RAM.",
                    nbytes / GiB,
                    exc,
                    main_process_only=False,
                )
            else:
                self.pinned = True
                self._finalizer = weakref.finalize(self, cudart.unregister_host, self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        if self.used + nbytes > self.nbytes:
            return None
        region = self.buffer[self.used : self.used + nbytes]
        self.used += aligned(nbytes)
        return region

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


class _Saved:
    """What autograd keeps for an offloaded input: the host copy and how to bring it back."""

    __slots__ = (
        "owner",
        "position",
        "host",
        "shape",
        "dtype",
        "sum",
        "device_copy",
        "ready",
        "home",
        "used",
        "gone",
        "__weakref__",
    )

    def __init__(self, owner, position, host, shape, dtype, sum_):
        self.owner, self.position, self.host = owner, position, host
        self.shape, self.dtype, self.sum = shape, dtype, sum_
        self.device_copy: Optional[torch.Tensor] = None
        self.ready = None  # the copy stream's event after the copy back
        self.home = None  # the stream the copy back's memory was allocated on
        self.used = False  # unpacked by a backward once
        self.gone = False  # being finalised: a weak reference may still reach it, never fetch again

    def __del__(self):
        self.gone = True
        if self.ready is not None:  # a copy back never unpacked (its home is set with it):
            try:
                self.home.wait_event(self.ready)  # its memory is reused there only after the copy
            except RuntimeError:  # CUDA already torn down at interpreter exit: nothing reuses it
                pass
        self.owner._live -= 1


class ActivationOffloader:
    """The host arena, the copy stream and the hooks of one streamed model."""

    def __init__(self, device: torch.device, num_layers: int, pin: bool, verify: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.num_layers = num_layers
        self.pin = pin and self.cuda
        self.verify = verify
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.arenas: List[_Arena] = []
        self._stack: List[weakref.ref] = []  # handles in pack order (forward order)
        self._live = 0  # handles autograd still holds
        self.offloaded = 0  # counters
        self.restored = 0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.checks = 0
        self._target: Optional[torch.Tensor] = None  # the input the hooks offload now
        self._hooks = saved_tensors_hooks(self._pack_hook, self._unpack)

    # -- sizing ------------------------------------------------------------------------
    @staticmethod
    def pass_bytes(num_layers: int, hidden: torch.Tensor) -> int:
        """Host bytes one training pass with inputs shaped like ``hidden`` needs."""
        return offloaded_layers(num_layers) * aligned(hidden.numel() * hidden.element_size())

    def idle(self) -> bool:
        """No pass's inputs are held: the arenas can be released."""
        return self._live == 0

    def start_pass(self, hidden: torch.Tensor, store_bytes: int, ends_bytes: int = 0) -> None:
        """Before layer 0 of a training pass: make room for its inputs, or refuse
        (``store_bytes``, ``ends_bytes``: the layer store's and the ends' store's host
        bytes, page-locked beside the arena)."""
        need = self.pass_bytes(self.num_layers, hidden)
        if self._live == 0:
            self._stack = []
            for arena in self.arenas:
                arena.used = 0
            if self.arenas and self.arenas[0].nbytes >= need:
                return
            self.release()  # too small for this shape: one arena of the new size
        elif sum(a.nbytes - a.used for a in self.arenas) >= need:
            return
        self._check_host_memory(need, hidden, store_bytes, ends_bytes)
        self.arenas.append(_Arena(need, self.pin))

    def _check_host_memory(self, need: int, hidden: torch.Tensor, store_bytes: int, ends_bytes: int) -> None:
        memory = host_memory()
        if memory is None:
            return
        available, total = memory
        shape = "x".join(str(n) for n in hidden.shape)
        what = (
            f"offload_activations needs {need / GiB:.2f} GiB of host memory for the checkpointed inputs of "
            f"{offloaded_layers(self.num_layers)} layers ({shape} {str(hidden.dtype).removeprefix('torch.')} each)"
        )
        fixes = (
            "Shorten the sequences or the batch, free host memory, or set offload_activations=False "
            "(--offload-activations false, stream.offload_activations: false) to keep them on the GPU"
        )
        if need > available:
            room = store_bytes - (need - available)  # what the layer store could keep of host RAM
            if room > 0:  # reading the other layers from disk each time would make room
                fixes += (
                    f", or load with layerstream.from_pretrained(..., host_budget='{room // MiB}MiB') or less "
                    "(--host-budget): the layers beyond it are then read from disk at each visit"
                )
            raise HostMemoryError(f"{what}, but only {available / GiB:.2f} GiB is available. {fixes}.")
        lockable = memory_limits.lockable_bytes(total)
        pinned = need + store_bytes + ends_bytes + sum(a.nbytes for a in self.arenas if a.pinned)
        if self.pin and pinned > lockable:
            raise HostMemoryError(
                f"{what}; with the layer store that would page-lock {pinned / GiB:.2f} GiB of this host's "
                f"{total / GiB:.2f} GiB, leaving less than {(total - lockable) / GiB:.2f} GiB unlocked. {fixes}, or pass "
                "pin=False (pageable copies, slower)."
            )

    def release(self) -> None:
        for arena in self.arenas:
            arena.release()
        self.arenas = []

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for a in self.arenas)

    # -- the hooks ---------------------------------------------------------------------
    def offloads(self, index: int) -> bool:
        """Whether layer ``index``'s input goes to the host (the last ones stay)."""
        return index < self.num_layers - OFFLOAD_KEPT_LAYERS

    @contextlib.contextmanager
    def saving(self, hidden: torch.Tensor):
        """Around one layer's checkpoint call: ``hidden`` goes to the host. The target is
        dropped when the call returns: autograd keeps the hooks with what they saved, and
        a hook that held the tensor would keep its device memory alive."""
        self._target = hidden
        try:
            with self._hooks:
                yield
        finally:
            self._target = None

    def _pack_hook(self, tensor):
        if tensor is not self._target or not tensor.is_contiguous():
            return tensor
        return self._pack(tensor)

    def _region(self, nbytes: int) -> torch.Tensor:
        for arena in self.arenas:
            region = arena.take(nbytes)
            if region is not None:
                return region
        # a pass larger than the one it was sized for (start_pass was not called): grow
        arena = _Arena(max(nbytes, self.host_bytes), self.pin)
        self.arenas.append(arena)
        return arena.take(nbytes)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        nbytes = tensor.numel() * tensor.element_size()
        host = self._region(nbytes).view(tensor.dtype).view(tensor.shape)
        sum_ = checksum(tensor.detach().reshape(-1).view(torch.uint8)) if self.verify else None
        if self.cuda:
            stream = self.stream
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is written
            with torch.cuda.stream(stream):
                host.copy_(tensor.detach(), non_blocking=True)
            tensor.record_stream(stream)  # its memory is reused only after the copy
        else:
            host.copy_(tensor.detach())
        saved = _Saved(self, len(self._stack), host, tensor.shape, tensor.dtype, sum_)
        self._live += 1
        self._stack.append(weakref.ref(saved))
        self.offloaded += 1
        self.d2h_bytes += nbytes
        return saved

    def _fetch(self, saved: _Saved) -> None:
        """Issue the copy back of one input (on CUDA, on the copy stream)."""
        if saved.device_copy is not None or saved.gone:  # a finalised handle is not waited for again
            return
        out = torch.empty(saved.shape, dtype=saved.dtype, device=self.device)
        if self.cuda:
            stream, home = self.stream, torch.cuda.current_stream(self.device)
            stream.wait_stream(home)  # the memory's last readers
            saved.home = home  # no record_stream: home waits for `ready` before the memory is used or reused
            with torch.cuda.stream(stream):
                out.copy_(saved.host, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
        else:
            out.copy_(saved.host)
        saved.device_copy = out
        self.h2d_bytes += out.numel() * out.element_size()

    def prefetch_newest(self) -> None:
        """Backward starts (the kept last layer recomputes): copy back the inputs the next
        layers in backward order need, so the first of them does not wait."""
        issued = 0
        for ref in reversed(self._stack):
            saved = ref()
            if saved is None or saved.used:
                continue
            self._fetch(saved)
            issued += 1
            if issued == OFFLOAD_LOOKAHEAD:
                return

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        self._fetch(saved)  # a demand copy when it was not issued ahead
        for ahead in range(saved.position - 1, max(saved.position - 1 - OFFLOAD_LOOKAHEAD, -1), -1):
            candidate = self._stack[ahead]() if ahead < len(self._stack) else None
            if candidate is not None:
                self._fetch(candidate)
        out, saved.device_copy, saved.used = saved.device_copy, None, True
        if saved.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.ready)
            if current != saved.home:  # used on another stream than its own: freed only after that use
                out.record_stream(current)
            saved.ready = None
        self.restored += 1
        if saved.sum is not None:
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            got = checksum(out.reshape(-1).view(torch.uint8))
            self.checks += 1
            if got != saved.sum:
                raise ActivationChecksumError(
                    f"layerstream debug checksum: the offloaded input of layer {saved.position} of this pass "
                    f"came back different (checksum {got}, it left the device as {saved.sum}). Its host copy "
                    "was overwritten, or a copy had not finished."
                )
        return out
