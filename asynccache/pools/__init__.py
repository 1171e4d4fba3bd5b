"""Device and host pools for KV pages and Mamba states (see ``base`` for layouts)."""

from asynccache.pools.allocator import IndexAllocator
from asynccache.pools.base import ItemPool, PoolLayout
from asynccache.pools.device import DeviceKVPool, DeviceMambaPool
from asynccache.pools.host import HostKVPool, MambaPoolHost
from asynccache.pools.memory import pinning_available

__all__ = [
    "DeviceKVPool",
    "DeviceMambaPool",
    "HostKVPool",
    "IndexAllocator",
    "ItemPool",
    "MambaPoolHost",
    "PoolLayout",
    "pinning_available",
]
