"""Archives of completed host writes (``asynccache.host_archive``): a backup's host copy is held
until its archive has read it, ``wait_idle`` waits for archives, and a storage that evicts gets
the whole path every time, which refreshes what it still holds; a backend that fails or refuses
a write leaves no archive flag and holds nothing, and the next backup of the path stores it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from serving import free_counts, serving_config

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import BackendError
from asynccache.spec import HybridSpec
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer

PAGE = 4
SPEC = HybridSpec.preset("tiny", page_size=PAGE)


def config(**overrides: Any) -> HybridCacheConfig:
    return dataclasses.replace(serving_config(SPEC), **overrides)


def insert(cache: HybridCache, tokens: list[int]) -> Any:
    alloc = cache.tree.alloc_device(len(tokens) // PAGE, 1)
    assert alloc is not None
    return cache.tree.insert(tokens, alloc.kv_indices, states={len(tokens): int(alloc.state_slots[0])})


async def backed_up(cache: HybridCache, nodes: Any) -> None:
    """Back ``nodes`` up to the host; their archive is queued (on CPU it has not run yet)."""
    op = cache.controller.write(nodes)
    assert op is not None
    cache.controller.start_writing()
    await op


async def stored_pages(cache: HybridCache, tokens: list[int]) -> int:
    """Pages of ``tokens`` storage could restore (their KV, and the state at the last)."""
    keys = list(cache.tree.match_prefix(tokens).page_hashes)  # every full page's, matched or not
    assert cache.controller.tiering is not None
    found = await cache.controller.tiering.backend.batch_exists_v2(
        keys,
        [
            PoolTransfer(pool_name=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ],
    )
    return found.num_hit_pages


async def test_a_host_eviction_before_the_archive_runs_does_not_lose_the_backup() -> None:
    """The host needs room (here: a flush) between a backup's completion and its archive: the
    host copy stays until the archive has read it, so storage gets the prefix; then it goes."""
    tokens = list(range(1, 4 * PAGE + 1))
    async with HybridCache(SPEC, config(storage_uri="memory://archive_held")) as cache:
        tier, tree = cache.controller.tiering, cache.tree
        assert tier is not None
        await backed_up(cache, insert(cache, tokens).backup_nodes)
        assert tier.busy  # the archive is queued, not run
        cache.flush_device()
        cache.flush_host()
        assert tree.match_prefix(tokens).num_host_tokens == len(tokens)  # held for the archive
        await tier.drain()
        assert tier.counts["backup_ok"] == 1
        cache.flush_host()
        assert tree.match_prefix(tokens).num_tokens == 0
        assert await stored_pages(cache, tokens) == len(tokens) // PAGE
        assert tree.stats().host_kv_pages == 0
        tree.check_integrity()


async def test_wait_idle_waits_for_archives() -> None:
    """An archive holds host copies: ``wait_idle`` waits for it (a scheduler that found no room
    then finds the copies evictable)."""
    tokens = list(range(1, 2 * PAGE + 1))
    async with HybridCache(SPEC, config(storage_uri="memory://archive_idle")) as cache:
        tier = cache.controller.tiering
        assert tier is not None
        await backed_up(cache, insert(cache, tokens).backup_nodes)
        assert tier.busy
        assert await cache.controller.wait_idle()
        assert not tier.busy and tier.counts["backup_ok"] == 1
        assert not await cache.controller.wait_idle()


async def test_storage_that_evicts_keeps_the_path_in_use_and_drops_what_is_not() -> None:
    """A backend with a capacity: each archive writes the whole path, so the objects of a prefix
    that later turns extend are refreshed and outlive traffic stored after the prefix; the
    traffic that no turn extends is evicted first."""
    prefix = list(range(1, 3 * PAGE + 1))
    room = 10 * (SPEC.kv_page_bytes + 64) + 4 * (SPEC.state_bytes + 64) + 256
    cfg = config(storage_uri="memory://archive_refresh", storage_options={"capacity_bytes": room})
    async with HybridCache(SPEC, cfg) as cache:
        tier = cache.controller.tiering
        assert tier is not None and tier.storage_evicts

        async def serve(tokens: list[int]) -> None:
            await backed_up(cache, insert(cache, tokens).backup_nodes)
            await tier.drain()
            cache.flush_device()
            cache.flush_host()

        await serve(prefix)
        other = [[10_000 * (k + 1) + i for i in range(2 * PAGE)] for k in range(3)]
        await serve(other[0])
        turn = prefix + list(range(500, 500 + PAGE))
        await serve(turn)  # the prefix's objects are refreshed, not skipped
        for tokens in other[1:]:
            await serve(tokens)  # room: the least recently used go
        assert await stored_pages(cache, turn) == len(turn) // PAGE
        assert await stored_pages(cache, other[0]) == 0


def _refuse_states(real: Any) -> Any:
    """``batch_set_v2`` that stores KV pages as ``real`` does and refuses every state."""

    async def batch_set_v2(transfers: Any) -> list[list[bool]]:
        kv = [t for t in transfers if t.pool_name is PoolName.KV]
        out = iter(await real(kv) if kv else [])
        return [[False] * len(t.keys) if t.pool_name is PoolName.MAMBA else next(out) for t in transfers]

    return batch_set_v2


def _raise(real: Any) -> Any:
    async def batch_set_v2(transfers: Any) -> list[list[bool]]:
        raise BackendError("disk gone")

    return batch_set_v2


@pytest.mark.parametrize("failure", [_raise, _refuse_states], ids=["raises", "refuses-the-state"])
async def test_a_failed_archive_holds_nothing_and_the_next_backup_stores_the_path(failure: Any) -> None:
    """An archive whose write fails (the backend raises) or is refused (the state is not
    stored, the KV is) is counted, marks no node archived, gives back its hold on the host
    copy, and leaves storage unable to restore the prefix (KV without its state is no hit).
    The next backup of the path archives it again, and then storage restores it whole."""
    tokens = list(range(1, 3 * PAGE + 1))
    async with HybridCache(SPEC, config(storage_uri="memory://archive_failed")) as cache:
        tier, tree = cache.controller.tiering, cache.tree
        assert tier is not None
        before = free_counts(cache)
        real = tier.backend.batch_set_v2
        result = insert(cache, tokens)
        node = result.last_node
        tier.backend.batch_set_v2 = failure(real)
        try:
            await backed_up(cache, result.backup_nodes)
            await tier.drain()
        finally:
            tier.backend.batch_set_v2 = real
        assert tier.counts["backup_failed"] == 1 and tier.counts["backup_ok"] == 0
        assert not any(n.archived for n in tree.path_to(node))
        assert await stored_pages(cache, tokens) == 0
        cache.flush_host()  # no hold is left: the host copy goes, the device keeps the prefix
        assert tree.stats().host_kv_pages == 0
        assert tree.match_prefix(tokens).num_device_tokens == len(tokens)
        tree.check_integrity()

        await backed_up(cache, [node])
        await tier.drain()
        assert tier.counts["backup_ok"] == 1
        assert all(n.archived for n in tree.path_to(node))
        assert await stored_pages(cache, tokens) == len(tokens) // PAGE
        cache.flush_device()
        cache.flush_host()
        tree.check_integrity()
        assert free_counts(cache) == before
