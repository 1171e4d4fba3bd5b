"""A request that fits the device once the cache is evicted is served, with nothing running:
under ``write_back`` with a host state pool smaller than a write-back batch needs, and when
each eviction frees only part of what an attempt lacks (the scheduler tries again while an
attempt still frees device memory). The error of a request that finds no room tells the
cache's pages from those in use outside it."""

from __future__ import annotations

import asyncio
from typing import Any

import serving
from serving import arith_prompt, config_with, held_nodes, tiny_model, tiny_spec

from asynccache.cache import HybridCache
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
PAGE = SPEC.page_size
MODEL = tiny_model(SPEC, "cpu", seed=0)


async def cold_output(tokens: list[int], n: int) -> list[int]:
    return await serving.cold_output(MODEL, tokens, n)


async def two_conversations(sched: Scheduler, cache: HybridCache) -> None:
    """Two earlier requests, each leaving a chain of device nodes with states (EndsAdmission);
    nothing locked, nothing running."""
    await sched.generate(arith_prompt(36, 3, 1), 6)
    await sched.generate(arith_prompt(36, 5, 2), 6)
    await cache.controller.wait_idle()
    assert not held_nodes(cache)


async def test_write_back_with_few_host_state_slots_serves_a_request_needing_most_pages() -> None:
    """26 device pages, 2 host state slots: the 90-token prompt needs 24 pages, so both chains
    (6 states) must leave the device; their write-back cannot take them in one batch."""
    config = config_with(
        SPEC,
        device_kv_pages=26,
        device_state_slots=32,
        host_kv_bytes=64 * SPEC.kv_page_bytes,
        host_state_bytes=2 * SPEC.state_bytes,
        write_policy="write_back",
    )
    prompt = arith_prompt(90, 7, 3)
    async with HybridCache(SPEC, config) as cache, Scheduler(MODEL, cache, SchedulerConfig(max_running=1)) as sched:
        await two_conversations(sched, cache)
        free = cache.device_kv.num_free
        assert free < 24
        real = cache.tree.evict_device
        calls: list[int] = []

        def counted(num_kv_pages: int = 0, num_states: int = 0, **kwargs: Any) -> Any:
            calls.append(num_kv_pages)
            return real(num_kv_pages, num_states, **kwargs)

        cache.tree.evict_device = counted  # type: ignore[method-assign]
        try:
            result = await asyncio.wait_for(sched.generate(prompt, 6), 60)
        finally:
            del cache.tree.evict_device
        assert [n for n in calls if n] == [24 - free]  # one eviction made the room, at the first attempt
        await cache.controller.wait_idle()
        cache.tree.check_integrity()
    assert result.output_ids == await cold_output(prompt, 6)


async def test_attempts_that_free_device_memory_are_retried() -> None:
    """Each eviction frees at most a few pages: every attempt makes some room, none enough.
    The request is tried again while an attempt frees pages, and then served."""
    config = config_with(SPEC, device_kv_pages=26, device_state_slots=32)
    prompt = arith_prompt(90, 7, 3)
    async with HybridCache(SPEC, config) as cache, Scheduler(MODEL, cache, SchedulerConfig(max_running=1)) as sched:
        await two_conversations(sched, cache)
        tree = cache.tree
        real = tree.evict_device
        calls: list[int] = []

        def a_few_pages(num_kv_pages: int = 0, num_states: int = 0, **kwargs: Any) -> Any:
            calls.append(num_kv_pages)
            return real(min(num_kv_pages, 1), num_states, **kwargs)

        tree.evict_device = a_few_pages  # type: ignore[method-assign]
        try:
            result = await asyncio.wait_for(sched.generate(prompt, 6), 60)
        finally:
            del tree.evict_device
        assert len([n for n in calls if n]) > 2  # more than one attempt with its cache, and one without
        await cache.controller.wait_idle()
        tree.check_integrity()
    assert result.output_ids == await cold_output(prompt, 6)
