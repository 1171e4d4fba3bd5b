"""Stream dependencies on raw CUDA handles, for the per-step paths of loads and the forward.

``torch.cuda.current_stream()`` builds a ``Stream`` object per call and ``Stream.wait_stream``
records a ``torch.cuda.Event`` (tens of microseconds together on a busy host); a step makes a
few dozen such dependencies, so they go through ``kernels.cudart`` instead:

- :func:`current_device` — the current device's index (without ``torch.cuda.current_device``'s
  Python layer);
- :func:`current_stream` — ``(key, cudaStream_t)`` of the caller's current stream;
- :func:`make_wait` — one ``cudaStreamWaitEvent``;
- :func:`record_on` — an event recorded on a stream handle of the current device (its handle
  reused from the device's free list: ``kernels.cudart.CudaEvent``);
- :func:`order_after` — work queued on one stream from now on waits for what another holds.

Where no runtime library loads, each falls back to torch's own calls.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from asynccache.errors import TransferError
from kernels.api import current_device
from kernels.cudart import CudaEvent, CudaRuntime, cuda_runtime

__all__ = ["CudaEventLike", "current_device", "current_stream", "make_wait", "order_after", "record_on"]

#: A recorded CUDA event: ``torch.cuda.Event`` or ``kernels.cudart.CudaEvent`` (both have
#: ``cuda_event``, ``query``, ``synchronize`` and ``elapsed_time``).
CudaEventLike = Any

_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_streams: dict[object, int] = {}


def current_stream(device: int | None = None) -> tuple[object, int]:
    """``(key, handle)`` of the current CUDA stream of ``device`` (an index; default: the
    current device): its ``cudaStream_t``, kept by torch's stream id
    (``torch.cuda.current_stream()`` builds a new object on every call)."""
    if _get_stream is None:
        handle = torch.cuda.current_stream(device).cuda_stream
        return handle, handle
    key = _get_stream(current_device() if device is None else device)
    handle = _streams.get(key)
    if handle is None:
        if len(_streams) > 64:
            _streams.clear()
        handle = _streams[key] = torch.cuda.current_stream(device).cuda_stream
    return key, handle


@functools.cache
def _runtime() -> CudaRuntime | None:
    try:
        return cuda_runtime()
    except TransferError:
        return None


def make_wait(handle: int, event: CudaEventLike) -> None:
    """Make the stream ``handle`` wait on ``event`` (``cudaStreamWaitEvent``)."""
    rt = _runtime()
    if rt is not None:
        rt.stream_wait_event(handle, event.cuda_event)
    else:
        torch.cuda.ExternalStream(handle).wait_event(event)


def record_on(handle: int) -> CudaEventLike:
    """A new event recorded on the stream ``handle``."""
    rt = _runtime()
    if rt is not None:
        event = CudaEvent(rt, device=current_device())
        event.record(handle)
        return event
    ev = torch.cuda.Event(blocking=True, enable_timing=True)
    ev.record(torch.cuda.ExternalStream(handle))
    return ev


def order_after(waiter: int, stream: int) -> None:
    """Work queued on the stream ``waiter`` from now on waits for what ``stream`` holds now."""
    make_wait(waiter, record_on(stream))
