"""Typed views of byte-item pools: K/V page caches and state components.

The views share memory with the pool's byte buffer, so a copy of bytes is a copy of values.
"""

from __future__ import annotations

import torch

from asynccache.pools.base import ItemPool
from asynccache.spec import HybridSpec

__all__ = ["KVViews", "StateViews"]


class KVViews:
    """``kv_cache(layer_id)`` → (K, V), each ``[num_pages, page_size, num_kv_heads, head_dim]``."""

    spec: HybridSpec

    def kv_cache(self: ItemPool | KVViews, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(self, ItemPool)
        spec: HybridSpec = self.spec  # type: ignore[attr-defined]
        items = self.layer_items(layer_id).view(spec.kv_dtype)
        kv = items.view(self.num_items, 2, spec.page_size, spec.num_kv_heads, spec.head_dim)
        return kv[:, 0], kv[:, 1]


class StateViews:
    """``state(layer_id)`` → {component name: ``[num_slots, *shape]``} typed views."""

    spec: HybridSpec

    def state(self: ItemPool | StateViews, layer_id: int) -> dict[str, torch.Tensor]:
        assert isinstance(self, ItemPool)
        spec: HybridSpec = self.spec  # type: ignore[attr-defined]
        items = self.layer_items(layer_id)
        out: dict[str, torch.Tensor] = {}
        for comp, off in zip(spec.state_components, spec.state_component_offsets, strict=True):
            raw = items[:, off : off + comp.size_bytes]
            out[comp.name] = raw.view(comp.dtype).view(self.num_items, *comp.shape)
        return out
