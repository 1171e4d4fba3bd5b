"""Storage prefetches as the controller runs them, and the loads of their split restores.

A request whose prompt runs past its match asks the storage tier (``asynccache.tiering``) for
the pages it misses. The controller runs each such lookup as a task in its ``TaskGroup`` with
the nodes holding the match's KV pinned, on the device and the host (the lookup takes a while,
during which other requests evict, and what it fetches extends that KV), and the request waits
for it no longer than the prefetch policy's deadline: the fetch is never cancelled, its data
still lands on host for later requests. A split restore's tail (:class:`TailRestore`) that
lands in time is loaded onto the request's own device pages and state slots with the step's
other loads.

- :class:`Prefetcher` — one per controller: ``start`` a prefetch, the ``tasks`` in flight,
  ``wait`` for one within the deadline (a split restore nobody takes is released when it
  arrives), ``tail_load_op``: a landed tail as a load operation.
- :class:`PrefetchResult` — what a prefetch gives; :class:`TailRestore` — a split restore's
  tail, read into private host slots; :func:`held_node` — the node whose lock keeps the KV a
  match holds.

Call from the event-loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asynccache.config import HybridCacheConfig
from asynccache.errors import ClosedError, ConfigError
from asynccache.ops import CacheOperation, OpKind
from asynccache.stats import StatsRecorder
from asynccache.storage import PoolName, PoolTransfer

if TYPE_CHECKING:
    from asynccache.restore_cost import SplitTiming
    from asynccache.stale_purge import StaleWatch
    from asynccache.tree import HybridRadixTree

__all__ = ["PrefetchResult", "Prefetcher", "TailRestore", "held_node"]


@dataclass(slots=True, kw_only=True, eq=False)
class TailRestore:
    """The tail of a stored prefix, read while the engine computes its head.

    Tokens ``[begin_tokens, end_tokens)``: their KV pages land in ``host_kv`` (one host page per
    page, in order) and the state at ``end_tokens`` in ``host_slot``; ``fetch`` resolves to True
    when every item arrived intact. The slots are private (not in the tree): the caller copies
    them to the device and then calls :meth:`release` — also on every path that drops the
    restore. Releasing before the fetch finished defers the free until it has (a read may still
    be landing in the slots); the fetch itself is never cancelled. The caller reports when it
    starts computing the head (:meth:`head_started`) and when it has computed it
    (:meth:`head_computed`): the tier then learns which side of the split was the slower one
    (``timing``, see :class:`~asynccache.restore_cost.SplitTiming`).
    """

    begin_tokens: int
    end_tokens: int
    host_kv: torch.Tensor
    host_slot: torch.Tensor
    fetch: asyncio.Task[bool]
    free: Callable[[], None]
    released: bool = False
    timing: SplitTiming | None = None
    #: turns ``stale`` true when the storage tier hears, before the tail is released, that a key
    #: it read holds data computed on a failed load (``asynccache.stale_purge.StaleWatch``)
    watch: StaleWatch | None = None

    def head_started(self) -> None:
        """The engine starts computing the head (the request is admitted; the first call counts)."""
        if self.timing is not None:
            self.timing.head_started(time.perf_counter())

    def head_computed(self) -> None:
        """The engine has computed the head ``[.., begin_tokens)`` (the first call counts)."""
        if self.timing is not None:
            self.timing.head_done(time.perf_counter())

    @property
    def ok(self) -> bool:
        """The fetch finished, every item arrived intact, no key it read was reported since
        (see ``watch``) and the slots are not released."""
        f = self.fetch
        if self.released or not f.done() or f.cancelled() or f.exception() is not None or not f.result():
            return False
        return self.watch is None or not self.watch.stale

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.fetch.done():
            self.free()
        else:
            self.fetch.add_done_callback(lambda _: self.free())


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchResult:
    """``num_tokens``: prefix length now cached (the match's when nothing was
    fetched); ``num_pages_fetched``: KV pages read from storage for it (0 for a state alone);
    ``tail``: a split restore the caller must finish (and release), see :class:`TailRestore`."""

    num_tokens: int
    num_pages_fetched: int
    tail: TailRestore | None = None


def held_node(match: Any) -> Any:
    """The node whose lock keeps the KV of ``match``'s first ``num_matched_tokens`` tokens."""
    node = getattr(match, "matched_node", None)
    return match.last_node if node is None else node


