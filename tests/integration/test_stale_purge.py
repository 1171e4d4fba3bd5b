"""What a failed load left in storage is deleted (``asynccache.stale_purge``).

The tree reports the storage keys of what was computed on a failed load (``tree.stale_hook``).
Before, the tier only stopped restoring from them, for its own lifetime: the objects stayed, so
a later run (or another process) on the same storage restored them — wrong bytes — and the keys
stayed unservable after a correct recompute. Now the tier deletes them once every archive that
was in flight at the report has landed or dropped its writes, and then serves the keys again.
Here: a failed load end to end over a ``file://`` tier and an ``s3://`` one (a later cache on the
same storage computes the branch, then restores its correct copy); an archive in flight at the
report (its objects deleted after it lands) and one queued (dropped); a storage-only snapshot
staged before the report (deleted once it has landed); a failed delete (the keys stay
unservable, tried again at close); a report the task group can no longer run, and one whose
purge is still in flight at close (both deleted before the backend closes); a restore whose
lookup or read a report overtakes (a miss). The CPU copy path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from test_failed_load_copies import BRANCH, fail_the_branch_s_load, settle
from test_restore_split import TOKENS as SPLIT_TOKENS
from test_restore_split import balanced_tier
from test_scheduler_failed_load import MODEL, PREFIX, SPEC, cold_output, config
from test_storage_archive import backed_up, insert, stored_pages
from test_storage_snapshots import (
    SNAPS,
    TOKENS,
    free_slots,
    insert_with_snapshots,
    make_cache,
)

from asynccache.cache import HybridCache
from asynccache.reference.scheduler import Scheduler
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer

PAGE = SPEC.page_size
DEADLINE_S = 30


def keys_of(cache: HybridCache, tokens: Sequence[int]) -> list[str]:
    return list(cache.tree.match_prefix(list(tokens)).page_hashes)


async def kv_pages_stored(cache: HybridCache, keys: Sequence[str]) -> int:
    """How many of ``keys``' KV pages storage holds, from the first on."""
    tier = cache.controller.tiering
    assert tier is not None
    found = await tier.backend.batch_exists_v2(list(keys), [PoolTransfer(pool_name=PoolName.KV)])
    return found.num_hit_pages


