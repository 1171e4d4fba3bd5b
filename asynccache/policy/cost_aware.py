"""Compute- and byte-aware eviction: what a node's data saves in prefill FLOPs, per byte.

What evicting a node's resource from one LRU list loses and frees (:class:`NodeValue`,
:func:`node_value`; shared with :class:`~asynccache.policy.utility.UtilityEviction`):

- ``saved_flops``: ``F(end) − F(m)``, the prefill FLOPs a state at the node's end saves over the
  nearest state above it (depth ``m``; 0 without one) — the FLOP model is
  :class:`~asynccache.trace.flops.FlopModel`;
- ``bytes``: a state victim frees one state; a KV victim (a leaf of its tier) frees its pages,
  its state, and the pages of the stateless single-child chain above it that the tombstone
  cascade deletes with it — they serve nothing else;
- KV below the deepest state (no state at the leaf) saves nothing: utility 0, evicted first.

:class:`CostAwareEviction` ranks the evictable members of each list (:class:`RankedEviction`)
Marconi-style: ``recency + α · efficiency`` with both terms scaled
to [0, 1] (recency over a sliding time window, efficiency against the largest seen), and α tuned
online: every ``tune_every`` requests the policy replays its recent eviction decisions against
what happened next (a *ghost* of every evicted state remembers its key; a later prompt that
passes through it and resumes shallower is a regret) and keeps the α of a grid that ranks the
regretted victims highest (AUC), instead of fixing α once. The ghosts come from the tree's
eviction notifications (:meth:`CostAwareEviction.on_evict`): every victim whose last state went.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from asynccache.errors import ConfigError
from asynccache.policy.ranked import RankedEviction
from asynccache.spec import HybridSpec

if TYPE_CHECKING:
    from asynccache.trace.flops import FlopModel
    from asynccache.tree.node import EvictHow, TreeNode
    from asynccache.tree.results import MatchResult

__all__ = ["STATE_CLASSES", "CostAwareEviction", "NodeValue", "node_extent", "node_value", "spec_sizes", "state_class"]

LEAF, INTERIOR, BRANCH = "leaf", "interior", "branch"
STATE_CLASSES = (LEAF, INTERIOR, BRANCH)


def state_class(node: TreeNode) -> str:
    """``leaf`` (no children), ``interior`` (one child: a deeper turn usually made it
    redundant) or ``branch`` (several children: where prompts diverge)."""
    n = len(node.children)
    return LEAF if n == 0 else INTERIOR if n == 1 else BRANCH


@dataclass(frozen=True, slots=True)
class NodeValue:
    """What evicting a node's resource from one list would lose and free."""

    saved_flops: float
    saved_tokens: int
    bytes: int
    has_state: bool


_SIZES: dict[int, tuple[HybridSpec, int, int]] = {}


def spec_sizes(spec: HybridSpec) -> tuple[int, int]:
    """``(state_bytes, kv_page_bytes)`` of ``spec``, computed once (a ranking asks millions of times)."""
    hit = _SIZES.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _SIZES[id(spec)] = (spec, spec.state_bytes, spec.kv_page_bytes)
    return hit[1], hit[2]


def node_extent(node: TreeNode, tier: str, resource: str, state_bytes: int, kv_page_bytes: int) -> tuple[int, int, int]:
    """``(m, bytes, end)`` of evicting ``node`` from list ``f"{tier}_{resource}"``: the depth of
    the nearest state above it (0 without one), the bytes freed, and its end in tokens; ``end``
    is -1 for a KV victim without a state (it saves nothing). The walk of :func:`node_value`
    without the FLOP model or a result object, for policies that score whole rankings."""
    if resource == "state":
        up = node.parent
        while up is not None and up.parent is not None and up.device_state is None and up.host_state is None:
            up = up.parent
        m = (up.start_page + up.num_pages) * up.page_size if up is not None and up.parent is not None else 0
        return m, state_bytes, (node.start_page + node.num_pages) * node.page_size
    pages = node.num_pages
    nbytes = 0
    if (node.device_state if tier == "device" else node.host_state) is not None:
        nbytes += state_bytes
    up = node.parent
    while (
        up is not None
        and up.parent is not None
        and up.device_state is None
        and up.host_state is None
        and len(up.children) == 1
    ):
        pages += up.num_pages
        up = up.parent
    nbytes += pages * kv_page_bytes
    if node.device_state is None and node.host_state is None:
        return 0, nbytes, -1
    m = (up.start_page + up.num_pages) * up.page_size if up is not None and up.parent is not None else 0
    return m, nbytes, (node.start_page + node.num_pages) * node.page_size


