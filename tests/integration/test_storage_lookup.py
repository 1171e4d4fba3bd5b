"""A storage lookup counts the KV the tree already holds.

The tree holds the head of a prefix (on the device only, as ``write_back`` leaves it, or on the
host), never archived; storage holds the pages past it and the state at the end. The prefetch
asks storage only for what lies past the tree's pages, reads only those, and the next match
serves the whole prefix from the tree's pages and the fetched ones, bit for bit what was
computed. The tree's pages stay locked from the moment the prefetch starts: evictions while it
waits for storage cannot take them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from serving import free_counts, slow_backend

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.policy import EveryPageAdmission
from asynccache.spec import HybridSpec
from asynccache.storage import PoolName

PAGE = 4
HEAD = 3  # pages the tree holds
STORED = 8  # pages whose prefix storage serves (KV of [HEAD, STORED) and the state at STORED)
TOKENS = [(13 * t + 7) % 250 + 1 for t in range(10 * PAGE)]  # the prompt runs 2 pages further


def make_cache(root: Path, write_policy: str = "write_through") -> HybridCache:
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    config = HybridCacheConfig(
        device_kv_pages=64,
        device_state_slots=8,
        host_kv_bytes=64 * spec.kv_page_bytes,
        host_state_bytes=8 * spec.state_bytes,
        storage_uri=root.as_uri(),
        write_policy=write_policy,
    )
    return HybridCache(spec, config, admission=EveryPageAdmission())


@dataclass
class Computed:
    """The bytes of every attention layer's KV pages and of every recurrent layer's states."""

    kv: torch.Tensor  # [layers, pages, page bytes]
    states: dict[int, torch.Tensor]  # position (tokens) → [layers, state bytes]


def read_kv(cache: HybridCache, pages: torch.Tensor) -> torch.Tensor:
    return torch.stack([cache.device_kv.layer_items(lid)[pages] for lid in cache.spec.attention_layer_ids])


def read_state(cache: HybridCache, slot: int) -> torch.Tensor:
    return torch.stack([cache.device_mamba.layer_items(lid)[slot] for lid in cache.spec.mamba_layer_ids])


def write_device(
    cache: HybridCache, kv: torch.Tensor, states: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[int]]:
    """Fresh device pages and slots holding ``kv`` and ``states``."""
    alloc = cache.tree.alloc_device(kv.shape[1], len(states))
    assert alloc is not None
    for i, lid in enumerate(cache.spec.attention_layer_ids):
        cache.device_kv.layer_items(lid)[alloc.kv_indices] = kv[i]
    slots = alloc.state_slots.tolist()
    for slot, st in zip(slots, states, strict=True):
        for i, lid in enumerate(cache.spec.mamba_layer_ids):
            cache.device_mamba.layer_items(lid)[slot] = st[i]
    return alloc.kv_indices, slots


async def store_prefix(root: Path, *, keep_kv_from: int) -> Computed:
    """Compute (random bytes) the first ``STORED`` pages of ``TOKENS`` with states at ``HEAD`` and
    ``STORED``, archive them to the storage at ``root``, then remove from storage the KV of the
    pages before ``keep_kv_from`` and the state at ``HEAD``: storage keeps the rest only."""
    g = torch.Generator().manual_seed(7)
    async with make_cache(root) as cache:
        spec = cache.spec
        kv_bytes = {cache.device_kv.layer_items(lid).shape[1] for lid in spec.attention_layer_ids}
        state_bytes = {cache.device_mamba.layer_items(lid).shape[1] for lid in spec.mamba_layer_ids}
        assert len(kv_bytes) == len(state_bytes) == 1  # every layer alike: one tensor holds them
        num_kv, num_state = len(spec.attention_layer_ids), len(spec.mamba_layer_ids)
        kv = torch.randint(0, 256, (num_kv, STORED, kv_bytes.pop()), generator=g, dtype=torch.uint8)
        size = (num_state, state_bytes.pop())
        states = {p * PAGE: torch.randint(0, 256, size, generator=g, dtype=torch.uint8) for p in (HEAD, STORED)}
        pages, slots = write_device(cache, kv, list(states.values()))
        res = cache.tree.insert(TOKENS[: STORED * PAGE], pages, states=dict(zip(states, slots, strict=True)))
        op = cache.controller.write(res.backup_nodes)
        assert op is not None
        cache.controller.start_writing()
        await op
        tier = cache.controller.tiering
        assert tier is not None
        await tier.drain()
        assert tier.counts["backup_ok"] >= 1
        keys = cache.tree.match_prefix(TOKENS).page_hashes
        name = tier.backend.object_name  # type: ignore[attr-defined]
        gone = [name(PoolName.KV, keys[p]) for p in range(keep_kv_from)] + [name(PoolName.MAMBA, keys[HEAD - 1])]
    for name in gone:
        Path(name).unlink()  # raises if it was not stored
    return Computed(kv=kv, states=states)


def put_head(cache: HybridCache, computed: Computed, *, num_pages: int, state: bool) -> Any:
    """The tree computes the first ``num_pages`` pages again (the same bytes), with the state at
    ``HEAD`` when ``state``, followed by 2 pages of another prompt (a branch, with a state at its
    end: the prompt branches off the tree inside that node); on the device only."""
    branch = [t + 1 for t in TOKENS[num_pages * PAGE : (num_pages + 2) * PAGE]]
    other = torch.zeros((computed.kv.shape[0], 2, computed.kv.shape[2]), dtype=torch.uint8)
    end = torch.zeros_like(computed.states[HEAD * PAGE])
    states = [computed.states[HEAD * PAGE], end] if state else [end]
    pages, slots = write_device(cache, torch.cat([computed.kv[:, :num_pages], other], dim=1), states)
    positions = [HEAD * PAGE, (num_pages + 2) * PAGE] if state else [(num_pages + 2) * PAGE]
    tokens = TOKENS[: num_pages * PAGE] + branch
    return cache.tree.insert(tokens, pages, states=dict(zip(positions, slots, strict=True)))


async def move_to_host(cache: HybridCache, nodes: Sequence[Any]) -> None:
    """Back ``nodes`` up to the host without archiving them (as when the storage tier skipped
    the backup), then drop their device copies."""
    tier = cache.controller.tiering
    assert tier is not None
    tier.archive_host_writes = False
    try:
        op = cache.controller.write(nodes)
        assert op is not None
        cache.controller.start_writing()
        await op
    finally:
        tier.archive_host_writes = True
    cache.flush_device()


async def loaded_bytes(cache: HybridCache, num_pages: int) -> Computed:
    """Load the match of ``TOKENS`` to the device; its KV bytes and the state at its end."""
    m = cache.tree.match_prefix(TOKENS)
    assert m.num_tokens == num_pages * PAGE
    op = cache.controller.load(m)
    assert op is not None
    cache.controller.start_loading()
    await op
    m = cache.tree.match_prefix(TOKENS)
    assert m.num_device_tokens == num_pages * PAGE and m.last_node.device_state is not None
    return Computed(
        kv=read_kv(cache, m.device_kv_indices), states={m.num_tokens: read_state(cache, m.last_node.device_state)}
    )


@pytest.mark.parametrize("head_state", [True, False], ids=["head-state", "head-no-state"])
@pytest.mark.parametrize("head_tier", ["device", "host"])
async def test_the_tree_s_head_and_the_stored_tail_serve_the_prefix(
    tmp_path: Path, head_tier: str, head_state: bool
) -> None:
    computed = await store_prefix(tmp_path, keep_kv_from=HEAD)
    async with make_cache(tmp_path, write_policy="write_back") as cache:
        res = put_head(cache, computed, num_pages=HEAD, state=head_state)
        if head_tier == "host":
            await move_to_host(cache, cache.tree.path_to(res.last_node))
        match = cache.tree.match_prefix(TOKENS)
        # Without the tail: a miss, or the head's state.
        assert match.num_tokens == (HEAD * PAGE if head_state else 0)
        assert match.num_matched_tokens == HEAD * PAGE
        assert all(n.archived is False for n in cache.tree.path_to(res.last_node))
        tier = cache.controller.tiering
        assert tier is not None
        result = await tier.prefetch(TOKENS, match)
        assert result.num_tokens == STORED * PAGE
        assert result.num_pages_fetched == STORED - HEAD  # only the pages past the tree's were read
        assert tier.counts["prefetch_pages"] == STORED - HEAD
        assert tier.counts.get("prefetch_head_backups", 0) == (head_tier == "device")
        cache.tree.check_integrity()
        got = await loaded_bytes(cache, STORED)
        assert torch.equal(got.kv, computed.kv)
        assert torch.equal(got.states[STORED * PAGE], computed.states[STORED * PAGE])
        cache.tree.check_integrity()


async def test_a_stored_state_within_the_tree_s_pages_is_fetched_alone(tmp_path: Path) -> None:
    """The tree holds the KV of all 8 pages but the state only at page 3; storage holds the state
    at page 8 and no KV at all: the state alone is read, and the prefix is served to page 8."""
    computed = await store_prefix(tmp_path, keep_kv_from=STORED)
    async with make_cache(tmp_path) as cache:
        put_head(cache, computed, num_pages=STORED, state=True)
        match = cache.tree.match_prefix(TOKENS)
        assert match.num_tokens == HEAD * PAGE and match.num_matched_tokens == STORED * PAGE
        tier = cache.controller.tiering
        assert tier is not None
        result = await tier.prefetch(TOKENS, match)
        assert result.num_tokens == STORED * PAGE and result.num_pages_fetched == 0
        cache.tree.check_integrity()
        got = await loaded_bytes(cache, STORED)
        assert torch.equal(got.kv, computed.kv)
        assert torch.equal(got.states[STORED * PAGE], computed.states[STORED * PAGE])


@pytest.mark.parametrize("when", ["before the task runs", "during the lookup"])
@pytest.mark.parametrize("head_tier", ["device", "host"])
async def test_the_tree_s_pages_are_locked_while_the_prefetch_runs(tmp_path: Path, head_tier: str, when: str) -> None:
    """Everything evictable is evicted after the prefetch started (before its task first runs,
    or while it waits for storage): the head holds no state, so only a lock of the node holding
    the tree's pages (not of the match's usable prefix, the root) keeps it for the fetch."""
    computed = await store_prefix(tmp_path, keep_kv_from=HEAD)
    async with make_cache(tmp_path) as cache:
        res = put_head(cache, computed, num_pages=HEAD, state=False)
        if head_tier == "host":
            await move_to_host(cache, cache.tree.path_to(res.last_node))

        def evict_everything() -> None:
            cache.flush_device()
            cache.flush_host()

        if when == "during the lookup":
            calls = slow_backend(cache, "batch_exists_v2", 0.01, during=evict_everything)
        match = cache.tree.match_prefix(TOKENS)
        assert match.num_tokens == 0 and match.last_node.parent is None
        task = cache.controller.prefetch(TOKENS, match)
        assert task is not None
        if when == "before the task runs":
            evict_everything()
        result = await task
        if when == "during the lookup":
            assert calls[0] >= 1
        assert result.num_tokens == STORED * PAGE
        cache.tree.check_integrity()
        got = await loaded_bytes(cache, STORED)
        assert torch.equal(got.kv, computed.kv)
        assert torch.equal(got.states[STORED * PAGE], computed.states[STORED * PAGE])
        # Once the prefetch and the archives of the backups are over, nothing stays locked.
        await cache.controller.wait_idle()
        assert cache.controller.tiering is not None
        await cache.controller.tiering.drain()
        evict_everything()
        assert cache.tree.stats().num_nodes == 0
        pools = (cache.device_kv, cache.device_mamba, cache.host_kv, cache.host_mamba)
        assert free_counts(cache) == tuple(p.num_items for p in pools if p is not None)


class _CopyInFlight:
    """A backup's end event, as on CUDA, whose copy lands once ``landed`` is set."""

    def __init__(self, landed: threading.Event) -> None:
        self.landed = landed

    def query(self) -> bool:
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.landed.wait(30)


