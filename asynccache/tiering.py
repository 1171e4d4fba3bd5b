"""The storage tier (L3) as the controller drives it: backup (host → storage) and prefetch
(storage → host).

- **Backup** follows every completed host write (:mod:`asynccache.host_archive`): for each
  backed-up node that holds a host state, the KV pages of its path, then the host states of
  the path's nodes (KV first, states last), so a stored state always has its KV. The node's
  path stays locked on the host from the backup's completion until its archive has read it. A
  backend that never drops objects gets only the nodes not marked archived, which are marked
  once written; one that evicts for room (it reports a ``capacity_bytes``) gets the whole path
  every time and no node is marked archived: put-if-absent refreshes the objects still stored
  and writes again those the backend dropped. At most ``config.max_backups_in_flight`` write
  at once; the queue behind them is bounded too (past it a backup is skipped and counted).
- **Storage-only snapshots** (``HybridCacheController.archive_snapshots``, run by
  :class:`~asynccache.snapshots.SnapshotArchiver`): states the tree does not keep, staged from
  the caller's device slots and written under the page hash of the last page each covers, with
  the KV of the path up to the deepest one, as *speculative* objects (they only take room that
  displaces no regular object); see :mod:`asynccache.snapshots`.
- **Prefetch** of a miss past the host tier. The tree holds the KV of the match's first
  ``num_matched_tokens`` tokens on some tier (the state only at ``num_tokens``), so storage is
  asked for what lies past them: ``batch_exists_v2`` with KV ``ALL_PAGES`` and the state
  ``TRAILING_PAGES`` over the pages past the tree's gives the deepest page whose state is
  stored; failing that, a stored state within the tree's pages (state ``TRAILING_PAGES`` alone).
  Keys of objects computed on a load that failed (the tree reports them) are not restored
  from (:mod:`asynccache.stored_lookup`) until their objects are deleted, after every archive
  that could store them again (:mod:`asynccache.stale_purge`); a restore whose lookup or read
  such a report overtakes is a miss (``prefetch_stale``).
  The pages the tree holds stay locked (device and host) from the start to the end of the
  prefetch, so evictions meanwhile cannot take them. Only the pages past the tree's are read,
  with the state, into fresh host slots, which become host-only tree nodes below the tree's
  pages (``tree.insert_host(start_page=…)``) that the next match loads back; host copies stay a
  contiguous prefix, so tree pages held on the device only are backed up to the host first
  (``tree.host_gap`` and a controller write). A failure, timeout or corrupt object is a miss:
  everything allocated is freed, nothing is inserted.
- **Split restore** (with a :class:`RestoreCost`): restore everything, recompute everything, or
  — when the caller can take it (``allow_tail=True``) — a
  :class:`~asynccache.prefetch.TailRestore`: the engine
  computes the head of the prefix itself while the tier reads the tail's KV pages and the state
  at its end into private host slots (:mod:`asynccache.tail_fetch`), so reading and computing
  overlap. The split balances the
  two: ``min over b of max(compute(head b), read(tail from b))``, b not before the first page
  read from storage (:func:`~asynccache.restore_cost.plan_restore`). Read estimates are corrected
  by the read times observed, separately for whole restores and for tails read beside a head's
  computation (:class:`ReadTimeCorrection`), and the head's computation by its time beside the
  reads (``compute_beside_reads``): the two share the host, so a split overlaps less than
  perfectly, and the model learns by how much and on which side — a tail is observed when it
  landed (as the backend stamped it where it read, :mod:`asynccache.read_landing`, else when
  the loop resumed the read), a head when the engine reports it computed
  (``TailRestore.head_computed``), and each side's time corrects its own estimate
  (:class:`~asynccache.restore_cost.SplitTiming`). While
  whole restores are chosen over a possible split, the split's corrections fade back (the
  tail's toward the whole-restore one, the head's toward 1), so a split is tried again. (``counts["prefetch_split"]`` counts every choice other than a whole restore:
  recomputing or a tail restore.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from asynccache.completion import drop_done
from asynccache.host_archive import HostWriteArchiver
from asynccache.prefetch import PrefetchResult, TailRestore, held_node
from asynccache.read_landing import timed_read
from asynccache.restore_cost import (
    ReadTimeCorrection,
    RestoreCost,
    plan_restore,
)
from asynccache.snapshots import SnapshotArchiver
from asynccache.stale_purge import StalePurges, StaleWatch
from asynccache.storage import PoolName, PoolTransfer, StorageBackend
from asynccache.storage_admission import ArchiveAdmission
from asynccache.stored_lookup import deepest_stored
from asynccache.tail_fetch import TailFetchMixin

if TYPE_CHECKING:
    from asynccache.controller import HybridCacheController

# PrefetchResult and TailRestore (asynccache.prefetch), RestoreCost and ReadTimeCorrection
# (asynccache.restore_cost) are what the tier's prefetch gives and takes: importable from here too.
__all__ = ["PrefetchResult", "ReadTimeCorrection", "RestoreCost", "StorageTier", "TailRestore"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class StorageTier(TailFetchMixin):
    def __init__(self, controller: HybridCacheController, backend: StorageBackend, tg: asyncio.TaskGroup) -> None:
        self.controller = controller
        self.tree = controller.tree
        self.backend = backend
        self._tg = tg
        #: bounds the archives writing at once (``max_backups_in_flight``)
        self.sem = asyncio.Semaphore(controller.config.max_backups_in_flight)
        #: the backend drops objects for room (it reports a capacity): archive flags could not stay true
        stats = getattr(backend, "statistics", None)
        self.storage_evicts = stats is not None and getattr(stats(), "capacity_bytes", None) is not None
        self._in_flight: set[asyncio.Task[Any]] = set()
        self.counts: Counter[str] = Counter()
        #: Cost model for choosing how much of a stored prefix to restore (``None``: all of it).
        self.cost: RestoreCost | None = None
        #: Observed ÷ estimated read time of whole restores and of split restores' tails, and
        #: computation time of split restores' heads (beside their tails' reads).
        self.read_alone = ReadTimeCorrection()
        self.read_beside_compute = ReadTimeCorrection()
        self.compute_beside_reads = ReadTimeCorrection(min_bytes=0)
        #: Archive each completed device → host backup (write-through to storage). Off: storage
        #: gets only what the owner writes itself (trace replay's ``storage_write="demote"``).
        self.archive_host_writes = True
        #: storage-only snapshots (``HybridCacheController.archive_snapshots``)
        self.snapshots = SnapshotArchiver(self)
        #: archives of completed host writes (:meth:`on_host_write`)
        self.archiver = HostWriteArchiver(self)
        #: which of them a storage that evicts takes (:mod:`asynccache.storage_admission`;
        #: None: all of them)
        self.admission: ArchiveAdmission | None = None
        #: keys of objects computed on a failed load (the tree reports them): not restored
        #: from until their objects are deleted
        self.purges = StalePurges(self)
        self.unservable = self.purges.unservable
        self.tree.stale_hook = self.purges.report

    async def register(self) -> None:
        for name, (_, host) in self.controller.pools.items():
            if host is not None:
                await self.backend.register_host_pool_v2(name, host)

    @property
    def busy(self) -> bool:
        """Whether an archive (or another task of the tier's) is in flight."""
        drop_done(self._in_flight)
        return bool(self._in_flight)

    async def drain(self) -> None:
        while self._in_flight:
            drop_done(self._in_flight)
            if self._in_flight:
                await asyncio.gather(*list(self._in_flight), return_exceptions=True)

    # ---- backup ------------------------------------------------------------------------
    def on_host_write(self, plan: Any) -> None:
        """Called on the loop when a device → host backup completed: archive its nodes
        (:class:`~asynccache.host_archive.HostWriteArchiver`)."""
        if self.archive_host_writes:
            self.archiver.on_host_write(plan)

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Run ``coro`` in the controller's TaskGroup, waited for by :meth:`drain`
        (``RuntimeError`` when the group is shutting down: the caller closes ``coro``)."""
        task = self._tg.create_task(coro, name=name)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return task

    def archive_now(self, node: Any) -> asyncio.Task[None] | None:
        """Archive ``node`` (its path KV + state) in the background; returns the task (None
        when the group is shutting down). Its path stays locked on the host until read."""
        return self.archiver.queue(node, ticket=self.archiver.ticket(node))

    # ---- prefetch ----------------------------------------------------------------------
    async def prefetch(
        self,
        tokens: Any,
        match: Any,
        *,
        allow_tail: bool = False,
        probed: asyncio.Event | None = None,
    ) -> PrefetchResult:
        """Fetch from storage the part of ``tokens`` past ``match`` (see module docstring), into
        the match's tenant (``match.salt``: the keys read are that tenant's).

        With ``allow_tail`` the result may carry a :class:`TailRestore` that the caller owns.
        ``probed`` is set once storage has been probed: when the fetch starts reading (a whole
        restore), or when it ends (a miss, a split restore, a failure).
        """
        try:
            page = self.tree.spec.page_size
            start_page = match.num_tokens // page
            if len(match.page_hashes) <= start_page or self.controller.pools[PoolName.MAMBA][1] is None:
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
            # The lookup below awaits storage; meanwhile the KV the match holds (which the
            # fetched pages extend) must not be evicted.
            node = held_node(match)
            token = self.tree.lock(node)
            self.tree.lock_host(node)
            try:
                with self.purges.watching(match.page_hashes) as watch:
                    return await self._prefetch(
                        tokens, match, start_page, allow_tail=allow_tail, probed=probed, watch=watch
                    )
            finally:
                self.tree.unlock(node, token)
                self.tree.unlock_host(node)
        finally:
            if probed is not None:
                probed.set()

    async def _prefetch(
        self,
        tokens: Any,
        match: Any,
        start_page: int,
        *,
        allow_tail: bool,
        probed: asyncio.Event | None,
        watch: StaleWatch,
    ) -> PrefetchResult:
        keys = list(match.page_hashes)
        # The tree holds the KV of the pages before ``held`` on some tier (the state only at
        # ``start_page``): storage is asked for what lies past them.
        held = max(start_page, min(match.num_matched_tokens // self.tree.spec.page_size, len(keys)))
        try:
            n = await deepest_stored(self.backend, keys, start_page, held, self.unservable)
        except Exception as e:  # noqa: BLE001 — a storage failure is a miss, logged and counted
            self.counts["prefetch_failed"] += 1
            log.warning("storage lookup failed: %s", e)
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        if n <= start_page:
            self.counts["prefetch_miss"] += 1
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        first = min(held, n)  # the first page read from storage
        begin = start_page
        if self.cost is not None:
            stored = n
            begin, n, split_possible = plan_restore(
                self.cost,
                self.tree.spec,
                start_page=start_page,
                first_page=first,
                end_page=n,
                num_tokens=len(tokens),
                allow_tail=allow_tail,
                read_factor=self.read_alone.factor,
                tail_read_factor=self.read_beside_compute.factor,
                head_compute_factor=self.compute_beside_reads.factor,
            )
            if (begin, n) != (start_page, stored):
                self.counts["prefetch_split"] += 1
            elif split_possible:
                # A split was possible but not chosen, so its correction is not observed this
                # time: let a pessimism learnt from a few slow tails fade toward the whole-read
                # figure.
                self.read_beside_compute.relax(self.read_alone.factor)
                self.compute_beside_reads.relax(1.0)
            if n <= start_page:  # recomputing is estimated faster than restoring
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        if watch.stale:  # keys of what was found were reported meanwhile: their objects go
            self.counts["prefetch_stale"] += 1
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        if begin > start_page:
            return self._start_tail(tokens, match, keys, begin, n)
        if probed is not None:
            probed.set()  # reading from here on
        return await self._fetch(tokens, match, keys, first, n, watch=watch)

    def _observe(self, correction: ReadTimeCorrection, num_pages: int, elapsed_s: float) -> None:
        if self.cost is not None:
            spec = self.tree.spec
            correction.observe(num_pages * spec.kv_page_bytes + spec.state_bytes, elapsed_s, self.cost.read_bytes_per_s)

    async def _head_on_host(self, match: Any, num_pages: int) -> bool:
        """Give the first ``num_pages`` pages of ``match`` host copies: those the tree holds on
        the device only are backed up (host copies stay a contiguous prefix, so the fetched
        pages can only hang below host copies). False when the host has no room."""
        gap = self.tree.host_gap(held_node(match), num_pages) if num_pages else []
        if not gap:
            return True
        op = self.controller.write(gap, priority=1)
        if op is None:
            return False
        self.controller.start_writing()
        await op
        self.counts["prefetch_head_backups"] += 1
        return True

    async def _fetch(
        self, tokens: Any, match: Any, keys: list[str], first: int, n: int, *, watch: StaleWatch
    ) -> PrefetchResult:
        """Read pages ``[first, n)`` and the state at ``n`` into fresh host slots and insert them
        below the tree's first ``first`` pages (backed up to the host first where needed)."""
        ctrl = self.controller
        page = self.tree.spec.page_size
        _, host_kv_pool = ctrl.pools[PoolName.KV]
        _, host_state_pool = ctrl.pools[PoolName.MAMBA]
        host_kv = host_slot = None
        inserted = False  # the match's KV is locked throughout (see prefetch)
        try:
            if not await self._head_on_host(match, first):
                self.counts["prefetch_no_room"] += 1
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
            alloc = self.tree.alloc_host(n - first, 1)
            if alloc is None:
                self.counts["prefetch_no_room"] += 1
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
            host_kv, host_slot = alloc.kv_indices, alloc.state_slots
            transfers = [
                PoolTransfer(pool_name=PoolName.KV, keys=tuple(keys[first:n]), host_indices=host_kv),
                PoolTransfer(pool_name=PoolName.MAMBA, keys=(keys[n - 1],), host_indices=host_slot),
            ]
            t0 = time.perf_counter()
            results, landed_at = await timed_read(self.backend.batch_get_v2(transfers))
            if not all(all(r) for r in results):
                self.counts["prefetch_incomplete"] += 1
                # What the lookup found is gone (a backend removes an invalid object it reads):
                # a node the tree holds of those pages, inserted meanwhile, is stored no more.
                self.tree.forget_archived(tokens[: n * page], start_page=first, salt=match.salt)
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
            if watch.stale:  # read what a report named meanwhile (the objects of a failed load)
                self.counts["prefetch_stale"] += 1
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
            self._observe(self.read_alone, n - first, landed_at - t0)
            self.tree.insert_host(
                tokens[: n * page], host_kv, host_states={n * page: int(host_slot[0])}, start_page=first, salt=match.salt
            )
            inserted = True
            self.counts["prefetch_hit"] += 1
            self.counts["prefetch_pages"] += n - first
            return PrefetchResult(num_tokens=n * page, num_pages_fetched=n - first)
        except Exception as e:  # noqa: BLE001 — a storage failure is a miss, logged and counted
            self.counts["prefetch_failed"] += 1
            log.warning("prefetch from storage failed: %s", e)
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        finally:
            # Prefetches run as TaskGroup tasks that waiters never cancel (they stop waiting at the
            # policy's deadline instead), so no read can still be landing in a slot freed here.
            if not inserted:
                if host_kv is not None and host_kv.numel():
                    assert host_kv_pool is not None
                    host_kv_pool.free(host_kv)
                if host_slot is not None and host_slot.numel():
                    assert host_state_pool is not None
                    host_state_pool.free(host_slot)
