"""Device pools: paged KV for attention layers and state slots for recurrent layers.

Both are layer-first (``[layer][index][bytes]``) so one layer's items are contiguous for the
forward pass and a per-layer load is one strided gather. They also work on CPU tensors
(``device="cpu"``), which is how every test runs without a GPU.
"""

from __future__ import annotations

import torch

from asynccache.pools.base import ItemPool, PoolLayout, check_size
from asynccache.pools.views import KVViews, StateViews
from asynccache.spec import HybridSpec

__all__ = ["DeviceKVPool", "DeviceMambaPool"]


class DeviceKVPool(KVViews, ItemPool):
    """``num_pages`` KV pages per attention layer; ``kv_cache(layer_id)`` gives typed K/V views."""

    def __init__(
        self, spec: HybridSpec, num_pages: int, *, device: str | torch.device = "cpu", materialize: bool = True
    ) -> None:
        self.spec = spec
        super().__init__(
            name="device_kv",
            layer_ids=spec.attention_layer_ids,
            num_items=check_size("device_kv", "num_pages", num_pages),
            item_bytes=spec.kv_item_bytes,
            layout=PoolLayout.LAYER_FIRST,
            device=device,
            pin=False,
            materialize=materialize,
        )


class DeviceMambaPool(StateViews, ItemPool):
    """``num_slots`` state slots per recurrent layer; ``state(layer_id)`` gives component views."""

    def __init__(
        self, spec: HybridSpec, num_slots: int, *, device: str | torch.device = "cpu", materialize: bool = True
    ) -> None:
        self.spec = spec
        super().__init__(
            name="device_mamba",
            layer_ids=spec.mamba_layer_ids,
            num_items=check_size("device_mamba", "num_slots", num_slots),
            item_bytes=max(spec.state_item_bytes, 1),
            layout=PoolLayout.LAYER_FIRST,
            device=device,
            pin=False,
            materialize=materialize,
        )
