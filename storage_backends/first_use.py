"""First-use setup of a storage backend: attempts shared by the calls that come meanwhile, a
listing bounded by its progress, and the back-off after a failure.

Primitives:

- :class:`FirstUseSetup` — the attempts of one backend: :meth:`~FirstUseSetup.join` starts an
  attempt (or joins the one running) and waits for it; :meth:`~FirstUseSetup.cancel` stops it
  (``aclose``).
- :class:`SetupProgress` — what an attempt is doing: preparing, or listing the stored objects
  (how many found so far, and when the last were found).
- :func:`list_bounded_by_progress` — a listing that fails only when ``timeout_s`` passes with
  nothing new found (from the attempt's start to the first page, then between two), however
  long it takes in all; it lets the calls waiting for the attempt go ``timeout_s`` after the
  attempt started.
- :class:`NotReady` — why a call found the backend not set up, and how to count it.

An attempt (the backend's ``_set_up``) runs as a task of its own: ``_prepare``, bounded by
``timeout_s``, then with a capacity the listing. The calls that come meanwhile wait for it, but
not past ``timeout_s`` after it started: a store that hangs costs a burst of first calls one
``timeout_s``, and once a long listing has run that long, the calls waiting are let go and the
calls after them are misses at once, without waiting, while it goes on — a large namespace is
listed in the background while the cache serves without the tier. The first call after the
attempt succeeded uses the backend. After a failed attempt, the calls of the next
``setup_retry_s`` are misses at once and the first call after that starts another attempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from storage_backends.reporting import describe_error

__all__ = ["FirstUseSetup", "NotReady", "SetupProgress", "list_bounded_by_progress"]

T = TypeVar("T")

#: an attempt: given its progress, ``None`` once the backend is ready, else the store's error
Attempt = Callable[["SetupProgress"], Coroutine[Any, Any, BaseException | None]]


class SetupProgress:
    """What a setup attempt is doing. A listing reports to it by calling it with the number of
    objects found so far (from the event loop or from any one worker thread). Made on the
    event loop."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self.listing = False
        self.found = 0
        #: when the listing last reported, or the attempt started (``time.monotonic()``)
        self.last_at = self.started_at
        #: done once the calls waiting for the attempt are let go (a long listing)
        self.released: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def __call__(self, found: int) -> None:
        self.found, self.last_at = found, time.monotonic()

    def describe(self) -> str:
        running = f"the setup has run for {time.monotonic() - self.started_at:.1f} s"
        if self.listing:
            return f"{running}, listing the stored objects ({self.found} found so far)"
        return running


async def list_bounded_by_progress(
    listing: Callable[[Callable[[int], None]], Awaitable[T]], progress: SetupProgress, timeout_s: float
) -> T:
    """``await listing(progress)``, which reports as it goes: a :class:`TimeoutError` only when
    ``timeout_s`` passes without a report — from the attempt's start to the first report, then
    between two — however long the listing takes in all. Still running ``timeout_s`` after the
    attempt started, having reported, it lets the calls waiting for the attempt go (one that has
    not reported fails then instead). Cut short (or cancelled), the listing is cancelled and
    waited for."""
    progress.listing = True
    release_at = progress.started_at + timeout_s
    task = asyncio.ensure_future(listing(progress))
    try:
        while not task.done():
            now = time.monotonic()
            if now - progress.last_at >= timeout_s:
                raise TimeoutError(
                    f"listing the stored objects: nothing new for {timeout_s:g} s ({progress.found} found)"
                )
            wake_at = progress.last_at + timeout_s
            if not progress.released.done():
                if now >= release_at:
                    progress.released.set_result(None)
                else:
                    wake_at = min(wake_at, release_at)
            await asyncio.wait([task], timeout=wake_at - now)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])  # a listing stops between files; one stuck in a call is left behind
        if not task.cancelled():
            task.exception()  # retrieved: what it raised once it was cut short does not matter


@dataclass(frozen=True, slots=True)
class NotReady:
    """Why a call found the backend not set up: ``error`` (reported as ``why``), and whether it
    is this call's own failure (it waited for the attempt: counted like an I/O error of its
    items, a timeout as a timeout) or not (the back-off, or a listing still running when the
    call came: counted as failures only)."""

    error: BaseException
    why: str
    of_this_call: bool


class FirstUseSetup:
    """The setup attempts of one backend (see the module docstring). Event-loop bound."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._task: asyncio.Task[BaseException | None] | None = None
        self._progress: SetupProgress | None = None
        #: the last attempt's error and when it ended (``time.monotonic()``)
        self._error: BaseException | None = None
        self._ended_at = 0.0

    async def join(
        self, attempt: Attempt, *, retry_s: float, closed: Callable[[], BaseException]
    ) -> NotReady | None:
        """Wait for the attempt running, or start one (unless one failed within ``retry_s``),
        until it ends or lets its calls go: ``None`` once it has succeeded, else why not. An
        attempt stopped by :meth:`cancel` fails the call with ``closed()``; an error other than
        the store's (a usage error) raises, in every call that waited for it."""
        task = self._task
        if task is None or task.done():
            since_s = time.monotonic() - self._ended_at
            if self._error is not None and since_s < retry_s:
                why = (
                    f"{describe_error(self._error)} (the setup failed {since_s:.1f} s ago; it is tried again "
                    f"{retry_s:g} s after a failure)"
                )
                return NotReady(self._error, why, of_this_call=False)
            if task is not None and not task.cancelled():
                task.exception()  # a usage error that no call waited for: this call tries again
            self._progress = SetupProgress()
            self._task = task = asyncio.get_running_loop().create_task(
                self._run(attempt, self._progress), name=f"setup {self._name}"
            )
        progress = self._progress
        assert progress is not None
        waited = not progress.released.done()
        if waited:
            # ``wait``, not ``shield``: a caller cancelled here leaves the attempt to the
            # others, and an attempt that ``cancel`` stops fails the call rather than looking
            # like a cancellation of its caller
            await asyncio.wait([task, progress.released], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            error = TimeoutError(progress.describe())
            if waited:  # this call waited as long as any may
                return NotReady(error, describe_error(error), of_this_call=True)
            return NotReady(error, f"{progress.describe()}; calls are misses until it is done", of_this_call=False)
        error = closed() if task.cancelled() else task.result()
        return None if error is None else NotReady(error, describe_error(error), of_this_call=True)

    async def _run(self, attempt: Attempt, progress: SetupProgress) -> BaseException | None:
        error = await attempt(progress)
        self._error, self._ended_at = error, time.monotonic()
        return error

    def cancel(self) -> None:
        """Stop the attempt running, if any (the calls waiting for it fail)."""
        if self._task is not None:
            self._task.cancel()
