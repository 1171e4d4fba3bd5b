"""Pools and caches built from inputs at their edges: devices that cannot hold a pool, CPU
device pools that with the host pools exceed the host's memory, non-numeric ratios, 0-d
index arrays, and the controller's message before it is entered."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import AllocationError, CapacityError, ClosedError, ConfigError
from asynccache.pools import DeviceKVPool, HostKVPool
from asynccache.pools.allocator import IndexAllocator
from asynccache.pools.memory import HOST_LIMIT_ENV
from asynccache.spec import HybridSpec

SPEC = HybridSpec.preset("tiny")


def config(**fields: int | str) -> HybridCacheConfig:
    return HybridCacheConfig(**{"device_kv_pages": 8, "device_state_slots": 4, **fields})  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_a_cuda_device_that_is_not_there_is_refused_in_accounting_mode_too(device: str) -> None:
    with pytest.raises(ConfigError, match="not available"):
        HybridCache(SPEC, config(), device=device, materialize=False)


@pytest.mark.parametrize("materialize", [True, False])
def test_devices_other_than_cpu_and_cuda_are_refused(materialize: bool) -> None:
    """A copy to or from a "meta" buffer does nothing, and would be counted as done."""
    with pytest.raises(ConfigError, match="neither a CPU nor a CUDA device"):
        HybridCache(SPEC, config(), device="meta", materialize=materialize)


def test_cpu_device_pools_count_with_the_host_pools_against_the_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_LIMIT_ENV, str(10 << 20))
    pages = (8 << 20) // SPEC.kv_page_bytes  # 8 MiB of device KV, in host memory on a CPU cache
    with pytest.raises(CapacityError, match="device_kv_pages"):
        HybridCache(SPEC, config(device_kv_pages=pages, host_kv_bytes=8 << 20))
    # each fits alone; in accounting mode nothing is allocated, so nothing is checked
    assert HybridCache(SPEC, config(device_kv_pages=pages)).device_kv.num_items == pages
    assert HybridCache(SPEC, config(host_kv_bytes=8 << 20)).host_kv is not None
    assert HybridCache(SPEC, config(device_kv_pages=pages, host_kv_bytes=8 << 20), materialize=False)


@pytest.mark.parametrize("ratio", ["2", 2j, [2], True])
def test_a_host_pool_ratio_that_is_not_a_real_number_is_a_config_error(ratio: object) -> None:
    device_pool = DeviceKVPool(SPEC, 4, materialize=False)
    with pytest.raises(ConfigError, match="ratio"):
        HostKVPool(SPEC, ratio=ratio, device_pool=device_pool, materialize=False)  # type: ignore[arg-type]
    assert HostKVPool(SPEC, ratio=2, device_pool=device_pool, materialize=False).num_items == 8


def test_a_0d_array_is_a_scalar_to_free_not_a_list() -> None:
    alloc = IndexAllocator(8)
    taken = alloc.alloc(4)
    assert taken is not None
    with pytest.raises(AllocationError, match="0-d array"):
        alloc.free(np.array(3))
    assert alloc.num_free == 4
    alloc.free(np.array([3]))
    assert alloc.num_free == 5


def test_flush_device_under_write_back_before_entering_names_how_to_enter() -> None:
    cache = HybridCache(SPEC, config(host_kv_bytes=8 * SPEC.kv_page_bytes, host_state_bytes=4 * SPEC.state_bytes,
                                     write_policy="write_back"))  # fmt: skip
    cache.tree.insert(torch.arange(2 * SPEC.page_size, dtype=torch.int64).numpy(), cache.device_kv.alloc(2),
                      states={2 * SPEC.page_size: int(cache.device_mamba.alloc(1)[0])})  # fmt: skip
    with pytest.raises(ClosedError, match=r"async with HybridCache\(\.\.\.\)"):
        cache.flush_device()
    cache.tree.check_integrity()
