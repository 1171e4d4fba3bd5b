"""Eviction by bytes: free one tier's memory from KV pages and states alike, in the policy's order.

A tier's memory is bytes, shared by its KV pages and its state slots, and which of the two
should go depends on the eviction policy. :meth:`ByteEvictionMixin.evict_bytes` frees at least
``num_bytes`` of the device or host tier, in rounds:

- the next victims of the tier's KV list and of its state list are peeked from the eviction
  policy (the members it offers first that the tree would evict now), enough of each to cover
  the missing bytes;
- they are merged by the policy's ``victim_key(node, key=, now=)``, lowest first (the last
  access by default, so LRU compares recency; utility per byte for
  :class:`~asynccache.policy.ranked.RankedEviction`). A KV victim's state on the tier leaves with
  it, so its bytes count with the KV and that state is not counted again on the state list;
- ``evict_device`` / ``evict_host`` evicts the merged numbers of pages and states in one call
  (demote, write back or drop as the write policy says: see :mod:`asynccache.tree.evict`);
- the rounds go on until the bytes are freed, or a round finds nothing to evict, or it frees
  nothing while nothing is left in flight.

Bytes are the pools' ``bytes_per_index``; what counts as freed is what went back to the tier's
pools during the call (what the tombstone cascade deleted included). Write-back victims still in
flight are not freed yet: the call goes on to the next victims. ``count_states=False`` leaves
states out of the bytes (they cost nothing and leave with their KV).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import fields
from functools import partial

from asynccache.errors import ConfigError
from asynccache.policy.base import EvictionPolicy
from asynccache.policy.ranked import evictable
from asynccache.pools.base import ItemPool
from asynccache.tree.core import DemoteFn, WriteBackFn
from asynccache.tree.evict import EvictionMixin
from asynccache.tree.lru import LRUList
from asynccache.tree.node import Tier, TreeNode
from asynccache.tree.results import EvictResult

__all__ = ["ByteEvictionMixin"]


class ByteEvictionMixin(EvictionMixin):
    """``evict_bytes`` on top of :class:`~asynccache.tree.evict.EvictionMixin`."""

    def evict_bytes(
        self,
        tier: Tier,
        num_bytes: int,
        *,
        count_states: bool = True,
        write_back: WriteBackFn | None = None,
        demote: DemoteFn | None = None,
    ) -> EvictResult:
        """Free at least ``num_bytes`` of ``tier``'s pages and state slots if possible, KV or
        states as the eviction policy's victim keys say (see the module docstring). ``tier``:
        ``DEVICE`` or ``HOST``. ``write_back`` (device) and ``demote`` (host) go to
        ``evict_device`` / ``evict_host``. The result adds up the rounds' evictions. Mutates the
        tree and frees indices to the pools."""
        if not isinstance(tier, Tier) or tier is Tier.STORAGE:
            raise ConfigError(f"evict_bytes frees the device or the host tier, not {tier!r}")
        if isinstance(num_bytes, bool):
            raise ConfigError(f"num_bytes must be an integer, got {num_bytes!r}")
        try:
            num_bytes = operator.index(num_bytes)
        except TypeError:
            raise ConfigError(f"num_bytes must be an integer, got {num_bytes!r}") from None
        if num_bytes < 0:
            raise ConfigError(f"cannot evict a negative amount ({num_bytes} bytes)")
        if tier is Tier.HOST and self.host_kv is None:
            raise ConfigError("no host tier to evict from")
        if demote is not None and tier is not Tier.HOST:
            raise ConfigError("only host eviction demotes to storage")
        if write_back is not None and tier is not Tier.DEVICE:
            raise ConfigError("only device eviction writes back")
        if tier is Tier.DEVICE:
            kv_pool, state_pool = self.device_kv, self.device_mamba
            kv_lru, state_lru = self.device_kv_lru, self.device_state_lru
            evict = partial(self.evict_device, write_back=write_back)
        else:
            assert self.host_kv is not None
            kv_pool, state_pool = self.host_kv, self.host_mamba
            kv_lru, state_lru = self.host_kv_lru, self.host_state_lru
            evict = partial(self.evict_host, demote=demote)
        if not count_states:
            state_pool = None
        kv_bytes = kv_pool.bytes_per_index
        state_bytes = state_pool.bytes_per_index if state_pool is not None else 0
        kv_key, state_key = f"{tier.value}_kv", f"{tier.value}_state"
        free0 = _free_bytes(kv_pool, state_pool)
        total = EvictResult(tier=tier)
        freed = 0
        while freed < num_bytes:
            deficit = num_bytes - freed
            now = self.clock()
            kv_nodes: list[TreeNode] = []
            if kv_bytes:  # a spec without attention layers: its pages hold no bytes to free
                kv_nodes = self._peek(kv_lru, kv_key, now, max(1, -(-deficit // kv_bytes)))
            st_nodes: list[TreeNode] = []
            if state_bytes:
                st_nodes = self._peek(state_lru, state_key, now, max(1, -(-deficit // state_bytes)))
            if not kv_nodes and not st_nodes:
                break
            pages, states = self._merge_victims(
                kv_nodes, st_nodes, tier=tier, deficit=deficit, kv_bytes=kv_bytes, state_bytes=state_bytes, now=now
            )
            result = evict(num_kv_pages=pages, num_states=states)
            total = _add(total, result)
            now_freed = _free_bytes(kv_pool, state_pool) - free0
            if now_freed <= freed and result.num_pending_kv_pages == 0 and result.num_pending_states == 0:
                break
            freed = now_freed
        return total

    def _peek(self, lru: LRUList, key: str, now: float, limit: int) -> list[TreeNode]:
        """Up to ``limit`` members the policy offers first that the tree would evict now."""
        out: list[TreeNode] = []
        if limit <= 0:
            return out
        # Twice at most: a policy that ranks lazily (RankedEviction) re-ranks once its ranking
        # is used up, which an empty first pass guarantees.
        for _ in range(2):
            for node in self.eviction.candidates(lru, now=now):
                if evictable(node, key):
                    out.append(node)
                    if len(out) >= limit:
                        return out
            if out:
                return out
        return out

    def _merge_victims(
        self,
        kv_nodes: list[TreeNode],
        st_nodes: list[TreeNode],
        *,
        tier: Tier,
        deficit: int,
        kv_bytes: int,
        state_bytes: int,
        now: float,
    ) -> tuple[int, int]:
        """The pages and states to evict: the peeked victims of both lists, lowest victim key
        first, until their bytes cover ``deficit`` (a KV victim's state on ``tier`` counts with
        it, and not again on the state list)."""
        kv_key, state_key = f"{tier.value}_kv", f"{tier.value}_state"
        kv_keys = _victim_keys(self.eviction, kv_nodes, kv_key, now)
        st_keys = _victim_keys(self.eviction, st_nodes, state_key, now)
        pages = states = freed = 0
        gone: set[int] = set()  # nodes whose state leaves with their KV
        i = j = 0
        while freed < deficit and (i < len(kv_nodes) or j < len(st_nodes)):
            if j < len(st_nodes) and st_nodes[j].node_id in gone:
                j += 1
                continue
            if j >= len(st_nodes) or (i < len(kv_nodes) and kv_keys(i) <= st_keys(j)):
                node = kv_nodes[i]
                i += 1
                pages += node.num_pages
                freed += node.num_pages * kv_bytes
                if (node.device_state if tier is Tier.DEVICE else node.host_state) is not None:
                    freed += state_bytes
                    gone.add(node.node_id)
            else:
                j += 1
                states += 1
                freed += state_bytes
        return pages, states


def _victim_keys(policy: EvictionPolicy, nodes: list[TreeNode], key: str, now: float) -> Callable[[int], float]:
    """The victim key of ``nodes[i]``, by index: all computed at once (``policy.victim_keys``),
    or, when the policy's ``victim_key`` is pure, each on first use (the merge compares only the
    victims it reaches)."""
    if not policy.pure_victim_key:
        return [float(k) for k in policy.victim_keys(nodes, key=key, now=now)].__getitem__
    keys: dict[int, float] = {}
    victim_key = policy.victim_key

    def at(i: int) -> float:
        k = keys.get(i)
        if k is None:
            k = keys[i] = float(victim_key(nodes[i], key=key, now=now))
        return k

    return at


def _free_bytes(kv_pool: ItemPool, state_pool: ItemPool | None) -> int:
    """Free bytes of a tier's pools (``state_pool`` ``None``: states not counted)."""
    free = kv_pool.num_free * kv_pool.bytes_per_index
    if state_pool is not None:
        free += state_pool.num_free * state_pool.bytes_per_index
    return free


def _add(a: EvictResult, b: EvictResult) -> EvictResult:
    """Two eviction calls' results on one tier, added up."""
    counts = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(EvictResult) if f.name != "tier"}
    return EvictResult(tier=a.tier, **counts)
