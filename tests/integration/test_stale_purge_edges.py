"""Purges of what a failed load left in storage (``asynccache.stale_purge``) on their edges: a
purge cancelled with the task group before its first step, a close cancelled while the late
purges delete, a delete that fails (the keys stay blocked for writes, so a recompute's archive
cannot count the old objects stored), and an archive whose state write is in flight when the
load fails (it must not mark its node archived: the purge deletes what it wrote), and a split
restore's tail that landed before a report of a key it read (not handed to the engine). The CPU
copy path; each test ends by opening another cache on the same storage, or by what the tree keeps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_failed_load_copies import settle
from test_pending_loads import fail_copies
from test_restore_split import TOKENS as SPLIT_TOKENS
from test_restore_split import balanced_tier
from test_scheduler_failed_load import SPEC, config
from test_stale_purge import keys_of, state_stored, stored_prefix
from test_storage_archive import backed_up, insert, stored_pages

from asynccache.cache import HybridCache
from asynccache.errors import TransferError
from asynccache.storage import PoolName

PAGE = SPEC.page_size
TOKENS = list(range(1, 3 * PAGE + 1))


async def test_a_purge_the_group_cancels_before_its_first_step_is_deleted_at_close(tmp_path: Path) -> None:
    uri = tmp_path.as_uri()
    cache = HybridCache(SPEC, config(storage_uri=uri))
    with pytest.raises(BaseExceptionGroup):  # the failed task, through the group
        async with cache:
            tier = cache.controller.tiering
            assert tier is not None
            keys = await stored_prefix(cache, TOKENS)

            async def fails() -> None:
                raise RuntimeError("a background task failed")

            tier.spawn(fails(), name="failing")
            await asyncio.sleep(0)  # it fails in the next turn, and its group aborts after that
            # This turn: the report; its purge task is made, then cancelled before it ran.
            cache.tree.stale_hook(keys, keys)
            await asyncio.sleep(0)
    assert tier.purges.num_pending == 0
    async with HybridCache(SPEC, config(storage_uri=uri)) as later:
        assert await stored_pages(later, TOKENS) == 0


async def test_a_close_cancelled_while_the_late_purges_delete_still_deletes_them(tmp_path: Path) -> None:
    uri = tmp_path.as_uri()
    cache = HybridCache(SPEC, config(storage_uri=uri))
    await cache.__aenter__()
    tier = cache.controller.tiering
    assert tier is not None
    keys = await stored_prefix(cache, TOKENS)

    def shutting_down(coro: Any, *, name: str) -> Any:  # a report as the controller shuts down
        raise RuntimeError("TaskGroup is shutting down")

    tier.spawn = shutting_down  # type: ignore[method-assign]
    cache.tree.stale_hook(keys, keys)
    assert tier.purges.num_pending
    real = tier.backend.batch_delete_v2  # type: ignore[attr-defined]
    in_delete = asyncio.Event()

    async def slow(*args: Any) -> Any:
        in_delete.set()
        await asyncio.sleep(0.2)
        return await real(*args)

    tier.backend.batch_delete_v2 = slow  # type: ignore[attr-defined]
    closing = asyncio.create_task(cache.aclose())
    await asyncio.wait_for(in_delete.wait(), 10)
    closing.cancel()  # a shutdown deadline, say
    with pytest.raises(asyncio.CancelledError):
        await closing
    await cache.aclose()  # waits for the delete and the backend's close
    assert tier.purges.num_pending == 0
    async with HybridCache(SPEC, config(storage_uri=uri)) as later:
        assert await stored_pages(later, TOKENS) == 0


async def test_after_a_failed_delete_a_recompute_is_not_taken_for_stored(tmp_path: Path) -> None:
    """The old objects may still be stored: a correct recompute's archive would find them
    (put-if-absent), count them stored and mark its nodes archived — and a host eviction of
    archived nodes would drop the only correct copy."""
    async with HybridCache(SPEC, config(storage_uri=tmp_path.as_uri())) as cache:
        tier = cache.controller.tiering
        assert tier is not None
        keys = await stored_prefix(cache, TOKENS)

        async def refused(keys: Any, pools: Any) -> list[bool]:
            return [False] * len(keys)

        tier.backend.batch_delete_v2 = refused  # type: ignore[attr-defined]
        cache.tree.stale_hook(keys, keys)
        await settle(cache)
        assert tier.counts["stale_purge_failed"] == 1
        cache.flush_device()
        cache.flush_host()  # the undo dropped that data; then a correct recompute
        await backed_up(cache, insert(cache, TOKENS).backup_nodes)
        await settle(cache)
        nodes = cache.tree.path_to(cache.tree.match_prefix(TOKENS).last_node)
        assert tier.counts["backup_skipped_stale"] >= 1 and not any(n.archived for n in nodes)
        cache.flush_device()
        cache.tree.evict_host(num_kv_pages=10_000, num_states=10_000, archived_only=True)
        assert cache.tree.match_prefix(TOKENS).num_tokens == len(TOKENS)  # still held


async def test_an_archive_writing_when_the_load_fails_does_not_mark_its_node_archived(tmp_path: Path) -> None:
    """A node S backed up, its archive's state write in flight; S flushed to the host, loaded,
    a branch computed below it, and the load fails: the undo reports S's keys and clears its
    mark. The archive's write lands after that — the purge deletes it — so S must not be marked
    archived again (a host eviction of archived nodes would drop its only copy)."""
    branch = TOKENS + list(range(500, 500 + 2 * PAGE))
    async with HybridCache(SPEC, config(storage_uri=tmp_path.as_uri())) as cache:
        ctrl, tree, tier = cache.controller, cache.tree, cache.controller.tiering
        assert tier is not None
        real_set = tier.backend.batch_set_v2
        gate, entered = asyncio.Event(), asyncio.Event()

        async def held_states(transfers: Any) -> Any:  # the first state write waits
            if transfers[0].pool_name == PoolName.MAMBA and not entered.is_set():
                entered.set()
                await gate.wait()
            return await real_set(transfers)

        tier.backend.batch_set_v2 = held_states  # type: ignore[method-assign]
        try:
            alloc = tree.alloc_device(len(TOKENS) // PAGE, 1)
            assert alloc is not None
            res = tree.insert(TOKENS, alloc.kv_indices, states={len(TOKENS): int(alloc.state_slots[0])})
            node = res.last_node
            await backed_up(cache, res.backup_nodes)
            async with asyncio.timeout(10):
                await entered.wait()  # its KV stored, its state being written
            keys = keys_of(cache, TOKENS)
            cache.flush_device()
            match = tree.match_prefix(TOKENS)
            assert match.needs_load and match.last_node is node
            token = tree.lock(node)
            load = ctrl.load(match)
            assert load is not None
            more = tree.alloc_device(2, 1)
            assert more is not None
            loading = tree.match_prefix(TOKENS).device_kv_indices
            tree.insert(branch, torch.cat([loading, more.kv_indices]), states={len(branch): int(more.state_slots[0])})
            real = fail_copies(cache)
            ctrl.start_loading()
            with pytest.raises(TransferError):
                async with asyncio.timeout(5):
                    await load
            await asyncio.sleep(0)
            assert node.alive and not node.archived and tier.counts["stale_reports"] == 1
        finally:
            gate.set()
        await settle(cache)
        tree.unlock(node, token)
        ctrl.layer_copier = real
        await settle(cache)
        assert not await state_stored(cache, keys)  # purged
        assert not node.archived
        cache.flush_device()
        tree.evict_host(num_kv_pages=10_000, num_states=10_000, archived_only=True)
        assert tree.match_prefix(TOKENS).num_tokens == len(TOKENS)  # its host copy kept


async def test_a_tail_that_landed_before_a_report_of_its_keys_is_not_handed_over() -> None:
    async with balanced_tier() as (cache, tier):
        assert cache.host_kv is not None
        free_kv = cache.host_kv.num_free
        result = await tier.prefetch(SPLIT_TOKENS, cache.tree.match_prefix(SPLIT_TOKENS), allow_tail=True)
        tail = result.tail
        assert tail is not None and await tail.fetch and tail.ok  # landed intact
        keys = keys_of(cache, SPLIT_TOKENS)
        cache.tree.stale_hook(frozenset(keys[-1:]), frozenset())
        assert not tail.ok  # the engine computes it instead (``load_tail`` refuses it)
        tail.release()
        assert cache.host_kv.num_free == free_kv and not tier.purges._watches