def node_value(node: TreeNode, key: str, *, spec: HybridSpec, flops: FlopModel) -> NodeValue:
    """Saved FLOPs and freed bytes of evicting ``node`` from list ``key`` (module docstring)."""
    state_bytes, kv_page_bytes = spec_sizes(spec)
    tier, resource = key.split("_", 1)
    m, nbytes, end = node_extent(node, tier, resource, state_bytes, kv_page_bytes)
    if end < 0:
        return NodeValue(saved_flops=0.0, saved_tokens=0, bytes=nbytes, has_state=False)
    return NodeValue(saved_flops=flops.saved_flops(m, end), saved_tokens=end - m, bytes=nbytes, has_state=True)


# ---- ghosts: what happened to evicted states -------------------------------------------------
@dataclass(slots=True)
class _Ghost:
    features: tuple[float, ...]
    evicted_at: float
    regret: bool = False


class _GhostLedger:
    """Evicted states by storage key (hash of their last page): did a later prompt need them?"""

    def __init__(self, *, horizon_s: float, max_size: int = 200_000) -> None:
        self.horizon_s = horizon_s
        self.max_size = max_size
        self._by_key: dict[bytes, _Ghost] = {}
        self._order: deque[tuple[bytes, _Ghost]] = deque()
        self.resolved: deque[_Ghost] = deque(maxlen=20_000)

    def add(self, key: bytes, features: tuple[float, ...], now: float) -> None:
        ghost = _Ghost(features=features, evicted_at=now)
        self._by_key[key] = ghost
        self._order.append((key, ghost))
        if len(self._order) > self.max_size:
            self._expire(float("inf"))

    def observe(self, match: MatchResult, *, max_pages: int, now: float) -> None:
        """Mark ghosts a prompt passes through below its usable prefix as regretted."""
        hashes = match.page_hashes
        page = match.last_node.page_size
        start = match.num_tokens // page
        end = min(max_pages, len(hashes))
        if not self._by_key or end <= start:
            return
        raw = getattr(hashes, "raw", None)
        for i in range(start, end):
            key = raw(i) if raw is not None else bytes.fromhex(hashes[i])
            ghost = self._by_key.get(key)
            if ghost is not None and not ghost.regret:
                ghost.regret = True
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._order and (
            len(self._order) > self.max_size or now - self._order[0][1].evicted_at > self.horizon_s
        ):
            key, ghost = self._order.popleft()
            if self._by_key.get(key) is ghost:
                del self._by_key[key]
            self.resolved.append(ghost)


