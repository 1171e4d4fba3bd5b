"""A slot's payload in pieces, and piecewise work that stops when asked.

Primitives:

- :data:`IO_CHUNK_BYTES` — the size of the pieces that copies, checksums and file I/O work on.
- :func:`slot_buffers` — the contiguous runs of one host slot in payload (page_first) order.
- :func:`payload_range` — views of a byte range of a payload given as its buffers.
- :func:`iter_chunks` — buffers cut into pieces of at most ``IO_CHUNK_BYTES``.
- :class:`StopRequested` / :func:`check_stop` — between two pieces, a worker job stops when its
  caller was cancelled or its deadline passed.
- :func:`run_steps` — runs a stepwise operation (one piece per step) to its end on a thread;
  an event loop may run the same steps one per callback instead.

Imported by reader processes, which have no torch: pools appear only in annotations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from asynccache.errors import BackendError

if TYPE_CHECKING:  # not at run time: a reader process imports this module without torch
    from asynccache.pools.base import ItemPool

T = TypeVar("T")

__all__ = [
    "IO_CHUNK_BYTES",
    "StopRequested",
    "check_stop",
    "iter_chunks",
    "payload_range",
    "run_steps",
    "slot_buffers",
]

#: Copies, checksums and file I/O work on pieces of at most this size: a piece is checksummed
#: right after (or before) it is read (written), while it is still in the core's L2 cache —
#: checksumming a whole 1.5 MiB page after reading it costs a second trip to DRAM and halved
#: page-cache read speed on the development machines. Also the granularity at which a
#: cancelled worker stops touching host memory.
IO_CHUNK_BYTES = 256 << 10


def slot_buffers(pool: ItemPool, index: int) -> list[np.ndarray]:
    """The bytes of slot ``index`` as contiguous 1-D uint8 arrays in payload (page_first) order:
    one array for a page_first pool, one per layer for a layer_first pool. They alias the pool."""
    item = pool.index_bytes(index).numpy()  # [num_layers, item_bytes]
    if item.flags.c_contiguous:
        return [item.reshape(-1)]
    return list(item)


def payload_range(buffers: Sequence[np.ndarray], start: int, end: int) -> list[np.ndarray]:
    """Views of payload bytes ``[start, end)`` of ``buffers`` (their concatenation), in order."""
    out: list[np.ndarray] = []
    base = 0
    for buf in buffers:
        lo, hi = max(start, base), min(end, base + buf.nbytes)
        if lo < hi:
            out.append(buf[lo - base : hi - base])
        base += buf.nbytes
        if base >= end:
            break
    return out


def iter_chunks(buffers: Sequence[np.ndarray], chunk_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Split buffers into pieces of at most ``chunk_bytes`` (default ``IO_CHUNK_BYTES``; views, in order)."""
    chunk_bytes = IO_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    for buf in buffers:
        for start in range(0, buf.nbytes, chunk_bytes):
            yield buf[start : start + chunk_bytes]


class StopRequested(BackendError):
    """Raised inside a worker job whose caller was cancelled (never reaches callers)."""


def check_stop(stop: threading.Event | None, deadline: float | None = None) -> None:
    """Between pieces of a job: stop when its caller was cancelled (``stop`` set) or its
    deadline (``time.monotonic()``) passed."""
    if stop is not None and stop.is_set():
        raise StopRequested("stopped: the caller was cancelled")
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("timed out")


def run_steps(steps: Generator[None, None, T], stop: threading.Event | None = None) -> T:
    """Run a stepwise codec operation to its end and return its result, checking ``stop``
    before each step. A step handles one piece of at most ``IO_CHUNK_BYTES`` (~50 µs of copy
    and checksum): an event loop can run one step per callback instead, so that the work never
    holds the loop for longer than that (dropping the generator abandons the operation)."""
    while True:
        check_stop(stop)
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
