"""Reading objects in other processes: the local disk's ``read_processes`` option.

A worker thread of the local disk holds the interpreter lock for its Python steps between
system calls (open, header check, checksum step, close). Beside a forward pass — the head of a
split restore, or any serving loop — every one of those steps waits for the lock, and reads
slow down (docs/benchmarks.md, Long-prefix TTFT). Here ``n`` child processes, each with an
interpreter of its own, run the same :func:`~storage_backends.object_reads.read_object_range`
straight into the host pool's slots: the pool lives in shared memory
(:class:`~asynccache.pools.memory.SharedHostMemory`), which each child maps once.

Primitives:

- :class:`ReaderProcesses` — the ``n`` children: the shared memories they map (``memory_id``,
  ``pieces``), their starts in the background (``start``, ``available``), a batch's units spread
  over them (``read``, from :class:`~storage_backends.reader_batches.ReaderBatches`, its base),
  and their close (``aclose``).
- :func:`deal_by_bytes` — a batch's units cut into chunks of nearly equal bytes (from
  :mod:`storage_backends.reader_batches`, where a batch is dealt over the children).
- :func:`clock_shared` — whether a child's clock is this process's (asked at its start): only
  then do its replies' stamps report when a read landed (``read(landed=)``).
- :class:`ReaderLost` — a unit no child read (from :mod:`storage_backends.reader_child`, where a
  child is started, sent its requests and stopped).

How a batch's chunks go out to the children and their replies come back (no thread of this
process waits; a child that dies fails its chunks' units with :class:`ReaderLost` once it has
exited): see ``storage_backends.reader_batches``.

A read uses the children that are up when it starts and never waits for a start: a child that
is not up (dead, or never started) is started in the background, in a task of its own that
stores it in its slot as soon as it is spawned, whatever happens to the read that asked. Each
request of a start — the child's first answer, then its mappings — and each mapping that
:meth:`ReaderProcesses.start` asks of a child that is up has ``START_TIMEOUT_S`` (or
``timeout_s``, if longer) of its own, however short the reads' ``timeout_s``. One that does not
answer its start in time is killed, and its slot is not started again before
``RETRY_START_S``; the other children, or the threads, read meanwhile. When no child is up,
:meth:`ReaderProcesses.available` says so (the threads read the batch). Closing lets each child
finish what it holds, and kills one that has not exited within ``CLOSE_GRACE_S``; a start gives
the dead child it replaces (one whose socket closed may still be exiting) the same grace.
Children ignore SIGINT (Ctrl-C reaches the whole process group): the parent decides when they
stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from asynccache.errors import BackendError
from asynccache.pools.memory import SharedHostMemory
from storage_backends.reader_batches import (
    CHUNK_UNITS_MAX,
    CHUNKS_IN_FLIGHT,
    ReaderBatches,
    deal_by_bytes,
)
from storage_backends.reader_child import (
    ReaderChild,
    ReaderLost,
    kill_child,
    spawn_child,
    stop_process,
)
from storage_backends.workers import drain_future

log = logging.getLogger("asynccache.storage")

__all__ = [
    "CHUNKS_IN_FLIGHT",
    "CHUNK_UNITS_MAX",
    "CLOSE_GRACE_S",
    "RETRY_START_S",
    "START_TIMEOUT_S",
    "ReaderLost",
    "ReaderProcesses",
    "clock_shared",
    "deal_by_bytes",
]

#: After a child failed to start, its slot is left empty for this long before a start is tried
#: again (the other children, or the threads, read meanwhile).
RETRY_START_S = 30.0
#: A child that has not answered a request of its start (its first answer, its mappings)
#: within this long (or the backend's ``timeout_s``, if longer) is killed: a start takes a few
#: hundred milliseconds.
START_TIMEOUT_S = 30.0
#: On close, a child that has not finished the requests it holds and exited within this long (a
#: stopped or wedged one) is killed; so is the dead child a start replaces, past this long.
CLOSE_GRACE_S = 5.0


def clock_shared(asked: float, reply: tuple[Any, ...], answered: float) -> bool:
    """Whether a child's ``ping`` reply, stamped with its ``time.perf_counter()``, fell between
    this process's clock when the ping was sent (``asked``) and when the reply was taken
    (``answered``): then the two clocks are one (``CLOCK_MONOTONIC`` on Linux), and the child's
    stamps can be compared with this process's times."""
    return len(reply) == 2 and isinstance(reply[1], float) and asked <= reply[1] <= answered


