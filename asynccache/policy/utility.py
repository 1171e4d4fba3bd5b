"""Utility eviction: learnt reuse likelihood × recency × value per byte, tier-aware.

Scores (higher is kept; :class:`~asynccache.policy.ranked.RankedEviction` evicts the lowest)::

    score = w_class · w_tier · density^β / (1 + age / τ)

- ``age`` — seconds since the node was last used (``last_access``): recency, hyperbolic so a
  weight ``w`` is worth a constant *factor* of age rather than a fixed number of seconds; the
  scale ``τ`` is learnt: the median age at which cached states have been resumed (a cache that
  keeps data longer sees, and so weighs, longer reuse gaps);
- ``w_class`` — how often states of the node's class are resumed, relative to the most resumed
  class, learnt online: resumptions seen per class (``observe_match``) divided by the
  state-seconds spent in the cache per class (measured at each ranking). Classes
  (:func:`reuse_class`): ``leaf`` (the end of a live sequence), ``interior`` (one child: a later
  turn extended it, its own state is rarely resumed again — the tree's LRU keeps it as long as
  the conversation lives, because a match touches the whole path), ``branch`` (several
  children: where prompts diverge);
- ``w_tier`` — on the host, a node the device also holds counts ``redundant_weight`` (the host
  copy only saves a later write-back), so the two tiers hold different data; on the device
  nothing changes (write-back demotes what the device lets go);
- ``density`` — saved value per byte (prompt tokens or prefill FLOPs, ``value``) relative to a
  full page of KV; ``β = 0`` (the default) ignores it: on conversation traffic longer sequences
  are not likelier to come back, so favouring them per byte costs hits;
- KV past the deepest state (no state at the leaf) scores 0 and goes first.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from asynccache.errors import ConfigError
from asynccache.policy.cost_aware import node_value
from asynccache.policy.ranked import RankedEviction
from asynccache.spec import HybridSpec

if TYPE_CHECKING:
    from asynccache.trace.flops import FlopModel
    from asynccache.tree.lru import LRUList
    from asynccache.tree.node import TreeNode
    from asynccache.tree.results import InsertResult, MatchResult

__all__ = ["REUSE_CLASSES", "UtilityEviction", "reuse_class"]

#: Classes whose reuse rates are learnt separately (see :func:`reuse_class`).
REUSE_CLASSES = ("leaf", "interior", "branch")


def reuse_class(node: TreeNode) -> int:
    """Index in :data:`REUSE_CLASSES` of a node holding a state: ``leaf`` (no children: the end
    of a live sequence), ``interior`` (one child: a later turn extended it), ``branch``
    (several children: prompts diverge here)."""
    return min(len(node.children), 2)


class UtilityEviction(RankedEviction):
    """Learnt class weights × recency (× value density), tier-aware (module docstring)."""

    name: ClassVar[str] = "utility"

    def __init__(
        self,
        *,
        spec: HybridSpec,
        flops: FlopModel,
        recency_scale_s: float | None = None,
        initial_recency_scale_s: float = 60.0,
        redundant_weight: float = 0.1,
        density_exponent: float = 0.0,
        value: str = "tokens",
        prior_state_s: float = 3600.0,
        rerank_fraction: float = 0.25,
        rerank_interval_s: float = 30.0,
    ) -> None:
        super().__init__(rerank_fraction=rerank_fraction, rerank_interval_s=rerank_interval_s)
        if (recency_scale_s is not None and recency_scale_s <= 0) or initial_recency_scale_s <= 0 or prior_state_s <= 0:
            raise ConfigError("recency scales and prior_state_s must be positive")
        if not 0 <= redundant_weight <= 1:
            raise ConfigError(f"redundant_weight must be in [0, 1], got {redundant_weight}")
        if value not in ("flops", "tokens"):
            raise ConfigError(f"value must be 'flops' or 'tokens', got {value!r}")
        self.spec = spec
        self.flops = flops
        #: Fixed recency scale, or None to learn it: the median age at which states are resumed.
        self.fixed_recency_scale_s = recency_scale_s
        self.recency_scale_s = recency_scale_s if recency_scale_s is not None else initial_recency_scale_s
        self._seen: dict[int, float] = {}  # node id → when its state was created or last resumed
        self._reuse_ages: deque[float] = deque(maxlen=2048)
        self.redundant_weight = redundant_weight
        self.density_exponent = density_exponent
        self.value = value
        self.prior_state_s = prior_state_s
        self.hits = np.zeros(len(REUSE_CLASSES))
        self.exposure_s = np.zeros(len(REUSE_CLASSES))
        self._exposure_at: float | None = None
        self.class_weights = np.ones(len(REUSE_CLASSES))
        self._state_lists: dict[str, LRUList] = {}  # the tree's state lists, seen in candidates()
        # Reference density: one full page of KV serving its own tokens.
        page_value = spec.page_size if value == "tokens" else flops.saved_flops(0, spec.page_size)
        self._density_ref = page_value / spec.kv_page_bytes

    # ---- learning ------------------------------------------------------------------------
    def observe_match(self, match: MatchResult, *, prompt_len: int, now: float) -> None:
        node = match.last_node
        if match.num_tokens and node.parent is not None:
            cls = reuse_class(node)
            self.hits[cls] += 1.0
            seen = self._seen.get(node.node_id)
            if seen is not None and cls != 2:  # branch points are resumed by everyone, constantly
                self._reuse_ages.append(now - seen)
            self._seen[node.node_id] = now

    def observe_insert(self, result: InsertResult, *, now: float) -> None:
        node: TreeNode | None = result.last_node
        while node is not None and node.parent is not None:
            if node.has_state and node.node_id not in self._seen:
                self._seen[node.node_id] = now
            node = node.parent

    def _accrue_exposure(self, lru: LRUList, now: float) -> None:
        last, self._exposure_at = self._exposure_at, now
        if last is None or now <= last:
            return
        counts = np.zeros(len(REUSE_CLASSES))
        for node in lru.iter_oldest():
            counts[reuse_class(node)] += 1.0
        self.exposure_s += counts * (now - last)

    def begin_ranking(self, key: str, now: float) -> None:
        # Learn on the list holding the most states: the host's when there is a host tier.
        if key == "host_state" or (key == "device_state" and "host_state" not in self._rankings):
            lru = self._state_lists.get(key)
            if lru is not None:
                self._accrue_exposure(lru, now)
        if self.fixed_recency_scale_s is None and len(self._reuse_ages) >= 32:
            self.recency_scale_s = float(np.clip(np.median(np.asarray(self._reuse_ages)), 1.0, 3600.0))
        if len(self._seen) > 200_000:
            cutoff = now - 100 * self.recency_scale_s
            self._seen = {k: v for k, v in self._seen.items() if v >= cutoff}
        total_rate = (self.hits.sum() + 1.0) / (self.exposure_s.sum() + self.prior_state_s)
        rates = (self.hits + total_rate * self.prior_state_s) / (self.exposure_s + self.prior_state_s)
        self.class_weights = rates / rates.max()

    def candidates(self, lru: LRUList, *, now: float) -> Any:
        if lru.resource.value == "state":
            self._state_lists[f"{lru.tier.value}_state"] = lru
        return super().candidates(lru, now=now)

    # ---- the score -----------------------------------------------------------------------
    def score(self, node: TreeNode, *, key: str, now: float) -> float:
        value = node_value(node, key, spec=self.spec, flops=self.flops)
        if not value.has_state or value.bytes == 0:
            return 0.0
        weight = float(self.class_weights[reuse_class(node)])
        if key.startswith("host") and node.device_kv is not None:
            weight *= self.redundant_weight
        if self.density_exponent:
            saved = value.saved_flops if self.value == "flops" else float(value.saved_tokens)
            weight *= (saved / value.bytes / self._density_ref) ** self.density_exponent
        age = max(now - node.last_access, 0.0)
        return weight / (1.0 + age / self.recency_scale_s)

    def describe(self) -> dict[str, Any]:
        return {
            "class_weights": {c: round(float(w), 4) for c, w in zip(REUSE_CLASSES, self.class_weights, strict=True)},
            "hits": {c: int(h) for c, h in zip(REUSE_CLASSES, self.hits, strict=True)},
            "exposure_state_hours": {
                c: round(float(e) / 3600, 1) for c, e in zip(REUSE_CLASSES, self.exposure_s, strict=True)
            },
            "recency_scale_s": round(self.recency_scale_s, 1),
            "rankings": self.num_rankings,
        }
