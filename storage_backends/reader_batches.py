"""One batch's reads spread over the reader processes (see ``storage_backends.reader_processes``).

Primitives:

- :class:`ReaderBatches` — a batch's units cut into chunks and sent to the children that are up,
  ``CHUNKS_IN_FLIGHT`` ahead of their replies (``read``). The base of
  :class:`~storage_backends.reader_processes.ReaderProcesses`, which finds the children up
  (``_up_slots``) and has them map their memories (``_ready``); not used on its own.
- :func:`deal_by_bytes` — a batch's units cut into chunks of nearly equal bytes.
- :data:`CHUNKS_IN_FLIGHT`, :data:`CHUNK_UNITS_MAX` — the chunks a child holds at most (its
  ``room``, given at its start), and the units of one chunk.

The event loop sends each child chunks of work units (the object's path, geometry, key,
payload range and the slot's pieces as offsets into a mapped pool), ``CHUNKS_IN_FLIGHT`` ahead
of its replies, and takes each reply when the child's socket is readable — no thread of this
process waits. A batch is cut into that many chunks per child, of nearly equal bytes, so a
batch that is not too large goes out at once and the children read it whether or not the loop
is free meanwhile. A caller cancelled meanwhile still waits for the chunks in flight (a child
must not write into a slot after the call that named it has returned); each unit has its own
deadline, ``timeout_s`` from its start, and a child that has not replied in time is killed (see
``storage_backends.reader_child``).
A child that dies fails its chunks' units with :class:`~storage_backends.reader_child.ReaderLost`
— the local disk reads those with its threads — only once it has exited; a child whose socket
fails while it may still run is killed first.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from asynccache.errors import BackendError
from storage_backends.object_reads import RangeResult, ReadUnit, reply_outcome
from storage_backends.reader_child import ReaderChannels, ReaderChild, ReaderLost
from storage_backends.workers import drain_future

log = logging.getLogger("asynccache.storage")

__all__ = ["CHUNKS_IN_FLIGHT", "CHUNK_UNITS_MAX", "ReaderBatches", "deal_by_bytes"]

#: Units per message, at most: enough to keep a child's pipe round trip small against its reads
#: (a 32k-token prefix of hybrid-3b, 525 units, goes out in one round to 8 children).
CHUNK_UNITS_MAX = 32
#: Chunks sent to a child ahead of its replies. A batch is cut into this many chunks per child
#: (more rounds of as many where a chunk would exceed ``CHUNK_UNITS_MAX`` units), of nearly
#: equal bytes (:func:`deal_by_bytes`), so a batch of up to ``CHUNKS_IN_FLIGHT · n ·
#: CHUNK_UNITS_MAX`` units goes out at once and the children finish together. A forward pass may
#: hold the event loop for most of its GPU time (its launches wait for the device's queue: ~160
#: ms for a 2,112-token pass of hybrid-3b on an H200); children that had to wait for the loop to
#: take a reply before they got more work sat idle meanwhile (a split restore's tail read at up
#: to 2.3 × its estimate with two chunks ahead).
CHUNKS_IN_FLIGHT = 4


def deal_by_bytes(sizes: Sequence[int], num_chunks: int) -> list[list[int]]:
    """The indices of ``sizes`` dealt into at most ``num_chunks`` chunks of nearly equal bytes:
    the largest first, each to the chunk with the fewest bytes so far (a state's 4 MiB ranges,
    first in a batch, spread over the children instead of filling one child's first chunk).
    Each chunk's indices ascend; empty chunks are left out."""
    heap = [(0, k) for k in range(max(1, num_chunks))]
    chunks: list[list[int]] = [[] for _ in heap]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        nbytes, k = heapq.heappop(heap)
        chunks[k].append(i)
        heapq.heappush(heap, (nbytes + sizes[i], k))
    return [sorted(chunk) for chunk in chunks if chunk]


class ReaderBatches(ReaderChannels, ABC):
    """A batch's reads over the children (see the module docstring); the base of
    :class:`~storage_backends.reader_processes.ReaderProcesses`, not used on its own."""

    #: set by ``aclose``: no read starts
    _closed: bool

    @abstractmethod
    def _up_slots(self) -> list[int]: ...

    @abstractmethod
    async def _ready(self, slot: int) -> ReaderChild | None: ...

    async def read(
        self,
        units: Sequence[ReadUnit],
        *,
        stopping: Callable[[], bool] = lambda: False,
        landed: Callable[[float], None] | None = None,
    ) -> list[RangeResult | BaseException]:
        """Each unit's result; once ``stopping()`` says so (its backend is closing), no more
        chunks are sent and the units not sent stay :class:`ReaderLost`. ``landed(t)`` gets,
        for each chunk a child answered, the time the child was done with it, stamped in the
        child (only from children whose clock is this process's): when the bytes were in,
        however late the loop took the reply."""
        if self._closed:
            raise BackendError("the backend was closed")
        results: list[RangeResult | BaseException] = [ReaderLost("not read")] * len(units)
        slots = self._up_slots()  # a child being started takes no part: no read waits for a start
        if not slots or not units:
            return results
        rounds = max(CHUNKS_IN_FLIGHT, math.ceil(len(units) / (CHUNK_UNITS_MAX * len(slots))))
        dealt = deal_by_bytes([sum(n for _, _, n in unit.pieces) for unit in units], rounds * len(slots))
        chunks = iter(dealt)

        async def drive(slot: int) -> None:
            try:
                maybe_child = await self._ready(slot)
            except Exception as e:  # noqa: BLE001 (cannot map: the others take the chunks)
                log.warning("reader process %d unavailable: %s", slot, e)
                return  # chunks no child takes stay ReaderLost (the threads read them)
            if maybe_child is None:  # died meanwhile
                return
            child = maybe_child
            inflight: deque[tuple[list[int], asyncio.Future[Any]]] = deque()

            # A child holds at most CHUNKS_IN_FLIGHT chunks of all batches together (its
            # ``room``), so a slow or stuck one never fills its socket, where a send would block
            # the loop. A drive waits for room only while it holds none: no drive holds room
            # while it waits for more.
            def take_chunk() -> bool:  # with a unit of room held
                if not stopping():
                    for indices in chunks:
                        part = [units[i] for i in indices]
                        inflight.append((indices, self._send(child, ("read", part))))
                        return True
                child.room.release()  # nothing (more) to send
                return False

            async def send_more() -> None:
                while len(inflight) < CHUNKS_IN_FLIGHT and not child.dead and not child.room.locked():
                    await child.room.acquire()  # free: returns at once
                    if not take_chunk():
                        return

            try:
                await child.room.acquire()
                if take_chunk():
                    await send_more()
                while inflight:
                    indices, fut = inflight[0]
                    try:
                        replies, done_at = await asyncio.shield(fut)
                        for i, reply in zip(indices, replies, strict=True):
                            results[i] = reply_outcome(reply)
                        if landed is not None and child.clock_shared:
                            landed(done_at)
                    except BackendError as e:
                        for i in indices:
                            results[i] = e
                    inflight.popleft()
                    child.room.release()
                    if child.dead:
                        continue
                    if not inflight:
                        await child.room.acquire()
                        if not take_chunk():
                            break
                    await send_more()
            except BaseException:
                for _, fut in inflight:  # the child may be writing into their slots
                    await drain_future(fut)
                    child.room.release()
                raise

        async with asyncio.TaskGroup() as tg:
            for slot in slots[: len(dealt)]:
                tg.create_task(drive(slot))
        return results
