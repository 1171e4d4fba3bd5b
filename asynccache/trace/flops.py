"""Prefill FLOPs of a hybrid model, for "compute saved" figures and compute-aware eviction.

Prefilling ``n`` tokens from scratch costs

    F(n) = n · (2 · P_active + R) + 2 · A · H_q · d · n · (n − 1)

- ``P_active``: parameters touched per token (matrix multiplies: 2 FLOPs per parameter);
- ``R``: the recurrent layers' per-token state update and read-out, ``4 ·`` (state elements of
  one layer's SSM / delta-rule matrix) per recurrent layer;
- the last term: causal attention, ``4 · H_q · d · t`` FLOPs for the token at position ``t`` in
  each of the ``A`` attention layers (``QKᵀ`` and ``AV``), summed over ``t < n``.

A request that finds its first ``h`` tokens in the cache skips exactly ``F(h)``: the cached
tokens are not computed, while the computed ones still attend to them. So ``saved(h) = F(h)`` and
a state at ``n`` with its nearest cached ancestor state at ``m`` saves ``F(n) − F(m)`` more.

``P_active`` defaults to an estimate from the spec: attention projections (q, k, v, o), the
recurrent layers' input/output projections, and a SwiGLU MLP of ``intermediate_size`` in every
layer; embeddings and the LM head are left out (prefill computes logits for one token). For
Qwen3-Next-80B-A3B this gives 2.95e9, close to its 3B active parameters (10 routed + 1 shared
expert of width 512 ≈ one dense MLP of width 5,120). Pass ``active_params`` to override.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from asynccache.errors import ConfigError
from asynccache.spec import HybridSpec

__all__ = ["FlopModel", "estimate_active_params"]


def estimate_active_params(spec: HybridSpec) -> int:
    """Active parameters per token estimated from the spec's dimensions (see module docstring)."""
    h = spec.hidden_size
    if h <= 0:
        raise ConfigError(f"{spec.model_id}: hidden_size unknown; pass active_params explicitly")
    hq = spec.num_attention_heads or spec.num_kv_heads * spec.tp_size
    d = spec.head_dim
    kv_heads = spec.num_kv_heads * spec.tp_size
    attn = h * hq * d * 2 + h * kv_heads * d * 2  # q, o; k, v
    lin = 0
    geo = spec.linear
    if geo is not None:
        if geo.kind == "gated_deltanet":
            inner = geo.num_heads * geo.head_dim
            proj_in = 2 * geo.num_k_heads * geo.head_k_dim + 2 * inner + 2 * geo.num_heads  # q,k,v,z; b,a
        elif geo.kind == "mamba2":
            inner = geo.num_heads * geo.head_dim
            proj_in = 2 * inner + 2 * geo.n_groups * geo.state_size + geo.num_heads  # x,z; B,C; dt
        else:  # mamba1
            inner = geo.head_dim
            proj_in = 2 * inner  # x, z (x_proj and dt_proj are small)
        lin = h * proj_in + inner * h
    mlp = 3 * h * spec.intermediate_size
    return spec.num_attention_layers * attn + spec.num_mamba_layers * lin + spec.num_layers * mlp


@dataclass(frozen=True, slots=True, kw_only=True)
class FlopModel:
    """``prefill_flops(n)`` and ``saved_flops(m, n)`` for one model (see module docstring)."""

    active_params: float
    recurrent_flops_per_token: float
    attention_coeff: float  # 2 · A · H_q · d

    @classmethod
    def from_spec(cls, spec: HybridSpec, *, active_params: float | None = None) -> FlopModel:
        params = float(active_params) if active_params is not None else float(estimate_active_params(spec))
        if params <= 0:
            raise ConfigError(f"active_params must be positive, got {params}")
        recurrent = 0.0
        if spec.linear is not None:
            recurrent = 4.0 * math.prod(spec.linear.ssm_shape(1)) * spec.num_mamba_layers
        hq = spec.num_attention_heads or spec.num_kv_heads * spec.tp_size
        return cls(
            active_params=params,
            recurrent_flops_per_token=recurrent,
            attention_coeff=2.0 * spec.num_attention_layers * hq * spec.head_dim,
        )

    @property
    def linear_flops_per_token(self) -> float:
        return 2.0 * self.active_params + self.recurrent_flops_per_token

    def prefill_flops(self, num_tokens: float | np.ndarray) -> float | np.ndarray:
        """``F(n)``: FLOPs to prefill ``n`` tokens from an empty cache (vectorised over arrays)."""
        if isinstance(num_tokens, (int, float)):  # the same float64 arithmetic, without numpy's overhead
            x = float(num_tokens)
            return x * self.linear_flops_per_token + self.attention_coeff * x * max(x - 1.0, 0.0)
        n = np.asarray(num_tokens, dtype=np.float64)
        out = n * self.linear_flops_per_token + self.attention_coeff * n * np.maximum(n - 1.0, 0.0)
        return float(out) if out.ndim == 0 else out

    def saved_flops(self, from_tokens: float, to_tokens: float) -> float:
        """``F(to) − F(from)``: what a state at ``to`` saves over one at ``from``."""
        return float(self.prefill_flops(to_tokens)) - float(self.prefill_flops(from_tokens))
