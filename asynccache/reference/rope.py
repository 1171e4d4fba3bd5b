"""Rotary position embedding (rotate-half form) at absolute token positions.

Primitives: :func:`rope_cos_sin` (angles for a pass's positions, fp32) and :func:`apply_rope`.
Positions are absolute, so a token's rotation does not depend on how its sequence was cut into
forward calls.
"""

from __future__ import annotations

import torch

__all__ = ["ROPE_THETA", "apply_rope", "rope_cos_sin"]

ROPE_THETA = 1_000_000.0


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[T, 1, head_dim // 2]`` (fp32) for int64 ``positions`` ``[T]``."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, device=positions.device, dtype=torch.float64) / half))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (computed in fp32, returned in ``x``'s dtype)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
