"""The reference scheduler under pressure and failure: a host hit admitted under write_back, a
loop that stops, leaving with queued loads that build on each other, an abandoned storage
lookup's locks, and a request that waits for room."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from serving import (
    arith_prompt,
    config_with,
    held_nodes,
    slow_backend,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError, SchedulerError
from asynccache.policy import EveryPageAdmission
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
MODEL = tiny_model(SPEC, "cpu", seed=0)


def config(**overrides: Any) -> HybridCacheConfig:
    return config_with(SPEC, **overrides)


prompt = arith_prompt


async def settle(cache: HybridCache) -> None:
    await cache.controller.wait_idle()
    if cache.controller.tiering is not None:
        await cache.controller.tiering.drain()


async def cold_output(tokens: list[int], n: int) -> list[int]:
    async with HybridCache(SPEC, config(device_kv_pages=512, device_state_slots=64)) as cache, Scheduler(
        MODEL, cache, SchedulerConfig(chunk_size=4096, use_cache=False)
    ) as sched:
        return (await sched.generate(tokens, n)).output_ids


def assert_nothing_held(cache: HybridCache) -> None:
    cache.flush_device()
    cache.flush_host()
    cache.tree.check_integrity()
    for pool in (cache.device_kv, cache.device_mamba, cache.host_kv, cache.host_mamba):
        assert pool is not None and pool.num_free == pool.num_items
    assert not held_nodes(cache)


async def test_a_host_hit_admitted_under_write_back_keeps_its_host_state() -> None:
    """Making room for the request's slots writes device states back to a full host tier, which
    evicts host states: not the match's own, which admission holds on the host too."""
    p1, p2 = prompt(24, 7, 3), prompt(24, 5, 1)
    again = p1 + [9] * 8
    want = await cold_output(again, 2)
    cfg = config(
        device_kv_pages=64,
        device_state_slots=4,
        host_kv_bytes=64 * SPEC.kv_page_bytes,
        host_state_bytes=2 * SPEC.state_bytes,
        write_policy="write_back",
    )
    async with HybridCache(SPEC, cfg) as cache:
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            await sched.generate(p1, 2)
            await settle(cache)
            cache.flush_device()  # written back: p1 on the host only
            await settle(cache)
            await sched.generate(p2, 2)  # p2's states on the device, not backed up
            await settle(cache)
            match = cache.tree.match_prefix(again[:-1])
            assert match.num_tokens == len(p1) and cache.host_mamba.num_free == 0
            res = await asyncio.wait_for(sched.generate(again, 2), 30)
            assert res.output_ids == want and res.cached_tokens == len(p1)
            await settle(cache)
        assert_nothing_held(cache)


async def test_a_stopped_loop_fails_its_requests_and_refuses_new_ones() -> None:
    async with HybridCache(SPEC, config()) as cache:
        sched = Scheduler(MODEL, cache)
        await sched.__aenter__()

        def broken_step(*_: object) -> None:
            raise RuntimeError("a step failed")

        sched._step = broken_step  # type: ignore[assignment,method-assign]
        with pytest.raises(RuntimeError, match="a step failed"):
            await asyncio.wait_for(sched.generate([1, 2, 3, 4, 5], 2), 5)
        await asyncio.sleep(0.01)  # the caller's task is not cancelled by the loop's failure
        with pytest.raises(SchedulerError, match="stopped") as info:
            sched.submit([1, 2, 3], 2)
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(SchedulerError, match="stopped"):
            await sched.__aexit__(None, None, None)
        with pytest.raises(SchedulerError):
            sched.submit([1, 2, 3], 2)


def test_scheduler_config_is_validated() -> None:
    for bad in (
        {"chunk_size": 0},
        {"max_running": -1},
        {"max_batch_tokens": 1.5},
        {"chunk_size": True},
        {"lookup_wait_s": -0.1},
        {"lookup_wait_s": float("nan")},
        {"lookup_wait_s": float("inf")},
        {"lookup_wait_s": "0.01"},
        {"lookup_wait_s": True},
        {"lookahead_host_fraction": -0.1},
        {"lookahead_host_fraction": 1.5},
        {"lookahead_host_fraction": float("nan")},
        {"lookahead_host_fraction": "0.5"},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SchedulerConfig(**bad)  # type: ignore[arg-type]


async def test_leaving_with_loads_that_build_on_each_other_frees_everything() -> None:
    """Two admitted host hits, the newer one's load below the older one's, and a third request
    whose storage lookup runs when the scheduler is left: leaving cancels the running ones newest
    first and abandons the lookup, so no load stays queued and nothing stays held."""
    p1, p3 = prompt(48, 7, 3), prompt(30, 5, 1)
    cfg = config(storage_uri="memory://leave_two_loads", prefetch_policy="wait_complete")
    async with HybridCache(SPEC, cfg, admission=EveryPageAdmission()) as cache:
        ctrl = cache.controller
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            await sched.generate(p1, 2)
            await settle(cache)
            cache.flush_device()  # p1 on the host
        slow_backend(cache, "batch_exists_v2", 0.3)
        sched = Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64))
        await sched.__aenter__()
        sched.submit(p1[:24] + [9, 9, 9], 2)  # loads p1's first pages
        sched.submit(p1 + [8, 8, 8], 2)  # loads the pages below them
        sched.submit(p3, 2)  # its storage lookup runs while the other two compute
        await asyncio.sleep(0.1)
        assert sched._waiting and sched._waiting[0].storage_tokens is not None  # looking up
        await sched.__aexit__(None, None, None)
        assert ctrl.statistics().load_queue == 0 and cache.tree.stats().num_active_plans == 0
        await settle(cache)
        assert_nothing_held(cache)