class ReaderProcesses(ReaderBatches):
    """``n`` child processes that read plain objects into shared host memory (see the module
    docstring). :meth:`read` takes the units of one batch and returns each unit's result — what
    :func:`~storage_backends.object_reads.read_object_range` returns, or the exception it raised."""

    def __init__(self, n: int, *, namespace: str, header_align: int, piece_bytes: int, timeout_s: float) -> None:
        self.n = n
        self._codec_args = (namespace, header_align, piece_bytes)  # a child's init, with timeout_s
        self._timeout_s = timeout_s
        self._children: list[ReaderChild | None] = [None] * n
        #: a slot's start, running as a task of its own: no caller's cancellation loses the child
        self._starting: list[asyncio.Task[None] | None] = [None] * n
        self._failed_at: list[float | None] = [None] * n  # when each slot's last start failed
        self._slot_locks = [asyncio.Lock() for _ in range(n)]  # one mapping of a child's memories at a time
        #: id → (base address, size, the memory, weakly: a pool dropped is unmapped and freed)
        self._memories: dict[int, tuple[int, int, weakref.ref[SharedHostMemory]]] = {}
        self._ids: weakref.WeakKeyDictionary[SharedHostMemory, int] = weakref.WeakKeyDictionary()
        self._next_id = itertools.count()
        self._closed = False

    # ---- memory ----
    def memory_id(self, memory: SharedHostMemory) -> int:
        """The id under which the children map ``memory`` (they map it before their next read)."""
        mem_id = self._ids.get(memory)
        if mem_id is None:
            mem_id = self._ids[memory] = next(self._next_id)
            self._memories[mem_id] = (memory.tensor.data_ptr(), memory.size, weakref.ref(memory))
        return mem_id

    def pieces(self, mem_id: int, views: Sequence[np.ndarray]) -> tuple[tuple[int, int, int], ...]:
        """``views`` (of the memory ``mem_id``) as ``(id, offset, bytes)`` pieces."""
        base, size, _ = self._memories[mem_id]
        out = []
        for v in views:
            off = v.ctypes.data - base
            if not (0 <= off and off + v.nbytes <= size):
                raise ValueError("a view outside the shared memory it was said to be in")
            out.append((mem_id, off, v.nbytes))
        return tuple(out)

    async def start(self) -> None:
        """Start every child that is not up now (each takes a few hundred milliseconds to import
        what it needs), rather than beside the first reads, and map every memory in each (each
        mapping with a start's deadline, :meth:`_start_deadline_s`). A child that cannot start
        is logged; reads start it again ``RETRY_START_S`` later."""

        async def start_one(slot: int) -> None:
            if not self._is_up(slot) and (task := self._start_soon(slot, now=True)) is not None:
                await asyncio.wait([task])  # a cancelled caller leaves the start to finish alone
            await self._ready(slot, own_s=self._start_deadline_s())  # maps what was registered since

        await asyncio.gather(*(start_one(slot) for slot in range(self.n)))

    def available(self) -> bool:
        """Whether a child can take a batch now: ``False`` when none is up — the caller reads
        with threads. Never waits for a start: a child that is not up is started in the
        background (at most once per ``RETRY_START_S`` after a failed start)."""
        if self._closed:
            raise BackendError("the backend was closed")
        return bool(self._up_slots())

    def _is_up(self, slot: int) -> bool:
        child = self._children[slot]
        return child is not None and child.up and not child.dead

    def _up_slots(self) -> list[int]:
        """The slots whose child is up; the others are started in the background."""
        up = []
        for slot in range(self.n):
            if self._is_up(slot):
                up.append(slot)
            else:
                self._start_soon(slot)
        return up

    # ---- a child's mappings, start and close ----
    async def _ready(self, slot: int, *, own_s: float | None = None) -> ReaderChild | None:
        """Child ``slot`` with every memory mapped, if it is up; else ``None`` (it is started in
        the background). ``own_s``: each mapping's own deadline (see :meth:`_map`)."""
        async with self._slot_locks[slot]:
            if self._closed:
                raise BackendError("the backend was closed")
            child = self._children[slot]
            if child is None or not child.up or child.dead:
                self._start_soon(slot)
                return None
            await self._map(child, own_s=own_s)
            return child

    async def _map(self, child: ReaderChild, *, own_s: float | None = None) -> None:
        """Map every memory in ``child`` and unmap those whose pool is gone. A child that has not
        answered a request within ``timeout_s`` for each unit queued ahead of it plus ``own_s``
        (by default ``timeout_s``; a start gives :meth:`_start_deadline_s`) is killed."""
        for mem_id, (_, size, ref) in list(self._memories.items()):
            memory = ref()
            if memory is None:  # its pool is gone: free the mapping here and in the children
                self._memories.pop(mem_id, None)
            elif mem_id not in child.mapped:
                reply = await self._request(child, ("map", mem_id, memory.path, size), own_s=own_s)
                if reply[0] != "ok":
                    raise BackendError(f"reader process: {reply[1]}")
                child.mapped.add(mem_id)
        for mem_id in child.mapped - self._memories.keys():
            await self._request(child, ("unmap", mem_id), own_s=own_s)
            child.mapped.discard(mem_id)

    def _start_deadline_s(self) -> float:
        """How long a start's request may take: ``START_TIMEOUT_S``, or ``timeout_s`` if longer.
        A read's deadline (``timeout_s``) can be far below a child's start."""
        return max(self._timeout_s, START_TIMEOUT_S)

    def _start_soon(self, slot: int, *, now: bool = False) -> asyncio.Task[None] | None:
        """The start of child ``slot`` in progress, or a new one — unless the backend is closed
        or (but ``now``) the slot's last start failed less than ``RETRY_START_S`` ago."""
        task = self._starting[slot]
        failed_at = self._failed_at[slot]
        if task is None and not self._closed and (now or failed_at is None or time.monotonic() - failed_at >= RETRY_START_S):
            task = asyncio.get_running_loop().create_task(self._start(slot), name=f"asynccache-reader-start-{slot}")
            self._starting[slot] = task
        return task

    async def _start(self, slot: int) -> None:
        """Start child ``slot`` (after stopping the dead one there): spawn it, wait for its
        answer once it has imported its modules, map the memories — each request with the
        start's deadline, :meth:`_start_deadline_s`. Runs as a task of its own, which nothing
        cancels: the spawned child is in its slot — where :meth:`aclose` stops it — in the step
        the spawn returns. A failure is logged, and the slot waits ``RETRY_START_S``."""
        loop = asyncio.get_running_loop()
        child: ReaderChild | None = None
        try:
            old = self._children[slot]
            if old is not None:  # (one that closed its socket may still run: the close's grace)
                await asyncio.to_thread(stop_process, old, CLOSE_GRACE_S)
            if self._closed:
                return
            child = await asyncio.to_thread(self._spawn)
            self._children[slot] = child
            if self._closed:
                return
            start_s = self._start_deadline_s()  # the whole start: its answer, then its mappings
            asked = time.perf_counter()
            reply = await self._request(child, ("ping",), own_s=start_s)
            child.clock_shared = clock_shared(asked, reply, time.perf_counter())
            if self._closed:
                return
            await self._map(child, own_s=start_s)
            child.up = not self._closed
            self._failed_at[slot] = None
        except Exception as e:  # noqa: BLE001 (nothing awaits a start: logged, tried again later)
            if self._closed:
                return
            if child is not None and not child.dead:  # it answers, but cannot map: not used
                self._abandon(child, loop, f"reader process could not start: {e}")
            self._failed_at[slot] = time.monotonic()
            log.warning("reader process %d could not start (%s): started again in %.0f s at the earliest",
                        slot, e, RETRY_START_S)
        finally:
            self._starting[slot] = None

    def _spawn(self) -> ReaderChild:
        """A new child, sent its init (see :func:`~storage_backends.reader_child.spawn_child`)."""
        return spawn_child(("init", *self._codec_args, self._timeout_s), room=CHUNKS_IN_FLIGHT)

    def kill_children(self) -> None:
        """Kill every child now and take no new one: what a backend dropped unclosed does from
        its finalizer (signals only, from whatever thread collects it). The loop's watch of each
        child's socket then sees its end and reaps it; without this the watches keep the
        children alive until the loop closes."""
        self._closed = True
        for child in self._children:
            if child is not None:
                kill_child(child)

    async def aclose(self) -> None:
        """Stop the children: each finishes the requests it holds and exits; one that has not
        within ``CLOSE_GRACE_S`` (a stopped or wedged child) is killed. Starts in progress end
        at their next step, their children stopped with the others."""
        self._closed = True
        loop = asyncio.get_running_loop()
        for child in self._children:  # each finishes the requests it has, then exits
            if child is not None and not child.dead:
                with contextlib.suppress(OSError):
                    child.conn.send(("exit",))

        def kill_all() -> None:  # those of starts still in progress included
            for child in self._children:
                if child is not None:
                    kill_child(child)

        kill = loop.call_later(CLOSE_GRACE_S, kill_all)
        try:
            for task in list(self._starting):
                if task is not None:
                    await drain_future(task)
            for child in list(self._children):
                for fut, _ in list(child.pending) if child is not None else ():
                    await drain_future(fut)
        finally:
            kill.cancel()
        children = [c for c in self._children if c is not None]
        self._children = [None] * self.n
        for child in children:
            self._lost(child, loop, "the backend was closed")
        self._memories.clear()
        self._ids = weakref.WeakKeyDictionary()  # a read planned after this gets new ids (and fails: closed)
        await asyncio.gather(*(asyncio.to_thread(stop_process, c, CLOSE_GRACE_S) for c in children))
