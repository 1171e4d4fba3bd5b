"""The reference scheduler's storage lookups run beside the running requests: the loop keeps
stepping them while a waiting request's lookup (which may read a whole prefix) is in flight,
a restore found that way still serves its request exactly, and a ``timeout`` policy's deadline
counts from the lookup's start, not from when the scheduler comes back to it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from serving import (
    arith_prompt,
    config_with,
    free_counts,
    settled,
    slow_backend,
    store_only,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
PAGE = SPEC.page_size


def _reads_in_flight(cache: HybridCache, seconds: float) -> list[int]:
    """Make each storage read wait ``seconds`` first; the returned one-item list holds the most
    reads in flight at once."""
    tier = cache.controller.tiering
    assert tier is not None
    real = tier.backend.batch_get_v2
    in_flight, most = [0], [0]

    async def slow_read(*args: object, **kwargs: object) -> object:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            await asyncio.sleep(seconds)
            return await real(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            in_flight[0] -= 1

    tier.backend.batch_get_v2 = slow_read  # type: ignore[method-assign]
    return most


def _timeout_config(storage: Path, seconds: float) -> HybridCacheConfig:
    """The ``timeout`` prefetch policy with a fixed deadline of ``seconds``."""
    return config_with(
        SPEC,
        storage_uri=storage.as_uri(),
        prefetch_policy="timeout",
        prefetch_timeout_base_s=seconds,
        prefetch_timeout_per_1k_tokens_s=0.0,
    )


async def test_running_requests_step_while_a_lookup_is_in_flight(tmp_path: Path) -> None:
    model = tiny_model(SPEC, "cpu", seed=0)
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=64)) as sched:
            long_run = sched.submit(arith_prompt(24, 3, 1), 400)
            async with asyncio.timeout(10):
                while not sched._running:
                    await asyncio.sleep(0.001)
            calls = slow_backend(cache, "batch_exists_v2", 0.5)  # the next lookups take half a second
            waiting = sched.submit(arith_prompt(32, 5, 2), 2)
            async with asyncio.timeout(10):
                while not calls[0]:  # its lookup has started
                    await asyncio.sleep(0.001)
            steps0, t0 = sched.num_steps, time.perf_counter()
            async with asyncio.timeout(10):
                while sched._waiting:
                    await asyncio.sleep(0.001)
            lookup_s = time.perf_counter() - t0
            # The lookup waited its half second; the running request was stepped meanwhile
            # (a loop that awaited the lookup would have taken no step at all).
            assert lookup_s >= 0.45
            assert sched.num_steps - steps0 >= 5
            await waiting
            long_run.cancel()  # (it has served its purpose: freed now, not decoded to its end)
        await cache.controller.wait_idle()
        assert cache.controller.tiering is not None
        await cache.controller.tiering.drain()
        cache.flush_device()
        cache.flush_host()
        assert free_counts(cache) == (128, 32, 256, 32)


async def test_a_restore_found_beside_a_running_request_is_exact(tmp_path: Path) -> None:
    """A prefix in storage only, looked up and restored while another request decodes, gives
    the same greedy output as the same request computed cold."""
    model = tiny_model(SPEC, "cpu", seed=1)
    prefix = arith_prompt(12 * PAGE, 7, 3)
    prompt = [*prefix, 11, 12, 13]
    cold_config = config_with(SPEC, storage_uri=None)
    async with HybridCache(SPEC, cold_config) as cold_cache, Scheduler(model, cold_cache, SchedulerConfig(use_cache=False)) as cold_sched:
        cold = await cold_sched.generate(prompt, 6)
    config = config_with(SPEC, storage_uri=tmp_path.as_uri())
    async with HybridCache(SPEC, config) as cache, Scheduler(model, cache, SchedulerConfig(chunk_size=64)) as sched:
        await sched.generate(prefix, 1)  # cached (its states at the admission's positions)
        await cache.controller.wait_idle()
        assert cache.controller.tiering is not None
        await cache.controller.tiering.drain()
        cache.flush_device()
        cache.flush_host()
        assert cache.tree.match_prefix(prompt[:-1]).num_tokens == 0
        long_run = sched.submit(arith_prompt(24, 3, 1), 400)
        async with asyncio.timeout(10):
            while not sched._running:
                await asyncio.sleep(0.001)
        slow_backend(cache, "batch_exists_v2", 0.2)
        warm = await sched.generate(prompt, 6)
        assert not long_run.done()  # the restore was served while it ran
        long_run.cancel()
    assert warm.cached_tokens > 0 and warm.cached_by_tier["storage"] == warm.cached_tokens
    assert warm.output_ids == cold.output_ids


async def test_the_timeout_deadline_counts_from_the_lookups_start(tmp_path: Path) -> None:
    """Under ``timeout`` a lookup that the scheduler leaves running while others compute is
    given up once the deadline from its start has passed (the request then computes cold)."""
    model = tiny_model(SPEC, "cpu", seed=2)
    async with HybridCache(SPEC, _timeout_config(tmp_path, 0.3)) as cache:
        await store_only(cache, arith_prompt(8 * PAGE, 7, 3), grid=2)
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=64)) as sched:
            long_run = sched.submit(arith_prompt(24, 3, 1), 400)
            async with asyncio.timeout(10):
                while not sched._running:
                    await asyncio.sleep(0.001)
            slow_backend(cache, "batch_exists_v2", 3.0)
            t0 = time.perf_counter()
            late = await asyncio.wait_for(sched.generate([*arith_prompt(8 * PAGE, 7, 3), 5], 2), 10)
            waited = time.perf_counter() - t0
            long_run.cancel()
        assert late.cached_tokens == 0  # the lookup was given up: computed cold
        assert 0.25 <= waited < 2.0  # its deadline (0.3 s), not the lookup's 3 s
        assert cache.controller.statistics().counts.get("prefetch_deadline_passed", 0) == 1


async def test_wait_prefetch_counts_the_time_already_waited(tmp_path: Path) -> None:
    tokens = arith_prompt(8 * PAGE, 7, 3)
    async with HybridCache(SPEC, _timeout_config(tmp_path, 1.0)) as cache:
        await store_only(cache, tokens, grid=2)
        ctrl = cache.controller
        slow_backend(cache, "batch_exists_v2", 5.0)
        task = ctrl.prefetch(tokens, cache.tree.match_prefix(tokens))
        assert task is not None
        assert not ctrl.prefetch_overdue(len(tokens), 0.9) and ctrl.prefetch_overdue(len(tokens), 1.0)
        t0 = time.perf_counter()
        assert await ctrl.wait_prefetch(task, len(tokens), elapsed_s=0.9) is None
        assert time.perf_counter() - t0 < 0.5  # the 0.1 s left of its 1 s, not a whole second
        task.cancel()


async def test_waiting_for_the_probe_does_not_wait_for_the_read(tmp_path: Path) -> None:
    """``wait_prefetch_probed`` returns once storage has been probed: at once after a miss's
    lookup has ended, while a whole restore is still reading, and after ``at_most_s`` when the
    probe itself is slow."""
    tokens = arith_prompt(8 * PAGE, 7, 3)
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        await store_only(cache, tokens, grid=2)
        ctrl = cache.controller
        miss = arith_prompt(8 * PAGE, 5, 1)
        task = ctrl.prefetch(miss, cache.tree.match_prefix(miss))
        assert task is not None
        await ctrl.wait_prefetch_probed(task, len(miss))
        assert task.done() and task.result().num_pages_fetched == 0

        reads = slow_backend(cache, "batch_get_v2", 1.0)
        task = ctrl.prefetch(tokens, cache.tree.match_prefix(tokens))
        assert task is not None
        t0 = time.perf_counter()
        await ctrl.wait_prefetch_probed(task, len(tokens))
        assert time.perf_counter() - t0 < 0.5 and reads[0] == 1 and not task.done()  # reading
        assert (await task).num_pages_fetched == 8

        cache.flush_device()
        cache.flush_host()
        slow_backend(cache, "batch_exists_v2", 1.0)
        task = ctrl.prefetch(tokens, cache.tree.match_prefix(tokens))
        assert task is not None
        t0 = time.perf_counter()
        await ctrl.wait_prefetch_probed(task, len(tokens), at_most_s=0.05)
        assert time.perf_counter() - t0 < 0.5 and not task.done()
        await task


async def test_with_nothing_running_the_next_requests_lookups_read_side_by_side(tmp_path: Path) -> None:
    """Requests that arrive together at an idle scheduler start their lookups together: their
    restores read at the same time, and the requests start in one step, not one a step."""
    model = tiny_model(SPEC, "cpu", seed=3)
    prefixes = [arith_prompt(8 * PAGE, 7, b) for b in (1, 2, 3)]
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        for p in prefixes:
            await store_only(cache, p, grid=2)
        most = _reads_in_flight(cache, 0.3)
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=64)) as sched:
            results = await asyncio.gather(*(sched.generate([*p, 9], 2) for p in prefixes))
            assert sched.num_steps == 2  # one prefill step for the three, one decode step
    assert most[0] == 3
    assert all(r.cached_by_tier["storage"] == 8 * PAGE for r in results)


async def _occupied(sched: Scheduler, step_s: float = 0.005) -> asyncio.Future:  # type: ignore[type-arg]
    """Submit a long request and return once it runs (it holds the room of ``max_running=1``);
    every step from here on takes at least ``step_s``, so its 400 steps outlast the test's waits."""
    forward = sched.model.forward

    async def slow_forward(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(step_s)
        return await forward(*args, **kwargs)

    sched.model.forward = slow_forward  # type: ignore[method-assign]
    long_run = sched.submit(arith_prompt(24, 3, 1), 400)
    async with asyncio.timeout(10):
        while not sched._running:
            await asyncio.sleep(0.001)
    return long_run


async def test_lookups_of_requests_beyond_the_room_read_while_it_is_taken(tmp_path: Path) -> None:
    """With the device's room taken, the waiting requests' restores are read ahead (both side by
    side) and serve them exactly once they are admitted; with ``lookahead_host_fraction=0``
    nothing is read until there is room."""
    model = tiny_model(SPEC, "cpu", seed=4)
    prefixes = [arith_prompt(8 * PAGE, 7, b) for b in (1, 2)]
    prompts = [[*p, 9, 10] for p in prefixes]
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=None)) as cold_cache, Scheduler(
        model, cold_cache, SchedulerConfig(use_cache=False)
    ) as cold_sched:
        cold = [await cold_sched.generate(p, 3) for p in prompts]
    for share in (0.25, 0.0):
        storage = tmp_path / str(share)
        async with HybridCache(SPEC, config_with(SPEC, storage_uri=storage.as_uri())) as cache:
            full = free_counts(cache)
            config = SchedulerConfig(chunk_size=64, max_running=1, lookahead_host_fraction=share)
            async with Scheduler(model, cache, config) as sched:
                for p in prefixes:  # computed, written to storage, then in storage only
                    await sched.generate(p, 1)
                assert await settled(cache) == full
                long_run = await _occupied(sched)
                reads = slow_backend(cache, "batch_get_v2", 0.2)
                waiting = [sched.submit(p, 3) for p in prompts]
                if share:
                    async with asyncio.timeout(10):
                        while reads[0] < 2:
                            await asyncio.sleep(0.001)
                else:
                    await asyncio.sleep(0.5)
                    assert reads[0] == 0
                assert not long_run.done() and len(sched._waiting) == 2
                long_run.cancel()
                results = await asyncio.gather(*waiting)
            assert await settled(cache) == full
        assert [r.output_ids for r in results] == [c.output_ids for c in cold]
        assert all(r.cached_tokens >= 6 * PAGE and r.cached_by_tier["storage"] == r.cached_tokens for r in results)