async def test_an_abandoned_storage_lookup_does_not_make_a_request_too_big() -> None:
    """A lookup that outlives its request (prefetch policy 'timeout') holds that request's
    prefix locked; a request that needs the room waits for the lookup, not fails."""
    short, big = prompt(24, 7, 3), prompt(57, 5, 1)  # big needs 15 of the 16 device pages
    cfg = config(
        device_kv_pages=16,
        device_state_slots=8,
        storage_uri="memory://abandoned_lookup",
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.01,
        prefetch_timeout_per_1k_tokens_s=0.0,
    )
    async with HybridCache(SPEC, cfg) as cache, Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
        want = (await sched.generate(big, 2)).output_ids
        await settle(cache)
        cache.flush_device()
        cache.flush_host()
        await sched.generate(short, 2)  # its prefix on the device
        await settle(cache)
        slow_backend(cache, "batch_exists_v2", 1.0)
        await sched.generate(short + [1, 2, 3, 4, 5, 6, 7, 8], 2)  # stops waiting for its lookup
        assert any(n.device_lock for n in cache.tree.iter_nodes())  # the lookup holds the prefix
        res = await asyncio.wait_for(sched.generate(big, 2), 10)
        assert res.output_ids == want


async def test_a_request_waiting_for_room_looks_storage_up_once() -> None:
    """Each step would wait for the waiting request's lookup again (prefetch policy
    'wait_complete'): the running request's decode steps would crawl."""
    a, b = prompt(20, 7, 3), prompt(40, 5, 1)  # b does not fit beside a's 13 pages
    cfg = config(device_kv_pages=16, device_state_slots=8, storage_uri="memory://waiting_room",
                 prefetch_policy="wait_complete")  # fmt: skip
    async with HybridCache(SPEC, cfg) as cache, Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
        await sched.generate([1, 2, 3], 2)
        lookups = slow_backend(cache, "batch_exists_v2", 0.01)
        steps = sched.num_steps
        fa = sched.submit(a, 30)
        await asyncio.sleep(0)
        fb = sched.submit(b, 2)
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(fa, fb), 60)
        assert sched.num_steps - steps > 30 and time.perf_counter() - t0 < 30
        assert lookups == [2]  # one each


async def test_requests_a_scheduler_cannot_take_are_typed_errors() -> None:
    """Bad input is a ConfigError (a ValueError); a scheduler not running (not entered, or
    exited) a SchedulerError."""
    async with HybridCache(SPEC, config()) as cache:
        sched = Scheduler(MODEL, cache)
        with pytest.raises(SchedulerError, match="async with"):
            sched.submit(prompt(8, 1, 1), 2)
        async with sched:
            with pytest.raises(ConfigError, match="at least one prompt token"):
                sched.submit([], 2)
            with pytest.raises(ConfigError, match="prompt token ids"):
                sched.submit([SPEC.vocab_size], 2)
        with pytest.raises(SchedulerError, match="closed"):
            sched.submit(prompt(8, 1, 1), 2)


async def test_a_caller_cancelled_while_leaving_the_scheduler_stays_cancelled_and_frees_everything() -> None:
    """Leaving waits for the loop to stop; a cancellation of the leaving task meanwhile is not
    swallowed: the device is waited for and the requests freed all the same, then it goes on."""

    class SlowToStop(Scheduler):
        async def _loop(self) -> None:
            try:
                await super()._loop()
            except asyncio.CancelledError:
                await asyncio.sleep(0.3)  # a step that takes a while to end
                raise

    async with HybridCache(SPEC, config()) as cache:
        sched = SlowToStop(MODEL, cache, SchedulerConfig(chunk_size=64))
        left = asyncio.Event()
        went_on: list[bool] = []

        async def serve_then_leave() -> None:
            async with sched:
                sched.submit(prompt(40, 3, 1), 200)
                await asyncio.sleep(0.05)
                left.set()
            went_on.append(True)  # never reached: the leave is cancelled

        task = asyncio.create_task(serve_then_leave())
        await left.wait()
        await asyncio.sleep(0.05)  # inside __aexit__, waiting for the loop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled() and not went_on
        assert not sched._running and not sched._waiting
        await settle(cache)
        assert_nothing_held(cache)