async def state_stored(cache: HybridCache, keys: Sequence[str]) -> bool:
    """Whether storage holds the state at the end of ``keys``."""
    tier = cache.controller.tiering
    assert tier is not None
    found = await tier.backend.batch_exists_v2(
        list(keys), [PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    )
    return found.num_hit_pages == len(keys)


@pytest.mark.parametrize("store", ["file", pytest.param("s3", marks=pytest.mark.s3)])
async def test_a_later_cache_on_the_same_storage_computes_what_a_failed_load_left_then_restores_it(
    tmp_path: Path, request: pytest.FixtureRequest, store: str
) -> None:
    """The failed load's cache deletes the branch's objects; a later cache on the same storage
    (a restart, or another process) restores the prefix and computes the branch — a cold run's
    output, where the objects left behind gave another — and archives it; the next one restores
    the branch's correct copy, with a cold run's output again."""
    uri = f"file://{tmp_path}/store" if store == "file" else request.getfixturevalue("s3_uri")
    prompt = BRANCH + [23]
    want = await cold_output(prompt, 4)
    async with HybridCache(SPEC, config(storage_uri=uri)) as cache:
        await fail_the_branch_s_load(cache)
        tier = cache.controller.tiering
        assert tier is not None
        assert (tier.counts["stale_reports"], tier.counts["stale_purges"]) == (1, 1)
        assert not tier.unservable.kv and not tier.unservable.states and not tier.purges.num_pending
        keys = keys_of(cache, BRANCH)
        assert await kv_pages_stored(cache, keys) == len(PREFIX) // PAGE  # the branch's pages are gone
        assert await state_stored(cache, keys[: len(PREFIX) // PAGE])  # the prefix's own state is not
    for cached in (len(PREFIX), len(BRANCH)):
        async with HybridCache(SPEC, config(storage_uri=uri)) as cache, Scheduler(MODEL, cache) as sched:
            out = await sched.generate(prompt, 4)
            assert out.output_ids == want
            assert out.cached_by_tier["storage"] == out.cached_tokens == cached
            await settle(cache)


def record_calls(tier: Any, calls: list[tuple[str, tuple[str, ...]]]) -> None:
    """Record each ``batch_set_v2`` of the tier's backend once it returned, and each
    ``batch_delete_v2`` as it is called: (call, keys)."""
    real_set, real_delete = tier.backend.batch_set_v2, tier.backend.batch_delete_v2

    async def batch_set_v2(transfers: Any) -> Any:
        done = await real_set(transfers)
        calls.extend(("set", t.keys) for t in transfers)
        return done

    async def batch_delete_v2(keys: Any, pools: Any) -> Any:
        calls.append(("delete", tuple(keys)))
        return await real_delete(keys, pools)

    tier.backend.batch_set_v2 = batch_set_v2
    tier.backend.batch_delete_v2 = batch_delete_v2


async def test_an_archive_in_flight_at_the_report_is_deleted_once_it_landed_and_one_queued_is_dropped(
    tmp_path: Path,
) -> None:
    """One archive at a time: the first one's KV write is on its way when the tree reports the
    keys of both prefixes; the second archive is queued. The first one's KV lands, its states
    are dropped; the second writes nothing. The delete comes after the first has ended, so its
    KV does not outlive it, and the keys are servable again."""
    first, second = list(range(1, 2 * PAGE + 1)), list(range(100, 100 + 3 * PAGE))
    async with HybridCache(SPEC, config(storage_uri=tmp_path.as_uri(), max_backups_in_flight=1)) as cache:
        tier = cache.controller.tiering
        assert tier is not None
        calls: list[tuple[str, tuple[str, ...]]] = []
        record_calls(tier, calls)
        recorded_set, gate, entered = tier.backend.batch_set_v2, asyncio.Event(), asyncio.Event()

        async def held_once(transfers: Any) -> Any:  # the first write's request is slow
            if not entered.is_set():
                entered.set()
                await gate.wait()
            return await recorded_set(transfers)

        tier.backend.batch_set_v2 = held_once
        await backed_up(cache, insert(cache, first).backup_nodes)
        async with asyncio.timeout(DEADLINE_S):
            await entered.wait()
        await backed_up(cache, insert(cache, second).backup_nodes)  # its archive waits for the first
        reported = frozenset(keys_of(cache, first) + keys_of(cache, second))
        cache.tree.stale_hook(reported, reported)  # as the tree's undo reports them
        assert tier.unservable.kv == tier.unservable.states == reported
        for _ in range(20):  # a purge that did not wait for the archive would delete now
            await asyncio.sleep(0)
        gate.set()
        await settle(cache)
        assert calls[0] == ("set", tuple(keys_of(cache, first)))  # the first one's KV, and nothing else
        assert [c for c, _ in calls] == ["set", "delete", "delete"]
        assert tier.counts["backup_skipped_stale"] == 2 and tier.counts["backup_ok"] == 0
        assert tier.counts["stale_purges"] == 1 and not tier.purges.num_pending
        assert await kv_pages_stored(cache, keys_of(cache, first)) == 0
        assert await kv_pages_stored(cache, keys_of(cache, second)) == 0
        assert not tier.unservable.kv and not tier.unservable.states
        # an archive now stores them (and storage restores the prefix)
        assert tier.archive_now(cache.tree.match_prefix(second).last_node) is not None
        await settle(cache)
        assert tier.counts["backup_ok"] == 1
        assert await stored_pages(cache, second) == len(second) // PAGE


async def test_a_storage_only_snapshot_staged_before_the_report_is_deleted_once_it_landed(tmp_path: Path) -> None:
    """A snapshot archive queued before the report (its staging not issued yet) writes its
    states after it: the delete waits for it, so they do not survive; the prefix's own
    backup (begun after the report, its keys not reported) stays."""
    async with make_cache(tmp_path) as cache:
        ctrl, tier = cache.controller, cache.controller.tiering
        assert tier is not None
        res, snaps, _ = await insert_with_snapshots(cache)
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        keys = keys_of(cache, TOKENS)
        states = frozenset(keys[p // PAGE - 1] for p in SNAPS)
        calls: list[tuple[str, tuple[str, ...]]] = []
        record_calls(tier, calls)
        cache.tree.stale_hook(frozenset(), states)
        for _ in range(20):  # a purge that did not wait for the snapshot would delete now
            await asyncio.sleep(0)
        ctrl.start_writing()
        await archive.staged
        free_slots(cache, snaps.values())
        assert await archive == dict.fromkeys(SNAPS, True)  # it began before the report: it lands
        await settle(cache)
        wrote_states = max(i for i, (call, ks) in enumerate(calls) if call == "set" and states & set(ks))
        deleted = [i for i, (call, _) in enumerate(calls) if call == "delete"]
        assert len(deleted) == 1 and deleted[0] > wrote_states
        for p in SNAPS:
            assert not await state_stored(cache, keys[: p // PAGE])
        assert await stored_pages(cache, TOKENS) == len(TOKENS) // PAGE
        assert tier.counts["stale_purges"] == 1 and not tier.unservable.states


async def stored_prefix(cache: HybridCache, tokens: list[int]) -> frozenset[str]:
    """``tokens`` archived; their keys."""
    await backed_up(cache, insert(cache, tokens).backup_nodes)
    await settle(cache)
    assert await stored_pages(cache, tokens) == len(tokens) // PAGE
    return frozenset(keys_of(cache, tokens))


async def test_a_failed_delete_keeps_the_keys_unservable_and_is_tried_again_at_close(tmp_path: Path) -> None:
    tokens = list(range(1, 3 * PAGE + 1))
    uri = tmp_path.as_uri()
    async with HybridCache(SPEC, config(storage_uri=uri)) as cache:
        tier = cache.controller.tiering
        assert tier is not None
        keys = await stored_prefix(cache, tokens)
        real = tier.backend.batch_delete_v2

        async def refused(keys: Any, pools: Any) -> list[bool]:
            return [False] * len(keys)

        tier.backend.batch_delete_v2 = refused
        cache.tree.stale_hook(keys, keys)
        await settle(cache)
        assert tier.counts["stale_purge_failed"] == 1 and tier.counts["stale_purges"] == 0
        assert tier.unservable.kv == tier.unservable.states == keys
        assert await stored_pages(cache, tokens) == len(tokens) // PAGE  # still stored, never served:
        cache.flush_device()
        cache.flush_host()
        result = await cache.controller.wait_prefetch(
            cache.controller.prefetch(tokens + [1], cache.tree.match_prefix(tokens + [1])), len(tokens)
        )
        assert result is not None and result.num_pages_fetched == 0
        tier.backend.batch_delete_v2 = real
    async with HybridCache(SPEC, config(storage_uri=uri)) as cache:
        assert await stored_pages(cache, tokens) == 0  # deleted as the first cache closed


@pytest.mark.parametrize("when", ["group-closed", "purge-in-flight"])
async def test_a_purge_the_group_did_not_finish_is_done_before_the_backend_closes(tmp_path: Path, when: str) -> None:
    """A report the tier's task group can no longer run (the controller shutting down), or a
    purge still waiting at ``aclose``: the objects are deleted all the same before the backend
    closes, and nothing of the tier is left running."""
    tokens = list(range(1, 2 * PAGE + 1))
    uri = tmp_path.as_uri()
    cache = HybridCache(SPEC, config(storage_uri=uri))
    async with cache:
        tier = cache.controller.tiering
        assert tier is not None
        keys = await stored_prefix(cache, tokens)
        if when == "group-closed":

            def shutting_down(coro: Any, *, name: str) -> Any:
                raise RuntimeError("TaskGroup is shutting down")

            tier.spawn = shutting_down  # type: ignore[method-assign]
        else:
            real = tier.backend.batch_delete_v2

            async def slow(*args: Any) -> Any:  # many loop turns: a close that does not wait ends first
                for _ in range(200):
                    await asyncio.sleep(0)
                return await real(*args)

            tier.backend.batch_delete_v2 = slow
        cache.tree.stale_hook(keys, keys)
        # closed at once: no wait for the purge
    assert not tier.busy and not tier.purges.num_pending
    async with HybridCache(SPEC, config(storage_uri=uri)) as cache:
        assert await stored_pages(cache, tokens) == 0


# ---- restores in flight at a report ------------------------------------------------------------
def hold_after(tier: Any, method: str) -> tuple[asyncio.Event, asyncio.Event]:
    """The first call of the tier's ``backend.method`` is done (its bytes landed) but its caller
    resumes only once the returned gate is set; the other event is set then."""
    real = getattr(tier.backend, method)
    gate, entered = asyncio.Event(), asyncio.Event()

    async def held(*args: Any) -> Any:
        done = await real(*args)
        if not entered.is_set():
            entered.set()
            await gate.wait()
        return done

    setattr(tier.backend, method, held)
    return gate, entered


@pytest.mark.parametrize("stage", ["lookup", "read"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "tail"])
async def test_a_restore_that_a_report_overtakes_is_a_miss(stage: str, split: bool) -> None:
    """A restore whose lookup ran before the report, and whose lookup or read lands after it
    (before the purge, which waits for an archive in flight here): what it found or read is
    dropped — not inserted, not handed over as a split restore's tail."""
    async with balanced_tier() as (cache, tier):
        if not split:
            tier.cost = None  # a whole restore
        archive_in_flight = asyncio.Event()
        tier.spawn(archive_in_flight.wait(), name="an archive in flight")
        try:
            gate, entered = hold_after(tier, "batch_exists_v2" if stage == "lookup" else "batch_get_v2")
            match = cache.tree.match_prefix(SPLIT_TOKENS)
            fetching = asyncio.create_task(tier.prefetch(SPLIT_TOKENS, match, allow_tail=split))
            async with asyncio.timeout(DEADLINE_S):
                await entered.wait()
            keys = keys_of(cache, SPLIT_TOKENS)
            cache.tree.stale_hook(frozenset(keys[-2:]), frozenset())  # the last pages' KV
            gate.set()
            result = await fetching
            assert result.num_pages_fetched == 0 and cache.tree.match_prefix(SPLIT_TOKENS).num_tokens == 0
            if result.tail is not None:
                fetched = await result.tail.fetch
                result.tail.release()
                assert stage == "read" and split and not fetched
            else:
                assert stage == "lookup" or not split
            assert tier.counts["prefetch_stale"] == 1
        finally:
            archive_in_flight.set()
        await settle(cache)
        assert tier.counts["stale_purges"] == 1
        cache.tree.check_integrity()