async def test_lookups_ahead_stop_at_their_share_of_the_host_pool(tmp_path: Path) -> None:
    """Only the lookups whose pages fit in ``lookahead_host_fraction`` of the host KV pool start
    ahead, in arrival order; the next starts once its request reaches the room."""
    model = tiny_model(SPEC, "cpu", seed=5)
    prefixes = [arith_prompt(8 * PAGE, 7, b) for b in (1, 2)]
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        assert cache.host_kv is not None
        share = 10 / cache.host_kv.num_items  # room for one prefix's 8 pages, not two
        for p in prefixes:
            await store_only(cache, p, grid=2)
        config = SchedulerConfig(chunk_size=64, max_running=1, lookahead_host_fraction=share)
        async with Scheduler(model, cache, config) as sched:
            long_run = await _occupied(sched)
            reads = slow_backend(cache, "batch_get_v2", 0.1)
            waiting = [sched.submit([*p, 9], 2) for p in prefixes]
            async with asyncio.timeout(10):
                while reads[0] < 1:
                    await asyncio.sleep(0.001)
            await asyncio.sleep(0.4)  # the first read is over; the second must not have started
            assert reads[0] == 1 and not long_run.done()
            long_run.cancel()
            results = await asyncio.gather(*waiting)
        assert reads[0] == 2
        assert all(r.cached_by_tier["storage"] == 8 * PAGE for r in results)


