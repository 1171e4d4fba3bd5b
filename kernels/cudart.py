"""The CUDA runtime library of the process, through ctypes: the memcpy entry points of the DMA path
and the stream-event dependency of the forward's layer waits.

Primitives:

- ``cuda_runtime() -> CudaRuntime`` — the ``libcudart`` torch loaded (found once per process);
  raises :class:`TransferError` when none can be loaded.
- ``CudaRuntime`` — ``memcpy_async``, ``memcpy_2d_async``, ``memcpy_rows``, ``memcpy_batch_async``,
  ``stream_wait_event``, ``event_elapsed_ms`` (each checks its return code and raises
  :class:`TransferError` naming the CUDA error), ``runtime_version``, ``driver_version``,
  ``has_batch``, ``describe()``.
- ``CudaEvent(rt, device=None)`` — an event on raw handles (``cuda_event``, ``record(stream)``,
  ``query()``, ``synchronize()``, ``elapsed_time(end)``): what a load records after each step —
  one runtime call when a handle of that device is free (reused once its object is gone),
  without the binding layers of a ``torch.cuda.Event`` made and recorded there.
- ``elapsed_ms(start, end)`` — milliseconds between two recorded events of either kind.
- ``cudart_candidates()`` — where the library is looked for, in order.

Which library. The library torch already loaded is the one to use: its per-thread state (current
device, last error) is the state torch reads. It is found in ``/proc/self/maps``; failing that in
the ``nvidia`` wheel folders (``nvidia/cu13/lib``, ``nvidia/cuda_runtime/lib``), through
``ctypes.util.find_library`` and by soname (``libcudart.so.13``, ``.12``).

``cudaMemcpyBatchAsync`` (runtime ≥ 12.8) copies many buffers of any sizes in one call. Its
prototype changed with CUDA 13.0, which dropped the ``failIdx`` out-parameter::

    12.8, 12.9: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, size_t *failIdx, stream)
    13.x:       (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)

so the binding is chosen by the runtime's own version. ``cudaMemcpyAttributes`` is
``{int srcAccessOrder; {int type; int id} srcLocHint, dstLocHint; unsigned flags}`` (24 bytes) in
both. The batch API rejects the legacy default stream; ``kernels.dma_engines`` routes such copies
through a side stream.

A failed runtime call also sets the runtime's sticky-until-read "last error", which torch checks
after its own kernel launches: every failure here is read back (``cudaGetLastError``) before
raising, so it cannot surface later as an unrelated torch error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from collections.abc import Iterable
from typing import Any, ClassVar

from asynccache.errors import TransferError

__all__ = [
    "BATCH_MIN_VERSION",
    "MEMCPY_DEFAULT",
    "CudaEvent",
    "CudaRuntime",
    "cuda_runtime",
    "cudart_candidates",
    "elapsed_ms",
]

#: ``cudaMemcpyDefault``: the direction is inferred from the pointers (unified addressing).
MEMCPY_DEFAULT = 4
#: First runtime version with ``cudaMemcpyBatchAsync``.
BATCH_MIN_VERSION = 12080
#: ``cudaMemcpySrcAccessOrderStream``: the source is read in stream order.
SRC_ACCESS_ORDER_STREAM = 1
#: ``cudaMemcpyFlagPreferOverlapWithCompute``: ask the driver to keep the copy off the SMs' way.
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
#: ``cudaEventBlockingSync``: a thread synchronising on the event sleeps instead of spinning.
EVENT_BLOCKING_SYNC = 1
#: ``cudaErrorNotReady``: what ``cudaEventQuery`` returns while the recorded work runs.
ERROR_NOT_READY = 600


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


assert ctypes.sizeof(_MemcpyAttributes) == 24


def cudart_candidates() -> list[str]:
    """Paths or sonames to try, best first (the copy already mapped into this process first)."""
    out: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libcudart.so") and path not in out:
                    out.append(path)
    except OSError:
        pass
    try:
        import nvidia  # the CUDA wheels torch depends on

        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_runtime", "cu12"):
                out.extend(sorted(glob.glob(os.path.join(root, sub, "lib", "libcudart.so*")), reverse=True))
    except ImportError:
        pass
    found = ctypes.util.find_library("cudart")
    if found:
        out.append(found)
    out.extend(["libcudart.so.13", "libcudart.so.12", "libcudart.so"])
    return list(dict.fromkeys(out))


def _bind(lib: ctypes.CDLL, name: str, *argtypes: Any) -> Any:
    """``lib.name`` typed as a runtime call: the given argument types, a ``cudaError_t`` result."""
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return fn


class CudaRuntime:
    """A loaded ``libcudart`` with the few functions the DMA path calls, typed and checked.

    Thread-safe as the runtime is; pointers and streams are plain ints (``data_ptr()``,
    ``torch.cuda.Stream.cuda_stream``).
    """

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        self._error_name = lib.cudaGetErrorName
        self._error_name.restype = ctypes.c_char_p
        self._error_name.argtypes = [ctypes.c_int]
        self._error_string = lib.cudaGetErrorString
        self._error_string.restype = ctypes.c_char_p
        self._error_string.argtypes = [ctypes.c_int]
        self._last_error = lib.cudaGetLastError
        self._last_error.restype = ctypes.c_int
        self.runtime_version = self._version(lib.cudaRuntimeGetVersion, "cudaRuntimeGetVersion")
        self.driver_version = self._version(lib.cudaDriverGetVersion, "cudaDriverGetVersion")

        ptr, size, handle = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
        self._memcpy = _bind(lib, "cudaMemcpyAsync", ptr, ptr, size, ctypes.c_int, handle)
        self._memcpy_2d = _bind(lib, "cudaMemcpy2DAsync", ptr, size, ptr, size, size, size, ctypes.c_int, handle)
        self._wait_event = _bind(lib, "cudaStreamWaitEvent", handle, handle, ctypes.c_uint)
        self._event_create = _bind(lib, "cudaEventCreateWithFlags", ctypes.POINTER(handle), ctypes.c_uint)
        self._event_record = _bind(lib, "cudaEventRecord", handle, handle)
        self._event_query = _bind(lib, "cudaEventQuery", handle)
        self._event_sync = _bind(lib, "cudaEventSynchronize", handle)
        self._event_elapsed = _bind(lib, "cudaEventElapsedTime", ctypes.POINTER(ctypes.c_float), handle, handle)
        self._event_destroy = _bind(lib, "cudaEventDestroy", handle)

        self._batch: Any = None
        self.batch_signature: str | None = None
        if self.runtime_version >= BATCH_MIN_VERSION and hasattr(lib, "cudaMemcpyBatchAsync"):
            batch = lib.cudaMemcpyBatchAsync
            batch.restype = ctypes.c_int
            head = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]  # fmt: skip
            if self.runtime_version >= 13000:
                batch.argtypes = [*head, ctypes.c_void_p]
                self.batch_signature = "13"
            else:
                batch.argtypes = [*head, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
                self.batch_signature = "12.8"
            self._batch = batch

    @property
    def has_batch(self) -> bool:
        """True when the library exports ``cudaMemcpyBatchAsync`` with a known prototype."""
        return self._batch is not None

    def _version(self, fn: Any, what: str) -> int:
        value = ctypes.c_int(0)
        fn.restype = ctypes.c_int
        self.check(fn(ctypes.byref(value)), what)
        return value.value

    def error_name(self, code: int) -> str:
        name = self._error_name(code)
        return name.decode() if name else f"cudaError {code}"

    def check(self, code: int, what: str) -> None:
        """Raise :class:`TransferError` naming the CUDA error unless ``code`` is ``cudaSuccess``."""
        if code == 0:
            return
        self._last_error()  # clear it: torch must not pick it up after its next launch
        text = self._error_string(code)
        detail = text.decode() if text else ""
        raise TransferError(f"{what} failed: {self.error_name(code)} ({detail})")

    def memcpy_async(self, dst: int, src: int, num_bytes: int, stream: int) -> None:
        """``cudaMemcpyAsync(dst, src, num_bytes, cudaMemcpyDefault, stream)``."""
        self.check(self._memcpy(dst, src, num_bytes, MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def memcpy_2d_async(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int
    ) -> None:
        """``height`` rows of ``width`` bytes, rows ``src_pitch`` / ``dst_pitch`` bytes apart."""
        code = self._memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, MEMCPY_DEFAULT, stream)
        self.check(code, "cudaMemcpy2DAsync")

    def memcpy_rows(
        self, rows: Iterable[tuple[int, int, int, int, int, int]], src_base: int, dst_base: int, stream: int
    ) -> None:
        """One ``cudaMemcpy2DAsync`` per row ``(src_offset, dst_offset, width, height, src_pitch,
        dst_pitch)`` from the two base addresses, a plain ``cudaMemcpyAsync`` for a row of height
        one: the loop of a planned copy, with nothing but the runtime calls in it."""
        memcpy, memcpy_2d = self._memcpy, self._memcpy_2d
        for so, do, w, h, sp, dp in rows:
            if h == 1:
                code = memcpy(dst_base + do, src_base + so, w, MEMCPY_DEFAULT, stream)
            else:
                code = memcpy_2d(dst_base + do, dp, src_base + so, sp, w, h, MEMCPY_DEFAULT, stream)
            if code:
                self.check(code, "cudaMemcpyAsync" if h == 1 else "cudaMemcpy2DAsync")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """``cudaStreamWaitEvent(stream, event, 0)``: work queued on ``stream`` later waits for
        the event's recorded work (``torch.cuda.Event.cuda_event``)."""
        self.check(self._wait_event(stream, event, 0), "cudaStreamWaitEvent")

    def event_elapsed_ms(self, start: int, end: int) -> float:
        """``cudaEventElapsedTime`` between two recorded events' handles, in milliseconds."""
        ms = ctypes.c_float(0.0)
        self.check(self._event_elapsed(ctypes.byref(ms), start, end), "cudaEventElapsedTime")
        return float(ms.value)

    def memcpy_batch_async(
        self, dsts: int, srcs: int, sizes: int, count: int, stream: int, *, prefer_overlap: bool = True
    ) -> None:
        """One ``cudaMemcpyBatchAsync`` of ``count`` copies, all in stream order.

        ``dsts``, ``srcs`` and ``sizes`` are addresses of host arrays of ``count`` 64-bit values
        (read during the call only). ``prefer_overlap`` sets
        ``cudaMemcpyFlagPreferOverlapWithCompute``. ``stream`` must not be the legacy default
        stream.
        """
        if self._batch is None:
            raise TransferError(f"cudaMemcpyBatchAsync is not available in {self.path} ({self.runtime_version})")
        attrs = _MemcpyAttributes()
        attrs.srcAccessOrder = SRC_ACCESS_ORDER_STREAM
        attrs.flags = FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap else 0
        first = ctypes.c_size_t(0)
        if self.batch_signature == "13":
            code = self._batch(dsts, srcs, sizes, count, ctypes.byref(attrs), ctypes.byref(first), 1, stream)
            self.check(code, "cudaMemcpyBatchAsync")
        else:
            fail = ctypes.c_size_t(0)
            code = self._batch(
                dsts, srcs, sizes, count, ctypes.byref(attrs), ctypes.byref(first), 1, ctypes.byref(fail), stream
            )
            if code:
                self.check(code, f"cudaMemcpyBatchAsync (copy {fail.value} of {count})")

    def describe(self) -> dict[str, object]:
        """Library path, versions and which batch prototype is bound (for benchmark reports)."""
        return {
            "path": self.path,
            "runtime_version": self.runtime_version,
            "driver_version": self.driver_version,
            "batch_signature": self.batch_signature,
        }


