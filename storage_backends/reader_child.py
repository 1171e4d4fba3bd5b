"""One reader process as the parent sees it (see ``storage_backends.reader_processes``): its
program and its start, the requests it is sent and the replies taken from it, and its end.

Primitives:

- :func:`spawn_child` — start a child and send it its init. Children are fresh interpreters
  (``python -c``, a socket pair between them and this process) that import
  ``storage_backends.object_reads`` and what it needs, no torch: not forks of this process,
  which may hold a CUDA context, and not ``multiprocessing`` children, which would import the
  caller's main module again.
- :class:`ReaderChild` — a running child: its process, its end of the socket pair, its requests
  in flight (its replies come in their order), the read chunks it may hold, the memories it has
  mapped, and whether it is up or dead.
- :class:`ReaderChannels` — the requests of
  :class:`~storage_backends.reader_processes.ReaderProcesses` (its base, through
  :class:`~storage_backends.reader_batches.ReaderBatches`) to its children:
  ``_send`` (a future of the reply), ``_request`` (the reply, awaited), each reply taken when the
  child's socket is readable, and a child's end: ``_lost`` (it exited: its requests fail) or
  ``_abandon`` (its socket failed while it may still run: killed, its requests failed once it
  has exited). Not used on its own.
- :class:`ReaderLost` — what a unit no reader process read fails with.
- :func:`kill_child`, :func:`stop_process` — kill a child; close its socket and wait for it to
  exit, killing it after a grace.

No thread of this process waits for a reply: the loop watches a child's socket from its first
request until its end, idle or not (a child that dies between reads is found dead at once; no
reader is removed and added again on one descriptor between requests). The socket's end is not
the only sign of a child's death: uvloop calls the reader of a descriptor whose poll reports an
error once, then drops it — as for a child killed with requests it had not read (a reset
connection, behind a reply that one call takes) — so while a child has requests, the loop also
looks every ``ALIVE_CHECK_S`` whether it has exited. Without that look such requests waited for
their kill timer, and then for ever. A child that has not replied to a request (a chunk, a
mapping) within ``timeout_s`` for each unit queued ahead of it and for each of its own (the
requests of a start have the start's deadline for their own part, see
``storage_backends.reader_processes``) — stopped, or stuck in a system call — is killed. Its
requests fail with :class:`ReaderLost` only once it has exited: the kernel closes a dying
process's files only after unmapping its memory, so by then it writes into no slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from asynccache.errors import BackendError
from storage_backends.workers import drain_future

log = logging.getLogger("asynccache.storage")

__all__ = ["ALIVE_CHECK_S", "ReaderChannels", "ReaderChild", "ReaderLost", "kill_child", "spawn_child", "stop_process"]

#: Where ``asynccache`` and ``storage_backends`` are. A child imports from them without running
#: their ``__init__`` (which import torch): it starts in a fraction of a second and small. It
#: ignores SIGINT from its first line: Ctrl-C reaches the whole process group, and the parent — a
#: server draining its requests, say — decides when its children stop.
_PACKAGES_ROOT = str(Path(__file__).resolve().parents[1])
_CHILD = """\
import signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
import sys, types
for name in ("asynccache", "storage_backends"):
    package = types.ModuleType(name)
    package.__path__ = [sys.argv[1] + "/" + name]
    sys.modules[name] = package