def _release_late_tail(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        tail = getattr(task.result(), "tail", None)
        if tail is not None:
            tail.release()


class Prefetcher:
    """Runs the controller's storage prefetches (see ``HybridCacheController.prefetch``)."""

    def __init__(self, tree: HybridRadixTree, config: HybridCacheConfig, stats: StatsRecorder) -> None:
        self.tree = tree
        self.config = config
        self._stats = stats
        #: storage lookups in flight (each holds its match's KV locked until it ends)
        self.tasks: set[asyncio.Task[Any]] = set()
        #: each lookup's event set once it has probed storage (see ``tiering.prefetch``)
        self._probed: dict[asyncio.Task[Any], asyncio.Event] = {}
        #: lookups whose split restore nobody takes (``abandon``): a later ``wait`` gets no tail
        self._abandoned: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    def start(
        self, tg: asyncio.TaskGroup, tiering: Any, tokens: Sequence[int], match: Any, *, allow_tail: bool
    ) -> asyncio.Task[Any]:
        """``tiering.prefetch`` of what ``tokens`` miss past ``match``, as a task of ``tg``."""
        # The KV the match holds must outlive the fetch (the fetched pages extend it): the task
        # starts later, and storage lookups take a while, during which other requests evict.
        node = held_node(match)
        token = self.tree.lock(node)
        self.tree.lock_host(node)

        def unlock(_: asyncio.Task[Any]) -> None:
            self.tree.unlock(node, token)
            self.tree.unlock_host(node)

        probed = asyncio.Event()
        coro = tiering.prefetch(tokens, match, allow_tail=allow_tail, probed=probed)
        try:
            task = tg.create_task(coro, name="asynccache-prefetch")
        except RuntimeError as e:  # the group is shutting down: a background task failed
            coro.close()
            unlock(None)  # type: ignore[arg-type]
            raise ClosedError(f"the controller is shutting down: {e}") from e
        task.add_done_callback(unlock)
        self.tasks.add(task)
        self._probed[task] = probed

        def forget(_: asyncio.Task[Any]) -> None:
            self.tasks.discard(task)
            self._probed.pop(task, None)
            probed.set()  # ended (also when cancelled before it probed): wake its waiters

        task.add_done_callback(forget)
        return task

    async def wait_probed(
        self, task: asyncio.Task[Any], num_tokens: int, *, elapsed_s: float = 0.0, at_most_s: float | None = None
    ) -> None:
        """Wait until ``task`` has probed storage (it reads, or it has ended), at most until the
        policy's deadline (``elapsed_s`` already spent) and at most ``at_most_s``."""
        event = self._probed.get(task)
        if event is None or event.is_set():
            return
        timeout = self.time_left(num_tokens, elapsed_s)
        if at_most_s is not None:
            timeout = at_most_s if timeout is None else min(timeout, at_most_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()

    async def wait(self, task: asyncio.Task[Any], num_tokens: int, *, elapsed_s: float = 0.0) -> Any | None:
        """The prefetch's result if it finished within the policy's deadline, else None.
        ``elapsed_s``: how long the caller has already waited for it (the deadline counts from
        then: a request that waited while others computed does not wait a whole deadline more)."""
        timeout = self.time_left(num_tokens, elapsed_s)
        try:
            if timeout == 0.0 and not task.done():
                await asyncio.sleep(0)
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            # The waiter is gone (its request was cancelled): nobody takes a split restore.
            self.abandon(task)
            raise
        if task not in done:
            self._stats.count("prefetch_deadline_passed")
            # Nobody takes a split restore that arrives after the deadline: release it then.
            self.abandon(task)
            return None
        result = task.result()
        if task in self._abandoned and getattr(result, "tail", None) is not None:
            # Asked again after an earlier wait gave up: the tail is released (or will be when
            # it lands), its slots no longer the caller's. What landed on host stays.
            result = dataclasses.replace(result, tail=None)
        return result

    def time_left(self, num_tokens: int, elapsed_s: float) -> float | None:
        """Seconds left to wait for a prefetch that has run ``elapsed_s`` (None: no limit)."""
        timeout = self.config.prefetch_timeout_s(num_tokens)
        return None if timeout is None else max(0.0, timeout - elapsed_s)

    def abandon(self, task: asyncio.Task[Any]) -> None:
        """Nobody will take ``task``'s result: release the split restore it brings, if any,
        once it has ended (at once if it has). A later :meth:`wait` gets the result without it."""
        if task in self._abandoned:
            return
        self._abandoned.add(task)
        task.add_done_callback(_release_late_tail)

    def tail_load_op(
        self, tail: Any, device_pages: torch.Tensor, state_slots: torch.Tensor, *, num_pages: int, num_slots: int
    ) -> CacheOperation:
        """The load of a landed tail restore (see ``HybridCacheController.load_tail``): no tree
        plan, and the tail is released once the operation is done. :class:`ConfigError` for a
        tail that is not landed intact or already released, and for page or slot lists that do
        not fit the tail or the device pools (``num_pages`` pages, ``num_slots`` slots)."""
        if not tail.ok:
            state = "released" if tail.released else "not landed intact"
            raise ConfigError(f"load_tail: the tail restore is {state}")
        lists = (
            ("device_pages", device_pages, tail.host_kv.numel(), num_pages),
            ("state_slots", state_slots, None, num_slots),
        )
        for what, t, n, limit in lists:
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                raise ConfigError(f"load_tail: {what} must be a 1-D int64 tensor")
            if (n is not None and t.numel() != n) or (n is None and t.numel() < 1):
                raise ConfigError(
                    f"load_tail: {what} holds {t.numel()} indices, the tail needs {'at least 1' if n is None else n}"
                )
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= limit):
                raise ConfigError(f"load_tail: {what} must lie in [0, {limit})")
        loop = asyncio.get_running_loop()
        op = CacheOperation(
            OpKind.LOAD,
            (
                PoolTransfer(pool_name=PoolName.KV, host_indices=tail.host_kv, device_indices=device_pages),
                PoolTransfer(
                    pool_name=PoolName.MAMBA,
                    host_indices=tail.host_slot.repeat(state_slots.numel()),
                    device_indices=state_slots,
                ),
            ),
            plan=None,
            loop=loop,
        )
        op.future.add_done_callback(lambda _: tail.release())
        return op
