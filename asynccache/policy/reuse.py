"""Reuse eviction: the chance that a conversation comes back, per byte it holds, learnt online.

On conversation traffic almost every reusable prefix is the end of an earlier prompt that the
next turn extends, so each live conversation is one chain of KV pages ending in one state, and
evicting either loses the whole chain. :class:`ReuseEviction` ranks (as
:class:`~asynccache.policy.ranked.RankedEviction`, utility per byte, comparable across KV and
state lists) by::

    score = p_return(turn, age) · saved_tokens / bytes        (× redundant_weight, see below)

- ``saved_tokens`` / ``bytes`` — :func:`~asynccache.policy.cost_aware.node_extent`: tokens the
  node's state saves over the nearest state above it, and the bytes evicting it frees (a KV
  victim: its pages, the stateless single-child chain above it, its state). KV without a state
  below it saves nothing and goes first.
- ``p_return`` — the chance that the prompt end comes back within the next ``H`` seconds given
  that it has not in ``age = now − last_access`` seconds::

      p = π_turn · (G(age + H) − G(age)) / (1 − π_turn · G(age))

  ``G`` is the distribution of the gaps after which prompt ends are extended (observed online),
  ``H`` its median, and ``π_turn`` the probability that a prompt at conversation turn ``turn``
  (1 = a new conversation, capped at ``max_turn``) is ever extended. Turn counts are learnt from
  a *ledger* of prompt-end page hashes that sees every prompt, cached or not (so the estimates
  do not shrink with the cache): a prompt that passes through an earlier prompt's end is that
  conversation's next turn. ``π_turn = resumed_turn / Σ G(age_i)`` over the ledger's ends of
  that turn (resumptions per end, corrected for ends too young to have come back yet),
  shrunk towards the overall rate. On the Mooncake conversation trace the chance rises from
  0.25 at turn 1 to 0.7 at turn 7, the strongest online signal of reuse we found.
- Nodes that are not prompt ends (branch points, shared prefixes, checkpoints) use the overall
  rate; a prompt end that has children (a later turn extended it, so it is rarely resumed
  again) counts ``interior_weight``.
- On the host, a node the device also holds counts ``redundant_weight`` (its host copy only
  saves a later write-back), so exclusive tiers hold different data.

:meth:`superseded_states` names the states a finished insert made useless: the prompt end the
request resumed from, once the request extended it (one child). The replay releases them at once
(``tree.release_states``) instead of waiting for eviction to reach them.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from asynccache.errors import ConfigError
from asynccache.policy.cost_aware import node_extent, spec_sizes
from asynccache.policy.ranked import RankedEviction
from asynccache.spec import HybridSpec

if TYPE_CHECKING:
    from asynccache.trace.flops import FlopModel
    from asynccache.tree.node import TreeNode
    from asynccache.tree.results import InsertResult, MatchResult

__all__ = ["ReuseEviction", "return_probabilities", "return_probability"]

#: Rankings of at least this many nodes compute the return probabilities as arrays.
_BATCH_MIN = 16


def return_probability(pi: float, gaps: Sequence[float], age: float, horizon: float) -> float:
    """``π (G(age + H) − G(age)) / (1 − π G(age))`` with ``G`` the empirical distribution of the
    sorted ``gaps``: the chance of a return within ``horizon`` seconds after ``age`` seconds
    without one, when a fraction ``pi`` ever returns. (A list is the fast form of ``gaps``: one
    ``bisect`` per bound, called for every ranked node.)"""
    n = len(gaps)
    g0 = bisect.bisect_right(gaps, age) / n
    g1 = bisect.bisect_right(gaps, age + horizon) / n
    return float(pi * (g1 - g0) / max(1.0 - pi * g0, 1e-9))


def return_probabilities(pi: np.ndarray, gaps: np.ndarray, ages: np.ndarray, horizon: float) -> np.ndarray:
    """:func:`return_probability` elementwise over ``pi`` and ``ages`` (``gaps`` a sorted array),
    with the same float64 operations in the same order, so each value is the one it gives."""
    n = len(gaps)
    g0 = np.searchsorted(gaps, ages, side="right") / n
    g1 = np.searchsorted(gaps, ages + horizon, side="right") / n
    return pi * (g1 - g0) / np.maximum(1.0 - pi * g0, 1e-9)


class ReuseEviction(RankedEviction):
    """Return probability by conversation turn and age, per byte (see the module docstring)."""

    name: ClassVar[str] = "reuse"
    pure_victim_key: ClassVar[bool] = True  # a score reads the tree and the learnt rates only

    def __init__(
        self,
        *,
        spec: HybridSpec,
        flops: FlopModel,
        max_turn: int = 6,
        min_resume_pages: int = 2,
        prior_gap_s: float = 120.0,
        prior_weight: float = 5.0,
        min_gaps: int = 32,
        interior_weight: float = 0.05,
        redundant_weight: float = 0.1,
        refresh_interval_s: float = 30.0,
        ledger_size: int = 200_000,
        rerank_fraction: float = 0.25,
        rerank_interval_s: float = 30.0,
    ) -> None:
        super().__init__(rerank_fraction=rerank_fraction, rerank_interval_s=rerank_interval_s)
        if max_turn < 1 or min_resume_pages < 1 or min_gaps < 1 or ledger_size < 1:
            raise ConfigError("max_turn, min_resume_pages, min_gaps and ledger_size must be >= 1")
        if prior_gap_s <= 0 or prior_weight <= 0 or refresh_interval_s <= 0:
            raise ConfigError("prior_gap_s, prior_weight and refresh_interval_s must be positive")
        if not 0 <= interior_weight <= 1 or not 0 <= redundant_weight <= 1:
            raise ConfigError("interior_weight and redundant_weight must be in [0, 1]")
        self.spec = spec
        self.flops = flops
        self.max_turn = max_turn
        self.min_resume_pages = min_resume_pages
        self.prior_weight = prior_weight
        self.min_gaps = min_gaps
        self.interior_weight = interior_weight
        self.redundant_weight = redundant_weight
        self.refresh_interval_s = refresh_interval_s
        self.ledger_size = ledger_size
        # Ledger of prompt ends: end-page hash → entry; entries in creation order.
        self._ledger: dict[bytes, int] = {}
        self._end_key: list[bytes] = []
        self._end_time: list[float] = []
        self._end_turn: list[int] = []
        self._resumed: list[bool] = []
        self._first = 0  # entries before this one have left the ledger
        self._gaps: deque[float] = deque(maxlen=4096)
        # Prior gap distribution until min_gaps are seen: exponential with mean prior_gap_s.
        q = (np.arange(64) + 0.5) / 64
        self._prior_gaps = np.sort(-prior_gap_s * np.log1p(-q))
        self.gaps = self._prior_gaps
        self._gap_list: list[float] = self.gaps.tolist()
        self.horizon_s = float(np.median(self.gaps))
        self.pi = np.full(max_turn + 1, 0.5)  # index 0: nodes that are not prompt ends (overall)
        self._refreshed_at = float("-inf")
        self._pending_turn = 1
        self._turn: dict[int, int] = {}  # node id → turn of the prompt that ends there

    # ---- learning ------------------------------------------------------------------------
    def observe_match(self, match: MatchResult, *, prompt_len: int, now: float) -> None:
        """Find the earlier prompt end this prompt extends (its turn + 1 is this prompt's turn),
        record the gap if it is that end's first return, and record this prompt's end."""
        hashes = match.page_hashes
        raw = getattr(hashes, "raw", None)
        if raw is None or not len(hashes):
            self._pending_turn = 1
            return
        page = match.last_node.page_size
        turn = 1
        top = min(len(hashes), (prompt_len - 1) // page)
        for i in range(top - 1, self.min_resume_pages - 2, -1):
            entry = self._ledger.get(raw(i))
            if entry is not None:
                turn = min(self._end_turn[entry - self._first] + 1, self.max_turn)
                j = entry - self._first
                if not self._resumed[j]:
                    self._resumed[j] = True
                    self._gaps.append(now - self._end_time[j])
                break
        self._pending_turn = turn
        end = prompt_len // page
        key = raw(min(end, len(hashes)) - 1)
        self._ledger[key] = self._first + len(self._end_key)
        self._end_key.append(key)
        self._end_time.append(now)
        self._end_turn.append(turn)
        self._resumed.append(False)
        if len(self._end_key) > self.ledger_size:
            drop = len(self._end_key) - self.ledger_size
            for k, e in zip(self._end_key[:drop], range(self._first, self._first + drop), strict=True):
                if self._ledger.get(k) == e:
                    del self._ledger[k]
            del self._end_key[:drop], self._end_time[:drop], self._end_turn[:drop], self._resumed[:drop]
            self._first += drop

    def observe_insert(self, result: InsertResult, *, now: float) -> None:
        """Remember the turn of the prompt whose end the insert created."""
        node = result.last_node
        if node.parent is not None and node.has_state:
            self._turn[node.node_id] = self._pending_turn
        if len(self._turn) > 4 * self.ledger_size:
            self._turn = {k: v for k, v in self._turn.items() if k >= node.node_id - 2 * self.ledger_size}

    def superseded_states(self, match: MatchResult, result: InsertResult | None) -> list[TreeNode]:
        """The prompt end this request resumed from, if the request extended it (one child now):
        no later prompt resumes there except one that branches off exactly there."""
        node = match.last_node
        if result is None or node.parent is None or not node.alive or result.last_node is node:
            return []
        if node.node_id not in self._turn or len(node.children) != 1 or not node.has_state:
            return []
        return [node]

    def refresh(self, now: float) -> None:
        """Re-estimate the gap distribution, its median horizon and the return rates per turn."""
        self._refreshed_at = now
        if len(self._gaps) >= self.min_gaps:
            self.gaps = np.sort(np.asarray(self._gaps))
            self._gap_list = self.gaps.tolist()
        self.horizon_s = max(float(np.median(self.gaps)), 1.0)
        if not self._end_time:
            return
        ages = now - np.asarray(self._end_time)
        exposure = np.searchsorted(self.gaps, ages, side="right") / len(self.gaps)
        turns = np.asarray(self._end_turn)
        resumed = np.asarray(self._resumed, dtype=np.float64)
        overall = (resumed.sum() + 1.0) / (exposure.sum() + 2.0)
        per_turn = np.bincount(turns, weights=resumed, minlength=self.max_turn + 1)
        per_exposure = np.bincount(turns, weights=exposure, minlength=self.max_turn + 1)
        pi = (per_turn + self.prior_weight * overall) / (per_exposure + self.prior_weight)
        pi[0] = overall
        self.pi = np.clip(pi, 0.0, 1.0)

    def begin_ranking(self, key: str, now: float) -> None:
        if now - self._refreshed_at >= self.refresh_interval_s:
            self.refresh(now)

    # ---- the score -----------------------------------------------------------------------
    def _weight(self, node: TreeNode, turn: int, host: bool) -> float:
        weight = 1.0
        if turn and node.children:
            weight *= self.interior_weight
        if host and node.device_kv is not None:
            weight *= self.redundant_weight
        return weight

    def score(self, node: TreeNode, *, key: str, now: float) -> float:
        tier, resource = key.split("_", 1)
        state_bytes, kv_page_bytes = spec_sizes(self.spec)
        m, nbytes, end = node_extent(node, tier, resource, state_bytes, kv_page_bytes)
        if end < 0 or nbytes == 0:
            return 0.0
        turn = self._turn.get(node.node_id, 0)
        age = max(now - node.last_access, 0.0)
        p = return_probability(float(self.pi[turn]), self._gap_list, age, self.horizon_s)
        return self._weight(node, turn, tier == "host") * p * (end - m) / nbytes

    def score_many(self, nodes: Sequence[TreeNode], *, key: str, now: float) -> list[float]:
        """:meth:`score` of each node, the return probabilities computed as arrays (the same
        values: :func:`return_probabilities`)."""
        if len(nodes) < _BATCH_MIN:
            return [self.score(n, key=key, now=now) for n in nodes]
        tier, resource = key.split("_", 1)
        host = tier == "host"
        state_bytes, kv_page_bytes = spec_sizes(self.spec)
        turn_of = self._turn.get
        # Columns over the nodes that save something (every value an integer or a float that
        # float64 holds exactly): index, turn, last access, tokens saved, bytes freed, weight.
        index: list[int] = []
        turns: list[int] = []
        last: list[float] = []
        saved: list[int] = []
        freed: list[int] = []
        weights: list[float] = []
        for i, node in enumerate(nodes):
            m, nbytes, end = node_extent(node, tier, resource, state_bytes, kv_page_bytes)
            if end < 0 or nbytes == 0:
                continue
            turn = turn_of(node.node_id, 0)
            index.append(i)
            turns.append(turn)
            last.append(node.last_access)
            saved.append(end - m)
            freed.append(nbytes)
            weights.append(self._weight(node, turn, host))
        out = np.zeros(len(nodes))
        if index:
            f64 = np.float64
            ages = np.maximum(now - np.asarray(last, dtype=f64), 0.0)
            p = return_probabilities(self.pi[turns], self.gaps, ages, self.horizon_s)  # gaps: _gap_list's values
            value = np.asarray(weights, dtype=f64) * p * np.asarray(saved, dtype=f64) / np.asarray(freed, dtype=f64)
            if len(index) == len(nodes):
                out = value
            else:
                out[index] = value
        return out.tolist()

    # ---- storage admission (asynccache.storage_admission) --------------------------------
    def turn_of(self, node: TreeNode) -> int:
        """The conversation turn of the prompt that ends at ``node`` (0: not a prompt end)."""
        return self._turn.get(node.node_id, 0)

    def reuse_estimate(self) -> Callable[[int, float], float]:
        """``p(turn, age)``: the chance that a prompt end of ``turn``, unused for ``age``
        seconds, returns within the horizon, by the rates learnt so far (later refreshes do not
        change it)."""
        pi, gaps, horizon = self.pi, self._gap_list, self.horizon_s  # replaced, never mutated, on refresh

        def p(turn: int, age: float) -> float:
            return return_probability(float(pi[turn]), gaps, age, horizon)

        return p

    def describe(self) -> dict[str, Any]:
        return {
            "return_rate_by_turn": {str(t): round(float(p), 4) for t, p in enumerate(self.pi)},
            "horizon_s": round(self.horizon_s, 1),
            "gaps_seen": len(self._gaps),
            "ledger": len(self._end_key),
            "rankings": self.num_rankings,
        }
