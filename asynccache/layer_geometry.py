"""Per-layer cache geometry of a hybrid model, and how its heads shard over TP ranks.

Primitives:

- :class:`StateComponent` — one tensor of a Mamba / linear-attention layer's recurrent state
  (conv state, SSM / temporal state), per TP rank.
- :class:`LinearGeometry` — the dimensions of the recurrent layers (Gated DeltaNet, Mamba2,
  Mamba1) from which the state components are derived, and what one TP rank holds of them
  (``conv_dim``, ``ssm_shape``, ``groups_per_rank``).
- :func:`shard_kv_heads` — the attention KV heads one TP rank holds (divided, or one replicated
  head).

:class:`~asynccache.spec.HybridSpec` holds these for one TP rank; a count that does not shard
over ``tp_size`` is a :class:`~asynccache.errors.SpecError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asynccache.errors import SpecError

__all__ = ["LinearGeometry", "StateComponent", "shard_kv_heads"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StateComponent:
    """One tensor of a recurrent layer's state, per TP rank (e.g. ``conv`` or ``ssm``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def size_bytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearGeometry:
    """Dimensions of the recurrent layers, unsharded (tp=1).

    ``kind`` is ``"gated_deltanet"`` (Qwen3-Next / Qwen3.5), ``"mamba2"`` (Nemotron-H, Bamba,
    Granite-4.0-H, Falcon-H1) or ``"mamba1"`` (Jamba).

    - gated_deltanet: conv over q,k,v channels ``2·k_heads·k_dim + v_heads·v_dim``; recurrent
      state ``[v_heads, k_dim, v_dim]``.
    - mamba2: conv over ``heads·head_dim + 2·groups·state_size``; SSM state
      ``[heads, head_dim, state_size]``. Heads shard over TP ranks; groups shard too when
      ``n_groups`` divides by ``tp_size``, and a single group (``n_groups == 1``) is replicated
      on every rank (vLLM's ``extra_groups_for_head_shards``); anything else does not shard.
    - mamba1: conv over ``d_inner``; SSM state ``[d_inner, state_size]`` (``heads`` = 1,
      ``head_dim`` = d_inner).
    """

    kind: str
    num_heads: int  # v heads (GDN) / SSM heads (mamba2) / 1 (mamba1)
    head_dim: int  # v head dim (GDN) / SSM head dim (mamba2) / d_inner (mamba1)
    num_k_heads: int = 0  # GDN only
    head_k_dim: int = 0  # GDN only
    n_groups: int = 0  # mamba2 only
    state_size: int = 0  # mamba1/2 d_state
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ("gated_deltanet", "mamba2", "mamba1"):
            raise SpecError(f"unknown linear layer kind {self.kind!r}")
        for name in ("num_heads", "head_dim", "num_k_heads", "head_k_dim", "n_groups", "state_size", "conv_kernel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(f"{self.kind} geometry: {name} must be an int, got {value!r}")
        if self.conv_kernel < 2:
            raise SpecError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        needed = {"num_heads": self.num_heads, "head_dim": self.head_dim}
        if self.kind == "gated_deltanet":
            needed |= {"num_k_heads": self.num_k_heads, "head_k_dim": self.head_k_dim}
        else:
            needed["state_size"] = self.state_size
        if self.kind == "mamba2":
            needed["n_groups"] = self.n_groups
        for name, value in needed.items():
            if value <= 0:
                raise SpecError(f"{self.kind} geometry needs a positive {name}, got {value}")
        # Heads in whole groups: each key head (GDN) or B/C group (Mamba2) serves as many heads.
        if self.kind == "gated_deltanet" and self.num_heads % self.num_k_heads:
            raise SpecError(
                f"gated_deltanet geometry: num_heads={self.num_heads} value heads (linear_num_value_heads) are "
                f"not a multiple of num_k_heads={self.num_k_heads} key heads (linear_num_key_heads)"
            )
        if self.kind == "mamba2" and self.num_heads % self.n_groups:
            raise SpecError(
                f"mamba2 geometry: num_heads={self.num_heads} SSM heads are not a multiple of "
                f"n_groups={self.n_groups} B/C groups"
            )

    def conv_dim(self, tp_size: int = 1) -> int:
        if self.kind == "gated_deltanet":
            k = _shard(self.num_k_heads, tp_size, "linear_num_key_heads")
            v = _shard(self.num_heads, tp_size, "linear_num_value_heads")
            return 2 * k * self.head_k_dim + v * self.head_dim
        if self.kind == "mamba2":
            h = _shard(self.num_heads, tp_size, "mamba_num_heads")
            return h * self.head_dim + 2 * self.groups_per_rank(tp_size) * self.state_size
        return _shard(self.head_dim, tp_size, "mamba d_inner")

    def groups_per_rank(self, tp_size: int = 1) -> int:
        """Mamba2 B/C groups held by one TP rank: ``n_groups / tp_size``, or 1 when a single
        group is replicated on every rank. Other non-divisible counts raise :class:`SpecError`."""
        if tp_size <= 0:
            raise SpecError(f"tp_size must be positive, got {tp_size}")
        if self.n_groups % tp_size == 0:
            return self.n_groups // tp_size
        if self.n_groups == 1:
            return 1
        raise SpecError(
            f"n_groups={self.n_groups} is not divisible by tp_size={tp_size} "
            "(only a single group can be replicated across ranks)"
        )

    def ssm_shape(self, tp_size: int = 1) -> tuple[int, ...]:
        if self.kind == "gated_deltanet":
            v = _shard(self.num_heads, tp_size, "linear_num_value_heads")
            return (v, self.head_k_dim, self.head_dim)
        if self.kind == "mamba2":
            h = _shard(self.num_heads, tp_size, "mamba_num_heads")
            return (h, self.head_dim, self.state_size)
        return (_shard(self.head_dim, tp_size, "mamba d_inner"), self.state_size)


def _shard(n: int, tp_size: int, what: str) -> int:
    if tp_size <= 0:
        raise SpecError(f"tp_size must be positive, got {tp_size}")
    if n % tp_size:
        raise SpecError(f"{what}={n} is not divisible by tp_size={tp_size}")
    return n // tp_size


def shard_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads held by one TP rank.

    Heads divide over ranks when ``num_kv_heads`` is a multiple of ``tp_size``; when ``tp_size``
    is a multiple of ``num_kv_heads`` each rank holds one replicated head (vLLM and SGLang do
    the same for GQA models with few KV heads). Anything else raises :class:`SpecError`.
    """
    if tp_size <= 0:
        raise SpecError(f"tp_size must be positive, got {tp_size}")
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return 1
    raise SpecError(
        f"num_key_value_heads={num_kv_heads} is not divisible by tp_size={tp_size} "
        "(nor tp_size by it, which would replicate one head per rank)"
    )
