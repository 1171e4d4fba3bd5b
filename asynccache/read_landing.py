"""When a storage read's bytes landed, stamped where they were read: a backend's optional report
to the caller of ``batch_get_v2``.

The caller of a read learns that it is done when the event loop runs the code after its
``await``. A forward pass may hold the loop for most of its GPU time (its launches wait for the
device's queue), so a read that landed early is seen late: the split restore's tail, read
beside the head's forward, was timed at up to 2.3 × its estimate that way (docs/followups.md,
item 15). A backend that reads on worker threads or in other processes can say when the bytes
were in, on the reader's side.

- :class:`ReadLanding` — one read's landing time as its backends report it: ``with
  landing.observing(): await backend.batch_get_v2(...)``, then ``landing.at`` (the latest
  report, ``None`` without one) or ``landing.at_or(now)``. ``observing`` sets it as the
  current landing (a context variable), which the tasks a backend starts inside the call
  inherit.
- :func:`timed_read` — ``results, landed_at = await timed_read(backend.batch_get_v2(...))``: a
  read awaited under a landing of its own, with the time it landed (the caller's clock when it
  resumed, without a report).
- :func:`note_landed` — a backend's report: some of the current read's bytes were in at ``t``
  (a ``time.perf_counter()`` value on this host; a reader process's stamps count only where its
  clock is this process's, see ``storage_backends.reader_processes``). Outside ``observing`` it
  does nothing, so backends report unconditionally.

A backend that reports nothing (the memory backend; the object store, whose requests complete
on the loop) leaves ``at`` at ``None``: the caller's own clock stands.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["ReadLanding", "note_landed", "timed_read"]

T = TypeVar("T")

_CURRENT: contextvars.ContextVar[ReadLanding | None] = contextvars.ContextVar("asynccache_read_landing", default=None)


class ReadLanding:
    """The latest time a backend reported bytes of one read as landed (see the module
    docstring). Event-loop bound: reports are made on the loop."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None

    def landed(self, t: float) -> None:
        if self.at is None or t > self.at:
            self.at = t

    def at_or(self, now: float) -> float:
        """The reported landing, never later than ``now`` (the caller's clock when it resumed),
        or ``now`` without a report."""
        return now if self.at is None else min(self.at, now)

    @contextlib.contextmanager
    def observing(self) -> Iterator[ReadLanding]:
        """This landing is the current one for the reads awaited inside the block."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


def note_landed(t: float) -> None:
    """Report that some of the current read's bytes were in at ``t`` (no-op outside
    :meth:`ReadLanding.observing`)."""
    landing = _CURRENT.get()
    if landing is not None:
        landing.landed(t)


async def timed_read(read: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """Await ``read`` (a coroutine not yet started) under a landing of its own: its result and
    when it landed (:meth:`ReadLanding.at_or` the caller's clock when it resumed)."""
    landing = ReadLanding()
    with landing.observing():
        result = await read
    return result, landing.at_or(time.perf_counter())
