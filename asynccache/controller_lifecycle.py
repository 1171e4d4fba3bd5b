"""The controller's lifecycle: the part of
:class:`~asynccache.controller.HybridCacheController` that enters its ``TaskGroup`` (the
completion tasks, the storage tier), waits until nothing is in flight, and closes it. A base of
the controller, not used on its own.

- :class:`ControllerLifecycleMixin` — ``async with`` (``__aenter__`` / ``__aexit__``),
  ``aclose`` (queued operations cancelled, in-flight copies, lookups and backups finished, the
  backend closed once; idempotent), ``wait_idle``; ``_require_started`` for the operations that
  need the ``TaskGroup``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Self

from asynccache.completion import CompletionQueue, drop_done
from asynccache.errors import ClosedError

if TYPE_CHECKING:
    from collections.abc import Callable

    from asynccache.layer_counter import LayerTransferCounter
    from asynccache.ops import CacheOperation
    from asynccache.prefetch import Prefetcher
    from asynccache.storage import StorageBackend
    from asynccache.tree_ops import TreeOps

__all__ = ["ControllerLifecycleMixin"]


class ControllerLifecycleMixin:
    """Entering, idling and closing the controller (see the module docstring)."""

    # Set by HybridCacheController's constructor.
    backend: StorageBackend | None
    tiering: Any
    _cuda: bool
    _tg: asyncio.TaskGroup | None
    _closing: asyncio.Future[None] | None
    _backend_closing: asyncio.Future[None] | None
    _tasks: list[asyncio.Task[None]]
    _loaders: set[asyncio.Task[None]]
    _load_queue: list[CacheOperation]
    _write_queue: list[CacheOperation]
    _load_completion: CompletionQueue
    _write_completion: CompletionQueue
    _ops: TreeOps
    _prefetcher: Prefetcher
    # The controller's operations, which closing issues or cancels.
    cancel: Callable[[CacheOperation], bool]
    start_loading: Callable[[], LayerTransferCounter]
    start_writing: Callable[[], int]

    async def __aenter__(self) -> Self:
        if self._closing is not None or self._tg is not None:
            # A second TaskGroup would orphan the first; a closed backend would serve nothing.
            raise ClosedError("the controller is " + ("closed" if self._closing is not None else "entered already"))
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        if self._cuda:
            self._tasks = [
                self._tg.create_task(self._load_completion.run(), name="asynccache-load-completion"),
                self._tg.create_task(self._write_completion.run(), name="asynccache-write-completion"),
            ]
        if self.backend is not None:
            from asynccache.tiering import StorageTier

            try:  # registering may start the backend's reader processes: a failed entry stops them
                self.tiering = StorageTier(self, self.backend, self._tg)
                await self.tiering.register()
            except BaseException:
                await self.aclose()
                raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel queued operations, finish in-flight copies, storage lookups and backups, then
        stop background tasks and close the backend. Idempotent; concurrent calls wait for the
        first."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            if self._backend_closing is not None:
                # A first close cancelled while the backend was closing left that close running
                # on its own: this one still returns only once it is done (its failure was the
                # first call's to raise).
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._backend_closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        if self._tg is None:  # never entered: the backend it was given is still closed
            try:
                await self._close_backend()
            finally:
                self._closing.set_result(None)
            return
        try:
            # Newest first: a queued operation may hang below an older one in the tree. One
            # that others build on cannot be cancelled: it is issued and completes instead.
            for op in reversed(self._load_queue + self._write_queue):
                self.cancel(op)
            if self._load_queue:
                self.start_loading()
            if self._write_queue:
                self.start_writing()
            # Until nothing is in flight: a storage lookup may still back the tree's head up to
            # the host (a copy the completion tasks, stopped below, must complete) and insert
            # what it read.
            await self.wait_idle()
        finally:
            for t in self._tasks:
                t.cancel()
            tg, self._tg = self._tg, None
            try:
                try:
                    await tg.__aexit__(None, None, None)
                finally:
                    # A close cancelled in ``wait_idle`` (or a group that failed) gets here with
                    # loads still copying (each a task of its own) and completions the stopped
                    # tasks left: both still finish.
                    await self._settle()
            finally:
                try:
                    await self._close_backend()
                finally:  # concurrent and later calls must not wait for ever
                    self._closing.set_result(None)

    async def _settle(self) -> None:
        """Wait for the load tasks, then complete what the completion queues hold."""
        while self._loaders:
            await asyncio.wait(list(self._loaders))
            drop_done(self._loaders)
        await self._load_completion.drain()
        await self._write_completion.drain()

    async def _close_backend(self) -> None:
        """Delete from storage what failed loads left there that the group did not
        (``asynccache.stale_purge``), then close the backend — once, as a task of its own: a
        close cancelled meanwhile leaves it running, and a later :meth:`aclose` waits for it."""
        if self.backend is None:
            return
        self._backend_closing = asyncio.ensure_future(self._purge_and_close(self.backend))
        await asyncio.shield(self._backend_closing)

    async def _purge_and_close(self, backend: Any) -> None:
        if self.tiering is not None:
            await self.tiering.purges.run_late()  # a storage failure is counted there, not raised
        await backend.aclose()

    def _require_started(self) -> asyncio.TaskGroup:
        if self._tg is None:
            if self._closing is not None:
                raise ClosedError("the controller is closed")
            raise ClosedError("not started: enter it first (`async with HybridCache(...)` or `async with HybridCacheController(...)`)")
        return self._tg

    async def wait_idle(self) -> bool:
        """Wait until no copy, no storage lookup, no split restore's tail read and no archive to
        storage is in flight; True if anything was (memory may have been freed, and nodes a
        lookup or an archive held locked may be evictable again). A failed operation whose undo
        a released lock no longer blocks is undone first."""
        busy, tier = self._ops.undo_blocked(), self.tiering
        while self._loaders or self._prefetcher.tasks or self._load_completion.depth or self._write_completion.depth or (
            tier is not None and tier.busy
        ):
            busy = True
            for tasks in (self._loaders, self._prefetcher.tasks):
                drop_done(tasks)  # a finished one leaves by its callback a loop pass later
                if tasks:  # not gather: a cancelled wait must not cancel them
                    await asyncio.wait(list(tasks))
            await self._load_completion.wait_idle()
            await self._write_completion.wait_idle()
            if tier is not None:
                await tier.drain()
        return busy