async def test_a_lookup_ahead_has_its_deadline_from_the_requests_turn(tmp_path: Path) -> None:
    """Under ``timeout`` the deadline of a lookup started ahead of room counts from when the
    request could be admitted, not from the lookup's start: time spent queued behind running
    requests is not time spent waiting for storage."""
    model = tiny_model(SPEC, "cpu", seed=6)
    prefix = arith_prompt(8 * PAGE, 7, 3)
    async with HybridCache(SPEC, _timeout_config(tmp_path, 2.0)) as cache:
        await store_only(cache, prefix, grid=2)
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=64, max_running=1)) as sched:
            long_run = await _occupied(sched, step_s=0.01)
            slow_backend(cache, "batch_get_v2", 2.8)  # ends 0.6 s into the request's 2 s
            late = sched.submit([*prefix, 5], 2)
            await asyncio.sleep(2.2)  # queued past the deadline, its read still in flight
            assert not long_run.done()
            long_run.cancel()
            result = await asyncio.wait_for(late, 10)
        assert result.cached_by_tier["storage"] == 8 * PAGE
        assert cache.controller.statistics().counts.get("prefetch_deadline_passed", 0) == 0


async def test_a_request_cancelled_while_its_lookup_reads_ahead_leaves_nothing_held(tmp_path: Path) -> None:
    model = tiny_model(SPEC, "cpu", seed=7)
    prefix = arith_prompt(8 * PAGE, 7, 3)
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        full = free_counts(cache)
        await store_only(cache, prefix, grid=2)
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=64, max_running=1)) as sched:
            long_run = await _occupied(sched)
            reads = slow_backend(cache, "batch_get_v2", 0.3)
            doomed = sched.submit([*prefix, 5], 2)
            async with asyncio.timeout(10):
                while reads[0] < 1:
                    await asyncio.sleep(0.001)
            assert not long_run.done() and len(sched._waiting) == 1  # read ahead of room
            doomed.cancel()
            await asyncio.sleep(0.5)  # the read lands after the cancellation
            long_run.cancel()
        assert await settled(cache) == full


async def test_reads_ahead_wait_for_the_reads_of_the_requests_next_in_line(tmp_path: Path) -> None:
    """At an idle scheduler the request the device can take reads alone: the one behind it
    starts its read only once the first runs, so it never slows the read that the first
    request's start waits for."""
    model = tiny_model(SPEC, "cpu", seed=8)
    prefixes = [arith_prompt(8 * PAGE, 7, b) for b in (1, 2)]
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        for p in prefixes:
            await store_only(cache, p, grid=2)
        most = _reads_in_flight(cache, 0.3)
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=64, max_running=1)) as sched:
            results = await asyncio.gather(*(sched.generate([*p, 9], 2) for p in prefixes))
    assert most[0] == 1
    assert all(r.cached_by_tier["storage"] == 8 * PAGE for r in results)
