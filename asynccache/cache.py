"""HybridCache: pools, tree, controller and storage backend built from a spec and a config.

The one object a serving engine holds::

    async with HybridCache.build(spec, config, device="cuda") as cache:
        match = cache.tree.match_prefix(tokens[:-1])
        op = cache.controller.load(match)
        counter = cache.controller.start_loading()
        ...
"""

from __future__ import annotations

from typing import Any

import torch

from asynccache.config import HybridCacheConfig
from asynccache.controller import HybridCacheController
from asynccache.pools import DeviceKVPool, DeviceMambaPool, HostKVPool, MambaPoolHost
from asynccache.spec import HybridSpec
from asynccache.storage import StorageBackend, open_backend

__all__ = ["HybridCache"]


class HybridCache:
    def __init__(
        self,
        spec: HybridSpec,
        config: HybridCacheConfig,
        *,
        device: str | torch.device = "cpu",
        admission: Any = None,
        eviction: Any = None,
        backend: StorageBackend | None = None,
        materialize: bool = True,
    ) -> None:
        from asynccache.policy import EndsAdmission, LRUEviction, WritePolicy
        from asynccache.tree import HybridRadixTree

        self.spec = spec
        self.config = config
        self.device_kv = DeviceKVPool(spec, config.device_kv_pages, device=device, materialize=materialize)
        self.device_mamba = DeviceMambaPool(spec, config.device_state_slots, device=device, materialize=materialize)
        pin = config.pin_host_memory
        # a storage tier that reads in other processes needs host pools they can map
        shared = bool(config.storage_options.get("read_processes")) and materialize
        self.host_kv = (
            HostKVPool(
                spec, size_bytes=config.host_kv_bytes, layout=config.host_layout, pin=pin, materialize=materialize,
                shared=shared,
            )
            if config.host_kv_bytes > 0
            else None
        )
        self.host_mamba = (
            MambaPoolHost(
                spec, size_bytes=config.host_state_bytes, layout=config.host_layout, pin=pin, materialize=materialize,
                shared=shared,
            )
            if config.host_state_bytes > 0
            else None
        )
        if backend is None and config.storage_uri is not None:
            backend = open_backend(config.storage_uri, namespace=spec.namespace_id, **config.storage_options)
        self.tree = HybridRadixTree(
            spec,
            device_kv=self.device_kv,
            device_mamba=self.device_mamba,
            host_kv=self.host_kv,
            host_mamba=self.host_mamba,
            admission=admission or EndsAdmission(),
            eviction=eviction or LRUEviction(),
            write_policy=WritePolicy.parse(config.write_policy),
        )
        self.controller = HybridCacheController(
            self.tree,
            device_kv=self.device_kv,
            device_mamba=self.device_mamba,
            host_kv=self.host_kv,
            host_mamba=self.host_mamba,
            config=config,
            backend=backend,
        )
        self.tree.write_back = self.controller.write_back

    @classmethod
    def build(cls, spec: HybridSpec, config: HybridCacheConfig, **kwargs: Any) -> HybridCache:
        return cls(spec, config, **kwargs)

    async def __aenter__(self) -> HybridCache:
        await self.controller.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.controller.aclose()

    def flush_device(self) -> None:
        """Evict everything evictable from the device tier (demoting what has a host copy)."""
        self.tree.evict_device(num_kv_pages=self.device_kv.num_items, num_states=self.device_mamba.num_items)

    def flush_host(self) -> None:
        """Drop everything evictable from the host tier (what is archived stays in storage)."""
        if self.host_kv is not None or self.host_mamba is not None:
            self.tree.evict_host(
                num_kv_pages=self.host_kv.num_items if self.host_kv else 0,
                num_states=self.host_mamba.num_items if self.host_mamba else 0,
            )
