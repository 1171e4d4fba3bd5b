"""Replays of small hand-made traces with known answers, one per policy behaviour."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from trace_builders import BLOCK, make_config, make_spec, make_trace, mixed_trace

from asynccache.errors import ConfigError
from asynccache.storage import PoolName
from asynccache.trace.bound import infinite_cache_bound
from asynccache.trace.loader import Trace
from asynccache.trace.policies import parse_combo
from asynccache.trace.replay import ReplayConfig, TraceReplay, replay_trace
from asynccache.trace.results import TierBudget
from asynccache.tree import EvictHow, EvictResult, TreeNode

BIG = 10_000  # pages: nothing is ever evicted


def hits_per_request(trace: Trace, config: ReplayConfig) -> list[int]:
    replay = TraceReplay(trace, config)
    out = []
    for i in range(len(trace)):
        out.append(sum(replay._request(i)))
        replay.tree.check_integrity()
    return out


# ---- admission ---------------------------------------------------------------------------------
SHARED = [0, 1, 2]  # a 3-block shared prefix (a system prompt), then private turns
THREE_USERS = make_trace([(0, SHARED + [3, 4]), (1, SHARED + [5, 6]), (2, SHARED + [7, 8])])


def test_branch_admission_hits_from_the_third_occurrence_of_a_shared_prefix() -> None:
    # 1st: cached with a state at its end only. 2nd: KV matches the 3 shared pages but no state
    # there → miss, and its prefill snapshots the branch point. 3rd: resumes from it.
    assert hits_per_request(THREE_USERS, make_config("branch/lru", device_pages=BIG)) == [0, 0, 3 * BLOCK]
    # Ends-only never has a state at the branch point.
    assert hits_per_request(THREE_USERS, make_config("ends/lru", device_pages=BIG)) == [0, 0, 0]
    # A state at every page serves the second occurrence already.
    assert hits_per_request(THREE_USERS, make_config("every-page/lru", device_pages=BIG)) == [0, 3 * BLOCK, 3 * BLOCK]
    # A grid of 2 pages: the shared prefix is usable up to page 2.
    assert hits_per_request(THREE_USERS, make_config("block-grid:2/lru", device_pages=BIG)) == [0, 2 * BLOCK, 2 * BLOCK]


def test_infinite_cache_with_every_page_admission_reaches_the_bound() -> None:
    rng = np.random.default_rng(7)
    reqs, next_id, convs = [], 100, []
    for t in range(40):
        if convs and rng.random() < 0.6:
            c = int(rng.integers(len(convs)))
            ids = convs[c][:-1] + [next_id, next_id + 1]  # the next turn extends the previous one
            convs[c] = ids
        else:
            ids = [0, 1] + [next_id, next_id + 1] if rng.random() < 0.5 else [next_id, next_id + 1]
            convs.append(ids)
        next_id += 2
        reqs.append((float(t), ids))
    trace = make_trace(reqs)
    bound = infinite_cache_bound(trace, page_size=BLOCK)
    r = replay_trace(trace, make_config("every-page/lru", device_pages=BIG))
    assert r.hit_tokens == bound.hit_tokens and r.fraction_of_bound == pytest.approx(1.0)
    ends = replay_trace(trace, make_config("ends/lru", device_pages=BIG))
    assert 0 < ends.hit_tokens < bound.hit_tokens  # first-turn branch points at [0, 1] are missed


# ---- eviction order ----------------------------------------------------------------------------
# X: 8 full pages (+ 1 token), Y: 1 full page, Z: 2 full pages; then X continues.
X = list(range(9))
LONG_VS_SHORT = make_trace(
    [(0, X), (1, [20, 21]), (2, [30, 31, 32]), (3, X[:-1] + [40, 41])]
)


def test_lru_and_compute_aware_evict_different_victims() -> None:
    # Device budget 16 pages; X = 8 pages + a state (2.75 pages), Y = 3.75, Z = 4.75 pages:
    # after Z something must go. LRU drops the oldest (X); compute-aware drops the sequence
    # that saves the fewest FLOPs per byte (Y), so X's next turn still hits.
    lru = hits_per_request(LONG_VS_SHORT, make_config("ends/lru", device_pages=16))
    cost = hits_per_request(LONG_VS_SHORT, make_config("ends/cost-aware", device_pages=16))
    assert lru == [0, 0, 0, 0]
    assert cost == [0, 0, 0, 8 * BLOCK]
    utility = hits_per_request(LONG_VS_SHORT, make_config("ends/utility", device_pages=16))
    assert utility[-1] == 0  # utility is recency-led: like LRU here


# ---- tiers -------------------------------------------------------------------------------------
A, B = [0, 1, 2, 3], [10, 11, 12, 13]  # 3 full pages each (+ 1 token)
A_NEXT = A[:-1] + [4, 5]


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_device_eviction_demotes_to_host_and_keeps_the_hit(write: str) -> None:
    # The device holds one sequence (3 pages + a state = 5.75 pages); B pushes A to the host.
    trace = make_trace([(0, A), (1, B), (2, A_NEXT)])
    config = make_config(f"ends/lru/{write}", device_pages=7, host_pages=BIG)
    r = replay_trace(trace, config)
    assert r.hit_tokens == 3 * BLOCK
    assert r.hit_tokens_by_tier == {"device": 0, "host": 3 * BLOCK, "storage": 0}
    assert r.bytes_moved["h2d"] > 0
    # Without a host tier the same trace misses.
    assert replay_trace(trace, make_config(f"ends/lru/{write}", device_pages=7)).hit_tokens == 0


@pytest.mark.parametrize("storage_write", ["through", "demote"])
def test_host_eviction_demotes_to_storage_and_keeps_the_hit(storage_write: str) -> None:
    C = [20, 21, 22, 23]
    trace = make_trace([(0, A), (1, B), (2, C), (3, A_NEXT)])
    config = make_config(f"ends/lru/write_back/{storage_write}", device_pages=7, host_pages=7, storage_pages=BIG)
    r = replay_trace(trace, config)
    assert r.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 3 * BLOCK}
    assert r.bytes_moved["storage_read"] > 0 and r.extra["prefetches"] == 1
    no_storage = make_config(f"ends/lru/write_back/{storage_write}", device_pages=7, host_pages=7)
    assert replay_trace(trace, no_storage).hit_tokens == 0


def test_dense_storage_states_serve_a_second_occurrence() -> None:
    # Adaptive admission writes a state at every page to a roomy storage tier: the second user
    # of the shared prefix resumes from storage, which branch admission alone cannot do.
    config = make_config("adaptive/lru/write_back", device_pages=BIG, host_pages=BIG, storage_pages=100 * BIG)
    r = TraceReplay(THREE_USERS, config)
    hits = [sum(r._request(i)) for i in range(3)]
    assert hits == [0, 3 * BLOCK, 3 * BLOCK]
    assert r.admission.describe()["storage_grid"] == 1  # type: ignore[attr-defined]
    tight = make_config("adaptive/lru/write_back", device_pages=BIG, host_pages=BIG, storage_pages=4)
    assert hits_per_request(THREE_USERS, tight) == [0, 0, 3 * BLOCK]  # no room: branch only


# ---- determinism and budgets ---------------------------------------------------------------------
def _mixed_trace(seed: int) -> Trace:
    return mixed_trace(seed, 120, shared=3)


@pytest.mark.parametrize(
    "combo", ["ends/lru", "branch/cost-aware", "adaptive/utility/write_back", "adaptive/utility/write_back/demote"]
)
def test_same_trace_and_budget_give_identical_figures(combo: str) -> None:
    trace = _mixed_trace(3)
    config = make_config(combo, device_pages=24, host_pages=60, storage_pages=120)
    a = replay_trace(trace, config).to_json()
    b = replay_trace(trace, config).to_json()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    assert 0 < a["hit_rate"] <= a["extra"]["bound_hit_tokens"] / a["prompt_tokens"]


def test_budgets_are_kept_in_bytes() -> None:
    trace = _mixed_trace(5)
    spec = make_spec()
    config = make_config("branch/utility/write_back", device_pages=20, host_pages=50, spec=spec)
    replay = TraceReplay(trace, config)
    for i in range(len(trace)):
        replay._request(i)
        assert replay.device_budget.used_bytes() <= config.budget.device
        assert replay.host_budget is not None and replay.host_budget.used_bytes() <= config.budget.host


@pytest.mark.parametrize("drop", ["mamba_layer_ids", "attention_layer_ids"])
def test_a_spec_without_kv_or_without_states_is_refused(drop: str) -> None:
    """A spec of attention layers alone (no state bytes) or of recurrent layers alone (no KV
    bytes) is a valid spec, but no replay of it can budget both: refused by name."""
    spec = dataclasses.replace(make_spec(), **{drop: ()})
    with pytest.raises(ConfigError, match="needs both attention KV and recurrent state"):
        ReplayConfig(spec=spec, budget=TierBudget(device=1 << 30), combo=parse_combo("ends/lru"))


def test_a_page_shorter_than_a_block_id_is_refused() -> None:
    """Ids up to 300 take two tokens in the tiny spec's vocabulary of 256 (blocks 1 and 2 start
    [0, 1] and [0, 2]): with one-token pages the second request matched a page of block 1 in
    block 2, one token above the infinite-cache bound. Two-token pages tell them apart."""
    trace = make_trace([(0, [0, 1]), (1, [0, 2]), (2, [300])], partial=3)
    with pytest.raises(ConfigError, match="shorter than the 2 tokens that spell a block id"):
        TraceReplay(trace, make_config("attention-only/lru", device_pages=BIG, spec=make_spec(page_size=1)))
    config = make_config("attention-only/lru", device_pages=BIG, spec=make_spec(page_size=2))
    bound = infinite_cache_bound(trace, page_size=2)
    assert hits_per_request(trace, config) == bound.per_request.tolist() == [0, BLOCK, 0]


def test_storage_needs_a_host_tier() -> None:
    with pytest.raises(ConfigError, match="host tier"):
        ReplayConfig(
            spec=make_spec(),
            budget=TierBudget(device=1 << 20, storage=1 << 30),
            combo=make_config("ends/lru", device_pages=1).combo,
        )


# ---- the controller engine -----------------------------------------------------------------------
@pytest.mark.parametrize("combo", ["ends/lru", "branch/cost-aware/write_back", "adaptive/utility/write_back"])
async def test_controller_engine_gives_the_same_figures_as_the_synchronous_one(combo: str) -> None:
    from asynccache.trace.controller_replay import ControllerReplay

    trace = _mixed_trace(11)
    config = make_config(combo, device_pages=24, host_pages=60)
    sync = replay_trace(trace, config)
    ctrl = await ControllerReplay(trace, config).arun()
    assert ctrl.extra["engine"] == "controller"
    assert ctrl.hit_tokens == sync.hit_tokens and ctrl.hit_tokens_by_tier == sync.hit_tokens_by_tier
    assert ctrl.evictions == sync.evictions
    assert ctrl.bytes_moved["h2d"] == sync.bytes_moved["h2d"] > 0
    assert ctrl.extra["controller_counts"]["load_ops"] > 0


async def test_controller_engine_with_storage_serves_from_storage() -> None:
    from asynccache.trace.controller_replay import ControllerReplay

    C = [20, 21, 22, 23]
    trace = make_trace([(0, A), (1, B), (2, C), (3, A_NEXT)])
    config = make_config("ends/lru/write_back", device_pages=7, host_pages=7, storage_pages=BIG)
    r = await ControllerReplay(trace, config).arun()
    assert r.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 3 * BLOCK}


async def test_dense_storage_states_reach_storage_through_the_controller() -> None:
    """The controller engine archives the admission policy's storage-only snapshots through
    ``controller.archive_snapshots`` (the replay's own tier writes none), and the second user
    of the shared prefix resumes from them, as in the synchronous engine."""
    from asynccache.trace.controller_replay import ControllerReplay

    config = make_config("adaptive/lru/write_back", device_pages=BIG, host_pages=BIG, storage_pages=100 * BIG)
    replay = ControllerReplay(THREE_USERS, config)
    r = await replay.arun()
    assert r.hit_tokens_by_tier == {"device": 3 * BLOCK, "host": 0, "storage": 3 * BLOCK}
    assert replay.storage_tier is not None and replay.storage_tier.staged_state_bytes == 0
    counts = r.extra["snapshot_counts"]
    assert counts["snapshot_states_stored"] == counts["snapshot_staged_states"] > 0
    assert counts["snapshot_staged_kv_pages"] > 0  # write_back: the path's KV is on the device only
    assert r.bytes_moved["d2h_state"] == 0 < r.bytes_moved["d2h"]  # no backup: only the staging
    assert replay.device_mamba.num_free == replay.device_mamba.num_items - r.extra["final_tree"]["device_states"]


@pytest.mark.parametrize(
    "combo,storage_pages",
    [("adaptive/lru/write_back", 400), ("adaptive/utility/write_back/demote", 90), ("adaptive/utility/write_back/demote", 400)],
)
async def test_storage_only_snapshots_give_the_same_figures_in_both_engines(combo: str, storage_pages: int) -> None:
    """Tight and roomy storage, written through or demoted to (the engines are compared request
    by request on more cells in ``test_trace_engines.py``)."""
    from asynccache.trace.controller_replay import ControllerReplay

    trace = _mixed_trace(5)
    config = make_config(combo, device_pages=24, host_pages=60, storage_pages=storage_pages)
    sync = replay_trace(trace, config)
    ctrl = await ControllerReplay(trace, config).arun()
    assert ctrl.extra["snapshot_counts"]["snapshot_states_stored"] > 0
    assert ctrl.hit_tokens == sync.hit_tokens and ctrl.hit_tokens_by_tier == sync.hit_tokens_by_tier
    assert ctrl.hit_tokens_by_tier["storage"] > 0
    assert ctrl.evictions == sync.evictions
    assert ctrl.bytes_moved == sync.bytes_moved  # the snapshots' staging in d2h too
    assert ctrl.extra["storage_objects"] == sync.extra["storage_objects"]


async def test_demote_writes_to_storage_only_what_the_host_evicts_in_both_engines() -> None:
    """``storage_write=demote``: a host that evicts nothing sends nothing to storage (the
    controller's tier archived every host write, so demote behaved as write-through there); a
    host that evicts sends its victims, alike in both engines."""
    from asynccache.trace.controller_replay import ControllerReplay

    roomy = make_config("ends/lru/write_through/demote", device_pages=7, host_pages=BIG, storage_pages=BIG)
    trace = make_trace([(0, A), (1, B), (2, A_NEXT)])
    for r in (replay_trace(trace, roomy), await ControllerReplay(trace, roomy).arun()):
        assert r.hit_tokens_by_tier["host"] == 3 * BLOCK
        assert r.bytes_moved["storage_write"] == 0, r.extra["engine"]
    tight = make_config("ends/lru/write_back/demote", device_pages=7, host_pages=7, storage_pages=BIG)
    trace = make_trace([(0, A), (1, B), (2, [20, 21, 22, 23]), (3, A_NEXT)])
    sync, ctrl = replay_trace(trace, tight), await ControllerReplay(trace, tight).arun()
    assert ctrl.bytes_moved["storage_write"] == sync.bytes_moved["storage_write"] > 0
    assert ctrl.hit_tokens_by_tier == sync.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 3 * BLOCK}


@pytest.mark.parametrize("combo", ["branch/cost-aware/write_back", "adaptive/reuse/write_back/demote", "every-page/lru"])
def test_the_tree_reports_every_state_its_evictions_free_in_a_replay(combo: str) -> None:
    """Eviction notifications under a replay's load: each state an eviction frees is reported
    once on its tier's state list (how it left: demoted, written back or dropped), each state
    ``release_states`` frees as released; a cascade never takes a state."""
    replay = TraceReplay(_mixed_trace(11), make_config(combo, device_pages=20, host_pages=40, storage_pages=80))
    tree = replay.tree
    freed = {"device": 0, "host": 0}
    heard: dict[tuple[str, EvictHow], int] = {}

    def listener(node: TreeNode, list_key: str, how: EvictHow) -> None:
        heard[(list_key, how)] = heard.get((list_key, how), 0) + 1
        if how is EvictHow.CASCADE:
            assert not node.alive and not node.has_state

    def counting(evict: Callable[..., EvictResult]) -> Callable[..., EvictResult]:
        def wrapped(*args: Any, **kwargs: Any) -> EvictResult:
            result = evict(*args, **kwargs)
            freed[result.tier.value] += result.num_states
            return result

        return wrapped

    tree.add_evict_listener(listener)
    tree.evict_device = counting(tree.evict_device)  # type: ignore[method-assign]
    tree.evict_host = counting(tree.evict_host)  # type: ignore[method-assign]
    r = replay.run()
    for tier in ("device", "host"):
        reported = sum(
            n
            for (key, how), n in heard.items()
            if key == f"{tier}_state" and how not in (EvictHow.RELEASE, EvictHow.CASCADE)
        )
        assert reported == freed[tier] > 0, (tier, heard)
    device_hows = {how for key, how in heard if key.startswith("device")}
    assert (EvictHow.WRITE_BACK in device_hows) == ("write_back" in combo)  # else backed up at insert
    assert EvictHow.DEMOTE in device_hows
    released = sum(n for (key, how), n in heard.items() if how is EvictHow.RELEASE)
    assert released >= r.evictions["released_states"]  # per tier, so a state on both counts twice
    assert (released > 0) == combo.startswith("adaptive/reuse")


def test_demote_writes_the_host_victims_the_tree_drops_in_its_order() -> None:
    """``storage_write=demote`` goes through the tree's ``evict_host(demote=…)``: storage gets
    each host victim (with a state) just before the tree drops its copy, in the tree's victim
    order, and nothing the tree keeps."""
    trace = mixed_trace(7, 80, shared=3)
    replay = TraceReplay(trace, make_config("branch/lru/write_back/demote", device_pages=24, host_pages=30, storage_pages=BIG))
    tier, budget = replay.storage_tier, replay.host_budget
    assert tier is not None and budget is not None and budget.demote == tier.demote
    handed: list[tuple[int, str]] = []
    victims: list[tuple[int, str]] = []

    def demote(nodes: Sequence[TreeNode], list_key: str) -> None:
        victim = nodes[-1]
        assert all(n.alive and n.host_kv is not None for n in nodes)  # before any copy goes
        assert all(not n.archived for n in nodes[:-1])
        handed.append((victim.node_id, list_key))
        tier.demote(nodes, list_key)
        if victim.has_state:  # written with its path, state included, before the tree drops it
            assert tier.storage.contains(PoolName.MAMBA, victim.page_hashes[-1])
            path = replay.tree.path_to(victim)
            assert all(tier.storage.contains(PoolName.KV, h) for n in path for h in n.page_hashes)
            assert not any(n.archived for n in path)  # the storage may drop it: no flag claims it

    def heard(node: TreeNode, list_key: str, how: EvictHow) -> None:
        if list_key.startswith("host") and how is not EvictHow.CASCADE:
            assert how is EvictHow.DEMOTE
            if victims and victims[-1] == (node.node_id, "host_kv") and list_key == "host_state":
                return  # the state that left with its KV
            victims.append((node.node_id, list_key))

    budget.demote = demote
    replay.tree.add_evict_listener(heard)
    replay.run()
    assert victims and handed == victims
    assert any(key == "host_state" for _, key in victims) and any(key == "host_kv" for _, key in victims)


async def test_a_branch_state_split_off_an_archived_node_reaches_storage_in_both_engines() -> None:
    """B branches off A, whose node is already in storage: the branch point's state is new and
    must be archived (it was not: the split node inherited 'archived'), so that C, after
    fillers pushed A and B off the device and host, resumes from it in storage."""
    from asynccache.trace.controller_replay import ControllerReplay

    requests = [(0.0, [0, 1, 2, 3, 4, 5]), (1000.0, [0, 1, 2, 10, 11, 12])]
    requests += [(2000.0 + 1000 * k, list(range(100 + 12 * k, 112 + 12 * k))) for k in range(6)]
    requests.append((9000.0, [0, 1, 2, 20, 21, 22]))
    trace = make_trace(requests)
    config = make_config("branch/lru", device_pages=16, host_pages=16, storage_pages=100 * BIG)
    want = {"device": 0, "host": 0, "storage": 3 * BLOCK}
    assert replay_trace(trace, config).hit_tokens_by_tier == want
    assert (await ControllerReplay(trace, config).arun()).hit_tokens_by_tier == want


async def test_the_attention_only_reference_moves_no_state_bytes() -> None:
    """Its states cost nothing (budgets leave them out): their copies are not reported either."""
    from asynccache.trace.controller_replay import ControllerReplay

    trace = _mixed_trace(5)
    config = make_config("attention-only/lru/write_back", device_pages=24, host_pages=60)
    for result in (replay_trace(trace, config), await ControllerReplay(trace, config).arun()):
        moved = result.bytes_moved
        assert moved["d2h_state"] == 0 and moved["d2h"] == moved["d2h_kv"] > 0
        assert moved["h2d"] % make_spec().kv_page_bytes == 0 and moved["h2d"] > 0


async def test_a_storage_restore_reads_only_the_pages_past_the_tree_s_in_both_engines() -> None:
    """The tree holds the first 3 pages of a stored prefix on the device only (``write_back``
    never backed them up): both engines restore the prefix from those and the stored pages past
    them, reading only those from storage (the tree's pages are backed up to the host instead:
    host copies stay contiguous), and agree on every figure."""
    from asynccache.storage import PoolName
    from asynccache.trace.controller_replay import ControllerReplay

    reqs = [(0, [0, 1, 2, 3, 4, 5, 6])]
    reqs += [(1 + k, [1000 + 10 * k + j for j in range(7)]) for k in range(6)]  # push the first out
    reqs += [(20, [0, 1, 2, 100, 101]), (21, [0, 1, 2, 3, 4, 5, 6, 7])]
    trace = make_trace(reqs)
    config = make_config("ends/lru/write_back/through", device_pages=14, host_pages=14, storage_pages=1000)
    replay = TraceReplay(trace, config)
    for i in range(len(trace) - 1):
        replay._request(i)
    match = replay._begin(len(trace) - 1)[2]
    assert match.num_tokens == 0 and match.num_matched_tokens == 3 * BLOCK
    before = replay.storage.counters().bytes_read.get(PoolName.KV, 0)
    _, _, from_storage = replay._request(len(trace) - 1)
    read_pages = (replay.storage.counters().bytes_read.get(PoolName.KV, 0) - before) // replay.spec.kv_page_bytes
    assert from_storage == 6 * BLOCK
    assert read_pages == 3  # the pages past the tree's
    replay.tree.check_integrity()
    sync, ctrl = replay_trace(trace, config), await ControllerReplay(trace, config).arun()
    assert sync.hit_tokens_by_tier == ctrl.hit_tokens_by_tier and sync.hit_tokens_by_tier["storage"] == 6 * BLOCK
    assert sync.bytes_moved["storage_read"] == ctrl.bytes_moved["storage_read"]
    assert sync.bytes_moved["d2h"] == ctrl.bytes_moved["d2h"]


def test_the_replay_clock_strictly_increases_at_any_time() -> None:
    """Past ~2³⁰ s a fixed epsilon is below a float's resolution: the clock still moves."""
    import itertools

    from asynccache.trace.replay import TraceReplay

    replay = TraceReplay.__new__(TraceReplay)
    for now in (0.0, 3600.0, 1.74e9, -1.0e3):
        replay._now, replay._tick = now, float("-inf")
        ticks = [replay._clock() for _ in range(4)]
        assert ticks[0] == now and all(b > a for a, b in itertools.pairwise(ticks))
