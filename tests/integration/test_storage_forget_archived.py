"""A node marked archived stops counting as stored once storage is found to have lost its objects.

``mark_archived`` tells the storage tier a node's pages (and state) are stored, so archives
through it skip them. A backend removes an invalid object it reads and reports a miss; when the
tree holds a node of those pages meanwhile (the same prefix computed and archived while the
read was in flight: its put-if-absent found the invalid object and counted it stored), the mark
outlives the object: every later archive through the node skips its pages, and storage never
serves the prefix past them. ``tree.forget_archived`` clears the marks of a path's pages; the
storage tier calls it for a read that came back incomplete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import torch
from serving import split_cost
from test_storage_snapshots import NUM_PAGES, PAGE, TOKENS, fill_device, make_cache

from asynccache.cache import HybridCache
from asynccache.storage import PoolTransfer


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


async def computed_and_archived(cache: HybridCache, tokens: list[int], seed: int) -> list[object]:
    """``tokens`` computed (a state at the end), backed up and archived: the path's nodes."""
    ctrl = cache.controller
    assert ctrl.tiering is not None
    num_pages = len(tokens) // PAGE
    match = cache.tree.match_prefix(tokens)
    have = match.device_kv_indices
    pages, slots = fill_device(cache, num_pages - int(have.numel()), 1, seed)
    res = cache.tree.insert(tokens, torch.cat([have, pages]), states={len(tokens): slots[0]})
    op = ctrl.write(res.backup_nodes)
    assert op is not None
    ctrl.start_writing()
    await op
    path = cache.tree.path_to(res.last_node)
    async with asyncio.timeout(30):
        while not path[-1].archived:  # its archive (other storage tasks may be in flight)
            await asyncio.sleep(0.005)
    return path


async def only_in_storage(cache: HybridCache) -> list[str]:
    """``TOKENS`` computed, archived, then flushed from device and host: their keys."""
    await computed_and_archived(cache, TOKENS, seed=3)
    keys = list(cache.tree.match_prefix(TOKENS).page_hashes)
    assert cache.controller.tiering is not None
    await cache.controller.tiering.drain()
    cache.flush_device()
    cache.flush_host()
    return keys


async def test_an_object_found_corrupt_while_its_prefix_was_archived_again_is_written_again(tmp_path: Path) -> None:
    async with make_cache(tmp_path) as cache:
        ctrl, tree, backend = cache.controller, cache.tree, cache.controller.backend
        assert ctrl.tiering is not None and backend is not None
        keys = await only_in_storage(cache)
        obj = Path(backend.object_name("kv", keys[3]))  # type: ignore[attr-defined]
        flip_a_byte(obj)
        started, gate = asyncio.Event(), asyncio.Event()
        read = backend.batch_get_v2

        async def held_read(transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
            started.set()
            await gate.wait()
            return await read(transfers)

        backend.batch_get_v2 = held_read  # type: ignore[method-assign]
        prompt = TOKENS + [251] * PAGE
        task = ctrl.prefetch(prompt, tree.match_prefix(prompt))
        assert task is not None
        async with asyncio.timeout(30):
            await started.wait()
            # The same prefix computed and archived while the read is in flight: its put finds
            # the corrupt object and counts it stored.
            path = await computed_and_archived(cache, TOKENS, seed=3)
            assert all(n.archived for n in path)
            gate.set()
            result = await ctrl.wait_prefetch(task, len(prompt))
        backend.batch_get_v2 = read  # type: ignore[method-assign]
        assert result is not None and result.num_pages_fetched == 0 and not obj.exists()  # found, removed
        assert not any(n.archived for n in path)
        # A turn below it is archived with the path's pages that storage lost.
        longer = TOKENS + [77] * (2 * PAGE)
        await computed_and_archived(cache, longer, seed=9)
        await ctrl.tiering.drain()
        assert obj.exists()
        cache.flush_device()
        cache.flush_host()
        prompt = longer + [251] * PAGE
        task = ctrl.prefetch(prompt, tree.match_prefix(prompt))
        assert task is not None
        result = await ctrl.wait_prefetch(task, len(prompt))
        assert result is not None and result.num_tokens == len(longer) == (NUM_PAGES + 2) * PAGE


async def test_a_split_restore_whose_tail_is_found_corrupt_unmarks_the_tail_archived_meanwhile(tmp_path: Path) -> None:
    """The same race as above with a split restore: the tail's read finds an object invalid
    (removed) while the prefix was computed and archived, its put counting that object stored."""
    async with make_cache(tmp_path) as cache:
        ctrl, tree, backend = cache.controller, cache.tree, cache.controller.backend
        assert ctrl.tiering is not None and backend is not None
        keys = await only_in_storage(cache)
        obj = Path(backend.object_name("kv", keys[-2]))  # type: ignore[attr-defined]
        flip_a_byte(obj)
        ctrl.tiering.cost = split_cost(cache.spec)
        gate = asyncio.Event()
        read = backend.batch_get_v2

        async def held_read(transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
            await gate.wait()
            return await read(transfers)

        backend.batch_get_v2 = held_read  # type: ignore[method-assign]
        prompt = TOKENS + [251] * PAGE
        task = ctrl.prefetch(prompt, tree.match_prefix(prompt), allow_tail=True)
        assert task is not None
        async with asyncio.timeout(30):
            result = await ctrl.wait_prefetch(task, len(prompt))
            assert result is not None and result.tail is not None and result.tail.begin_tokens > 0
            path = await computed_and_archived(cache, TOKENS, seed=3)
            assert all(n.archived for n in path)
            gate.set()
            assert not await result.tail.fetch
        backend.batch_get_v2 = read  # type: ignore[method-assign]
        result.tail.release()
        assert not obj.exists()  # found invalid, removed
        tail_nodes = [n for n in path if n.end_page * PAGE > result.tail.begin_tokens]
        assert tail_nodes and not any(n.archived for n in tail_nodes)
