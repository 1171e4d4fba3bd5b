"""Storage-only snapshots archived through the controller (``archive_snapshots``).

A request's snapshots that the tree does not keep are staged from the caller's device slots and
written to storage, with the KV of the path up to the deepest one; a later storage lookup and
prefetch find them like any stored state and restore them bit for bit. They are speculative
objects: they never displace regular ones. Bad input is refused before anything is queued, and
the staging host slots come back on every path: stored, failed, cancelled, shut down.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from serving import device_of, free_counts, serving_config, tiny_model, tiny_spec

from asynccache.cache import HybridCache
from asynccache.errors import ClosedError, ConfigError, TransferError, TreeError
from asynccache.policy import EndsAdmission, EveryPageAdmission
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.storage import PoolName, PoolTransfer
from asynccache.trace.storage_index import AccountingStorage
from storage_backends.object_format import ObjectGeometry

SPEC = tiny_spec()
PAGE = SPEC.page_size
NUM_PAGES = 8
TOKENS = [(11 * t + 5) % 250 + 1 for t in range(NUM_PAGES * PAGE)]
SNAPS = (2 * PAGE, 5 * PAGE)  # storage-only snapshot positions; the tree keeps the state at the end only
OTHER_KEY = "f0" * 16  # a key of no prefix here


def make_cache(
    root: Path | None = None, *, write_policy: str = "write_through", backend: Any = None, **storage: Any
) -> HybridCache:
    """The serving tests' budgets; storage at ``root`` (with ``storage`` options), or ``backend``."""
    uri = None if root is None or backend is not None else root.as_uri()
    config = dataclasses.replace(
        serving_config(SPEC, uri), storage_options=storage, write_policy=write_policy
    )
    return HybridCache(SPEC, config, admission=EveryPageAdmission(), backend=backend)


