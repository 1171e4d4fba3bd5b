"""One byte budget per tier, shared by KV pages and recurrent states.

The tree's pools are sized in items (pages, state slots), but a tier's memory is bytes, and how
many of them should hold states rather than KV depends on the workload and the policy. In replay
the pools of a tier are sized so that either could take the whole budget (accounting mode costs
nothing), and :class:`ByteBudget` keeps ``pages · page_bytes + states · state_bytes`` of the
tier within budget by evicting through the tree:

- the next victims of each of the tier's two LRU lists are peeked from the eviction policy (the
  members it offers first that the tree would evict), enough to cover the missing bytes;
- they are merged by victim key: a policy's ``victim_key`` (utility per byte,
  :class:`~asynccache.policy.ranked.RankedEviction`) where it has one, else the last access;
- ``tree.evict_device`` / ``tree.evict_host`` evicts the chosen numbers of pages and states in
  one call (demote, write back or drop, as the tree's write policy says), and the round repeats
  until the tier fits or nothing can go.

``demote`` (optional, host tier) goes to ``tree.evict_host``: the tree hands it each host victim
just before dropping the copy, in its own victim order (the replay's storage tier writes it to
storage). ``count_states=False`` leaves states out of the tier's bytes (the attention-only
reference: states cost nothing and leave with their KV).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from asynccache.errors import ConfigError
from asynccache.policy.ranked import evictable
from asynccache.pools.base import ItemPool
from asynccache.tree import DemoteFn, HybridRadixTree, Tier, TreeNode
from asynccache.tree.lru import LRUList

__all__ = ["ByteBudget", "EvictionCounts"]


@dataclass(slots=True)
class EvictionCounts:
    """Indices freed by budget enforcement, per list, and the number of eviction calls."""

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

    @property
    def _lists(self) -> tuple[LRUList, LRUList]:
        t = self.tree
        if self.tier is Tier.DEVICE:
            return t.device_kv_lru, t.device_state_lru
        return t.host_kv_lru, t.host_state_lru

    def used_bytes(self) -> int:
        """Bytes of allocated pages and slots of this tier (tree-held and in flight)."""
        kv, states = self._pools
        used = (kv.num_items - kv.num_free) * kv.bytes_per_index
        if states is not None and self.count_states:
            used += (states.num_items - states.num_free) * states.bytes_per_index
        return used

    # ---- enforcement -------------------------------------------------------------------
    def _peek(self, lru: LRUList, key: str, now: float, limit: int) -> list[TreeNode]:
        """Up to ``limit`` members the policy offers first that the tree would evict now."""
        out: list[TreeNode] = []
        if limit <= 0:
            return out
        # Twice at most: a policy that ranks lazily (RankedEviction) re-ranks once its ranking
        # is used up, which an empty first pass guarantees.
        for _ in range(2):
            for node in self.tree.eviction.candidates(lru, now=now):
                if evictable(node, key):
                    out.append(node)
                    if len(out) >= limit:
                        return out
            if out:
                return out
        return out

    def _victim_key(self, node: TreeNode, key: str, now: float) -> float:
        policy = self.tree.eviction
        fn = getattr(policy, "victim_key", None)
        if fn is not None:
            return float(fn(node, key=key, now=now))
        return node.last_access

    def enforce(self) -> None:
        """Evict until the tier fits its budget (or only locked data is left).

        Each round peeks enough next victims of both lists to cover the missing bytes, merges
        them by victim key (a state whose node already goes with its KV is not counted twice),
        and evicts the lot in one tree call — one call per round however many victims.
        """
        used = self.used_bytes()
        self.peak_bytes = max(self.peak_bytes, used)
        if used <= self.budget_bytes:
            return
        tree = self.tree
        kv_lru, state_lru = self._lists
        kv_pool, state_pool = self._pools
        kv_bytes = kv_pool.bytes_per_index
        state_bytes = state_pool.bytes_per_index if state_pool is not None and self.count_states else 0
        prefix = self.tier.value
        kv_key, state_key = f"{prefix}_kv", f"{prefix}_state"
        evict = tree.evict_device if self.tier is Tier.DEVICE else partial(tree.evict_host, demote=self.demote)
        while used > self.budget_bytes:
            deficit = used - self.budget_bytes
            now = tree.clock()
            kv_nodes = self._peek(kv_lru, kv_key, now, max(1, -(-deficit // kv_bytes)))
            st_nodes: list[TreeNode] = []
            if state_bytes:
                st_nodes = self._peek(state_lru, state_key, now, max(1, -(-deficit // state_bytes)))
            if not kv_nodes and not st_nodes:
                self.counts.stuck += 1
                return
            kv_keys = [self._victim_key(n, kv_key, now) for n in kv_nodes]
            st_keys = [self._victim_key(n, state_key, now) for n in st_nodes]
            pages = states = freed = 0
            gone: set[int] = set()  # nodes whose state leaves with their KV
            i = j = 0
            while freed < deficit and (i < len(kv_nodes) or j < len(st_nodes)):
                if j < len(st_nodes) and st_nodes[j].node_id in gone:
                    j += 1
                    continue
                if j >= len(st_nodes) or (i < len(kv_nodes) and kv_keys[i] <= st_keys[j]):
                    node = kv_nodes[i]
                    i += 1
                    pages += node.num_pages
                    freed += node.num_pages * kv_bytes
                    if (node.device_state if self.tier is Tier.DEVICE else node.host_state) is not None:
                        freed += state_bytes
                        gone.add(node.node_id)
                else:
                    node = st_nodes[j]
                    j += 1
                    states += 1
                    freed += state_bytes
            result = evict(num_kv_pages=pages, num_states=states)
            self.counts.calls += 1
            self.counts.kv_pages += result.num_kv_pages
            self.counts.states += result.num_states
            self.counts.lost_states += result.num_lost_states
            self.counts.deleted_nodes += result.num_deleted_nodes
            new_used = self.used_bytes()
            if new_used >= used and result.num_pending_kv_pages == 0 and result.num_pending_states == 0:
                self.counts.stuck += 1
                return
            used = new_used