def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(score of a regretted victim > score of a harmless one), ties count half."""
    if not len(pos) or not len(neg):
        return 0.5
    allv = np.concatenate([pos, neg])
    ranks = np.empty(len(allv))
    order = np.argsort(allv, kind="mergesort")
    ranks[order] = np.arange(1, len(allv) + 1)
    # Average ranks of ties.
    sorted_v = allv[order]
    i = 0
    while i < len(sorted_v):
        j = i
        while j + 1 < len(sorted_v) and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        if j > i:
            ranks[order[i : j + 1]] = (i + j + 2) / 2
        i = j + 1
    r_pos = ranks[: len(pos)].sum()
    return float((r_pos - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


class CostAwareEviction(RankedEviction):
    """Marconi-style ``recency + α · FLOP efficiency``, α tuned online (module docstring)."""

    name: ClassVar[str] = "cost-aware"

    def __init__(
        self,
        *,
        spec: HybridSpec,
        flops: FlopModel,
        alpha: float = 1.0,
        alpha_grid: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
        recency_window_s: float = 600.0,
        tune_every: int = 500,
        regret_horizon_s: float = 900.0,
        rerank_fraction: float = 0.25,
        rerank_interval_s: float = 30.0,
    ) -> None:
        super().__init__(rerank_fraction=rerank_fraction, rerank_interval_s=rerank_interval_s)
        if alpha < 0 or any(a < 0 for a in alpha_grid) or not alpha_grid:
            raise ConfigError("alpha and the alpha grid must be >= 0 (and the grid non-empty)")
        if recency_window_s <= 0 or tune_every < 1:
            raise ConfigError("recency_window_s must be positive and tune_every >= 1")
        self.spec = spec
        self.flops = flops
        self.alpha = alpha
        self.alpha_grid = alpha_grid
        self.recency_window_s = recency_window_s
        self.tune_every = tune_every
        self._eff_ref = 0.0
        self._ghosts = _GhostLedger(horizon_s=regret_horizon_s)
        self._num_requests = 0
        self._now = 0.0
        self._ranked_terms: dict[tuple[str, int], tuple[float, float]] = {}
        self._ranking_effs: tuple[list[TreeNode], str, list[float]] | None = None
        self.alpha_history: list[tuple[float, float]] = []

    # ---- the score -------------------------------------------------------------------------
    def _efficiency(self, node: TreeNode, key: str) -> float:
        """``node_value``'s saved FLOPs per byte freed (0 when nothing is freed)."""
        state_bytes, kv_page_bytes = spec_sizes(self.spec)
        tier, resource = key.split("_", 1)
        m, nbytes, end = node_extent(node, tier, resource, state_bytes, kv_page_bytes)
        if not nbytes:
            return 0.0
        return (self.flops.saved_flops(m, end) if end >= 0 else 0.0) / nbytes

    def before_scoring(self, members: list[TreeNode], *, key: str, now: float) -> None:
        # The efficiency term is relative to the largest seen: take this ranking's largest into
        # account before scoring any member, so that no score depends on the scan order.
        effs = [self._efficiency(n, key) for n in members]
        self._eff_ref = max([self._eff_ref, *effs])
        # The ranking scores these very members next, the tree unchanged: score_many reuses them.
        self._ranking_effs = (members, key, effs)

    def score_many(self, nodes: Sequence[TreeNode], *, key: str, now: float) -> list[float]:
        """:meth:`score` of each node; a ranking's members with the efficiencies that
        :meth:`before_scoring` has just computed for them."""
        pending, self._ranking_effs = self._ranking_effs, None
        if pending is None or pending[0] is not nodes or pending[1] != key:
            return super().score_many(nodes, key=key, now=now)
        return [self._score(n, key, now, eff) for n, eff in zip(nodes, pending[2], strict=True)]

    def _terms(self, node: TreeNode, key: str, now: float, eff: float | None = None) -> tuple[float, float]:
        if eff is None:
            eff = self._efficiency(node, key)
        self._eff_ref = max(self._eff_ref, eff)
        recency = 1.0 - min(max(now - node.last_access, 0.0) / self.recency_window_s, 1.0)
        efficiency = eff / self._eff_ref if self._eff_ref > 0 else 0.0
        return recency, efficiency

    def score(self, node: TreeNode, *, key: str, now: float) -> float:
        return self._score(node, key, now, None)

    def _score(self, node: TreeNode, key: str, now: float, eff: float | None) -> float:
        terms = self._terms(node, key, now, eff)
        self._ranked_terms[(key, node.node_id)] = terms
        return terms[0] + self.alpha * terms[1]

    def begin_ranking(self, key: str, now: float) -> None:
        # Terms are remembered per ranking: they are a victim's features if it gets evicted.
        for k in [k for k in self._ranked_terms if k[0] == key]:
            del self._ranked_terms[k]

    # ---- learning --------------------------------------------------------------------------
    def candidates(self, lru: Any, *, now: float) -> Any:
        self._now = now  # the eviction's time, for the ghosts its victims leave (``on_evict``)
        yield from super().candidates(lru, now=now)

    def on_evict(self, node: TreeNode, list_key: str, how: EvictHow) -> None:
        """A state left a tier and no tier keeps one for ``node``: remember it as a ghost, with
        the terms it was ranked by (on the state list, or on the KV list of the same tier when
        the state went with a KV victim). The tree reports every eviction, so every such victim
        is seen (the last one of a call and a parent taken once its child went included).
        Released states are not victims; nor is a ``CASCADE`` report: the cascade deletes only
        nodes without a state, so a victim it then takes was already reported (and counted) when
        its state went."""
        # (``how`` is a str enum: compared by value, without importing the tree at run time)
        if (
            not list_key.endswith("_state")
            or how in ("release", "cascade")
            or (node.alive and node.has_state)
        ):
            return
        tier = list_key.removesuffix("_state")
        features = self._ranked_terms.get((list_key, node.node_id)) or self._ranked_terms.get(
            (f"{tier}_kv", node.node_id)
        )
        if features is not None:
            self._ghosts.add(node.last_raw_hash(), features, self._now)

    def observe_match(self, match: MatchResult, *, prompt_len: int, now: float) -> None:
        self._ghosts.observe(match, max_pages=(prompt_len - 1) // match.last_node.page_size, now=now)
        self._num_requests += 1
        if self._num_requests % self.tune_every == 0:
            self._tune(now)

    def _tune(self, now: float) -> None:
        resolved = list(self._ghosts.resolved)
        if len(resolved) < 20:
            return
        feats = np.asarray([g.features for g in resolved], dtype=np.float64)
        regret = np.asarray([g.regret for g in resolved], dtype=bool)
        if regret.all() or not regret.any():
            return
        best, best_auc = self.alpha, -1.0
        for a in self.alpha_grid:
            s = feats[:, 0] + a * feats[:, 1]
            auc = _auc(s[regret], s[~regret])
            if auc > best_auc + 1e-9:
                best, best_auc = a, auc
        self.alpha = best
        self.alpha_history.append((now, best))
        self._ghosts.resolved.clear()

    def describe(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "alpha_history": self.alpha_history[-20:], "rankings": self.num_rankings}
