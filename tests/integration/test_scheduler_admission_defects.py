"""The reference scheduler's admission at its edges: the tier a hit is counted on when other
requests filled the tree during its storage lookup, a request the device pools could never
hold, a request without room, and a request cancelled while its storage lookup is in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from serving import (
    arith_prompt,
    config_with,
    free_counts,
    held_nodes,
    settled,
    slow_backend,
    store_only,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.errors import CapacityError
from asynccache.policy import EveryPageAdmission
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
PAGE = SPEC.page_size
MODEL = tiny_model(SPEC, "cpu", seed=0)


def _lookups(cache: HybridCache) -> list[asyncio.Task[Any]]:
    """Record the storage lookups the controller starts from here on (their tasks, in order)."""
    ctrl = cache.controller
    real = ctrl.prefetch
    tasks: list[asyncio.Task[Any]] = []

    def prefetch(*args: Any, **kwargs: Any) -> Any:
        task = real(*args, **kwargs)
        if task is not None:
            tasks.append(task)
        return task

    ctrl.prefetch = prefetch  # type: ignore[method-assign]
    return tasks


def _forwards(sched: Scheduler) -> list[tuple[int, list[int]]]:
    """Record each sequence the model computes from here on: its start and token ids."""
    forward = sched.model.forward
    seen: list[tuple[int, list[int]]] = []

    async def recording(batch: Any, *args: Any) -> Any:
        seen.extend((s.start, s.token_ids.tolist()) for s in batch.sequences)
        return await forward(batch, *args)

    sched.model.forward = recording  # type: ignore[method-assign]
    return seen


def _computed(seen: list[tuple[int, list[int]]], prompt: list[int]) -> bool:
    return any(start == 0 and ids == prompt[: len(ids)] for start, ids in seen)


# ---- the tier a hit counts on ---------------------------------------------------------------


async def test_a_device_hit_after_a_missed_lookup_counts_on_the_device() -> None:
    """B waits behind A (``max_running=1``) with A's prompt as its prefix; its storage lookup
    misses, then A finishes and inserts the prefix on the device: B's hit is the device's, not a
    restore from storage."""
    prefix = arith_prompt(6 * PAGE, 7, 3)
    config = config_with(SPEC, storage_uri="memory://device_hit_after_miss")
    async with HybridCache(SPEC, config) as cache:
        lookups = _lookups(cache)
        async with Scheduler(MODEL, cache, SchedulerConfig(max_running=1)) as sched:
            first = sched.submit(prefix, 8)
            await asyncio.sleep(0)
            second = sched.submit([*prefix, 9, 9, 9, 9, 9], 2)
            _, b = await asyncio.wait_for(asyncio.gather(first, second), 60)
        assert len(lookups) == 2 and all(t.result().num_pages_fetched == 0 for t in lookups)  # both missed
        assert b.cached_tokens == len(prefix)
        assert b.cached_by_tier == {"device": len(prefix), "host": 0, "storage": 0}


async def test_a_restore_below_a_host_hit_counts_each_part_on_its_tier(tmp_path: Path) -> None:
    """The host holds a prefix's first half, storage all of it: the lookup restores the second
    half, which counts on storage, the first half on the host; together the cached tokens."""
    prefix = arith_prompt(8 * PAGE, 7, 3)
    config = config_with(SPEC, storage_uri=tmp_path.as_uri())
    async with HybridCache(SPEC, config) as cache:
        await store_only(cache, prefix, grid=2)
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            await sched.generate(prefix[: 4 * PAGE], 1)  # its first half, with a state at its end
            await cache.controller.wait_idle()
            cache.flush_device()  # on the host only
            assert cache.tree.match_prefix(prefix).num_tokens == 4 * PAGE
            result = await sched.generate([*prefix, 9], 2)
        assert result.cached_tokens == 8 * PAGE
        assert result.cached_by_tier == {"device": 0, "host": 4 * PAGE, "storage": 4 * PAGE}


# ---- requests the device pools cannot hold --------------------------------------------------


async def test_a_request_the_device_could_never_hold_is_refused_at_submit() -> None:
    """Refused before it is queued, naming what it needs and what the pools hold: admission
    would evict every cached prefix from the device at each attempt before failing it."""
    prefix = arith_prompt(10 * PAGE, 7, 3)
    config = config_with(SPEC, host_kv_bytes=0, host_state_bytes=0)
    async with HybridCache(SPEC, config) as cache, Scheduler(MODEL, cache) as sched:
        await sched.generate(prefix, 2)
        await cache.controller.wait_idle()
        on_device = cache.tree.match_prefix(prefix).num_device_tokens
        assert on_device == 10 * PAGE
        with pytest.raises(CapacityError, match="needs 250001 device KV pages .* hold 128 pages and 32 slots"):
            sched.submit([1, 2, 3], 10**6)
        assert not sched._waiting
        await asyncio.sleep(0.05)
        assert cache.tree.match_prefix(prefix).num_device_tokens == on_device  # nothing evicted
        assert (await sched.generate([*prefix, 1], 2)).cached_by_tier["device"] == on_device


async def test_a_request_that_fills_the_empty_device_exactly_is_served() -> None:
    """Its pages: one per page of the positions it computes, the last sampled token's excluded
    (the arithmetic admission uses): 16 of a 16-page pool run, 17 are refused."""
    config = config_with(SPEC, device_kv_pages=16, device_state_slots=8)
    async with HybridCache(SPEC, config) as cache, Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
        await sched.generate(arith_prompt(8 * PAGE, 5, 1), 2)  # cached, evicted to make room below
        await cache.controller.wait_idle()
        result = await asyncio.wait_for(sched.generate(arith_prompt(60, 7, 3), 5), 30)  # 64 positions
        assert len(result.output_ids) == 5
        with pytest.raises(CapacityError, match="61 prompt \\+ 5 new tokens needs 17 device KV pages"):
            sched.submit(arith_prompt(61, 7, 3), 5)


async def test_an_allocation_beyond_a_pool_evicts_nothing() -> None:
    """No eviction could make room for more pages or slots than a pool holds: the tree refuses
    at once, and what it caches stays."""
    prefix = arith_prompt(10 * PAGE, 7, 3)
    async with HybridCache(SPEC, config_with(SPEC)) as cache:
        async with Scheduler(MODEL, cache) as sched:
            await sched.generate(prefix, 2)
        await cache.controller.wait_idle()
        tree = cache.tree
        before = free_counts(cache)
        assert cache.host_kv is not None and cache.host_mamba is not None
        for alloc in (
            lambda: tree.alloc_device(cache.device_kv.num_items + 1, 0),
            lambda: tree.alloc_device(1, cache.device_mamba.num_items + 1),
            lambda: tree.alloc_host(cache.host_kv.num_items + 1, 0),
            lambda: tree.alloc_host(0, cache.host_mamba.num_items + 1),
        ):
            assert alloc() is None
            assert free_counts(cache) == before
        match = tree.match_prefix(prefix)
        assert match.num_device_tokens == 10 * PAGE and match.num_host_tokens == 0
        whole = tree.alloc_device(cache.device_kv.num_items, 0)  # as many as it holds: evicts
        assert whole is not None and tree.match_prefix(prefix).num_device_tokens == 0
        cache.device_kv.free(whole.kv_indices)


async def test_snapshots_beyond_the_slot_pool_still_take_every_slot_eviction_frees() -> None:
    """Every-page admission asks a 40-token prompt for more states than the device's 8 slots:
    it keeps as many as the pool holds besides the working slot, evicting the states an earlier
    request left, rather than as many as happen to be free."""
    first, second = arith_prompt(10 * PAGE, 7, 3), arith_prompt(10 * PAGE, 5, 1)
    config = config_with(SPEC, device_state_slots=8, host_kv_bytes=0, host_state_bytes=0)
    async with HybridCache(SPEC, config, admission=EveryPageAdmission()) as cache:
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            await sched.generate(first, 2)
            assert cache.device_mamba.num_free == 1  # 7 of its states kept
            await sched.generate(second, 2)
        assert cache.tree.match_prefix(second[:-1]).num_tokens == 9 * PAGE
        states = [n for n in cache.tree.iter_nodes() if n.device_state is not None]
        assert len(states) == 7 and cache.tree.match_prefix(first[:-1]).num_tokens == 0
        cache.tree.check_integrity()


async def test_a_request_that_fits_only_an_emptier_device_waits_without_evicting() -> None:
    """A request the empty device could hold, but not beside a running one's pages: its
    admission attempts, once per step while that one runs, leave the cached prefixes alone
    (before, each evicted every prefix the tree could give up, for nothing); it runs once the
    other has finished."""
    config = config_with(SPEC, device_kv_pages=32, device_state_slots=8, host_kv_bytes=0, host_state_bytes=0)
    async with HybridCache(SPEC, config) as cache, Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
        cached = arith_prompt(6 * PAGE, 5, 1)
        await sched.generate(cached, 1)
        await cache.controller.wait_idle()
        assert cache.tree.match_prefix(cached).num_device_tokens == len(cached)
        running = sched.submit(arith_prompt(12 * PAGE, 7, 3), 40)  # 22 of the 32 pages while it runs
        async with asyncio.timeout(30):
            while not sched._running:
                await asyncio.sleep(0)
        steps = sched.num_steps
        big = sched.submit(arith_prompt(20 * PAGE, 9, 2), 4)  # 21 pages: only beside nothing
        async with asyncio.timeout(30):
            while sched.num_steps < steps + 5:
                await asyncio.sleep(0)
        assert not big.done()
        assert cache.tree.match_prefix(cached).num_device_tokens == len(cached)  # nothing evicted
        async with asyncio.timeout(30):
            assert len((await big).output_ids) == 4
            await running
        await settled(cache)


async def test_a_host_hit_keeps_a_slot_for_its_state_beside_the_snapshots() -> None:
    """Every-page admission asks for a state at each page past a host hit; the hit's state,
    loaded from the host, needs the node's slot too. The snapshots leave it one: the request is
    served with its hit rather than found without room."""
    prefix = arith_prompt(6 * PAGE, 7, 3)
    config = config_with(SPEC, device_state_slots=4)
    async with HybridCache(SPEC, config, admission=EveryPageAdmission()) as cache:
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            await sched.generate(prefix, 1)
            await cache.controller.wait_idle()
            cache.flush_device()  # the prefix and its states on the host only
            match = cache.tree.match_prefix(prefix)
            assert match.num_tokens == len(prefix) and match.num_device_tokens == 0
            longer = [*prefix, *arith_prompt(5 * PAGE, 5, 1)]  # 5 pages past the hit: 5 states asked
            result = await asyncio.wait_for(sched.generate(longer, 2), 30)
        assert result.cached_by_tier == {"device": 0, "host": len(prefix), "storage": 0}
        await settled(cache)


async def test_a_hit_the_device_cannot_load_beside_the_request_is_computed_cold() -> None:
    """One device state slot: a host hit's state needs the node's slot besides the request's
    working slot, which the device never has. The request is served cold, as without the cache,
    rather than failed."""
    prefix = arith_prompt(6 * PAGE, 7, 3)
    config = config_with(SPEC, device_state_slots=1)
    async with HybridCache(SPEC, config) as cache:
        tree = cache.tree
        alloc = tree.alloc_device(len(prefix) // PAGE, 1)
        assert alloc is not None
        inserted = tree.insert(prefix, alloc.kv_indices, states={len(prefix): int(alloc.state_slots[0])})
        op = cache.controller.write(inserted.backup_nodes)
        assert op is not None
        cache.controller.start_writing()
        await op
        cache.flush_device()  # the prefix and its state on the host only
        assert tree.match_prefix(prefix).num_host_tokens == len(prefix)
        longer = [*prefix, 9, 9, 9]
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            result = await asyncio.wait_for(sched.generate(longer, 3), 30)
        assert result.cached_tokens == 0
        async with (
            HybridCache(SPEC, config_with(SPEC)) as cold_cache,
            Scheduler(MODEL, cold_cache, SchedulerConfig(use_cache=False, chunk_size=64)) as cold,
        ):
            assert (await cold.generate(longer, 3)).output_ids == result.output_ids
        await cache.controller.wait_idle()
        cache.flush_device()
        cache.flush_host()
        tree.check_integrity()
        assert free_counts(cache)[:2] == (config.device_kv_pages, 1)


async def test_a_request_without_room_fails_with_what_it_needs_and_what_is_free() -> None:
    config = config_with(SPEC, device_kv_pages=16, device_state_slots=8)
    async with HybridCache(SPEC, config) as cache, Scheduler(MODEL, cache) as sched:
        held = cache.tree.alloc_device(10, 0)  # not the tree's: nothing evicts them
        assert held is not None
        try:
            with pytest.raises(CapacityError, match="need 8 KV pages .* 6 of 16 pages and 8 of 8 slots are free") as err:
                await asyncio.wait_for(sched.generate(arith_prompt(30, 7, 3), 3), 30)
        finally:
            cache.device_kv.free(held.kv_indices)
        # what is cached (evictable but for its locked part) is told from what is in use elsewhere
        assert str(err.value).endswith(
            "the cache keeps 0 pages (0 of them locked or in a copy) and 0 slots, and 10 pages and 0 slots "
            "are in use outside it"
        )
        assert len((await sched.generate(arith_prompt(30, 7, 3), 3)).output_ids) == 3


# ---- a request cancelled during its storage lookup ------------------------------------------


@pytest.mark.parametrize("slow", ["probe", "read"])
async def test_a_request_cancelled_during_its_lookup_holds_up_nothing(tmp_path: Path, slow: str) -> None:
    """With nothing running the step waits for the next requests' lookups (``wait_complete``:
    with no deadline). A request cancelled while its lookup probes or reads is dropped at once,
    never computed; the next request does not wait for that lookup, which ends on its own (what
    it read lands on the host) and leaves nothing held."""
    doomed = [*arith_prompt(10 * PAGE, 7, 3), 5]
    later = arith_prompt(12, 5, 1)
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        full = free_counts(cache)
        if slow == "read":
            await store_only(cache, doomed[:-1], grid=2)
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            await sched.generate(arith_prompt(8, 1, 1), 1)
            lookups = _lookups(cache)
            calls = slow_backend(cache, "batch_exists_v2" if slow == "probe" else "batch_get_v2", 3.0, first_only=True)
            seen = _forwards(sched)
            first = sched.submit(doomed, 2)
            async with asyncio.timeout(10):
                while not calls[0]:
                    await asyncio.sleep(0.001)
            first.cancel()
            result = await asyncio.wait_for(sched.generate(later, 2), 10)
            # Served while the cancelled request's lookup still runs (it would have waited for it).
            assert not lookups[0].done()
            assert len(result.output_ids) == 2 and not _computed(seen, doomed)
            assert len(lookups) == 2 and lookups[1].done()  # the later request's own, a miss
            await asyncio.wait_for(lookups[0], 10)
            if slow == "read":
                assert lookups[0].result().num_pages_fetched == 10  # landed on the host for later requests
        assert not held_nodes(cache)
        assert await settled(cache) == full


async def test_a_request_cancelled_while_its_probe_is_awaited_is_never_computed(tmp_path: Path) -> None:
    """With a request running, the step waits up to ``lookup_wait_s`` for the next request's
    probe; cancelled meanwhile, that request is not admitted once the probe ends."""
    running = arith_prompt(24, 3, 1)
    doomed = arith_prompt(10 * PAGE, 7, 3)
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        full = free_counts(cache)
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64, lookup_wait_s=2.0)) as sched:
            long_run = sched.submit(running, 400)
            async with asyncio.timeout(10):
                while not sched._running:
                    await asyncio.sleep(0.001)
            calls = slow_backend(cache, "batch_exists_v2", 0.2)
            seen = _forwards(sched)
            waiting = sched.submit(doomed, 2)
            async with asyncio.timeout(10):
                while not calls[0]:
                    await asyncio.sleep(0.001)
            waiting.cancel()
            await asyncio.sleep(0.5)  # the probe has ended, and the running request stepped on
            assert not long_run.done() and not sched._waiting
            assert not _computed(seen, doomed) and any(ids == [] or len(ids) == 1 for _, ids in seen)
            long_run.cancel()
        assert await settled(cache) == full


async def test_a_request_cancelled_while_its_step_awaits_is_not_computed() -> None:
    """A request admitted in a step and cancelled while that step still awaits (here: the
    running requests' tail restores) is dropped before the step's forward, not computed once;
    the one beside it is served, and nothing stays held."""
    doomed, kept = arith_prompt(10 * PAGE, 7, 3), arith_prompt(6 * PAGE, 5, 1)
    async with HybridCache(SPEC, config_with(SPEC)) as cache:
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64)) as sched:
            seen = _forwards(sched)
            resume = sched._resume_tails
            futs: list[asyncio.Future[Any]] = []

            async def cancel_meanwhile() -> bool:
                if futs and not futs[0].done():
                    futs[0].cancel()  # as if it came while the step awaited
                    await asyncio.sleep(0)
                return await resume()

            sched._resume_tails = cancel_meanwhile  # type: ignore[method-assign]
            futs += [sched.submit(doomed, 4), sched.submit(kept, 2)]
            async with asyncio.timeout(30):
                assert len((await futs[1]).output_ids) == 2
            assert futs[0].cancelled()
        assert not _computed(seen, doomed) and _computed(seen, kept)
        await settled(cache)


async def test_a_request_cancelled_as_its_lookup_is_taken_is_dropped_and_the_next_looked_up(tmp_path: Path) -> None:
    """Cancelled while admission takes its lookup's result (nothing running, ``max_running=1``):
    it is dropped, never computed, and the request moving up into its place is admitted only
    after a lookup of its own — which restores its prefix from storage."""
    doomed = [*arith_prompt(10 * PAGE, 5, 1), 5]
    stored = arith_prompt(8 * PAGE, 7, 3)
    async with HybridCache(SPEC, config_with(SPEC, storage_uri=tmp_path.as_uri())) as cache:
        full = free_counts(cache)
        await store_only(cache, stored, grid=2)
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=64, max_running=1)) as sched:
            await sched.generate(arith_prompt(8, 1, 1), 1)
            ctrl = cache.controller
            wait_prefetch = ctrl.wait_prefetch
            futures: list[asyncio.Future[Any]] = []

            async def cancelling_wait(*args: Any, **kwargs: Any) -> Any:
                if not futures[0].done():
                    futures[0].cancel()  # as its result is taken
                return await wait_prefetch(*args, **kwargs)

            ctrl.wait_prefetch = cancelling_wait  # type: ignore[method-assign]
            seen = _forwards(sched)
            futures += [sched.submit(doomed, 2), sched.submit([*stored, 9], 2)]
            result = await asyncio.wait_for(futures[1], 10)
        assert futures[0].cancelled() and not _computed(seen, doomed)
        assert result.cached_by_tier == {"device": 0, "host": 0, "storage": 8 * PAGE}
        assert await settled(cache) == full
