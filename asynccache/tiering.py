"""The storage tier (L3) as the controller drives it: backup (host → storage) and prefetch
(storage → host).

- **Backup** follows every completed host write: for each backed-up node that holds a host
  state, the KV pages of its path not yet archived are written, then the host states of those
  nodes (KV first, states last), so a stored state always has its KV and archived KV always has
  a state companion at or below it. Nodes are marked archived only when both succeeded. Backups run in the controller's TaskGroup, at most
  ``config.max_backups_in_flight`` at once; the queue behind them is bounded too (past it a
  backup is skipped and counted). Host copies stay locked while their bytes are read.
- **Prefetch** of a miss past the host tier: ``batch_exists_v2`` with KV ``ALL_PAGES`` and the
  state ``TRAILING_PAGES`` clips the hit to the deepest page whose state is stored; with a
  :class:`RestoreCost` the tier restores only the part of the prefix that pays (a shallower
  stored state when reading is slower than recomputing the tokens in between); KV pages and
  then the state are read straight into fresh host slots, which become host-only tree nodes
  (``tree.insert_host``) that the next match loads back. A failure, timeout or corrupt object is
  a miss: everything allocated is freed, nothing is inserted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer, StorageBackend

if TYPE_CHECKING:
    from asynccache.controller import HybridCacheController

__all__ = ["StorageTier", "PrefetchResult", "RestoreCost"]

log = logging.getLogger(__name__)

#: Backups waiting for one of the ``max_backups_in_flight`` places; past this they are skipped
#: (and counted) rather than queued without bound.
_MAX_PENDING_BACKUPS = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreCost:
    """What restoring from storage costs against recomputing: the storage tier's read bandwidth
    and the engine's prefill rate (both measured by the caller, e.g. in a warm-up)."""

    read_bytes_per_s: float
    prefill_tokens_per_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchResult:
    """``num_tokens``: prefix length now available on host (0 when nothing was fetched)."""

    num_tokens: int
    num_pages_fetched: int
    timed_out: bool = False


def _path_to_root(node: Any) -> list[Any]:
    path = []
    while node is not None and node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


