"""Policy interfaces of the hybrid radix tree.

- :class:`AdmissionPolicy` — which recurrent states are kept. ``state_positions`` tells the
  scheduler where to snapshot states during a request; ``keep_states`` lets the tree refuse some
  of the states offered to ``insert``.
- :class:`AdmissionContext` — what the tree knows about an insert when it asks ``keep_states``.
- :class:`EvictionPolicy` — the order in which the nodes of one LRU list are offered for
  eviction, and (``victim_key``) how a KV victim and a state victim of one tier compare when
  the tree evicts by bytes. The tree decides whether each offered node can be evicted and how,
  and tells a policy that overrides ``on_evict`` what it evicted.
- :class:`ScoredEviction` — base for utility-aware eviction (FLOP- or byte-aware): lowest score
  first among a window of the least recently used candidates.

Policies are plain synchronous objects. They read node attributes (``num_pages``, ``hit_count``,
``last_access``, ``end_tokens``, ``device_state`` …) and never mutate the tree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, ClassVar

from asynccache.errors import ConfigError

if TYPE_CHECKING:
    from asynccache.tree.lru import LRUList
    from asynccache.tree.node import EvictHow, Tier, TreeNode
    from asynccache.tree.results import MatchResult

__all__ = ["AdmissionContext", "AdmissionPolicy", "EvictionPolicy", "ScoredEviction"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionContext:
    """An insert, as the admission policy sees it.

    ``num_tokens``: full-page tokens being inserted. ``num_cached_tokens``: how many of them the
    tree already held (on any tier) before the insert — the branch point of the new sequence.
    ``prompt_len``: the prompt length when the caller gave it. ``tier``: the tier the offered
    states live on (``DEVICE`` for ``insert``, ``HOST`` for ``insert_host``).
    """

    page_size: int
    num_tokens: int
    num_cached_tokens: int
    prompt_len: int | None
    tier: Tier
    salt: str = ""


class AdmissionPolicy(ABC):
    """Which page-aligned positions get a recurrent state snapshot.

    Positions are token counts, multiples of the page size, ``> 0``. A state at position ``p``
    is the recurrent state after token ``p - 1``.
    """

    name: ClassVar[str] = "admission"

    @abstractmethod
    def state_positions(
        self,
        prompt_len: int,
        *,
        page_size: int,
        total_len: int | None = None,
        match: MatchResult | None = None,
    ) -> set[int]:
        """Positions where the scheduler should snapshot the state of a request.

        ``prompt_len``: prompt tokens; ``total_len``: prompt + output tokens once known (at the
        end of the request); ``match``: the prefix match of the request — positions at or
        before ``match.num_tokens`` are already cached and are left out.
        """

    def keep_states(self, offered: Collection[int], ctx: AdmissionContext) -> set[int]:
        """The subset of ``offered`` positions whose states the tree should keep (default: all).

        States not kept are freed by the tree. Called once per insert, before the tree changes.
        """
        return set(offered)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EvictionPolicy(ABC):
    """Order of eviction within one LRU list (device KV, device state, host KV, host state)."""

    name: ClassVar[str] = "eviction"
    #: ``victim_key`` has no side effects at all (on the policy either): eviction by bytes may
    #: then compute only the keys it compares, each on first use (else :meth:`victim_keys` of
    #: every peeked victim).
    pure_victim_key: ClassVar[bool] = False

    @abstractmethod
    def candidates(self, lru: LRUList, *, now: float) -> Iterator[TreeNode]:
        """Yield members of ``lru`` in the order they should be evicted.

        The tree checks each yielded node (locks, children, in-flight copies) and evicts it or
        skips it, then resumes the iterator. Between two yields the tree may remove any nodes
        from ``lru`` (the yielded one, its ancestors) but never adds any; the iterator must
        tolerate that (``LRUList.iter_oldest`` does) and must not yield nodes that left the list.
        """

    def victim_key(self, node: TreeNode, *, key: str, now: float) -> float:
        """Rank of ``node``'s resource in list ``key`` among the victims of both lists of its
        tier (KV and state), lower goes first: eviction by bytes (``tree.evict_bytes``) compares
        the next KV victim with the next state victim by it, so keys must be comparable across
        the two lists. Default: the last access (least recently used first). Must not change
        the tree."""
        return node.last_access

    def victim_keys(self, nodes: Sequence[TreeNode], *, key: str, now: float) -> list[float]:
        """:meth:`victim_key` of each of ``nodes``, in order (a policy may compute them together:
        the values, and any side effects, must be those of calling it on each in turn)."""
        return [self.victim_key(n, key=key, now=now) for n in nodes]

    def on_evict(self, node: TreeNode, list_key: str, how: EvictHow) -> None:
        """Called by the tree after it evicted ``node`` from list ``list_key`` (``how``: demoted,
        written back, dropped, deleted by the cascade, released); see ``asynccache.tree.evict``.
        The tree subscribes a policy that overrides it; the default does nothing. Must not change
        the tree."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ScoredEviction(EvictionPolicy):
    """Utility-aware eviction: the lowest :meth:`score` goes first.

    Scoring every node of a large tree on every eviction would cost O(tree); instead the policy
    looks at the ``window`` least recently used members at a time (sampled-LRU style), sorts
    them by score, yields them, then takes the next window. ``window=None`` scores the whole
    list at once. Subclasses implement ``score`` from the node's attributes: ``num_pages``,
    ``hit_count``, ``last_access``, ``end_tokens`` (depth), ``has_state``, and the list's
    ``tier`` / ``resource``.
    """

    name: ClassVar[str] = "scored"

    def __init__(self, *, window: int | None = 256) -> None:
        if window is not None and window < 1:
            raise ConfigError(f"window must be >= 1 or None, got {window}")
        self.window = window

    @abstractmethod
    def score(self, node: TreeNode, *, lru: LRUList, now: float) -> float:
        """Utility of keeping ``node``'s data in ``lru``'s tier; lower is evicted first."""

    def candidates(self, lru: LRUList, *, now: float) -> Iterator[TreeNode]:
        it = lru.iter_oldest()
        while True:
            batch = list(it) if self.window is None else list(islice(it, self.window))
            if not batch:
                return
            batch.sort(key=lambda node: self.score(node, lru=lru, now=now))
            for node in batch:
                if node in lru:
                    yield node
            if self.window is None:
                return

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window})"
