"""Allocation from the tree's pools that evicts through the tree to make room.

Primitives: :class:`AllocationMixin` — ``alloc_device``, ``alloc_host``: take pages and state
slots of one tier, evicting (:mod:`asynccache.tree.evict`) for what its pools lack. ``None`` when
there is still no room; nothing is taken then, and what eviction freed stays free. ``None`` at
once, nothing evicted, for more than a pool holds in all: eviction cannot make that room.
"""

from __future__ import annotations

from collections.abc import Callable

from asynccache.checks import check_int
from asynccache.pools.base import ItemPool
from asynccache.tree.evict import EvictionMixin
from asynccache.tree.results import Allocation, EvictResult

__all__ = ["AllocationMixin"]


class AllocationMixin(EvictionMixin):
    """``alloc_device``, ``alloc_host`` on top of :class:`~asynccache.tree.evict.EvictionMixin`."""

    def alloc_device(self, num_kv_pages: int = 0, num_states: int = 0) -> Allocation | None:
        """``num_kv_pages`` device pages and ``num_states`` device state slots, evicting through
        the tree for what the pools lack; ``None`` when there is still no room (nothing is
        taken then; what eviction freed stays free), and at once, with nothing evicted, when
        either count exceeds its pool's ``num_items``. The caller owns the indices."""
        return self._alloc(self.device_kv, self.device_mamba, num_kv_pages, num_states, self.evict_device)

    def alloc_host(self, num_kv_pages: int = 0, num_states: int = 0) -> Allocation | None:
        """Like :meth:`alloc_device` for the host pools (``None`` without a host tier)."""
        if self.host_kv is None or (num_states and self.host_mamba is None):
            return None
        return self._alloc(self.host_kv, self.host_mamba, num_kv_pages, num_states, self.evict_host)

    @staticmethod
    def _alloc(
        kv_pool: ItemPool,
        state_pool: ItemPool | None,
        num_kv_pages: int,
        num_states: int,
        evict: Callable[..., EvictResult],
    ) -> Allocation | None:
        """Take ``num_kv_pages`` of ``kv_pool`` and ``num_states`` of ``state_pool``, all or
        nothing, after ``evict`` for what they lack; ``None`` without evicting anything when a
        count exceeds its pool's ``num_items`` (no eviction could make that room)."""
        num_kv_pages = check_int("num_kv_pages", num_kv_pages, minimum=0)
        num_states = check_int("num_states", num_states, minimum=0)
        if num_kv_pages > kv_pool.num_items or (state_pool is not None and num_states > state_pool.num_items):
            return None  # more than the pool holds even when empty: evicting would only lose the cache
        short_kv = num_kv_pages - kv_pool.num_free
        short_states = num_states - state_pool.num_free if state_pool is not None else 0
        if short_kv > 0 or short_states > 0:
            evict(num_kv_pages=max(short_kv, 0), num_states=max(short_states, 0))
        kv = kv_pool.alloc(num_kv_pages)
        if kv is None:
            return None
        if not num_states:
            return Allocation(kv_indices=kv)
        assert state_pool is not None
        slots = state_pool.alloc(num_states)
        if slots is None:
            kv_pool.free(kv)
            return None
        return Allocation(kv_indices=kv, state_slots=slots)
