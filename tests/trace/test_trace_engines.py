"""The two replay engines compared request by request: the synchronous one (the replay's model
of the storage tier) and the asyncio controller (the production code), in lockstep on one
trace, must hit the same tokens on the same tiers, keep the same tree on the same clock and
hold the same objects in storage in the same recency order, with storage written through or
demoted to, tight or roomy, or absent; and the controller's storage tier must never lose a
completed host write to a host eviction that comes before its archive. Both count the same
device → host bytes staging storage-only snapshots."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from trace_builders import BLOCK, make_config, make_trace, mixed_trace

from asynccache.storage import PoolName
from asynccache.stored_lookup import UnservableKeys, deepest_stored
from asynccache.trace.controller_replay import ControllerReplay
from asynccache.trace.loader import Trace
from asynccache.trace.replay import ReplayConfig, TraceReplay
from asynccache.trace.storage_index import AccountingStorage

BIG = 10_000  # pages: storage never evicts


def tree_shape(replay: TraceReplay) -> dict[str, tuple[int, bool, bool, bool, bool]]:
    """Each node, by the hash of its last page: pages and what it holds on which tier."""
    shape = {}
    todo = list(replay.tree.root.children.values())
    while todo:
        n = todo.pop()
        shape[n.page_hashes[-1]] = (
            n.num_pages,
            n.device_kv is not None,
            n.host_kv is not None,
            n.device_state is not None,
            n.host_state is not None,
        )
        todo.extend(n.children.values())
    return shape


async def replay_in_lockstep(trace: Trace, config: ReplayConfig) -> tuple[TraceReplay, ControllerReplay]:
    """Replay ``trace`` through both engines one request at a time; after each, everything the
    next request could see must be the same."""
    sync, ctrl = TraceReplay(trace, config), ControllerReplay(trace, config)
    async with ctrl.controller:
        ctrl.started()
        for i in range(len(trace)):
            hits = sync._request(i), await ctrl._arequest(i)
            assert hits[0] == hits[1], f"request {i}: hits (device, host, storage) differ"
            assert sync._tick == ctrl._tick, f"request {i}: the tree's clock was read a different number of times"
            assert tree_shape(sync) == tree_shape(ctrl), f"request {i}: the trees differ"
            if sync.storage is not None:
                assert ctrl.storage is not None
                assert sync.storage.objects() == ctrl.storage.objects(), f"request {i}: storage differs"
    return sync, ctrl


CELLS = [
    # (policy, device pages, host pages, storage pages)
    ("adaptive/reuse/write_back", 24, 40, 0),
    ("adaptive/reuse/write_back", 24, 40, 60),
    ("adaptive/reuse/write_back", 24, 40, BIG),
    ("adaptive/reuse/write_through", 24, 40, 60),
    ("adaptive/reuse/write_through", 24, 60, BIG),
    ("adaptive/reuse/write_back/demote", 24, 40, 60),
    ("branch/cost-aware", 20, 40, 50),
    ("branch/cost-aware/write_back", 20, 40, 50),
    ("adaptive/lru/write_back", 24, 40, 80),
]


@pytest.mark.parametrize("combo,device,host,storage", CELLS)
async def test_the_engines_agree_request_by_request(combo: str, device: int, host: int, storage: int) -> None:
    """Every figure of the result too, as the recorded matrix reads them."""
    trace = mixed_trace(5, 120, shared=3)
    config = make_config(combo, device_pages=device, host_pages=host, storage_pages=storage)
    sync, ctrl = await replay_in_lockstep(trace, config)
    assert sync.device_budget.counts == ctrl.device_budget.counts
    assert sync.host_budget is not None and ctrl.host_budget is not None
    assert sync.host_budget.counts == ctrl.host_budget.counts
    assert sync.released_states == ctrl.released_states
    if storage:
        assert sync.storage is not None and ctrl.storage is not None
        assert sync.storage.counters() == ctrl.storage.counters()


async def test_a_storage_lookup_refreshes_what_it_finds_as_the_controller_s_does() -> None:
    """The synchronous tier's lookup asks storage what the controller's tier asks
    (``batch_exists_v2``, which refreshes the objects of a hit), so a lookup whose read then
    finds no room leaves storage as in the other engine."""
    trace = mixed_trace(5, 40, shared=3)
    config = make_config("branch/lru/write_back", device_pages=24, host_pages=40, storage_pages=BIG)
    sync = TraceReplay(trace, config)
    for i in range(len(trace)):
        sync._request(i)
    tier, storage = sync.storage_tier, sync.storage
    assert tier is not None and storage is not None
    twin = AccountingStorage(storage.capacity_bytes)
    for pool in (PoolName.KV, PoolName.MAMBA):
        twin.set_object_bytes(pool, storage.object_bytes(pool))
    for pool, key in storage.objects()[0]:
        twin.put(pool, [key])
    hits = 0
    for i in range(len(trace)):
        match = sync._begin(i)[2]
        keys = list(match.page_hashes)
        start = match.num_tokens // BLOCK
        held = max(start, min(match.num_matched_tokens // BLOCK, len(keys)))
        n = tier.lookup(match, max_pages=len(keys))
        assert (n or start) == await deepest_stored(twin, keys, start, held, UnservableKeys())  # the controller tier's
        assert storage.objects() == twin.objects(), f"request {i}"
        hits += n > 0
    assert hits


@pytest.mark.parametrize("storage", [20, 40, BIG])
async def test_the_engines_agree_on_what_a_tight_storage_admits(storage: int) -> None:
    """The storage admission rule (``asynccache.storage_admission``) skips archives in both
    engines alike when storage is tight, and none when it has room."""
    trace = mixed_trace(5, 120, shared=3)
    config = make_config("adaptive/reuse/write_back", device_pages=24, host_pages=20, storage_pages=storage)
    sync, ctrl = await replay_in_lockstep(trace, config)
    assert sync.storage_tier is not None and ctrl.storage_tier is not None
    assert sync.storage_tier.admission is not None and ctrl.storage_tier.admission is not None
    counts = sync.storage_tier.admission.counts()
    assert counts == ctrl.storage_tier.admission.counts()
    assert ctrl.controller.tiering is not None
    assert ctrl.controller.tiering.counts["backup_not_admitted"] == sync.storage_tier.num_not_admitted == counts["skipped"]
    if storage == BIG:
        assert counts == {"admitted_over_victim": 0, "skipped": 0}
    else:
        assert counts["skipped"] > 0


def count_snapshot_puts(replay: TraceReplay) -> Counter[str]:
    """How storage answers the synchronous engine's storage-only snapshot states (its only
    speculative puts), counted as they come: ``written``, ``already`` held, ``refused``."""
    storage = replay.storage
    assert storage is not None
    put, counts = storage.put, Counter[str]()

    def counting(pool: PoolName, keys: Sequence[str], *, speculative: bool = False) -> list[bool]:
        if not speculative:
            return put(pool, keys)
        before = storage.written_bytes(pool)
        ok = put(pool, keys, speculative=True)
        written = (storage.written_bytes(pool) - before) // storage.object_bytes(pool)
        counts.update(written=written, already=sum(ok) - written, refused=len(ok) - sum(ok))
        return ok

    storage.put = counting  # type: ignore[method-assign]
    return counts


async def test_the_engines_count_the_same_device_to_host_bytes_staging_storage_only_snapshots() -> None:
    """Staging storage-only snapshots is device → host traffic whatever storage then does with
    them. The controller engine counted every staged state and, under write-back, the path's
    KV staged from the device; the synchronous engine counted only the states storage newly
    wrote. Here a tight storage refuses some, already holds one (left without its KV, as by an
    earlier run) and writes the rest, and the prompts' KV is on the device only: every byte
    count agrees."""
    trace = make_trace(
        [(0, [0, 1, 2, 3, 4, 5]), (1, [0, 1, 2, 6, 7, 8]), (2, [20, 21, 22, 23, 24, 25]), (3, [0, 1, 2, 6, 7, 8, 9])]
    )
    config = make_config("adaptive/lru/write_back", device_pages=40, host_pages=40, storage_pages=12)
    sync, ctrl = TraceReplay(trace, config), ControllerReplay(trace, config)
    held = TraceReplay(trace, config)._begin(0)[2].page_hashes[1]  # the first prompt's second page
    for replay in (sync, ctrl):
        assert replay.storage is not None
        replay.storage.put(PoolName.MAMBA, [held])
    outcomes = count_snapshot_puts(sync)
    by_sync, by_ctrl = sync.run(), await ctrl.arun()
    assert outcomes == {"written": 4, "already": 1, "refused": 4}
    counts = by_ctrl.extra["snapshot_counts"]
    assert counts["snapshot_staged_states"] == outcomes.total() and counts["snapshot_staged_kv_pages"] > 0
    assert by_sync.bytes_moved == by_ctrl.bytes_moved
    spec = config.spec
    staged = counts["snapshot_staged_kv_pages"] * spec.kv_page_bytes + counts["snapshot_staged_states"] * spec.state_bytes
    moved = by_sync.bytes_moved
    assert moved["d2h"] == moved["d2h_kv"] + moved["d2h_state"] + staged
    assert by_sync.hit_tokens_by_tier == by_ctrl.hit_tokens_by_tier and by_sync.hit_tokens_by_tier["storage"] > 0


async def test_snapshots_without_host_room_to_stage_them_are_left_out_in_both_engines() -> None:
    """The controller's tier stages snapshots in free host slots and archives nothing when
    there are none; the synchronous tier wrote them to storage all the same."""
    trace = make_trace([(0, [0, 1, 2, 3, 4, 5])])
    config = make_config("adaptive/lru/write_back", device_pages=40, host_pages=40, storage_pages=BIG)
    sync, ctrl = TraceReplay(trace, config), ControllerReplay(trace, config)
    for replay in (sync, ctrl):
        assert replay.host_mamba is not None
        replay.host_mamba.alloc(replay.host_mamba.num_free)  # no host slot to stage a state in
    sync._request(0)
    async with ctrl.controller:
        ctrl.started()
        await ctrl._arequest(0)
    assert sync.storage_tier is not None and ctrl.controller.tiering is not None
    assert ctrl.controller.tiering.counts["snapshot_no_room"] == sync.storage_tier.num_snapshot_no_room == 1
    assert sync.storage is not None and ctrl.storage is not None
    assert sync.storage.objects() == ctrl.storage.objects() == ([], [])
    assert sync.storage_tier.staged_kv_bytes == sync.storage_tier.staged_state_bytes == 0
