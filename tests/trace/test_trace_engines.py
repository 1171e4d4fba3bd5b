"""The two replay engines compared request by request: the synchronous one (the replay's model
of the storage tier) and the asyncio controller (the production code), in lockstep on one
trace, must hit the same tokens on the same tiers, keep the same tree on the same clock and
hold the same objects in storage in the same recency order, with storage written through or
demoted to, tight or roomy, or absent; and the controller's storage tier must never lose a
completed host write to a host eviction that comes before its archive."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from trace_builders import BLOCK, make_config, mixed_trace

from asynccache.storage import PoolName
from asynccache.tiering import StorageTier
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
    controller_tier = SimpleNamespace(backend=twin)  # what StorageTier._deepest_stored uses
    hits = 0
    for i in range(len(trace)):
        match = sync._begin(i)[2]
        keys = list(match.page_hashes)
        start = match.num_tokens // BLOCK
        held = max(start, min(match.num_matched_tokens // BLOCK, len(keys)))
        n = tier.lookup(match, max_pages=len(keys))
        assert (n or start) == await StorageTier._deepest_stored(controller_tier, keys, start, held)  # type: ignore[arg-type]
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
