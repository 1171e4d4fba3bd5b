"""What a trace replay replays: :class:`ReplayConfig` — the model geometry, the byte budget of
each tier and the policy combination, checked when made (a hybrid model, a host tier under a
storage tier, no storage tier for the attention-only reference). Both engines take it:
:class:`~asynccache.trace.replay.TraceReplay` and
:class:`~asynccache.trace.controller_replay.ControllerReplay`.
"""

from __future__ import annotations

from dataclasses import dataclass

from asynccache.errors import ConfigError
from asynccache.spec import HybridSpec
from asynccache.trace.policies import ATTENTION_ONLY, PolicyCombo
from asynccache.trace.results import TierBudget

__all__ = ["ReplayConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """What to replay: the model geometry, byte budgets per tier, and the policy combination.

    ``active_params`` overrides the FLOP model's estimate. ``check_integrity_every``: run the
    tree's invariant checks every N requests (tests). ``progress_every``: call the progress
    callback every N requests.
    """

    spec: HybridSpec
    budget: TierBudget
    combo: PolicyCombo
    active_params: float | None = None
    check_integrity_every: int = 0
    progress_every: int = 1000

    def __post_init__(self) -> None:
        spec = self.spec
        if not (spec.num_attention_layers and spec.kv_page_bytes and spec.num_mamba_layers and spec.state_bytes):
            raise ConfigError(
                f"trace replay needs both attention KV and recurrent state: {spec.model_id} has "
                f"{spec.num_attention_layers} attention layer(s) ({spec.kv_page_bytes:,} B of KV per page) and "
                f"{spec.num_mamba_layers} recurrent layer(s) ({spec.state_bytes:,} B per state)"
            )
        if self.budget.storage and not self.budget.host:
            raise ConfigError("a storage tier needs a host tier (prefetches land on the host)")
        if self.budget.storage and self.combo.admission == ATTENTION_ONLY:
            raise ConfigError("the attention-only reference has no storage tier (its states cost no bytes)")