class StorageTier:
    def __init__(self, controller: HybridCacheController, backend: StorageBackend, tg: asyncio.TaskGroup) -> None:
        self.controller = controller
        self.tree = controller.tree
        self.backend = backend
        self._tg = tg
        self._sem = asyncio.Semaphore(controller.config.max_backups_in_flight)
        self._in_flight: set[asyncio.Task[None]] = set()
        self.counts: Counter[str] = Counter()
        #: Cost model for choosing how much of a stored prefix to restore (``None``: all of it).
        self.cost: RestoreCost | None = None

    async def register(self) -> None:
        for name, (_, host) in self.controller.pools.items():
            if host is not None:
                await self.backend.register_host_pool_v2(name, host)

    async def drain(self) -> None:
        while self._in_flight:
            await asyncio.gather(*list(self._in_flight), return_exceptions=True)

    # ---- backup ------------------------------------------------------------------------
    def on_host_write(self, plan: Any) -> None:
        """Called on the loop when a device → host backup completed."""
        for node in plan.nodes:
            if node.host_state is None or node.archived:
                continue
            if len(self._in_flight) >= _MAX_PENDING_BACKUPS:
                self.counts["backup_skipped_busy"] += 1
                continue
            task = self._tg.create_task(self._archive(node), name="asynccache-backup")
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    def archive_now(self, node: Any) -> asyncio.Task[None]:
        """Archive ``node`` (its path KV + state) in the background; returns the task."""
        task = self._tg.create_task(self._archive(node), name="asynccache-backup")
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return task

    async def _archive(self, node: Any) -> None:
        async with self._sem:
            if node.host_state is None or node.archived or not node.alive:
                return
            path = _path_to_root(node)
            if any(n.host_kv is None for n in path):
                self.counts["backup_skipped_not_on_host"] += 1
                return
            self.tree.lock_host(node)
            try:
                todo = [n for n in path if not n.archived]
                kv = PoolTransfer(
                    pool_name=PoolName.KV,
                    keys=tuple(h for n in todo for h in n.page_hashes),
                    host_indices=torch.cat([n.host_kv for n in todo]),
                )
                with_state = [n for n in todo if n.host_state is not None]
                state = PoolTransfer(
                    pool_name=PoolName.MAMBA,
                    keys=tuple(n.page_hashes[-1] for n in with_state),
                    host_indices=torch.tensor([n.host_state for n in with_state], dtype=torch.int64),
                )
                # KV first, the states last: a state in storage always has its KV.
                kv_ok = all((await self.backend.batch_set_v2([kv]))[0])
                state_ok = kv_ok and all((await self.backend.batch_set_v2([state]))[0])
            except Exception as e:  # a backend failure is a skipped backup, never a crash
                self.counts["backup_failed"] += 1
                log.warning("backup to storage failed: %s", e)
                return
            finally:
                self.tree.unlock_host(node)
            if state_ok:
                for n in todo:
                    if n.alive:
                        self.tree.mark_archived(n)
                self.counts["backup_ok"] += 1
            else:
                self.counts["backup_failed"] += 1

    # ---- prefetch ----------------------------------------------------------------------
    async def prefetch(self, tokens: Any, match: Any, *, salt: str = "") -> PrefetchResult:
        """Fetch from storage the part of ``tokens`` past ``match`` (see module docstring)."""
        page = self.tree.spec.page_size
        keys = list(match.page_hashes)
        start_page = match.num_tokens // page
        if len(keys) <= start_page or self.controller.pools[PoolName.MAMBA][1] is None:
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        try:
            n = await self._deepest_stored(keys)
            if n > start_page and self.cost is not None:
                n = await self._split_that_pays(keys, start_page, n, num_tokens=len(tokens))
        except Exception as e:
            self.counts["prefetch_failed"] += 1
            log.warning("storage lookup failed: %s", e)
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        if n <= start_page:
            self.counts["prefetch_miss"] += 1
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        return await self._fetch(tokens, match, keys, start_page, n, salt=salt)

    async def _deepest_stored(self, keys: list[str]) -> int:
        """Pages of the longest stored prefix of ``keys`` whose last page has a stored state."""
        if not keys:
            return 0
        exists = await self.backend.batch_exists_v2(
            keys,
            [
                PoolTransfer(pool_name=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES),
                PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES),
            ],
        )
        return exists.num_hit_pages

    async def _split_that_pays(self, keys: list[str], start_page: int, n: int, *, num_tokens: int) -> int:
        """Restore only the part of the prefix that pays.

        Reading ``p`` pages costs ``(p·kv_page_bytes + state_bytes) / read_bw`` and leaves
        ``num_tokens − p·page_size`` tokens to compute at the measured prefill rate; the read
        completes before the compute starts (the prefetch lands on host first). Candidate split
        points are the stored states at or below a few cut points; ``start_page`` (use what the
        upper tiers already hold, i.e. recompute) is always a candidate, so restoring is never
        chosen when it is estimated slower than recomputing.
        """
        assert self.cost is not None
        spec = self.tree.spec
        page = spec.page_size

        def cost(p: int) -> float:
            read = 0.0 if p <= start_page else (p * spec.kv_page_bytes + spec.state_bytes) / self.cost.read_bytes_per_s
            return read + (num_tokens - p * page) / self.cost.prefill_tokens_per_s

        candidates = {start_page, n}
        for frac in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875):
            cut = start_page + int((n - start_page) * frac)
            if cut > start_page:
                candidates.add(await self._deepest_stored(keys[:cut]))
        best = min((p for p in candidates if p == start_page or p > start_page), key=lambda p: (cost(p), -p))
        if best < n:
            self.counts["prefetch_split"] += 1
        return best

    async def _fetch(
        self, tokens: Any, match: Any, keys: list[str], start_page: int, n: int, *, salt: str
    ) -> PrefetchResult:
        ctrl = self.controller
        page = self.tree.spec.page_size
        _, host_kv_pool = ctrl.pools[PoolName.KV]
        _, host_state_pool = ctrl.pools[PoolName.MAMBA]
        node = match.last_node
        host_kv = host_slot = None
        self.tree.lock(node)
        self.tree.lock_host(node)
        inserted = False
        try:
            # Every page of the prefix is read (pages the tree already holds come back as
            # duplicates and are freed by insert_host): host-only nodes need all their pages.
            alloc = self.tree.alloc_host(n, 1)
            if alloc is None:
                self.counts["prefetch_no_room"] += 1
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
            host_kv, host_slot = alloc.kv_indices, alloc.state_slots
            results = await self.backend.batch_get_v2(
                [
                    PoolTransfer(pool_name=PoolName.KV, keys=tuple(keys[:n]), host_indices=host_kv),
                    PoolTransfer(pool_name=PoolName.MAMBA, keys=(keys[n - 1],), host_indices=host_slot),
                ]
            )
            if not (all(results[0]) and all(results[1])):
                self.counts["prefetch_incomplete"] += 1
                return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
            self.tree.insert_host(tokens[: n * page], host_kv, host_states={n * page: int(host_slot[0])}, salt=salt)
            inserted = True
            self.counts["prefetch_hit"] += 1
            self.counts["prefetch_pages"] += n - start_page
            return PrefetchResult(num_tokens=n * page, num_pages_fetched=n - start_page)
        except Exception as e:
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
            self.tree.unlock(node)
            self.tree.unlock_host(node)
