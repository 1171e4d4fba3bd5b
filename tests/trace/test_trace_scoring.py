"""Ranked eviction's batch scoring against a straightforward recomputation.

``node_extent`` (the walk behind ``node_value``), ``ReuseEviction.score_many`` (return
probabilities as arrays) and ``RankedEviction``'s ranking must give, bit for bit, what the
per-node formulas give: every list of a replay's tree is checked after every request, and a
ranking is compared with a plain sort by the reference scores. A merge that computes victim keys
on first use picks what one with every key picks, and cost-aware's rankings, which reuse the
efficiencies they normalise by, replay as when every score computes its own."""

from __future__ import annotations

import bisect

import numpy as np
import pytest
from trace_builders import make_config, mixed_trace

import asynccache.policy.reuse as reuse_module
from asynccache.policy.cost_aware import CostAwareEviction, NodeValue, node_value
from asynccache.policy.ranked import (
    RankedEviction,
    evictable,
    evictable_members,
    list_key,
)
from asynccache.policy.reuse import ReuseEviction
from asynccache.trace.flops import FlopModel
from asynccache.trace.replay import TraceReplay
from asynccache.tree import TreeNode


def reference_value(node: TreeNode, key: str, replay: TraceReplay) -> NodeValue:
    """``node_value`` as first written: properties, one walk up, the FLOP model."""
    spec, flops = replay.spec, replay.flops
    tier, resource = key.split("_", 1)
    if resource == "state":
        up = node.parent
        while up is not None and up.parent is not None and not up.has_state:
            up = up.parent
        m = up.end_tokens if up is not None and up.parent is not None else 0
        return NodeValue(flops.saved_flops(m, node.end_tokens), node.end_tokens - m, spec.state_bytes, True)
    pages, nbytes = node.num_pages, 0
    if (node.device_state if tier == "device" else node.host_state) is not None:
        nbytes += spec.state_bytes
    up = node.parent
    while up is not None and up.parent is not None and not up.has_state and len(up.children) == 1:
        pages += up.num_pages
        up = up.parent
    nbytes += pages * spec.kv_page_bytes
    if not node.has_state:
        return NodeValue(0.0, 0, nbytes, False)
    m = up.end_tokens if up is not None and up.parent is not None else 0
    return NodeValue(flops.saved_flops(m, node.end_tokens), node.end_tokens - m, nbytes, True)


def reference_score(policy: ReuseEviction, node: TreeNode, key: str, now: float, replay: TraceReplay) -> float:
    """``ReuseEviction.score`` as first written, one node at a time."""
    value = reference_value(node, key, replay)
    if not value.has_state or value.bytes == 0:
        return 0.0
    turn = policy._turn.get(node.node_id, 0)
    age = max(now - node.last_access, 0.0)
    gaps = policy._gap_list
    g0 = bisect.bisect_right(gaps, age) / len(gaps)
    g1 = bisect.bisect_right(gaps, age + policy.horizon_s) / len(gaps)
    pi = float(policy.pi[turn])
    p = float(pi * (g1 - g0) / max(1.0 - pi * g0, 1e-9))
    weight = 1.0
    if turn and node.children:
        weight *= policy.interior_weight
    if key.startswith("host") and node.device_kv is not None:
        weight *= policy.redundant_weight
    return weight * p * value.saved_tokens / value.bytes


def _lists(replay: TraceReplay) -> list:
    tree = replay.tree
    return [tree.device_kv_lru, tree.device_state_lru, tree.host_kv_lru, tree.host_state_lru]


@pytest.mark.parametrize("batch_min", [1, 16])
def test_reuse_batch_scores_and_node_values_match_the_per_node_formulas(
    monkeypatch: pytest.MonkeyPatch, batch_min: int
) -> None:
    monkeypatch.setattr(reuse_module, "_BATCH_MIN", batch_min)
    trace = mixed_trace(3, 220, shared=3)
    replay = TraceReplay(trace, make_config("adaptive/reuse/write_back", device_pages=30, host_pages=80))
    policy = replay.eviction
    assert isinstance(policy, ReuseEviction)
    checked = 0
    for i in range(len(trace)):
        replay._request(i)
        now = replay._now + 7.5  # ages past the last touches, across gap boundaries
        for lru in _lists(replay):
            key = list_key(lru)
            members = list(lru.iter_oldest())
            want = [reference_score(policy, n, key, now, replay) for n in members]
            assert policy.score_many(members, key=key, now=now) == want
            assert [policy.score(n, key=key, now=now) for n in members] == want
            assert policy.victim_keys(members, key=key, now=now) == want
            assert evictable_members(lru, key) == [n for n in lru.iter_oldest() if evictable(n, key)]
            for n in members:
                assert node_value(n, key, spec=replay.spec, flops=replay.flops) == reference_value(n, key, replay)
            checked += len(members)
    assert checked > 5000
    assert policy.num_rankings > 20 and replay.device_budget.counts.calls > 20  # eviction was busy
    assert any(s > 0 for s in policy.score_many(members, key=key, now=now))


