"""Bounded concurrency that serves the request path first.

A storage backend does two kinds of work: *foreground* work that a request waits for (probing
which keys exist, reading a prefix back) and *background* work that nothing waits for but the
cache's own bookkeeping (writing a finished prefix back, deleting objects). Both share a few
slots (threads, connections, the disk's queue). First come, first served would put a request's
lookup behind every object of the previous request's write-back — on a 32k-token prefix, half a
second of a second-and-a-half prefill. Here foreground work goes first:

- :class:`PriorityLimiter` — at most ``n`` holders on one event loop; a freed slot goes to the
  oldest foreground waiter, and only when there is none to the oldest background one.
- :class:`WorkerPool` — at most ``n`` threads; the next job is the oldest foreground job, then
  the oldest background one. A long background job that works through units (the objects of a
  batch) checks :meth:`JobControl.foreground_waiting` between units and returns :data:`YIELD`
  to give its thread up; it is queued again behind the other background jobs and picks up
  where it stopped.

Background work waits as long as foreground work keeps every slot busy; a request path that
saturates the storage tier gets all of it.

A job's ``stop`` (a :class:`JobControl`, a :class:`threading.Event`) is set when its caller is
cancelled; the caller then waits for the job to return, so no thread touches a host slot after
the call that named it has returned. A job cancelled before it started never runs. A job run
with ``detach=True`` (one that touches nothing its caller owns: a listing) is not waited for
once its caller is cancelled, nor by :meth:`WorkerPool.aclose`: a thread stuck in a system call
(a hung mount) then holds neither its caller nor the pool's close; it exits once the call
returns.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from asynccache.errors import BackendError

__all__ = ["YIELD", "JobControl", "PriorityLimiter", "WorkerPool", "drain_future"]

T = TypeVar("T")


class _Yield:
    __slots__ = ()

    def __repr__(self) -> str:
        return "YIELD"


#: What a background job returns to give its thread to waiting foreground work (it runs again later).
YIELD: Final = _Yield()


class PriorityLimiter:
    """At most ``n`` holders of ``async with limiter(background=...)`` at once (one event loop).

    Foreground waiters are served before background ones, each kind in arrival order. A waiter
    cancelled after it was handed a slot passes the slot on."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a limiter needs at least one slot, got {n}")
        self._free = n
        self._waiters: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (deque(), deque())

    @property
    def num_waiting(self) -> int:
        return sum(1 for q in self._waiters for f in q if not f.done())

    @asynccontextmanager
    async def __call__(self, *, background: bool = False) -> AsyncIterator[None]:
        await self._acquire(background)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, background: bool) -> None:
        if self._free > 0 and not any(self._waiters):
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiters[background]
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # handed a slot while being cancelled: pass it on
            elif fut in queue:  # (a release in the same iteration may have dropped it already)
                queue.remove(fut)
            raise

    def _release(self) -> None:
        for queue in self._waiters:
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot passes straight to the waiter
                    return
        self._free += 1


class JobControl(threading.Event):
    """A job's ``stop`` event (set when its caller is cancelled), which also tells a background
    job whether foreground work is waiting for a thread."""

    def __init__(self, state: _PoolState) -> None:
        super().__init__()
        self._queues = state.queues

    def foreground_waiting(self) -> bool:
        return bool(self._queues[0])


@dataclass(eq=False, slots=True)
class _Job:
    fn: Callable[[], Any]
    stop: JobControl
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    background: bool
    detach: bool = False
    started: bool = field(default=False)


class _PoolState:
    """What a pool's threads share with it. The threads hold this, not the pool: a pool that
    is dropped unclosed is collected, and its finalizer lets the idle threads exit."""

    __slots__ = ("closed", "cv", "detached", "idle", "queues", "threads")

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.queues: tuple[deque[_Job], deque[_Job]] = (deque(), deque())  # foreground, background
        self.threads: list[threading.Thread] = []
        self.detached: set[threading.Thread] = set()  # threads running a ``detach`` job
        self.idle = 0
        self.closed = False