async def test_close_waits_for_a_prefetch_whose_head_backup_it_issued(tmp_path: Path) -> None:
    """The completion tasks run as on CUDA. A close begins while an archive (its storage write
    slow) and a prefetch (its lookup slow) are in flight; the prefetch then backs the tree's head
    up to the host, and that copy lands only once the archive is over. The close must let the
    backup complete and the prefetch end before it stops the completion tasks: before, it
    stopped them once the archives were drained, the prefetch waited for ever for its backup,
    and the close with it. Nothing stays locked."""
    computed = await store_prefix(tmp_path, keep_kv_from=HEAD)
    cache = make_cache(tmp_path, write_policy="write_back")
    ctrl, tree = cache.controller, cache.tree
    ctrl._cuda = True  # start the completion tasks, as on CUDA
    landed = threading.Event()
    set_gate, exists_gate, head_backup_issued = asyncio.Event(), asyncio.Event(), asyncio.Event()
    closing: asyncio.Task[None] | None = None
    await cache.__aenter__()
    try:
        tier = ctrl.tiering
        assert tier is not None
        backend = tier.backend
        real_set, real_exists = backend.batch_set_v2, backend.batch_exists_v2

        async def slow_set(*args: Any, **kwargs: Any) -> Any:
            await set_gate.wait()
            return await real_set(*args, **kwargs)

        async def slow_exists(*args: Any, **kwargs: Any) -> Any:
            await exists_gate.wait()
            return await real_exists(*args, **kwargs)

        backend.batch_set_v2 = slow_set  # type: ignore[method-assign]
        backend.batch_exists_v2 = slow_exists  # type: ignore[method-assign]
        # An archive in flight: another prefix backed up to the host, its storage write slow.
        other = [(t + 100) % 250 + 1 for t in range(2 * PAGE)]
        zeros = torch.zeros((computed.kv.shape[0], 2, computed.kv.shape[2]), dtype=torch.uint8)
        pages, slots = write_device(cache, zeros, [torch.zeros_like(computed.states[HEAD * PAGE])])
        backup = ctrl.write(tree.path_to(tree.insert(other, pages, states={2 * PAGE: slots[0]}).last_node))
        assert backup is not None
        ctrl.start_writing()
        await backup
        (archive,) = tier._in_flight
        # From here a backup's copy lands once the archive has ended.
        archive.add_done_callback(lambda _: landed.set())
        real_finish = ctrl._writes._finish

        def in_flight(ops: Any, merged: Any, event: Any, *, error: Any) -> None:
            head_backup_issued.set()
            real_finish(ops, merged, _CopyInFlight(landed), error=error)

        ctrl._writes._finish = in_flight  # type: ignore[method-assign]
        put_head(cache, computed, num_pages=HEAD, state=False)  # on the device only
        task = ctrl.prefetch(TOKENS, tree.match_prefix(TOKENS))
        assert task is not None
        closing = asyncio.create_task(cache.aclose())
        await asyncio.sleep(0)  # the close starts (runs to its first wait)
        assert ctrl._closing is not None and not closing.done()
        exists_gate.set()
        async with asyncio.timeout(10):
            await head_backup_issued.wait()
        set_gate.set()
        async with asyncio.timeout(10):
            await closing
        result = task.result()
        assert result.num_tokens == STORED * PAGE and tier.counts["prefetch_head_backups"] == 1
    finally:
        landed.set()
        exists_gate.set()
        set_gate.set()
        if closing is not None and not closing.done():
            closing.cancel()
    stats = tree.stats()
    assert (stats.num_active_plans, stats.device_locked_pages, stats.host_locked_pages) == (0, 0, 0)
    tree.check_integrity()
