"""Policy combinations by name, for the replay and the ``bench trace`` command line.

Admission: ``ends`` (the tree's default), ``every-page``, ``block-grid:N``, ``branch``
(Marconi-style), ``adaptive`` (per-tier checkpoint density from observed reuse), and
``attention-only`` — a reference, not a hybrid policy: a state at every page that the byte
budgets do not count (an attention-only cache of the same bytes; no storage tier).
Eviction: ``lru`` (the tree's default), ``cost-aware`` (Marconi-style: recency + α · FLOPs saved
per byte, α tuned online), ``utility`` (learnt reuse likelihood × FLOPs saved per byte, tier-aware),
``reuse`` (return probability by conversation turn and age, per byte, learnt online; releases
superseded prompt-end states).

A :class:`PolicyCombo` also names the device write policy (``write_through`` keeps a host copy of
everything at insert; ``write_back`` copies to the host only what device eviction demotes, so the
two tiers hold different data) and how storage is fed (``through``: archive what reaches the
host; ``demote``: archive what the host evicts).
"""

from __future__ import annotations

from dataclasses import dataclass

from asynccache.errors import ConfigError
from asynccache.policy import (
    AdmissionPolicy,
    BlockGridAdmission,
    EndsAdmission,
    EveryPageAdmission,
    EvictionPolicy,
    LRUEviction,
    WritePolicy,
)
from asynccache.policy.adaptive import AdaptiveAdmission
from asynccache.policy.branch import BranchAdmission
from asynccache.policy.cost_aware import CostAwareEviction
from asynccache.policy.reuse import ReuseEviction
from asynccache.policy.utility import UtilityEviction
from asynccache.spec import HybridSpec
from asynccache.trace.flops import FlopModel
from asynccache.trace.results import TierBudget
from asynccache.trace.storage_tier import STORAGE_WRITE_MODES

__all__ = [
    "ADMISSIONS",
    "ATTENTION_ONLY",
    "EVICTIONS",
    "PolicyCombo",
    "make_admission",
    "make_eviction",
    "parse_combo",
]

#: Admission name of the attention-only reference (states at every page, zero bytes).
ATTENTION_ONLY = "attention-only"
ADMISSIONS = ("ends", "every-page", "block-grid:N", "branch", "adaptive", ATTENTION_ONLY)
EVICTIONS = ("lru", "cost-aware", "utility", "reuse")


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyCombo:
    """Admission + eviction + write policy (+ how storage is fed), by name."""

    admission: str
    eviction: str
    write_policy: str = "write_through"
    storage_write: str = "through"

    def __post_init__(self) -> None:
        WritePolicy.parse(self.write_policy)
        if self.storage_write not in STORAGE_WRITE_MODES:
            raise ConfigError(f"unknown storage write mode {self.storage_write!r}; known: {list(STORAGE_WRITE_MODES)}")

    @property
    def write_label(self) -> str:
        return f"{self.write_policy}, disk {self.storage_write}"

    @property
    def label(self) -> str:
        return f"{self.admission}/{self.eviction}/{self.write_policy}/{self.storage_write}"


def parse_combo(text: str) -> PolicyCombo:
    """``"admission/eviction[/write_policy[/storage_write]]"``, e.g. ``branch/cost-aware``,
    ``adaptive/utility/write_back/demote``."""
    parts = text.strip().split("/")
    if not 2 <= len(parts) <= 4:
        raise ConfigError(f"policy {text!r}: expected admission/eviction[/write_policy[/storage_write]]")
    kwargs: dict[str, str] = {"admission": parts[0], "eviction": parts[1]}
    if len(parts) > 2:
        kwargs["write_policy"] = parts[2]
    if len(parts) > 3:
        kwargs["storage_write"] = parts[3]
    return PolicyCombo(**kwargs)


def make_admission(name: str, *, spec: HybridSpec, budget: TierBudget, flops: FlopModel) -> AdmissionPolicy:
    """The admission policy called ``name`` (see :data:`ADMISSIONS`)."""
    base, _, arg = name.partition(":")
    if base == "ends" and not arg:
        return EndsAdmission()
    if base in ("every-page", ATTENTION_ONLY) and not arg:
        return EveryPageAdmission()
    if base == "block-grid":
        try:
            return BlockGridAdmission(int(arg))
        except ValueError:
            raise ConfigError(f"block-grid needs a page count, e.g. block-grid:8 (got {name!r})") from None
    if base == "branch" and not arg:
        return BranchAdmission()
    if base == "adaptive" and not arg:
        return AdaptiveAdmission(spec=spec, budget=budget.as_dict())
    raise ConfigError(f"unknown admission policy {name!r}; known: {list(ADMISSIONS)}")


def make_eviction(name: str, *, spec: HybridSpec, flops: FlopModel) -> EvictionPolicy:
    """The eviction policy called ``name`` (see :data:`EVICTIONS`)."""
    if name == "lru":
        return LRUEviction()
    if name == "cost-aware":
        return CostAwareEviction(spec=spec, flops=flops)
    if name == "utility":
        return UtilityEviction(spec=spec, flops=flops)
    if name == "reuse":
        return ReuseEviction(spec=spec, flops=flops)
    raise ConfigError(f"unknown eviction policy {name!r}; known: {list(EVICTIONS)}")
