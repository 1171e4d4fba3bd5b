"""ByteBudget: one byte budget per tier over KV pages and states, enforced through
``tree.evict_bytes``."""

from __future__ import annotations

import numpy as np
import pytest
from trace_builders import BLOCK, make_spec

from asynccache.errors import ConfigError
from asynccache.pools import DeviceKVPool, DeviceMambaPool, HostKVPool, MambaPoolHost
from asynccache.trace.budget import ByteBudget
from asynccache.tree import HybridRadixTree, SyncTransfer, Tier, TreeNode


def make_tree(*, host: bool = False) -> HybridRadixTree:
    spec = make_spec()
    clock = iter(range(1, 1_000_000))
    return HybridRadixTree(
        spec,
        device_kv=DeviceKVPool(spec, 64, materialize=False),
        device_mamba=DeviceMambaPool(spec, 16, materialize=False),
        host_kv=HostKVPool(spec, num_pages=64, materialize=False) if host else None,
        host_mamba=MambaPoolHost(spec, num_slots=16, materialize=False) if host else None,
        clock=lambda: float(next(clock)),
    )


def insert(tree: HybridRadixTree, seed: int, num_pages: int) -> TreeNode:
    """``num_pages`` pages of tokens unique to ``seed`` with a state at the end."""
    alloc = tree.alloc_device(num_pages, 1)
    assert alloc is not None
    tokens = [seed * 100_000 + i for i in range(num_pages * BLOCK)]
    return tree.insert(tokens, alloc.kv_indices, states={num_pages * BLOCK: int(alloc.state_slots[0])}).last_node


def sizes(tree: HybridRadixTree) -> tuple[int, int]:
    return tree.device_kv.bytes_per_index, tree.device_mamba.bytes_per_index


def test_within_budget_nothing_is_evicted_and_the_peak_is_kept() -> None:
    tree = make_tree()
    insert(tree, 1, 2)
    kv, state = sizes(tree)
    budget = ByteBudget(tree=tree, tier=Tier.DEVICE, budget_bytes=2 * kv + state)
    budget.enforce()
    assert budget.used_bytes() == budget.peak_bytes == 2 * kv + state
    assert budget.counts.calls == 0 and tree.stats().num_nodes == 1


def test_over_budget_evicts_the_excess_in_one_tree_call() -> None:
    tree = make_tree()
    nodes = [insert(tree, seed, 2) for seed in range(1, 5)]
    kv, state = sizes(tree)
    budget = ByteBudget(tree=tree, tier=Tier.DEVICE, budget_bytes=5 * kv + 2 * state)
    budget.enforce()
    assert budget.used_bytes() <= budget.budget_bytes
    assert budget.peak_bytes == 8 * kv + 4 * state
    # The two least recently used requests went, pages and states counted once each.
    assert [n.alive for n in nodes] == [False, False, True, True]
    c = budget.counts
    assert (c.kv_pages, c.states, c.lost_states, c.deleted_nodes, c.calls, c.stuck) == (4, 2, 2, 2, 1, 0)


def test_count_states_false_budgets_pages_only() -> None:
    tree = make_tree()
    nodes = [insert(tree, seed, 2) for seed in range(1, 4)]
    kv, _ = sizes(tree)
    budget = ByteBudget(tree=tree, tier=Tier.DEVICE, budget_bytes=4 * kv, count_states=False)
    assert budget.used_bytes() == 6 * kv
    budget.enforce()
    assert [n.alive for n in nodes] == [False, True, True]
    assert budget.used_bytes() == 4 * kv


def test_stuck_when_only_locked_data_is_left() -> None:
    tree = make_tree()
    node = insert(tree, 1, 2)
    token = tree.lock(node)
    budget = ByteBudget(tree=tree, tier=Tier.DEVICE, budget_bytes=1)
    budget.enforce()
    assert node.alive and (budget.counts.calls, budget.counts.stuck, budget.counts.kv_pages) == (1, 1, 0)
    tree.unlock(node, token)
    budget.enforce()
    assert not node.alive and (budget.counts.calls, budget.counts.stuck, budget.counts.kv_pages) == (2, 1, 2)


def test_host_budget_demotes_through_the_tree() -> None:
    tree = make_tree(host=True)
    node = insert(tree, 1, 2)
    assert SyncTransfer(tree).backup(tree.path_to(node)) is not None
    handed: list[tuple[int, str]] = []
    budget = ByteBudget(
        tree=tree, tier=Tier.HOST, budget_bytes=0, demote=lambda nodes, key: handed.append((nodes[-1].node_id, key))
    )
    budget.enforce()
    assert handed == [(node.node_id, "host_kv")]
    assert node.host_kv is None and node.device_kv is not None
    assert budget.used_bytes() == 0 and budget.counts.kv_pages == 2 and budget.counts.states == 1


def test_misconfigured_budgets_are_refused() -> None:
    with pytest.raises(ConfigError):
        ByteBudget(tree=make_tree(host=True), tier=Tier.STORAGE, budget_bytes=1)
    with pytest.raises(ConfigError):
        ByteBudget(tree=make_tree(), tier=Tier.HOST, budget_bytes=1)
    with pytest.raises(ConfigError):
        ByteBudget(tree=make_tree(host=True), tier=Tier.DEVICE, budget_bytes=1, demote=lambda nodes, key: None)


def test_enforcements_left_over_budget_reach_the_result_and_its_json() -> None:
    """``stuck`` is reported with the other eviction counts, per tier, in the result, its JSON
    and the table (it was counted and never shown)."""
    from trace_builders import make_config, make_trace

    from asynccache.trace.replay import TraceReplay
    from asynccache.trace.report import format_table
    from asynccache.trace.results import results_to_json

    trace = make_trace([(0, [0, 1, 2, 3]), (1, [10, 11, 12, 13])])
    replay = TraceReplay(trace, make_config("ends/lru", device_pages=100, host_pages=100))
    hits = np.zeros((len(trace), 3), dtype=np.int64)
    hits[0] = replay._request(0)
    held = replay.tree.match_prefix(replay._begin(0)[0]).last_node
    replay.tree.lock(held)  # a request still running on the first prompt
    replay.device_budget.budget_bytes = replay.host_budget.budget_bytes = 1  # type: ignore[union-attr]
    hits[1] = replay._request(1)
    result = replay._result(hits, 0.0)
    assert (result.evictions["device_stuck"], result.evictions["host_stuck"]) == (1, 0)  # the host's went
    assert held.alive and result.evictions["device_kv"] > 0  # the second prompt's were evicted
    (record,) = results_to_json(0.5, [result])["results"]
    assert record["evictions"]["device_stuck"] == 1 and record["evictions"]["host_stuck"] == 0
    header, _, row = format_table([result], bound=0.5).splitlines()[1:4]
    assert "evicted kv/state/stuck" in header and row.split()[-2].endswith("/1")