class WorkerPool:
    """At most ``max_workers`` threads running ``fn(stop, *args)`` for ``await run(...)``,
    foreground jobs first (see the module docstring). Threads start as work arrives and stay
    until :meth:`aclose` (or until the pool is collected), which lets queued jobs finish and
    refuses new ones."""

    def __init__(self, max_workers: int, *, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f"a worker pool needs at least one thread, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self._state = _PoolState()
        weakref.finalize(self, _close, self._state)

    async def run(self, fn: Callable[..., T], *args: Any, background: bool = False, detach: bool = False) -> T:
        """``fn(stop, *args)`` on a thread. Cancelled, the caller sets ``stop`` and waits for
        the job to return — unless ``detach`` (a job that touches nothing the caller owns)."""
        loop = asyncio.get_running_loop()
        stop = JobControl(self._state)
        job = _Job(
            fn=lambda: fn(stop, *args),
            stop=stop,
            future=loop.create_future(),
            loop=loop,
            background=background,
            detach=detach,
        )
        self._submit(job)
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            stop.set()
            state = self._state
            with state.cv:
                queued = not job.started
                if queued:
                    state.queues[background].remove(job)
            if not queued and detach:
                job.future.add_done_callback(_retrieve)  # its outcome no longer matters
            elif not queued:
                await drain_future(job.future)
            raise

    def _submit(self, job: _Job) -> None:
        state = self._state
        with state.cv:
            if state.closed:
                raise BackendError("the backend was closed")
            state.queues[job.background].append(job)
            if state.idle:
                state.idle -= 1  # this waiter is spoken for: the next job wakes another or starts one
                state.cv.notify()
            elif len(state.threads) < self.max_workers:
                t = threading.Thread(target=_work, args=(state,), name=f"{self.name}_{len(state.threads)}", daemon=True)
                state.threads.append(t)
                t.start()

    async def aclose(self) -> None:
        """Refuse new jobs, let the queued ones run, and wait for every thread to exit — but
        for one running a ``detach`` job, which exits when that job returns."""
        state = self._state
        threads = _close(state)

        def join() -> None:
            for t in threads:
                while t.is_alive():
                    t.join(0.05)
                    with state.cv:
                        if t in state.detached:
                            break

        await asyncio.to_thread(join)


def _close(state: _PoolState) -> list[threading.Thread]:
    with state.cv:
        state.closed = True
        state.idle = 0
        state.cv.notify_all()
        return list(state.threads)


def _work(state: _PoolState) -> None:
    while True:
        with state.cv:
            while not (state.queues[0] or state.queues[1] or state.closed):
                state.idle += 1
                state.cv.wait()  # woken by a submit (which took it off the idle count) or by close
            queue = state.queues[0] or state.queues[1]
            if not queue:
                return  # closed and nothing left
            job = queue.popleft()
            job.started = True
            if job.detach:
                state.detached.add(threading.current_thread())
        try:
            result, error = job.fn(), None
        except BaseException as e:  # noqa: BLE001 (delivered to the caller, whatever it is)
            result, error = None, e
        if job.detach:
            with state.cv:
                state.detached.discard(threading.current_thread())
        if result is YIELD and error is None:
            with state.cv:
                if not job.stop.is_set():  # (a cancelled caller waits for it: settle it now)
                    job.started = False
                    state.queues[job.background].append(job)
                    continue
            result = None
        _deliver(job, result, error)
        del job, result, error  # nothing of a finished job keeps its pool alive


def _deliver(job: _Job, result: Any, error: BaseException | None) -> None:
    def settle() -> None:
        if job.future.done():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: nobody is waiting


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def drain_future(fut: asyncio.Future[Any]) -> None:
    """Wait for ``fut`` through further cancellations (the job must have returned before the
    cancelled caller goes on)."""
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            continue
    if not fut.cancelled():
        fut.exception()  # retrieved: the caller has gone, the outcome no longer matters