from multiprocessing.connection import Connection
from storage_backends.object_reads import serve_reader
serve_reader(Connection(int(sys.argv[2])))
"""


#: How often the loop looks whether a child with requests has exited (see the module docstring).
ALIVE_CHECK_S = 0.25


class ReaderLost(BackendError):
    """A unit no reader process read: its child died, could not start, or the readers were
    closed. Nothing writes into its slot any more, so another reader may take it."""


@dataclass(eq=False, slots=True)
class ReaderChild:
    """A running child: its replies come in the order of the requests (``pending``)."""

    process: subprocess.Popen[bytes]
    conn: Connection
    #: read chunks it may hold, all batches together (see :func:`spawn_child`)
    room: asyncio.Semaphore
    #: each request's future and, for a read, its number of units
    pending: deque[tuple[asyncio.Future[Any], int]] = field(default_factory=deque)
    mapped: set[int] = field(default_factory=set)
    #: answered its start and mapped the memories: reads may use it
    up: bool = False
    #: its ``time.perf_counter()`` is this process's (checked at its start): its replies' stamps
    #: say when its reads were done
    clock_shared: bool = False
    #: its socket is watched by the loop (from its first request until it is dead)
    watched: bool = False
    #: the next look at whether it has exited, while it has requests (see ``ALIVE_CHECK_S``)
    alive_check: asyncio.TimerHandle | None = None
    #: takes no more requests: it exited, or was killed and is being reaped (``reaping``)
    dead: bool = False
    reaping: asyncio.Task[None] | None = None

    def queued_units(self) -> int:
        return sum(units for _, units in self.pending)


def spawn_child(init: tuple[Any, ...], *, room: int) -> ReaderChild:
    """Start a child and send it ``init`` (its codec's arguments and ``timeout_s``); it may
    hold ``room`` read chunks at a time. Raises :class:`BackendError` when it cannot start."""
    try:
        ours, theirs = socket.socketpair()
    except OSError as e:
        raise BackendError(f"cannot start a reader process: {e}") from None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, _PACKAGES_ROOT, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
        )
    except OSError as e:
        ours.close()
        raise BackendError(f"cannot start a reader process: {e}") from None
    finally:
        theirs.close()
    conn = Connection(ours.detach())
    child = ReaderChild(process=proc, conn=conn, room=asyncio.Semaphore(room))
    try:
        conn.send(init)
    except OSError as e:  # it exited at once
        stop_process(child, timeout_s=0.0)
        raise BackendError(f"cannot start a reader process: {e}") from None
    return child


class ReaderChannels:
    """Requests to the children and their replies (see the module docstring); the base of
    :class:`~storage_backends.reader_batches.ReaderBatches` and so of
    :class:`~storage_backends.reader_processes.ReaderProcesses`, not used on its own."""

    #: each read unit's time, by which a child's replies are due (see :meth:`_send`)
    _timeout_s: float

    def _send(
        self, child: ReaderChild, msg: tuple[Any, ...], *, own_s: float | None = None
    ) -> asyncio.Future[Any]:
        """Send ``msg``; the future gets the child's reply (or a :class:`ReaderLost` if it
        died). A child that has not replied within ``timeout_s`` for each read unit queued ahead
        of this message, plus ``own_s`` for the message itself — by default ``timeout_s`` for
        each of its units (one for a message that is not a read); a child's start gives its
        requests the start's deadline — is killed: its requests fail once the end of its socket
        shows that it has exited, and the kernel closes a dying process's files only after
        unmapping its memory, so by then it writes into no slot."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if child.dead:
            fut.set_exception(ReaderLost("reader process exited"))
            return fut
        units = len(msg[1]) if msg[0] == "read" else 0
        if own_s is None:
            own_s = self._timeout_s * max(units, 1)
        kill_after_s = self._timeout_s * child.queued_units() + own_s
        try:
            child.conn.send(msg)
        except OSError as e:  # this message never reached it whole; it may still be running
            fut.set_exception(ReaderLost(f"reader process lost: {e}"))
            self._abandon(child, loop, f"reader process lost: {e}")
            return fut
        child.pending.append((fut, units))
        kill = loop.call_later(kill_after_s, _kill_unanswered, child, kill_after_s)
        fut.add_done_callback(lambda _: kill.cancel())
        if not child.watched:  # from the first request to the child's end (see the module docstring)
            loop.add_reader(child.conn.fileno(), self._on_readable, child, loop)
            child.watched = True
        if child.alive_check is None:
            child.alive_check = loop.call_later(ALIVE_CHECK_S, self._check_alive, child, loop)
        return fut

    def _check_alive(self, child: ReaderChild, loop: asyncio.AbstractEventLoop) -> None:
        """While ``child`` has requests, look every ``ALIVE_CHECK_S`` whether it has exited: its
        requests fail then, whether or not its socket's end was reported."""
        child.alive_check = None
        if child.dead or not child.pending:
            return
        if child.process.poll() is not None:  # exited: its memory is unmapped, it writes no slot
            self._lost(child, loop, "reader process exited")
            return
        child.alive_check = loop.call_later(ALIVE_CHECK_S, self._check_alive, child, loop)

    def _on_readable(self, child: ReaderChild, loop: asyncio.AbstractEventLoop) -> None:
        try:
            reply = child.conn.recv()
        except EOFError:  # its end closed: it exited, or is exiting past its last write
            self._lost(child, loop, "reader process exited")
            return
        except OSError as e:
            self._abandon(child, loop, f"reader process lost: {e}")
            return
        if not child.pending:  # a child speaks only when asked
            self._abandon(child, loop, "reader process sent a reply nothing asked for")
            return
        fut, _ = child.pending.popleft()
        if not fut.done():
            fut.set_result(reply)

    def _lost(self, child: ReaderChild, loop: asyncio.AbstractEventLoop, why: str) -> None:
        """The child is gone: every request it had fails (it writes into no slot any more)."""
        child.dead = True
        _unwatch(child, loop)
        while child.pending:
            fut, _ = child.pending.popleft()
            if not fut.done():
                fut.set_exception(ReaderLost(why))

    def _abandon(self, child: ReaderChild, loop: asyncio.AbstractEventLoop, why: str) -> None:
        """The child's socket failed, but the child may still be running — and writing into the
        slots of the chunks it holds: kill it, and fail its requests only once it has exited."""
        if child.reaping is not None:
            return
        child.dead = True
        _unwatch(child, loop)
        kill_child(child)

        async def reap() -> None:
            await asyncio.to_thread(child.process.wait)
            self._lost(child, loop, why)

        child.reaping = loop.create_task(reap(), name="asynccache-reader-reap")

    async def _request(self, child: ReaderChild, msg: tuple[Any, ...], *, own_s: float | None = None) -> Any:
        """``msg``'s reply (a child that does not answer in time is killed, see :meth:`_send`,
        and the request fails). A cancelled caller still waits for the reply or the end."""
        fut = self._send(child, msg, own_s=own_s)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await drain_future(fut)
            raise


def _unwatch(child: ReaderChild, loop: asyncio.AbstractEventLoop) -> None:
    if child.alive_check is not None:
        child.alive_check.cancel()
        child.alive_check = None
    if child.watched:
        loop.remove_reader(child.conn.fileno())
        child.watched = False


def kill_child(child: ReaderChild) -> None:
    """Kill ``child``; one already gone is no error."""
    with contextlib.suppress(ProcessLookupError):
        child.process.kill()


def _kill_unanswered(child: ReaderChild, after_s: float) -> None:
    if not child.dead:
        log.warning("reader process %d did not answer within %.1f s: killed", child.process.pid, after_s)
        kill_child(child)


def stop_process(child: ReaderChild, timeout_s: float) -> None:
    """Close ``child``'s socket and wait for it to exit; kill it after ``timeout_s`` (the
    readers' ``CLOSE_GRACE_S``, see ``storage_backends.reader_processes``)."""
    child.conn.close()  # a child still waiting for work sees the end and exits
    try:
        child.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait()
