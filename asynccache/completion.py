"""Bridge from CUDA event completion to the event loop.

Each copy stream has one :class:`CompletionQueue` whose ``run()`` task lives in the controller's
``TaskGroup``. Operations on a stream complete in order, so the task waits on one end event at a
time: an event that has already fired (``query()``) completes at once; otherwise the wait runs
in the loop's bounded default thread pool (``asyncio.to_thread``) on an event created with
``cudaEventBlockingSync``: the waiting thread sleeps instead of spinning a
core, and the loop never blocks. Callbacks run on the loop thread.

Every submitted operation completes whatever happens, so that ``drain()`` returns:

- its callback gets ``error``: ``None``, or the error a synchronize raised (a CUDA fault) —
  for that operation and every one queued behind it then (same stream, after the fault); each
  still waits on its own event first, so no copy into memory the callback frees is in flight;
- a callback that raises is logged, and the operations behind it complete;
- an operation taken off the queue by a ``run()`` that is cancelled while it waits stays at the
  head: ``drain()`` completes what is left itself when no ``run()`` does.

Without CUDA the copies are synchronous and ``submit`` completes the callback immediately.

- :class:`CompletionQueue` — ``submit(event, callback)``, ``run()``, ``drain()``, ``wait_idle()``;
- :func:`drop_done` — drop finished tasks from a set that their done callbacks empty.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CompletionCallback", "CompletionQueue", "drop_done"]

log = logging.getLogger("asynccache.controller")  # what befalls the controller's operations

#: Called on the loop once an operation's copies have completed (``None``) or failed (the error).
CompletionCallback = Callable[[BaseException | None], None]


def drop_done(tasks: set[asyncio.Task[Any]]) -> None:
    """Remove the finished tasks from ``tasks``, a set that their done callbacks ``discard``
    them from (in place: the callbacks hold its ``discard``). Those callbacks run in a later
    loop pass, and since Python 3.12 gathering only finished tasks returns without yielding to
    the loop: a ``while tasks: await asyncio.gather(*tasks)`` would spin forever without this."""
    tasks.difference_update([t for t in tasks if t.done()])


class _Pending:
    __slots__ = ("callback", "error", "event", "submitted")

    def __init__(self, event: Any, callback: CompletionCallback, submitted: float) -> None:
        self.event = event
        self.callback = callback
        self.submitted = submitted
        self.error: BaseException | None = None  # set when an op ahead of it failed to sync


class CompletionQueue:
    """The operations of one copy stream, completed in submission order. Loop thread only."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: collections.deque[_Pending] = collections.deque()
        self._wakeup = asyncio.Event()  # set when something is queued for run()
        # One completer at a time (run() or a drain() standing in for it): ops complete in order.
        self._lock = asyncio.Lock()
        self.num_completed = 0
        self.total_latency_s = 0.0
        self.max_latency_s = 0.0

    @property
    def depth(self) -> int:
        """Operations submitted and not yet completed."""
        return len(self._items)

    async def wait_idle(self) -> bool:
        """Wait until nothing is pending; True if anything was pending."""
        if not self._items:
            return False
        await self.drain()
        return True

    def submit(self, event: Any, callback: CompletionCallback) -> None:
        """Run ``callback(error)`` on the loop once ``event`` (a recorded CUDA event with
        ``query`` and ``synchronize``) has completed. ``event`` None: at once (a raising
        callback raises here) unless operations are pending, then after them."""
        if event is None and not self._items:
            self._record(0.0)
            callback(None)
            return
        self._items.append(_Pending(event, callback, time.perf_counter()))
        self._wakeup.set()

    def _record(self, latency_s: float) -> None:
        self.num_completed += 1
        self.total_latency_s += latency_s
        self.max_latency_s = max(self.max_latency_s, latency_s)

    async def _complete_head(self) -> None:
        """Wait for the head's event and complete it (caller holds ``_lock``). Cancelled while
        waiting, the head stays queued: its copy may still be in flight."""
        item = self._items[0]
        error = item.error
        event = item.event
        if event is not None:
            try:
                if not event.query():
                    await asyncio.to_thread(event.synchronize)
            except Exception as e:  # noqa: BLE001 (a CUDA fault: the ops fail with it)
                if error is None:
                    error = e
                    log.error("%s completion: waiting for an operation's copies failed: %r", self.name, e)
                    for behind in self._items:
                        if behind.error is None:
                            behind.error = e
        self._items.popleft()
        self._record(time.perf_counter() - item.submitted)
        try:
            item.callback(error)
        except Exception:  # the ops behind it must still complete (and drain() return)
            log.exception("%s completion: an operation's callback failed", self.name)

    async def run(self) -> None:
        """Complete submitted operations in order, forever (cancel to stop)."""
        while True:
            if not self._items:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._lock:
                if self._items:
                    await self._complete_head()

    async def drain(self) -> None:
        """Wait until every submitted operation has completed, completing them in turn with
        ``run()`` (alone when it is not running: never started, or cancelled)."""
        while self._items:
            async with self._lock:
                if self._items:
                    await self._complete_head()
