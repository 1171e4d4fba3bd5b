"""One byte budget per tier, shared by KV pages and recurrent states.

The tree's pools are sized in items (pages, state slots), but a tier's memory is bytes, and how
many of them should hold states rather than KV depends on the workload and the policy. In replay
the pools of a tier are sized so that either could take the whole budget (accounting mode costs
nothing), and :class:`ByteBudget` keeps ``pages · page_bytes + states · state_bytes`` of the
tier within budget: whatever is over it goes through one ``tree.evict_bytes`` call
(:mod:`asynccache.tree.evict_bytes`), which compares the next victims of the tier's KV and state
lists by the eviction policy's ``victim_key`` (utility per byte for
:class:`~asynccache.policy.ranked.RankedEviction`, the last access by default) and evicts them
in rounds (demote, write back or drop, as the tree's write policy says) until the tier fits or
nothing can go.

``demote`` (optional, host tier) goes to the tree: it hands it each host victim just before
dropping the copy, in its own victim order (the replay's storage tier writes it to storage).
``count_states=False`` leaves states out of the tier's bytes (the attention-only reference:
states cost nothing and leave with their KV).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asynccache.errors import ConfigError
from asynccache.pools.base import ItemPool
from asynccache.tree import DemoteFn, HybridRadixTree, Tier

__all__ = ["ByteBudget", "EvictionCounts"]


@dataclass(slots=True)
class EvictionCounts:
    """Indices freed by budget enforcement, per list, and the number of eviction calls
    (``tree.evict_bytes``)."""

    kv_pages: int = 0
    states: int = 0
    lost_states: int = 0
    deleted_nodes: int = 0
    calls: int = 0
    stuck: int = 0  # enforcement stopped over budget (everything left was locked)


@dataclass(slots=True)
class ByteBudget:
    """Keep one tier of ``tree`` within ``budget_bytes`` (see the module docstring)."""

    tree: HybridRadixTree
    tier: Tier
    budget_bytes: int
    demote: DemoteFn | None = None
    count_states: bool = True
    counts: EvictionCounts = field(default_factory=EvictionCounts)
    peak_bytes: int = 0

    def __post_init__(self) -> None:
        if self.tier is Tier.STORAGE:
            raise ConfigError("ByteBudget manages the device and host tiers; storage keeps its own")
        if self.tier is Tier.HOST and self.tree.host_kv is None:
            raise ConfigError("no host tier to budget")
        if self.demote is not None and self.tier is not Tier.HOST:
            raise ConfigError("only host eviction demotes to storage")

    # ---- geometry ----------------------------------------------------------------------
    @property
    def _pools(self) -> tuple[ItemPool, ItemPool | None]:
        t = self.tree
        if self.tier is Tier.DEVICE:
            return t.device_kv, t.device_mamba
        assert t.host_kv is not None
        return t.host_kv, t.host_mamba

    def used_bytes(self) -> int:
        """Bytes of allocated pages and slots of this tier (tree-held and in flight)."""
        kv, states = self._pools
        used = (kv.num_items - kv.num_free) * kv.bytes_per_index
        if states is not None and self.count_states:
            used += (states.num_items - states.num_free) * states.bytes_per_index
        return used

    # ---- enforcement -------------------------------------------------------------------
    def enforce(self) -> None:
        """Evict until the tier fits its budget (or only locked data is left): one
        ``tree.evict_bytes`` call for the bytes over budget (``stuck`` counts the calls that
        left the tier over it)."""
        used = self.used_bytes()
        self.peak_bytes = max(self.peak_bytes, used)
        if used <= self.budget_bytes:
            return
        result = self.tree.evict_bytes(
            self.tier, used - self.budget_bytes, count_states=self.count_states, demote=self.demote
        )
        self.counts.calls += 1
        self.counts.kv_pages += result.num_kv_pages
        self.counts.states += result.num_states
        self.counts.lost_states += result.num_lost_states
        self.counts.deleted_nodes += result.num_deleted_nodes
        if self.used_bytes() > self.budget_bytes:
            self.counts.stuck += 1