def test_a_ranking_is_the_stable_sort_of_the_evictable_members_by_score() -> None:
    trace = mixed_trace(5, 160, shared=3)
    replay = TraceReplay(trace, make_config("branch/reuse/write_back", device_pages=30, host_pages=80))
    for i in range(len(trace)):
        replay._request(i)
    policy = replay.eviction
    assert isinstance(policy, ReuseEviction)
    now = replay._now + 3.0
    ties = 0
    for lru in _lists(replay):
        key = list_key(lru)
        policy.begin_ranking(key, now)  # the refresh a ranking may start, before the reference
        members = [n for n in lru.iter_oldest() if evictable(n, key)]
        scores = [reference_score(policy, n, key, now, replay) for n in members]
        want = [n for _, n in sorted(zip(scores, members, strict=True), key=lambda sn: sn[0])]
        assert policy._rank(lru, key, now).nodes == want
        assert len(want) >= 3
        ties += len(scores) - len(set(scores))
    assert ties  # equal scores keep their LRU order


def test_node_value_keeps_its_flops() -> None:
    trace = mixed_trace(1, 60, shared=2)
    replay = TraceReplay(trace, make_config("branch/cost-aware", device_pages=30, host_pages=80))
    for i in range(len(trace)):
        replay._request(i)
    flops = FlopModel.from_spec(replay.spec)
    seen = 0
    for lru in _lists(replay):
        key = list_key(lru)
        for n in lru.iter_oldest():
            got = node_value(n, key, spec=replay.spec, flops=flops)
            assert got == reference_value(n, key, replay)
            seen += got.saved_flops > 0
    assert seen > 10


def test_a_merge_with_keys_on_first_use_picks_what_a_merge_with_all_keys_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = mixed_trace(8, 200, shared=3)
    replay = TraceReplay(trace, make_config("adaptive/reuse/write_back", device_pages=30, host_pages=80))
    policy, tree = replay.eviction, replay.tree
    assert isinstance(policy, ReuseEviction) and policy.pure_victim_key
    scored: list[int] = []
    real = policy.victim_key
    monkeypatch.setattr(policy, "victim_key", lambda n, *, key, now: (scored.append(1), real(n, key=key, now=now))[1])
    kv_bytes, st_bytes = replay.spec.kv_page_bytes, replay.spec.state_bytes
    merges = lazy_keys = all_keys = 0
    for i in range(len(trace)):
        replay._request(i)
        now = replay._now + 1.0
        for kv_lru, st_lru in ((tree.device_kv_lru, tree.device_state_lru), (tree.host_kv_lru, tree.host_state_lru)):
            kv_nodes = evictable_members(kv_lru, list_key(kv_lru))[:12]
            st_nodes = evictable_members(st_lru, list_key(st_lru))[:12]
            tier = kv_lru.tier
            for deficit in (1, kv_bytes, 3 * st_bytes, 10**15):
                args = {"tier": tier, "deficit": deficit, "kv_bytes": kv_bytes, "state_bytes": st_bytes, "now": now}
                scored.clear()
                lazy = tree._merge_victims(kv_nodes, st_nodes, **args)
                lazy_keys += len(scored)
                monkeypatch.setattr(ReuseEviction, "pure_victim_key", False)
                eager = tree._merge_victims(kv_nodes, st_nodes, **args)
                monkeypatch.setattr(ReuseEviction, "pure_victim_key", True)
                assert lazy == eager
                merges += 1
                all_keys += len(kv_nodes) + len(st_nodes)
    assert merges > 500 and lazy_keys < all_keys / 2


def test_cost_aware_rankings_reuse_the_efficiencies_they_normalise_by(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = mixed_trace(6, 240, shared=3)
    config = make_config("branch/cost-aware", device_pages=24, host_pages=60)

    def run() -> tuple[dict, dict, int]:
        replay = TraceReplay(trace, config)
        policy = replay.eviction
        assert isinstance(policy, CostAwareEviction)
        hits = np.zeros((len(trace), 3), dtype=np.int64)
        for i in range(len(trace)):
            hits[i] = replay._request(i)
            if i % 40 == 0:
                for lru in _lists(replay):
                    key = list_key(lru)
                    for n in lru.iter_oldest():
                        value = reference_value(n, key, replay)
                        want = value.saved_flops / value.bytes if value.bytes else 0.0
                        assert policy._efficiency(n, key) == want
        return replay._result(hits, 0.0).to_json(), dict(policy._ranked_terms), policy.num_rankings

    fast = run()
    monkeypatch.setattr(CostAwareEviction, "score_many", RankedEviction.score_many)
    slow = run()
    fast[0].pop("wall_s"), slow[0].pop("wall_s")
    assert fast == slow
    assert fast[2] > 20 and len(fast[1]) > 20
