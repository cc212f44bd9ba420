"""Direct calls into the CUDA runtime this process already loaded, for the per-visit path.

Why: each torch CUDA call made from Python (``Event.record``, ``Stream.wait_event``,
``Tensor.copy_``, ``torch.cuda.set_stream``) costs several microseconds of host time in
argument parsing and dispatch, and a layer load needs about ten of them. The same work
is four runtime calls through ctypes at about a microsecond each. Streams and events
stay torch objects (created, owned and freed by torch); only their raw handles are
passed here, and they are valid for any runtime instance in the process because they
belong to the driver's primary context.

Where no shared ``libcudart`` is loaded (a statically linked build), ``runtime()``
returns None and callers use the torch calls instead.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .log import get_logger

_H2D = 1  # cudaMemcpyHostToDevice
_NOT_READY = 600  # cudaErrorNotReady


class CudaRuntimeError(RuntimeError):
    """A direct CUDA runtime call failed (the message names the call and the error code)."""


def _find_library() -> Optional[ctypes.CDLL]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class Runtime:
    """The handful of runtime calls the copy path needs, with argument types declared."""

    def __init__(self, lib: ctypes.CDLL):
        p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self.lib = lib
        self._record = self._bind("cudaEventRecord", p, p)
        self._wait = self._bind("cudaStreamWaitEvent", p, p, ctypes.c_uint)
        self._copy = self._bind("cudaMemcpyAsync", p, p, s, i, p)
        self._query = self._bind("cudaEventQuery", p)
        self._elapsed = self._bind("cudaEventElapsedTime", ctypes.POINTER(ctypes.c_float), p, p)
        self._last_error = self._bind("cudaGetLastError")

    def _bind(self, name: str, *argtypes):
        fn = getattr(self.lib, name)
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
        return fn

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code:
            raise CudaRuntimeError(f"{what} failed with CUDA error {code}")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cudaEventRecord")

    def wait(self, stream: int, event: int) -> None:
        self._check(self._wait(stream, event, 0), "cudaStreamWaitEvent")

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._copy(dst, src, nbytes, _H2D, stream), "cudaMemcpyAsync")

    def done(self, event: int) -> bool:
        code = self._query(event)
        if code == _NOT_READY:
            return False
        self._check(code, "cudaEventQuery")
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        out = ctypes.c_float()
        self._check(self._elapsed(ctypes.byref(out), start, end), "cudaEventElapsedTime")
        return out.value

    def clear_error(self) -> None:
        self._last_error()


_runtime: Optional[Runtime] = None
_looked = False


def runtime() -> Optional[Runtime]:
    """The loaded CUDA runtime, or None (no shared libcudart in this process)."""
    global _runtime, _looked
    if not _looked:
        _looked = True
        lib = _find_library()
        if lib is not None:
            try:
                _runtime = Runtime(lib)
            except AttributeError:
                _runtime = None
    return _runtime


def clear_error() -> None:
    """Reset the runtime's last error after a failed (non-sticky) runtime call.

    Left set, the error would surface at the next kernel launch check, far from its
    cause. torch does not expose cudaGetLastError; where the runtime is linked
    statically, let one kernel launch check consume it.
    """
    rt = runtime()
    if rt is not None:
        rt.clear_error()
        return
    try:
        torch.empty(1, device="cuda").fill_(0)
    except Exception:  # the launch check reported (and reset) the stale error
        pass


HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the pages are mapped read-only


def register_host(tensor: torch.Tensor, read_only: bool = False) -> None:
    """Page-lock a host tensor's memory in place (cudaHostRegister), so copies from it are
    asynchronous DMA; ``read_only`` for pages mapped without write access (a shared store).
    Raises PinError when the driver refuses (and clears its error)."""
    from .errors import PinError

    flags = HOST_REGISTER_READ_ONLY if read_only else 0
    code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), flags))
    if code != 0:
        clear_error()
        raise PinError(f"cudaHostRegister failed with CUDA error {code}")


def unregister_host(tensor: torch.Tensor) -> None:
    """Undo ``register_host`` (before the memory is freed: a later registration of the same
    pages would fail)."""
    code = int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
    if code != 0:
        clear_error()
        get_logger(__name__).warning(
            "layerstream: cudaHostUnregister failed with CUDA error %d", code, main_process_only=False
        )
