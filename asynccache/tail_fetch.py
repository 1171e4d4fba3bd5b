"""The storage tier's split restores: the tail of a stored prefix read into private host slots
in the background while the engine computes the head (see :mod:`asynccache.tiering`, *Split
restore*, and :class:`~asynccache.prefetch.TailRestore`).

- :class:`TailFetchMixin` — ``_start_tail`` (allocate the slots, start the read as a task of the
  tier) and ``_read_tail`` (the read, timed to its landing; a miss when a report of a key it
  reads came before it landed: :mod:`asynccache.stale_purge`; one after it, until the tail is
  released, makes ``TailRestore.ok`` false). A base of
  :class:`~asynccache.tiering.StorageTier`, not used on its own.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import torch

from asynccache.errors import ClosedError
from asynccache.prefetch import PrefetchResult, TailRestore
from asynccache.read_landing import timed_read
from asynccache.restore_cost import ReadTimeCorrection, RestoreCost, SplitTiming
from asynccache.storage import PoolName, PoolTransfer

if TYPE_CHECKING:
    import asyncio

    from asynccache.controller import HybridCacheController
    from asynccache.stale_purge import StalePurges, StaleWatch
    from asynccache.storage import StorageBackend

__all__ = ["TailFetchMixin"]

log = logging.getLogger("asynccache.tiering")


class TailFetchMixin:
    """Split restores' tails of :class:`~asynccache.tiering.StorageTier` (see the module
    docstring)."""

    # Set by StorageTier's constructor.
    controller: HybridCacheController
    tree: Any
    backend: StorageBackend
    counts: Counter[str]
    cost: RestoreCost | None
    read_beside_compute: ReadTimeCorrection
    compute_beside_reads: ReadTimeCorrection
    purges: StalePurges

    if TYPE_CHECKING:

        def spawn(self, coro: Coroutine[Any, Any, bool], *, name: str) -> asyncio.Task[bool]: ...

    def _start_tail(self, tokens: Any, match: Any, keys: list[str], begin: int, n: int) -> PrefetchResult:
        """Allocate private host slots for pages ``[begin, n)`` of ``tokens`` and the state at
        ``n``, and start reading them in the background (see :class:`TailRestore`)."""
        ctrl = self.controller
        page = self.tree.spec.page_size
        _, host_kv_pool = ctrl.pools[PoolName.KV]
        _, host_state_pool = ctrl.pools[PoolName.MAMBA]
        assert host_kv_pool is not None and host_state_pool is not None
        alloc = self.tree.alloc_host(n - begin, 1)  # the match's KV is locked (see prefetch)
        if alloc is None:
            self.counts["prefetch_no_room"] += 1
            return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0)
        host_kv, host_slot = alloc.kv_indices, alloc.state_slots
        timing = None
        if self.cost is not None:
            spec = self.tree.spec
            tail_bytes = (n - begin) * spec.kv_page_bytes + spec.state_bytes
            timing = SplitTiming(
                read=self.read_beside_compute,
                compute=self.compute_beside_reads,
                head_est_s=self.cost.compute_s(match.num_tokens // page * page, begin * page),
                tail_est_s=tail_bytes / self.cost.read_bytes_per_s,
                tail_bytes=tail_bytes,
                started=time.perf_counter(),
            )

        # Watched from here (the lookup's own watch ends with it) until the tail is released: a
        # report of a key it reads before the read has landed makes the tail a miss, and one
        # before the engine takes it makes it not ``ok`` (the engine computes it instead).
        watch = self.purges.watch(keys[begin:n])

        def free() -> None:
            self.purges.unwatch(watch)
            host_kv_pool.free(host_kv)
            host_state_pool.free(host_slot)
            if timing is not None:
                timing.settle_unreported()

        # A read that comes back incomplete: a node the tree holds of those pages (inserted
        # meanwhile) is stored no more.
        def lost() -> None:
            self.tree.forget_archived(tokens[: n * page], start_page=begin, salt=match.salt)

        read = self._read_tail(keys[begin:n], host_kv, host_slot, timing, watch, lost)
        try:  # waited for by drain(): a tail read in flight keeps the tier busy
            fetch = self.spawn(read, name="asynccache-tail")
        except RuntimeError as e:  # shutting down (a background task failed)
            read.close()
            free()
            raise ClosedError(f"the controller is shutting down: {e}") from e
        self.counts["prefetch_tail"] += 1
        tail = TailRestore(
            begin_tokens=begin * page,
            end_tokens=n * page,
            host_kv=host_kv,
            host_slot=host_slot,
            fetch=fetch,
            free=free,
            timing=timing,
            watch=watch,
        )
        return PrefetchResult(num_tokens=match.num_tokens, num_pages_fetched=0, tail=tail)

    async def _read_tail(
        self,
        keys: list[str],
        host_kv: torch.Tensor,
        host_slot: torch.Tensor,
        timing: SplitTiming | None,
        watch: StaleWatch,
        lost: Callable[[], object],
    ) -> bool:
        """Read the tail (``lost``: called when the read comes back incomplete — what the lookup
        found is gone, a backend removes an invalid object it reads)."""
        try:
            results, landed_at = await timed_read(
                self.backend.batch_get_v2(
                    [
                        PoolTransfer(pool_name=PoolName.KV, keys=tuple(keys), host_indices=host_kv),
                        PoolTransfer(pool_name=PoolName.MAMBA, keys=(keys[-1],), host_indices=host_slot),
                    ]
                )
            )
        except Exception as e:  # noqa: BLE001 — a storage failure is a miss, logged and counted
            self.counts["prefetch_failed"] += 1
            log.warning("tail restore from storage failed: %s", e)
            return False
        if not (all(results[0]) and all(results[1])):
            self.counts["prefetch_incomplete"] += 1
            lost()
            return False
        if watch.stale:  # read what a report named meanwhile (the objects of a failed load)
            self.counts["prefetch_stale"] += 1
            return False
        self.counts["tail_pages"] += len(keys)
        if timing is not None:
            timing.landed(landed_at)
        return True
