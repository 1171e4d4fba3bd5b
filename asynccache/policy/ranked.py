"""Ranked eviction: score a whole LRU list now and then, evict in score order in between.

:class:`~asynccache.policy.base.ScoredEviction` scores a window of the *least recently used*
members, so a node that is recent in LRU order but worthless (a state in the middle of a live
conversation, made redundant by the deeper state of the next turn: the tree touches the whole
path on every match) is never reached. :class:`RankedEviction` scores every *evictable* member of
a list instead, but not on every call:

- a ranking of one list (its evictable members sorted by :meth:`score`, lowest first) is built
  when the list has none, when it is used up, when more than ``rerank_fraction`` of it has been
  consumed, or when it is older than ``rerank_interval_s`` (simulated or wall time, whatever
  the tree's clock says);
- between rankings, :meth:`candidates` walks the ranking from a persistent cursor, skipping nodes
  that left the list and nodes touched since the ranking (``last_access`` newer than the
  ranking: they were just used, their score is stale and high);
- nodes added to the list after the ranking wait for the next one (they are the newest).

So a ranking costs O(list) score calls and is amortised over many evictions.

Scores must be comparable across the four lists (device KV, device state, host KV, host state):
they are *utility per byte* (``score(node) / bytes``), which lets eviction by bytes
(``tree.evict_bytes``, one byte budget per tier) choose between evicting KV and evicting a
state (:meth:`victim_key`).

Evictability mirrors the tree's own checks (``asynccache.tree.evict``): a KV victim must be a
leaf of its tier, nothing locked or loading.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from asynccache.errors import ConfigError
from asynccache.policy.base import EvictionPolicy

if TYPE_CHECKING:
    from asynccache.tree.lru import LRUList
    from asynccache.tree.node import TreeNode

__all__ = ["RankedEviction", "evictable", "evictable_check", "evictable_members", "list_key"]


def list_key(lru: LRUList) -> str:
    """``"device_kv"``, ``"device_state"``, ``"host_kv"`` or ``"host_state"``."""
    return f"{lru.tier.value}_{lru.resource.value}"


def _device_kv(node: TreeNode) -> bool:
    return (
        node.device_kv is not None
        and node.device_lock == 0
        and node.loading == 0
        and node.num_device_children == 0
        and (node.host_kv is not None or node.host_lock == 0)
    )


def _device_state(node: TreeNode) -> bool:
    return node.device_state is not None and node.device_lock == 0 and node.loading == 0


def _host_kv(node: TreeNode) -> bool:
    return (
        node.host_kv is not None
        and node.host_lock == 0
        and node.num_host_children == 0
        and (node.device_kv is not None or (node.device_lock == 0 and node.loading == 0))
    )


def _host_state(node: TreeNode) -> bool:
    return node.host_state is not None and node.host_lock == 0


_EVICTABLE: dict[str, Callable[[TreeNode], bool]] = {
    "device_kv": _device_kv,
    "device_state": _device_state,
    "host_kv": _host_kv,
    "host_state": _host_state,
}


def evictable_check(key: str) -> Callable[[TreeNode], bool]:
    """:func:`evictable` for the list named ``key``, as a one-argument function."""
    try:
        return _EVICTABLE[key]
    except KeyError:
        raise ConfigError(f"unknown LRU list {key!r}") from None


def evictable(node: TreeNode, key: str) -> bool:
    """Whether the tree would evict ``node`` from the list named ``key`` right now."""
    return evictable_check(key)(node)


def evictable_members(lru: LRUList, key: str) -> list[TreeNode]:
    """The members of ``lru`` (named ``key``) that :func:`evictable` accepts, least recently
    used first. Most members of a KV list hold a child's KV on the tier: they are passed over
    without a call."""
    check = evictable_check(key)
    members = lru.members()
    if key == "device_kv":
        return [n for n in members if n.num_device_children == 0 and check(n)]
    if key == "host_kv":
        return [n for n in members if n.num_host_children == 0 and check(n)]
    return [n for n in members if check(n)]


@dataclass(slots=True)
class _Ranking:
    nodes: list[TreeNode] = field(default_factory=list)
    cursor: int = 0
    ranked_at: float = float("-inf")


class RankedEviction(EvictionPolicy):
    """Base of utility-per-byte eviction orders (see the module docstring)."""

    name: ClassVar[str] = "ranked"

    def __init__(self, *, rerank_fraction: float = 0.25, rerank_interval_s: float = 30.0) -> None:
        if not 0 < rerank_fraction <= 1:
            raise ConfigError(f"rerank_fraction must be in (0, 1], got {rerank_fraction}")
        if rerank_interval_s <= 0:
            raise ConfigError(f"rerank_interval_s must be positive, got {rerank_interval_s}")
        self.rerank_fraction = rerank_fraction
        self.rerank_interval_s = rerank_interval_s
        self._rankings: dict[str, _Ranking] = {}
        self.num_rankings = 0

    # ---- the score -----------------------------------------------------------------------
    @abstractmethod
    def score(self, node: TreeNode, *, key: str, now: float) -> float:
        """Utility per byte of keeping ``node``'s resource in list ``key``; lower goes first."""

    def begin_ranking(self, key: str, now: float) -> None:
        """Hook called once before a list is scored (e.g. to refresh learnt weights)."""

    def before_scoring(self, members: list[TreeNode], *, key: str, now: float) -> None:
        """Hook called with a ranking's members before any is scored (e.g. to normalise a term
        over all of them, so that no score depends on the order they are scored in)."""

    def score_many(self, nodes: Sequence[TreeNode], *, key: str, now: float) -> list[float]:
        """:meth:`score` of each of ``nodes``, in order (a ranking's or a merge's victims). A
        policy may compute them together; the values, and any side effects of scoring, must be
        those of calling :meth:`score` on each node in turn."""
        return [self.score(n, key=key, now=now) for n in nodes]

    # ---- ordering ------------------------------------------------------------------------
    def victim_key(self, node: TreeNode, *, key: str, now: float) -> float:
        """Comparable across lists: the score (utility per byte), not the last access."""
        return self.score(node, key=key, now=now)

    def victim_keys(self, nodes: Sequence[TreeNode], *, key: str, now: float) -> list[float]:
        if type(self).victim_key is not RankedEviction.victim_key:
            return super().victim_keys(nodes, key=key, now=now)
        return self.score_many(nodes, key=key, now=now)

    def _rank(self, lru: LRUList, key: str, now: float) -> _Ranking:
        self.begin_ranking(key, now)
        members = evictable_members(lru, key)
        self.before_scoring(members, key=key, now=now)
        scores = self.score_many(members, key=key, now=now)
        order = sorted(range(len(members)), key=scores.__getitem__)  # stable, as a sort of members
        members = [members[i] for i in order]
        self.num_rankings += 1
        ranking = _Ranking(nodes=members, cursor=0, ranked_at=now)
        self._rankings[key] = ranking
        return ranking

    def _stale(self, ranking: _Ranking | None, now: float) -> bool:
        if ranking is None or ranking.cursor >= len(ranking.nodes):
            return True
        if now - ranking.ranked_at > self.rerank_interval_s:
            return True
        return ranking.cursor > self.rerank_fraction * len(ranking.nodes) + 16

    def candidates(self, lru: LRUList, *, now: float) -> Iterator[TreeNode]:
        key = list_key(lru)
        ranking = self._rankings.get(key)
        if self._stale(ranking, now):
            ranking = self._rank(lru, key, now)
        assert ranking is not None
        nodes, ranked_at = ranking.nodes, ranking.ranked_at
        freed: dict[int, TreeNode] = {}  # nearest live ancestors of this call's victims
        i = ranking.cursor
        while i < len(nodes):
            node = nodes[i]
            gone = node not in lru or not node.alive or node.last_access > ranked_at
            if gone:
                if i == ranking.cursor:
                    ranking.cursor += 1  # permanently past it
                i += 1
                continue
            yield node
            if node not in lru:
                _note_parent(freed, node)
                if i == ranking.cursor:
                    ranking.cursor += 1
            i += 1
        # Used up: members added since the ranking (or declined ones) need a fresh ranking.
        ranking.cursor = len(nodes)
        # Parents that this call's evictions made leaves were not evictable when ranked: offer
        # them now, lowest score first (and theirs in turn), so the call can free what it needs.
        while freed:
            offer = sorted(
                (n for n in freed.values() if n.alive and n in lru and evictable(n, key)),
                key=lambda n: self.score(n, key=key, now=now),
            )
            freed = {}
            for node in offer:
                yield node
                if node not in lru:
                    _note_parent(freed, node)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _note_parent(freed: dict[int, TreeNode], victim: TreeNode) -> None:
    """Record the nearest live ancestor of ``victim``: the tombstone cascade may have deleted
    its stateless parent (and more) with it, which makes the first live one above a leaf."""
    parent = victim.parent
    while parent is not None and not parent.alive:
        parent = parent.parent
    if parent is not None:
        freed[parent.node_id] = parent
