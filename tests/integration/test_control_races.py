"""Races and failures of the control path: eviction during a storage lookup, cancelled waiters,
failed copies of operations that build on each other, closing with work queued or in flight,
and the reference scheduler cancelling or exiting mid-admission. Nothing may crash the
controller, hang a waiter or leak a slot."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from serving import free_counts, slow_backend, store_only

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import TransferError
from asynccache.ops import OpState
from asynccache.policy import EveryPageAdmission
from asynccache.reference.model import HybridModel
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.spec import HybridSpec
from asynccache.tiering import RestoreCost

PAGE = 4
NUM_PAGES = 16
TOKENS = [(9 * t + 2) % 250 + 1 for t in range(NUM_PAGES * PAGE)]
SPEC = HybridSpec.preset("tiny", page_size=PAGE)


def config(**overrides: Any) -> HybridCacheConfig:
    cfg: dict[str, Any] = {
        "device_kv_pages": 128,
        "device_state_slots": 32,
        "host_kv_bytes": 256 * SPEC.kv_page_bytes,
        "host_state_bytes": 32 * SPEC.state_bytes,
    }
    cfg.update(overrides)
    return HybridCacheConfig(**cfg)


def insert(cache: HybridCache, tokens: list[int]) -> Any:
    alloc = cache.tree.alloc_device(len(tokens) // PAGE, 1)
    assert alloc is not None
    return cache.tree.insert(tokens, alloc.kv_indices, states={len(tokens): int(alloc.state_slots[0])})


async def stored(cache: HybridCache) -> None:
    """TOKENS in storage only, with a state every 4 pages."""
    await store_only(cache, TOKENS, grid=4)


async def test_the_matched_node_survives_eviction_during_the_storage_lookup() -> None:
    async with HybridCache(SPEC, config(storage_uri="memory://race1"), admission=EveryPageAdmission()) as cache:
        await stored(cache)
        insert(cache, TOKENS[:16])  # a device-only prefix: the match ends on it
        match = cache.tree.match_prefix(TOKENS)
        assert match.num_tokens == 16
        # Another request needs the device meanwhile: everything evictable goes.
        slow_backend(cache, "batch_exists_v2", 0.01, during=cache.flush_device)
        task = cache.controller.prefetch(TOKENS, match)
        assert task is not None
        res = await cache.controller.wait_prefetch(task, len(TOKENS))
        assert res is not None and res.num_tokens == NUM_PAGES * PAGE
        assert match.last_node.alive
        assert cache.tree.match_prefix(TOKENS).num_tokens == NUM_PAGES * PAGE
        cache.tree.check_integrity()
    assert cache.controller._tg is None  # closed cleanly


async def test_a_cancelled_waiter_releases_the_split_restore_it_would_have_taken() -> None:
    async with HybridCache(
        SPEC, config(storage_uri="memory://race2", prefetch_policy="wait_complete"), admission=EveryPageAdmission()
    ) as cache:
        await stored(cache)
        tier = cache.controller.tiering
        assert tier is not None
        read_page_s = SPEC.kv_page_bytes / 1e6
        tier.cost = RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=PAGE / (3.0 * read_page_s))
        slow_backend(cache, "batch_exists_v2", 0.05)
        slow_backend(cache, "batch_get_v2", 0.3)  # the tail lands well after the lookup
        before = free_counts(cache)

        async def request() -> None:
            task = cache.controller.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
            assert task is not None
            res = await cache.controller.wait_prefetch(task, len(TOKENS))
            if res is not None and res.tail is not None:
                res.tail.release()

        waiter = asyncio.create_task(request())
        await asyncio.sleep(0.01)
        waiter.cancel()  # the client went away during the lookup
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.1)
        await cache.controller.wait_idle()  # the tail's read in flight included
        assert tier.counts["prefetch_tail"] == 1  # a split was planned, and nobody took it
        assert free_counts(cache) == before
        cache.tree.check_integrity()


@pytest.mark.parametrize("kind", ["write", "load"])
async def test_a_failed_copy_of_operations_building_on_each_other_fails_them_all(kind: str) -> None:
    """Two requests of one step, the second extending the first (a shared prefix): the failed
    copy is undone for both, newest first, and both operations report it."""
    async with HybridCache(SPEC, config()) as cache:
        ctrl, tree = cache.controller, cache.tree
        r1 = insert(cache, TOKENS[:16])
        r2 = insert(cache, TOKENS[:32])
        if kind == "load":
            for res in (r1, r2):
                op = ctrl.write(res.backup_nodes)
                assert op is not None
                ctrl.start_writing()
                await op
            cache.flush_device()
        before = free_counts(cache)

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise TransferError("injected copy failure")

        if kind == "write":
            ctrl.copy = failing  # type: ignore[method-assign]
            ops = [ctrl.write(r1.backup_nodes), ctrl.write(r2.backup_nodes)]
            ctrl.start_writing()
        else:
            ctrl.layer_copier = failing  # type: ignore[method-assign]
            ops = [ctrl.load(tree.match_prefix(TOKENS[:16])), ctrl.load(tree.match_prefix(TOKENS[:32]))]
            counter = ctrl.start_loading()
            with pytest.raises(TransferError):
                for lid in SPEC.cached_layer_ids:
                    await counter.wait(lid)
        for op in ops:
            assert op is not None
            with pytest.raises(TransferError):
                await asyncio.wait_for(op, 5)
            assert op.state is OpState.FAILED
        assert tree.stats().num_active_plans == 0
        assert free_counts(cache) == before
        tree.check_integrity()


async def test_a_queued_load_that_another_builds_on_is_not_cancelled_and_completes() -> None:
    for close_with_it_queued in (False, True):
        cache = HybridCache(SPEC, config(storage_uri="memory://race4"), admission=EveryPageAdmission())
        await cache.__aenter__()
        ctrl, tree = cache.controller, cache.tree
        await stored(cache)
        task = ctrl.prefetch(TOKENS[:32], tree.match_prefix(TOKENS[:32]))
        assert task is not None
        await ctrl.wait_prefetch(task, 32)  # 8 pages back on the host
        op = ctrl.load(tree.match_prefix(TOKENS[:32]))
        assert op is not None
        insert(cache, TOKENS[:48])  # another request's pages land below the queued load's nodes
        if close_with_it_queued:
            await cache.aclose()  # issued instead of dropped: its waiter hears of it
            await asyncio.wait_for(op, 5)
            assert op.state is OpState.DONE
            continue
        assert ctrl.cancel(op) is False  # it cannot be undone without breaking the insert
        assert op in ctrl._load_queue and op.state is OpState.QUEUED
        ctrl.start_loading()
        await asyncio.wait_for(op, 5)
        assert op.state is OpState.DONE and tree.stats().num_active_plans == 0
        tree.check_integrity()
        await cache.aclose()


async def test_overlapping_closes_wait_for_the_first() -> None:
    cache = HybridCache(SPEC, config(storage_uri="memory://race5"))
    await cache.__aenter__()
    ctrl = cache.controller
    slow_backend(cache, "batch_set_v2", 0.05)
    res = insert(cache, TOKENS[:16])
    op = ctrl.write(res.backup_nodes)
    assert op is not None
    ctrl.start_writing()
    await op  # the backup to storage is still in flight
    assert await asyncio.gather(cache.aclose(), cache.aclose()) == [None, None]
    assert ctrl.tiering.counts["backup_ok"] >= 1  # the first close finished the backup
    await cache.aclose()  # and a later one is a no-op


async def test_a_request_cancelled_while_its_lookup_runs_does_not_stop_the_scheduler() -> None:
    model = HybridModel(SPEC, seed=0)
    cfg = config(device_kv_pages=16, device_state_slots=8, storage_uri="memory://race6", prefetch_policy="wait_complete")
    async with HybridCache(SPEC, cfg) as cache:
        slow_backend(cache, "batch_exists_v2", 0.05)
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=16)) as sched:
            first = await sched.generate(list(range(1, 20)), 2)
            doomed = sched.submit(list(range(1, 41)), 2)  # 10 of the 16 pages
            await asyncio.sleep(0.01)
            doomed.cancel()  # while its storage lookup is awaited
            await asyncio.sleep(0.1)
            again = await asyncio.wait_for(sched.generate(list(range(1, 20)), 2), 10)
            assert again.output_ids == first.output_ids


async def test_leaving_the_scheduler_mid_lookup_leaves_nothing_taken(tmp_path: Path) -> None:
    """Request A is admitted with a host load into its working slot and runs; request B's
    storage lookup runs in the background when the scheduler exits. A is cancelled with
    nothing queued, and B's split restore is released when its lookup ends."""
    model = HybridModel(SPEC, seed=0)
    cfg = config(storage_uri=tmp_path.as_uri(), prefetch_policy="wait_complete")
    p1 = [(7 * t + 3) % 250 + 1 for t in range(48)]
    p2 = [(5 * t + 1) % 250 + 1 for t in range(48)]
    async with HybridCache(SPEC, cfg) as cache:
        ctrl, tree = cache.controller, cache.tree
        tier = ctrl.tiering
        assert tier is not None
        async with Scheduler(model, cache, SchedulerConfig(chunk_size=PAGE)) as sched:
            r1 = await sched.generate(p1, 2)
            await ctrl.wait_idle()
            await tier.drain()
            cache.flush_device()
            cache.flush_host()  # p1: in storage only
            r2 = await sched.generate(p2, 2)
            await ctrl.wait_idle()
            await tier.drain()
            cache.flush_device()  # p2: on the host
        read_page_s = SPEC.kv_page_bytes / 1e6
        tier.cost = RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=PAGE / (3.0 * read_page_s))
        slow_backend(cache, "batch_exists_v2", 0.05)
        sched = Scheduler(model, cache, SchedulerConfig(chunk_size=PAGE))
        await sched.__aenter__()
        sched.submit([*p2, *r2.output_ids, 9, 9, 9], 2)  # a host hit, loaded into its working slot
        async with asyncio.timeout(10):
            while not sched._running:
                await asyncio.sleep(0.001)
        sched.submit([*p1, *r1.output_ids, 8, 8, 8], 2)  # from storage: a split restore
        async with asyncio.timeout(10):
            while not (sched._waiting and sched._waiting[0].lookup is not None):
                await asyncio.sleep(0.001)
        assert sched._running and not sched._waiting[0].lookup.done()  # A runs while B looks up
        await sched.__aexit__(None, None, None)
        assert ctrl.statistics().load_queue == 0 and tree.stats().num_active_plans == 0
        await asyncio.sleep(0.2)
        await ctrl.wait_idle()
        await tier.drain()
        cache.flush_device()
        cache.flush_host()
        tree.check_integrity()
        assert all(p.num_free == p.num_items for p in (cache.device_kv, cache.device_mamba, cache.host_kv, cache.host_mamba))