def fill_device(cache: HybridCache, num_pages: int, num_states: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Fresh device pages and slots holding random bytes (every layer)."""
    alloc = cache.tree.alloc_device(num_pages, num_states)
    assert alloc is not None
    g = torch.Generator().manual_seed(seed)
    for lid in cache.spec.attention_layer_ids:
        items = cache.device_kv.layer_items(lid)
        items[alloc.kv_indices] = torch.randint(0, 256, (num_pages, items.shape[1]), generator=g, dtype=torch.uint8)
    slots = alloc.state_slots.tolist()
    for lid in cache.spec.mamba_layer_ids:
        items = cache.device_mamba.layer_items(lid)
        for s in slots:
            items[s] = torch.randint(0, 256, (items.shape[1],), generator=g, dtype=torch.uint8)
    return alloc.kv_indices, slots


def kv_bytes(cache: HybridCache, pages: torch.Tensor) -> torch.Tensor:
    return torch.stack([cache.device_kv.layer_items(lid)[pages] for lid in cache.spec.attention_layer_ids])


def state_bytes(cache: HybridCache, slot: int) -> torch.Tensor:
    return torch.stack([cache.device_mamba.layer_items(lid)[slot] for lid in cache.spec.mamba_layer_ids])


async def insert_with_snapshots(cache: HybridCache, *, seed: int = 3) -> tuple[Any, dict[int, int], Any]:
    """Insert ``TOKENS`` (a state at the end only) and its backups; the storage-only snapshots in
    device slots of the caller's: (insert result, {position: slot}, computed bytes)."""
    pages, slots = fill_device(cache, NUM_PAGES, 1 + len(SNAPS), seed)
    kv = kv_bytes(cache, pages)
    states = {p: state_bytes(cache, s) for p, s in zip(SNAPS, slots[1:], strict=True)}
    res = cache.tree.insert(TOKENS, pages, states={len(TOKENS): slots[0]})
    if res.backup_nodes:
        op = cache.controller.write(res.backup_nodes)
        assert op is not None
    return res, dict(zip(SNAPS, slots[1:], strict=True)), (kv, states)


def free_slots(cache: HybridCache, slots: Sequence[int]) -> None:
    cache.device_mamba.free(torch.tensor(list(slots), dtype=torch.int64))


async def restored(cache: HybridCache, tokens: list[int], position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefetch ``tokens`` from storage into an empty tree, load the match to the device: the KV
    of its pages and the state at ``position`` (where the match must end)."""
    match = cache.tree.match_prefix(tokens)
    assert match.num_tokens == 0
    task = cache.controller.prefetch(tokens, match)
    assert task is not None
    result = await cache.controller.wait_prefetch(task, len(tokens))
    assert result is not None and result.num_tokens == position
    match = cache.tree.match_prefix(tokens)
    assert match.num_tokens == position
    op = cache.controller.load(match)
    assert op is not None
    cache.controller.start_loading()
    await op
    match = cache.tree.match_prefix(tokens)
    assert match.last_node.device_state is not None
    return kv_bytes(cache, match.device_kv_indices), state_bytes(cache, match.last_node.device_state)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_snapshots_are_found_by_a_later_prefetch_and_restored_byte_exact(tmp_path: Path, write_policy: str) -> None:
    """Under write_through the path's KV comes from its host copies; under write_back, with no
    host copy, it is staged from the device too."""
    async with make_cache(tmp_path, write_policy=write_policy) as cache:
        ctrl = cache.controller
        before = free_counts(cache)
        res, snaps, (kv, states) = await insert_with_snapshots(cache)
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None and archive.positions == SNAPS
        ctrl.start_writing()
        await archive.staged
        free_slots(cache, snaps.values())  # the caller's slots are its own again
        assert await archive == dict.fromkeys(SNAPS, True)
        tier = ctrl.tiering
        assert tier is not None
        await tier.drain()
        staged = tier.counts["snapshot_staged_kv_pages"]
        assert staged == (0 if write_policy == "write_through" else SNAPS[-1] // PAGE)
        assert tier.counts["snapshot_states_stored"] == len(SNAPS)
        cache.tree.check_integrity()
        cache.flush_device()
        await tier.drain()  # under write_back the flush wrote back: its archive holds the host copy
        cache.flush_host()
        # Nothing of the archive is left on the host, nor anything locked.
        assert free_counts(cache)[2:] == before[2:]
    for pos in SNAPS:
        # A fresh cache over the same storage: a prompt that branches off right after ``pos``.
        async with make_cache(tmp_path) as cache:
            tokens = TOKENS[:pos] + [251] * PAGE
            got_kv, got_state = await restored(cache, tokens, pos)
            assert torch.equal(got_kv, kv[:, : pos // PAGE])
            assert torch.equal(got_state, states[pos])


async def test_a_snapshot_on_a_node_s_inner_page_with_kv_archived_already(tmp_path: Path) -> None:
    """The path's KV already in storage (a backup archived it) and its host copies dropped: the
    archive writes the states alone (no page staged; storage that does not evict keeps the KV)."""
    async with make_cache(tmp_path) as cache:
        ctrl = cache.controller
        res, snaps, (kv, states) = await insert_with_snapshots(cache)
        ctrl.start_writing()
        await ctrl.wait_idle()
        tier = ctrl.tiering
        assert tier is not None
        await tier.drain()
        assert all(n.archived for n in cache.tree.path_to(res.last_node))
        cache.flush_host()  # archived host copies go; the device keeps the KV
        assert all(n.host_kv is None for n in cache.tree.path_to(res.last_node))
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        ctrl.start_writing()
        assert await archive == dict.fromkeys(SNAPS, True)
        assert tier.counts["snapshot_staged_kv_pages"] == 0
    async with make_cache(tmp_path) as cache:
        got_kv, got_state = await restored(cache, TOKENS[: SNAPS[0]] + [251] * PAGE, SNAPS[0])
        assert torch.equal(got_kv, kv[:, : SNAPS[0] // PAGE]) and torch.equal(got_state, states[SNAPS[0]])


async def test_speculative_snapshots_never_displace_regular_objects(tmp_path: Path) -> None:
    """A local disk with room for the regular prefix and one state more: the first snapshot
    takes the free room, the second finds none (it would displace a regular object); the
    regular objects all stay. A regular write that needs room then evicts the snapshot first."""
    probe = make_cache(tmp_path / "probe")
    codec = probe.controller.backend.codec  # type: ignore[union-attr]
    kv_obj = codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, probe.host_kv), OTHER_KEY)
    st_obj = codec.object_bytes(ObjectGeometry.of_pool(PoolName.MAMBA, probe.host_mamba), OTHER_KEY)
    await probe.aclose()
    capacity = NUM_PAGES * kv_obj + 2 * st_obj  # the prefix, its end state, one state more
    async with make_cache(tmp_path / "disk", capacity_bytes=capacity) as cache:
        ctrl, backend = cache.controller, cache.controller.backend
        assert backend is not None
        res, snaps, _ = await insert_with_snapshots(cache)
        ctrl.start_writing()
        await ctrl.wait_idle()
        tier = ctrl.tiering
        assert tier is not None
        await tier.drain()
        assert tier.counts["backup_ok"] == 1
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        ctrl.start_writing()
        assert await archive == {SNAPS[0]: True, SNAPS[1]: False}
        stats = backend.statistics()  # type: ignore[attr-defined]
        assert (stats.num_evictions, stats.num_speculative_skipped, stats.used_bytes) == (0, 1, capacity)
        keys = [h for n in cache.tree.path_to(res.last_node) for h in n.page_hashes]
        snapshot = keys[SNAPS[0] // PAGE - 1]
        regular = [("kv", k) for k in keys] + [("mamba", keys[-1])]

        def present(pool: str, key: str) -> bool:
            return Path(backend.object_name(pool, key)).exists()  # type: ignore[attr-defined]

        assert all(present(p, k) for p, k in regular) and present("mamba", snapshot)
        # A regular write that needs room evicts the speculative state, not a regular object.
        write = PoolTransfer(pool_name=PoolName.MAMBA, keys=(OTHER_KEY,), host_indices=torch.tensor([0]))
        assert await backend.batch_set_v2([write]) == [[True]]
        assert all(present(p, k) for p, k in regular) and not present("mamba", snapshot)
        assert backend.statistics().num_evictions == 1  # type: ignore[attr-defined]


async def test_the_accounting_backend_takes_the_snapshots_as_speculative_objects() -> None:
    """Through :class:`AccountingStorage`, room for the prefix and one state more."""
    storage = AccountingStorage(0)
    cache = make_cache(backend=storage)
    assert cache.host_kv is not None and cache.host_mamba is not None
    storage.capacity_bytes = NUM_PAGES * cache.host_kv.bytes_per_index + 2 * cache.host_mamba.bytes_per_index
    async with cache:
        ctrl = cache.controller
        res, snaps, _ = await insert_with_snapshots(cache)
        ctrl.start_writing()
        await ctrl.wait_idle()
        assert ctrl.tiering is not None
        await ctrl.tiering.drain()
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        ctrl.start_writing()
        # It puts key by key: the second snapshot takes the first one's room (older speculative
        # objects go first), never a regular object's.
        assert await archive == dict.fromkeys(SNAPS, True)
        keys = [h for n in cache.tree.path_to(res.last_node) for h in n.page_hashes]
        snapshots = [keys[p // PAGE - 1] for p in SNAPS]
        regular = [(PoolName.KV, k) for k in keys] + [(PoolName.MAMBA, keys[-1])]
        assert storage.counters().num_evicted == {"mamba": 1}
        assert [storage.contains(PoolName.MAMBA, k) for k in snapshots] == [False, True]
        assert all(storage.contains(p, k) for p, k in regular)
        assert storage.put(PoolName.MAMBA, [OTHER_KEY]) == [True]  # evicts the snapshot only
        assert not storage.contains(PoolName.MAMBA, snapshots[1])
        assert all(storage.contains(p, k) for p, k in regular)


# ---- input errors --------------------------------------------------------------------------
def locks(cache: HybridCache) -> list[tuple[int, int]]:
    return [(n.device_lock, n.host_lock) for n in cache.tree.path_to(cache.tree.match_prefix(TOKENS).last_node)]


async def test_bad_input_is_refused_before_anything_is_queued(tmp_path: Path) -> None:
    async with make_cache(tmp_path) as cache:
        ctrl = cache.controller
        res, snaps, _ = await insert_with_snapshots(cache)
        node, slot = res.last_node, snaps[SNAPS[0]]
        before = free_counts(cache), ctrl.statistics().write_queue, locks(cache)
        bad: list[tuple[Any, Any, str]] = [
            (node, {PAGE + 1: slot}, "not a positive multiple of the page size"),
            (node, {0: slot}, "not a positive multiple"),
            (node, {-PAGE: slot}, "not a positive multiple"),
            (node, {1.5 * PAGE: slot}, "not a positive multiple"),
            (node, {(NUM_PAGES + 1) * PAGE: slot}, "past the node's path"),
            (node, {PAGE: cache.device_mamba.num_items}, "outside the device state pool"),
            (node, {PAGE: -1}, "outside the device state pool"),
            (node, {PAGE: slot, 2 * PAGE: slot}, "one device slot given for two positions"),
            (node, [(PAGE, slot)], "must map positions to device slots"),
            (cache.tree.root, {PAGE: slot}, "below the root"),
            (None, {PAGE: slot}, "below the root"),
        ]
        for n, s, why in bad:
            with pytest.raises(ConfigError, match=why):
                ctrl.archive_snapshots(n, s)
        assert (free_counts(cache), ctrl.statistics().write_queue, locks(cache)) == before
        assert ctrl.archive_snapshots(node, {}) is None
    async with make_cache(None) as cache:  # no storage tier
        res, snaps, _ = await insert_with_snapshots(cache)
        with pytest.raises(ConfigError, match="needs a storage tier"):
            cache.controller.archive_snapshots(res.last_node, snaps)
    with pytest.raises(ClosedError):
        cache.controller.archive_snapshots(res.last_node, snaps)


async def test_a_deleted_node_is_refused(tmp_path: Path) -> None:
    async with make_cache(tmp_path) as cache:
        res, snaps, _ = await insert_with_snapshots(cache)
        cache.controller.start_writing()
        await cache.controller.wait_idle()
        node = res.last_node
        cache.flush_device()
        cache.flush_host()
        assert not node.alive
        with pytest.raises(TreeError):
            cache.controller.archive_snapshots(node, snaps)


# ---- nothing leaked --------------------------------------------------------------------------
async def archived_and_settled(cache: HybridCache, archive: Any) -> dict[int, bool]:
    result = await archive
    assert cache.controller.tiering is not None
    await cache.controller.tiering.drain()
    return result


@pytest.mark.parametrize("how", ["raises", "returns-false"])
async def test_a_backend_that_fails_writes_leaks_no_host_slot(tmp_path: Path, how: str) -> None:
    async with make_cache(tmp_path, write_policy="write_back") as cache:
        ctrl = cache.controller
        res, snaps, _ = await insert_with_snapshots(cache)
        before = free_counts(cache), locks(cache)
        backend: Any = ctrl.backend

        async def failing(transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
            if how == "raises":
                raise OSError("disk full")
            return [[False] * len(t.keys) for t in transfers]

        backend.batch_set_v2 = failing
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        assert free_counts(cache) != before[0]  # staging taken
        ctrl.start_writing()
        assert await archived_and_settled(cache, archive) == dict.fromkeys(SNAPS, False)
        assert (free_counts(cache), locks(cache)) == before
        assert ctrl.tiering is not None
        assert ctrl.tiering.counts["snapshot_failed" if how == "raises" else "snapshot_states_not_stored"] >= 1


async def test_a_failed_staging_copy_leaks_no_host_slot(tmp_path: Path) -> None:
    async with make_cache(tmp_path, write_policy="write_back") as cache:
        ctrl = cache.controller
        res, snaps, _ = await insert_with_snapshots(cache)
        before = free_counts(cache), locks(cache)

        def broken(*args: Any, **kwargs: Any) -> int:
            raise RuntimeError("copy engine fault")

        ctrl.copy = broken
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        ctrl.start_writing()
        with pytest.raises(TransferError):
            await archive.staged
        assert await archived_and_settled(cache, archive) == dict.fromkeys(SNAPS, False)
        assert (free_counts(cache), locks(cache)) == before
        assert ctrl.tiering is not None and ctrl.tiering.counts["snapshot_failed"] == 1


async def test_a_cancelled_archive_leaks_no_host_slot(tmp_path: Path) -> None:
    async with make_cache(tmp_path, write_policy="write_back") as cache:
        ctrl = cache.controller
        res, snaps, _ = await insert_with_snapshots(cache)
        before = free_counts(cache), locks(cache)
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        assert ctrl.cancel(archive.op)  # still queued
        assert archive.staged.cancelled()
        assert await archived_and_settled(cache, archive) == dict.fromkeys(SNAPS, False)
        assert (free_counts(cache), locks(cache)) == before
        assert ctrl.tiering is not None and ctrl.tiering.counts["snapshot_cancelled"] == 1
        assert ctrl.start_writing() == 0  # nothing left queued


async def test_an_archive_task_cancelled_while_writing_leaks_no_host_slot(tmp_path: Path) -> None:
    async with make_cache(tmp_path, write_policy="write_back") as cache:
        ctrl = cache.controller
        res, snaps, _ = await insert_with_snapshots(cache)
        before = free_counts(cache), locks(cache)
        backend: Any = ctrl.backend
        started, gate = asyncio.Event(), asyncio.Event()

        async def stuck(transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
            started.set()
            await gate.wait()
            raise AssertionError("the write was to be cancelled")

        backend.batch_set_v2 = stuck
        try:
            async with asyncio.timeout(30):
                archive = ctrl.archive_snapshots(res.last_node, snaps)
                assert archive is not None
                ctrl.start_writing()
                await archive.staged
                await started.wait()
                free_slots(cache, snaps.values())  # staged: the caller's slots are free to go
                assert free_counts(cache)[2:] != before[0][2:]  # the staging is held
                cache.tree.check_integrity()  # owned by the archive in flight, not leaked
                archive.task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await archive
        finally:
            gate.set()
        assert free_counts(cache)[2:] == before[0][2:] and locks(cache) == before[1]


async def test_an_archive_queued_at_close_leaks_no_host_slot(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, write_policy="write_back")
    async with cache:
        res, snaps, _ = await insert_with_snapshots(cache)
        before = free_counts(cache)
        archive = cache.controller.archive_snapshots(res.last_node, snaps)
        assert archive is not None
    assert archive.task.done() and archive.staged.cancelled()
    assert free_counts(cache)[2:] == before[2:]  # the host's staging is back
    assert all(lk == (0, 0) for lk in locks(cache))


async def test_without_free_host_room_nothing_is_staged_unless_asked_to_evict(tmp_path: Path) -> None:
    async with make_cache(tmp_path) as cache:
        ctrl = cache.controller
        res, snaps, _ = await insert_with_snapshots(cache)
        # Another prompt with two states, backed up to the host (evictable there).
        other = [t + 1 for t in TOKENS]
        pages, slots = fill_device(cache, NUM_PAGES, 2, seed=5)
        more = cache.tree.insert(other, pages, states={4 * PAGE: slots[0], len(other): slots[1]})
        assert ctrl.write(more.backup_nodes) is not None
        ctrl.start_writing()
        await ctrl.wait_idle()
        assert cache.host_mamba is not None and ctrl.tiering is not None
        await ctrl.tiering.drain()
        # Every free host state slot taken: only the tree's host states can make room.
        filler = cache.host_mamba.alloc(cache.host_mamba.num_free)
        assert filler is not None
        before = free_counts(cache), locks(cache)
        assert ctrl.archive_snapshots(res.last_node, snaps) is None
        assert ctrl.tiering.counts["snapshot_no_room"] == 1
        assert (free_counts(cache), locks(cache)) == before
        # Told to evict, it makes room through the tree's host eviction.
        archive = ctrl.archive_snapshots(res.last_node, snaps, evict_host=True)
        assert archive is not None
        ctrl.start_writing()
        assert await archived_and_settled(cache, archive) == dict.fromkeys(SNAPS, True)
        cache.host_mamba.free(filler)


async def test_a_backup_cancelled_after_the_archive_began_leaves_its_pages_unwritten(tmp_path: Path) -> None:
    """The archive reads the path's host copies of a backup still queued when it began; that
    backup is cancelled before the copies land (its host pages freed): the archive writes
    nothing rather than pages it no longer holds."""
    async with make_cache(tmp_path) as cache:
        ctrl = cache.controller
        pages, slots = fill_device(cache, NUM_PAGES, 1 + len(SNAPS), seed=3)
        res = cache.tree.insert(TOKENS, pages, states={len(TOKENS): slots[0]})
        backup = ctrl.write(res.backup_nodes)
        assert backup is not None
        snaps = dict(zip(SNAPS, slots[1:], strict=True))
        archive = ctrl.archive_snapshots(res.last_node, snaps)
        assert archive is not None
        assert ctrl.tiering is not None and ctrl.tiering.counts["snapshot_staged_kv_pages"] == 0  # host copies used
        assert ctrl.cancel(backup)
        ctrl.start_writing()
        assert await archived_and_settled(cache, archive) == dict.fromkeys(SNAPS, False)
        assert ctrl.tiering.counts["snapshot_kv_lost"] == 1
        keys = [h for n in cache.tree.path_to(res.last_node) for h in n.page_hashes]
        assert (await ctrl.backend.batch_exists_v2(  # type: ignore[union-attr]
            keys, [PoolTransfer(pool_name=PoolName.KV)]
        )).num_hit_pages == 0
        assert all(lk == (0, 0) for lk in locks(cache))


# ---- the reference scheduler -------------------------------------------------------------------
class EndsPlusStorageGrid(EndsAdmission):
    """The tree keeps the ends; storage gets a state at every page of the prompt besides."""

    def storage_positions(self, prompt_len: int, *, page_size: int, match: Any = None) -> set[int]:
        return set(range(page_size, prompt_len + 1, page_size))


class EndsPlusTreeGrid(EndsAdmission):
    """The same snapshots (the same prefill segments), all kept by the tree."""

    def state_positions(self, prompt_len: int, *, page_size: int, total_len: Any = None, match: Any = None) -> set[int]:
        grid = EndsPlusStorageGrid().storage_positions(prompt_len, page_size=page_size)
        return super().state_positions(prompt_len, page_size=page_size, total_len=total_len, match=match) | grid


PROMPT = [(7 * t + 3) % 250 + 1 for t in range(41)]
BRANCH = 3 * PAGE  # a storage-only snapshot, not one of the prompt's ends


def device_prefix_bytes(cache: HybridCache, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    m = cache.tree.match_prefix(tokens)
    assert m.num_tokens == len(tokens) and not m.needs_load and m.last_node.device_state is not None
    pages = m.device_kv_indices.to(cache.device_kv.device)
    return kv_bytes(cache, pages).cpu(), state_bytes(cache, m.last_node.device_state).cpu()


async def test_the_scheduler_archives_the_policy_s_storage_only_snapshots(tmp_path: Path, model_device: str) -> None:
    """The scheduler computes the admission policy's ``storage_positions`` as snapshots and
    archives them at the request's end; a later request that branches at one of them, with the
    tree empty, restores it from storage: the bytes the same run with the tree keeping that
    snapshot holds, and the greedy output of a cold run."""
    model = tiny_model(SPEC, model_device, seed=3)
    device = device_of(model)
    prompt2 = PROMPT[:BRANCH] + [(5 * t + 1) % 250 + 1 for t in range(9)]
    config = serving_config(SPEC)
    async with HybridCache(SPEC, config, device=device, admission=EndsPlusTreeGrid()) as cache, Scheduler(
        model, cache, SchedulerConfig(chunk_size=4096)
    ) as sched:
        await sched.generate(PROMPT, 4)
        saved = device_prefix_bytes(cache, PROMPT[:BRANCH])
    storage = dataclasses.replace(config, storage_uri=tmp_path.as_uri())
    async with HybridCache(SPEC, storage, device=device, admission=EndsPlusStorageGrid()) as cache, Scheduler(
        model, cache, SchedulerConfig(chunk_size=4096)
    ) as sched:
        before = free_counts(cache)
        await sched.generate(PROMPT, 4)
        assert cache.tree.match_prefix(PROMPT[:BRANCH]).num_tokens == 0  # not a tree state
        await cache.controller.wait_idle()
        tier = cache.controller.tiering
        assert tier is not None
        await tier.drain()
        assert tier.counts["snapshot_states_stored"] == len(PROMPT) // PAGE - 1  # all but the end's page
        cache.flush_device()
        cache.flush_host()
        assert free_counts(cache) == before  # every slot back: the snapshots' and their staging
        r2 = await sched.generate(prompt2, 4)
        assert r2.cached_by_tier["storage"] == BRANCH
        restored = device_prefix_bytes(cache, prompt2[:BRANCH])
        assert torch.equal(restored[0], saved[0]) and torch.equal(restored[1], saved[1])
    async with HybridCache(SPEC, config, device=device) as cache, Scheduler(
        model, cache, SchedulerConfig(chunk_size=4096, use_cache=False)
    ) as sched:
        assert (await sched.generate(prompt2, 4)).output_ids == r2.output_ids
