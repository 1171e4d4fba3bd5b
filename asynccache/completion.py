"""Bridge from CUDA event completion to the event loop.

Each copy stream has one :class:`CompletionQueue` whose ``run()`` task lives in the controller's
``TaskGroup``. Operations on a stream complete in order, so the task waits on one end event at a
time: an event that has already fired (``query()``) completes at once; otherwise the wait runs
in the loop's bounded default thread pool (``asyncio.to_thread``) on an event created with
``cudaEventBlockingSync``: the waiting thread sleeps instead of spinning a
core, and the loop never blocks. Callbacks run on the loop thread.

Without CUDA the copies are synchronous and ``submit`` completes the callback immediately.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CompletionQueue", "drop_done"]


def drop_done(tasks: set[asyncio.Task[Any]]) -> None:
    """Remove the finished tasks from ``tasks``, a set that their done callbacks ``discard``
    them from (in place: the callbacks hold its ``discard``). Those callbacks run in a later
    loop pass, and since Python 3.12 gathering only finished tasks returns without yielding to
    the loop: a ``while tasks: await asyncio.gather(*tasks)`` would spin forever without this."""
    tasks.difference_update([t for t in tasks if t.done()])


class CompletionQueue:
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: asyncio.Queue[tuple[Any, Callable[[], None], float]] = asyncio.Queue()
        self.num_completed = 0
        self.total_latency_s = 0.0
        self.max_latency_s = 0.0
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def depth(self) -> int:
        """Operations submitted and not yet completed."""
        return self._pending

    async def wait_idle(self) -> bool:
        """Wait until nothing is pending; True if anything was pending."""
        if self._pending == 0:
            return False
        await self._idle.wait()
        return True

    def submit(self, event: Any, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop once ``event`` (a recorded CUDA event with ``query`` and
        ``synchronize``) has completed (at once if ``event`` is None)."""
        if event is None:
            self._record(0.0)
            callback()
            return
        self._pending += 1
        self._idle.clear()
        self._queue.put_nowait((event, callback, time.perf_counter()))

    def _done_one(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()

    def _record(self, latency_s: float) -> None:
        self.num_completed += 1
        self.total_latency_s += latency_s
        self.max_latency_s = max(self.max_latency_s, latency_s)

    async def run(self) -> None:
        """Complete submitted operations in order, forever (cancel to stop)."""
        while True:
            event, callback, submitted = await self._queue.get()
            if not event.query():
                await asyncio.to_thread(event.synchronize)
            self._record(time.perf_counter() - submitted)
            try:
                callback()
            finally:
                self._done_one()

    async def drain(self) -> None:
        """Wait until every submitted operation has completed (``run()`` must be running)."""
        await self.wait_idle()
