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

The runtime bound is the one torch uses: a process can hold several (cupy's, a cu12 wheel
beside a cu13 one), and binding the wrong one would issue copies through another runtime
than torch's. Of the ``libcudart`` files mapped into the process, the one whose soname
major (``libcudart.so.13``) is torch's CUDA major (``torch.version.cuda``) is chosen, and
``cudaRuntimeGetVersion`` must agree. Where no file, or more than one, qualifies, nothing
is bound: torch's events and copies are used (a few microseconds more per layer visit), and
one warning says why.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import List, Optional, Sequence, Tuple

import torch

from .log import get_logger

logger = get_logger(__name__)

_H2D = 1  # cudaMemcpyHostToDevice
_NOT_READY = 600  # cudaErrorNotReady


class CudaRuntimeError(RuntimeError):
    """A direct CUDA runtime call failed (the message names the call and the error code)."""


def _maps() -> List[str]:
    try:
        with open("/proc/self/maps") as maps:
            return maps.readlines()
    except OSError:
        return []


_SONAME_MAJOR = re.compile(r"libcudart\.so\.(\d+)")


def cuda_major(version: Optional[str]) -> Optional[int]:
    """The major of a CUDA version as torch spells it ("13.0"), or None."""
    return int(version.split(".")[0]) if version and version.split(".")[0].isdigit() else None


def choose_runtime(maps: Sequence[str], torch_cuda: Optional[str]) -> Tuple[Optional[str], str]:
    """(path of the libcudart torch uses, "") from the lines of /proc/self/maps, or (None,
    why not) where no mapped file, or more than one, has torch's CUDA major in its soname;
    (None, "") where there is nothing to choose (no shared libcudart, a CPU build)."""
    paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    want = cuda_major(torch_cuda)
    if not paths or want is None:
        return None, ""
    majors = {path: _SONAME_MAJOR.search(os.path.basename(path)) for path in paths}
    same = [path for path, found in majors.items() if found and int(found.group(1)) == want]
    if len(same) == 1:
        return same[0], ""
    if not same:
        return None, f"no CUDA runtime mapped into this process is torch's CUDA {want} ({', '.join(paths)})"
    return None, f"several CUDA runtimes mapped into this process could be torch's CUDA {want} ({', '.join(same)})"


def _open(path: str) -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _runtime_version(lib) -> Optional[int]:
    """cudaRuntimeGetVersion of ``lib`` (13000 for 13.0), or None where it fails."""
    version = ctypes.c_int()
    try:
        code = lib.cudaRuntimeGetVersion(ctypes.byref(version))
    except AttributeError:
        return None
    return version.value if code == 0 else None


def _find_library() -> Optional[ctypes.CDLL]:
    """The libcudart torch uses, checked with cudaRuntimeGetVersion; None (one warning
    where there were runtimes but none could be told to be torch's)."""
    path, doubt = choose_runtime(_maps(), torch.version.cuda)
    if path is not None:
        lib = _open(path)
        version = _runtime_version(lib) if lib is not None else None
        if version is not None and version // 1000 == cuda_major(torch.version.cuda):
            return lib
        doubt = f"{path} reports CUDA runtime {version}, torch was built with CUDA {torch.version.cuda}"
    if doubt:
        logger.warning(
            "layerstream: copies and events go through torch's own calls, not the CUDA runtime directly "
            "(a few microseconds more per layer visit): %s.",
            doubt,
        )
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
    from ..errors import PinError

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
        logger.warning("layerstream: cudaHostUnregister failed with CUDA error %d", code, main_process_only=False)
