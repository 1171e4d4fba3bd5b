"""Set-up shared by the end-to-end model tests: the tiny hybrid spec, its reference model on the
test's device, the cache budgets they serve through, and a prefix left in storage only."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.reference.model import HybridModel
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.restore_cost import RestoreCost
from asynccache.spec import HybridSpec

PAGE = 4


def tiny_spec() -> HybridSpec:
    return HybridSpec.preset("tiny", page_size=PAGE)


def tiny_model(spec: HybridSpec, device: str, *, seed: int, bucket_passes: bool | None = None) -> HybridModel:
    """fp32 on CPU, bf16 on CUDA."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return HybridModel(spec, device=device, dtype=dtype, seed=seed, bucket_passes=bucket_passes)


def device_of(model: HybridModel) -> str:
    return next(model.parameters()).device.type


def serving_config(spec: HybridSpec, storage_uri: str | None = None) -> HybridCacheConfig:
    """Room for every test prompt on the device and host; prefetches waited for to completion."""
    return HybridCacheConfig(
        device_kv_pages=128,
        device_state_slots=32,
        host_kv_bytes=256 * spec.kv_page_bytes,
        host_state_bytes=32 * spec.state_bytes,
        storage_uri=storage_uri,
        prefetch_policy="wait_complete",
    )


async def store_only(cache: HybridCache, tokens: list[int], *, grid: int, salt: str = "") -> None:
    """Insert ``tokens`` (whole pages; for tenant ``salt``) with a state every ``grid`` pages,
    back them up to the cache's storage, then flush device and host: the prefix is in storage
    only."""
    page = cache.spec.page_size
    positions = list(range(grid * page, len(tokens) + 1, grid * page))
    alloc = cache.tree.alloc_device(len(tokens) // page, len(positions))
    assert alloc is not None
    states = dict(zip(positions, alloc.state_slots.tolist(), strict=True))
    res = cache.tree.insert(tokens, alloc.kv_indices, states=states, salt=salt)
    op = cache.controller.write(res.backup_nodes)
    assert op is not None
    cache.controller.start_writing()
    await op
    assert cache.controller.tiering is not None
    await cache.controller.tiering.drain()
    cache.flush_device()
    cache.flush_host()
    assert cache.tree.match_prefix(tokens, salt=salt).num_tokens == 0


def slow_backend(
    cache: HybridCache,
    method: str,
    seconds: float,
    during: Callable[[], None] | None = None,
    *,
    first_only: bool = False,
) -> list[int]:
    """Make the storage backend's ``method`` (a coroutine) wait ``seconds`` before each call
    (only the first with ``first_only``), then run ``during`` (if given); returns a one-item
    list counting the calls."""
    tier = cache.controller.tiering
    assert tier is not None
    real = getattr(tier.backend, method)
    calls = [0]

    async def slow(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1 or not first_only:
            await asyncio.sleep(seconds)
        if during is not None:
            during()
        return await real(*args, **kwargs)

    setattr(tier.backend, method, slow)
    return calls


def split_cost(spec: HybridSpec) -> RestoreCost:
    """Computing a page costs three page reads: the best plan computes about a quarter of a
    stored prefix while the rest is read (a split restore)."""
    read_page_s = spec.kv_page_bytes / 1e6
    return RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=spec.page_size / (3.0 * read_page_s))


def config_with(spec: HybridSpec, **overrides: Any) -> HybridCacheConfig:
    """:func:`serving_config` of ``spec`` with some fields replaced."""
    return dataclasses.replace(serving_config(spec), **overrides)


async def cold_output(model: HybridModel, tokens: list[int], n: int) -> list[int]:
    """``model``'s greedy output for ``tokens`` computed cold (the cache not used), on pools
    with room for any test prompt."""
    config = config_with(model.spec, device_kv_pages=512, device_state_slots=64)
    async with (
        HybridCache(model.spec, config) as cache,
        Scheduler(model, cache, SchedulerConfig(chunk_size=4096, use_cache=False)) as sched,
    ):
        return (await sched.generate(tokens, n)).output_ids


def arith_prompt(n: int, a: int, b: int) -> list[int]:
    """``n`` token ids of an arithmetic sequence (distinct prompts for distinct ``a``, ``b``)."""
    return [(a * t + b) % 250 + 1 for t in range(n)]


def free_counts(cache: HybridCache) -> tuple[int, ...]:
    """Free indices of the device and host pools (a leak shows as a smaller count)."""
    pools = (cache.device_kv, cache.device_mamba, cache.host_kv, cache.host_mamba)
    return tuple(p.num_free for p in pools if p is not None)


def held_nodes(cache: HybridCache) -> list[Any]:
    """The tree's nodes still locked on either tier or pinned by a load (none once idle)."""
    return [n for n in cache.tree.iter_nodes() if n.device_lock or n.host_lock or n.loading]


async def settled(cache: HybridCache) -> tuple[int, ...]:
    """Wait for the copies and archives in flight, flush device and host, check the tree (no
    lock left) and return :func:`free_counts` (a leak shows as a smaller count)."""
    await cache.controller.wait_idle()
    if cache.controller.tiering is not None:
        await cache.controller.tiering.drain()
    cache.flush_device()
    cache.flush_host()
    cache.tree.check_integrity()
    return free_counts(cache)