class CudaEvent:
    """A CUDA event on raw handles, made on the current device (timing kept, a synchronising
    thread sleeps): ``record(stream)`` on a ``cudaStream_t``, ``query()``, ``synchronize()`` (the
    GIL released), ``elapsed_time(end)`` in ms, ``cuda_event`` the handle (as on a
    ``torch.cuda.Event``).

    ``CudaEvent(rt, device=index)`` — the caller names the current device — takes a handle from
    that device's free list when one is there, and gives it back to the list when the object
    goes (a step's events cost two runtime calls fewer each). A handle is only reused once its
    object is gone, and a stream that waits on an event waits on the record made before the
    wait, so re-recording it later cannot affect that stream. Without ``device`` the handle is
    made and destroyed with the object. CUDA releases a destroyed event once its recorded work
    is done, so dropping an event still waited on is safe."""

    __slots__ = ("_device", "_rt", "cuda_event")

    #: Free handles per (runtime, device); bounded.
    _free: ClassVar[dict[tuple[int, int], list[int]]] = {}
    FREE_MAX: ClassVar[int] = 64

    def __init__(self, rt: CudaRuntime, device: int | None = None) -> None:
        self._rt = rt
        self._device = device
        free = None if device is None else self._free.get((id(rt), device))
        if free:
            self.cuda_event: int = free.pop()
            return
        handle = ctypes.c_void_p()
        rt.check(rt._event_create(ctypes.byref(handle), EVENT_BLOCKING_SYNC), "cudaEventCreateWithFlags")
        self.cuda_event = handle.value or 0

    def record(self, stream: int) -> None:
        self._rt.check(self._rt._event_record(self.cuda_event, stream), "cudaEventRecord")

    def query(self) -> bool:
        """True once the recorded work has completed."""
        code = self._rt._event_query(self.cuda_event)
        if code == ERROR_NOT_READY:
            self._rt._last_error()  # not an error; leave nothing for torch to pick up
            return False
        self._rt.check(code, "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        self._rt.check(self._rt._event_sync(self.cuda_event), "cudaEventSynchronize")

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to ``end`` (either kind of event)."""
        return self._rt.event_elapsed_ms(self.cuda_event, end.cuda_event)

    def __del__(self) -> None:
        rt = getattr(self, "_rt", None)
        handle = getattr(self, "cuda_event", 0)
        if rt is None or not handle:
            return
        device = getattr(self, "_device", None)
        if device is not None:
            free = self._free.setdefault((id(rt), device), [])
            if len(free) < self.FREE_MAX:
                free.append(handle)
                return
        rt._event_destroy(handle)  # a failure at interpreter exit has nowhere to go


def elapsed_ms(start: Any, end: Any) -> float:
    """Milliseconds between two recorded events, ``torch.cuda.Event`` or :class:`CudaEvent`."""
    return cuda_runtime().event_elapsed_ms(start.cuda_event, end.cuda_event)


@functools.cache
def cuda_runtime() -> CudaRuntime:
    """The process's CUDA runtime library (loaded once; see the module docstring for the search)."""
    errors: list[str] = []
    for candidate in cudart_candidates():
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as e:
            errors.append(f"{candidate}: {e}")
            continue
        if not hasattr(lib, "cudaMemcpyAsync"):
            errors.append(f"{candidate}: no cudaMemcpyAsync")
            continue
        return CudaRuntime(lib, candidate)
    raise TransferError("no CUDA runtime library could be loaded: " + "; ".join(errors[-4:]))
