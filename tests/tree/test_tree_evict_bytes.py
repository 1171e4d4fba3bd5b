"""Eviction by bytes (``tree.evict_bytes``): at least the bytes asked are freed when they can be,
KV and state victims are compared by the eviction policy's ``victim_key``, a state that leaves
with its KV counts once, pinned nodes stay, bad arguments are refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from tree_builders import PAGE, make_tree, put, seq

from asynccache.errors import ConfigError
from asynccache.policy import EvictionPolicy, LRUEviction
from asynccache.policy.ranked import RankedEviction
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.tree import HybridRadixTree, SyncTransfer, Tier, TreeNode
from asynccache.tree.results import EvictResult


class Table(RankedEviction):
    """A ranked policy whose scores come from a table: ``(list key, node id) → score``, 1.0
    for anything not in it."""

    def __init__(self) -> None:
        super().__init__()
        self.table: dict[tuple[str, int], float] = {}

    def score(self, node: TreeNode, *, key: str, now: float) -> float:
        return self.table.get((key, node.node_id), 1.0)


def sizes(tree: HybridRadixTree, tier: Tier = Tier.DEVICE) -> tuple[int, int]:
    """Bytes of one page and of one state slot of ``tier``."""
    if tier is Tier.DEVICE:
        return tree.device_kv.bytes_per_index, tree.device_mamba.bytes_per_index
    assert tree.host_kv is not None and tree.host_mamba is not None
    return tree.host_kv.bytes_per_index, tree.host_mamba.bytes_per_index


def free_bytes(tree: HybridRadixTree, tier: Tier = Tier.DEVICE) -> int:
    kv, states = (tree.device_kv, tree.device_mamba) if tier is Tier.DEVICE else (tree.host_kv, tree.host_mamba)
    assert kv is not None and states is not None
    return kv.num_free * kv.bytes_per_index + states.num_free * states.bytes_per_index


def freed_by(result: EvictResult, tree: HybridRadixTree, tier: Tier = Tier.DEVICE) -> int:
    kv, state = sizes(tree, tier)
    return result.num_kv_pages * kv + result.num_states * state


def device_only() -> HybridRadixTree:
    tree, _ = make_tree(device_pages=64, device_states=16, host_pages=None, host_states=None)
    return tree


def record_device_calls(tree: HybridRadixTree, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The ``(num_kv_pages, num_states)`` of each ``evict_device`` call ``evict_bytes`` makes."""
    calls: list[tuple[int, int]] = []
    inner = tree.evict_device

    def spy(num_kv_pages: int = 0, num_states: int = 0, **kw: Any) -> EvictResult:
        calls.append((num_kv_pages, num_states))
        return inner(num_kv_pages=num_kv_pages, num_states=num_states, **kw)

    monkeypatch.setattr(tree, "evict_device", spy)
    return calls


# ---- how much ------------------------------------------------------------------------------
def test_one_byte_takes_one_victim_and_no_more() -> None:
    tree = device_only()
    a = put(tree, seq(1, 2 * PAGE)).last_node
    b = put(tree, seq(2, 2 * PAGE)).last_node
    free0 = free_bytes(tree)
    res = tree.evict_bytes(Tier.DEVICE, 1)
    kv, state = sizes(tree)
    assert (res.tier, res.num_kv_pages, res.num_states) == (Tier.DEVICE, 2, 1)
    assert free_bytes(tree) - free0 == freed_by(res, tree) == 2 * kv + state
    assert not a.alive and b.alive and b.device_state is not None  # the least recently used went
    tree.check_integrity()


def test_frees_at_least_the_bytes_asked_over_as_many_rounds_as_it_takes() -> None:
    """Chains with a state on both nodes: a parent becomes a KV victim only once its child has
    gone, so freeing most of the tier takes several rounds."""
    for ask_pages, ask_states in ((1, 0), (5, 3), (15, 8)):
        tree = device_only()
        for i in range(4):
            put(tree, seq(i + 1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
        kv, state = sizes(tree)
        ask = ask_pages * kv + ask_states * state
        free0 = free_bytes(tree)
        res = tree.evict_bytes(Tier.DEVICE, ask)
        freed = free_bytes(tree) - free0
        assert freed >= ask, (ask, freed)
        assert freed == freed_by(res, tree)
        tree.check_integrity()


def test_more_than_the_tier_holds_frees_everything_and_stops() -> None:
    tree = device_only()
    for i in range(3):
        put(tree, seq(i + 1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
    kv, state = sizes(tree)
    res = tree.evict_bytes(Tier.DEVICE, 10**15)
    assert (res.num_kv_pages, res.num_states) == (12, 6)
    assert freed_by(res, tree) == 12 * kv + 6 * state
    assert tree.stats().num_nodes == 0
    assert tree.evict_bytes(Tier.DEVICE, 10**15) == EvictResult(tier=Tier.DEVICE)  # nothing left
    assert tree.evict_bytes(Tier.DEVICE, 0) == EvictResult(tier=Tier.DEVICE)


def test_count_states_false_counts_pages_only() -> None:
    tree = device_only()
    put(tree, seq(1, 2 * PAGE))
    put(tree, seq(2, 2 * PAGE))
    kv, _ = sizes(tree)
    # Three pages' bytes: the first leaf (two pages) is not enough without its state's bytes.
    res = tree.evict_bytes(Tier.DEVICE, 3 * kv, count_states=False)
    assert res.num_kv_pages == 4 and res.num_states == 2
    tree2 = device_only()
    put(tree2, seq(1, 2 * PAGE))
    put(tree2, seq(2, 2 * PAGE))
    res2 = tree2.evict_bytes(Tier.DEVICE, 3 * kv)  # with the state's bytes, one leaf is enough
    assert res2.num_kv_pages == 2 and res2.num_states == 1


# ---- which: the policy's victim key --------------------------------------------------------
def kv_or_state_tree(eviction: EvictionPolicy) -> tuple[HybridRadixTree, TreeNode, TreeNode, TreeNode]:
    """``a``: the least recently used leaf (one page, a state); ``b1`` → ``b2``: a chain with a
    state on both nodes (``b1`` interior: its state can go alone, leaving a tombstone)."""
    tree, _ = make_tree(host_pages=None, host_states=None, eviction=eviction)
    a = put(tree, seq(1, PAGE)).last_node
    b2 = put(tree, seq(2, 2 * PAGE), states=[PAGE, 2 * PAGE]).last_node
    b1 = b2.parent
    assert b1 is not None and b1.device_state is not None
    return tree, a, b1, b2


def test_lru_compares_by_recency_and_takes_the_oldest_leaf_with_its_state() -> None:
    tree, a, b1, b2 = kv_or_state_tree(LRUEviction())
    res = tree.evict_bytes(Tier.DEVICE, 1)
    assert (res.num_kv_pages, res.num_states) == (1, 1)
    assert not a.alive
    assert b1.device_state is not None and b2.device_state is not None
    tree.check_integrity()


def test_a_ranked_policy_takes_the_state_it_values_least_instead() -> None:
    policy = Table()
    tree, a, b1, b2 = kv_or_state_tree(policy)
    policy.table[("device_state", b1.node_id)] = 0.0  # worth less than any KV victim (1.0)
    res = tree.evict_bytes(Tier.DEVICE, 1)
    assert (res.num_kv_pages, res.num_states) == (0, 1)
    assert b1.alive and b1.device_state is None and b1.device_kv is not None  # a tombstone
    assert a.alive and a.device_state is not None and b2.device_state is not None
    tree.check_integrity()
    # Priced the other way round, the same policy takes a KV victim with its state.
    policy2 = Table()
    tree2, a2, c1, _ = kv_or_state_tree(policy2)
    policy2.table[("device_state", c1.node_id)] = 2.0
    policy2.table[("device_kv", a2.node_id)] = 0.5
    res2 = tree2.evict_bytes(Tier.DEVICE, 1)
    assert (res2.num_kv_pages, res2.num_states) == (1, 1)
    assert not a2.alive and c1.device_state is not None


def test_victim_key_is_part_of_every_eviction_policy() -> None:
    a = kv_or_state_tree(LRUEviction())[1]
    assert LRUEviction().victim_key(a, key="device_kv", now=0.0) == a.last_access
    policy = Table()
    policy.table[("device_kv", a.node_id)] = 0.25
    assert policy.victim_key(a, key="device_kv", now=0.0) == 0.25


# ---- a state that leaves with its KV counts once -------------------------------------------
def two_leaves() -> tuple[HybridRadixTree, TreeNode, TreeNode]:
    tree = device_only()
    a = put(tree, seq(1, PAGE)).last_node
    b = put(tree, seq(2, PAGE)).last_node
    return tree, a, b


def test_a_kv_victim_frees_its_state_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page + state of the oldest leaf is exactly what is asked: its KV alone is not enough, but
    with its state it is, so nothing else goes."""
    tree, a, b = two_leaves()
    calls = record_device_calls(tree, monkeypatch)
    kv, state = sizes(tree)
    res = tree.evict_bytes(Tier.DEVICE, kv + state)
    assert calls == [(1, 0)]
    assert (res.num_kv_pages, res.num_states) == (1, 1)
    assert not a.alive and b.alive


def test_a_state_that_left_with_its_kv_is_not_counted_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both leaves are asked for: the first KV victim's state is also the state list's first
    victim; it must be skipped there, not counted again (which would stop the round short)."""
    tree, a, b = two_leaves()
    calls = record_device_calls(tree, monkeypatch)
    kv, state = sizes(tree)
    res = tree.evict_bytes(Tier.DEVICE, 2 * kv + 2 * state)
    assert calls == [(2, 0)]  # one round: both KV victims, no separate state victim
    assert (res.num_kv_pages, res.num_states) == (2, 2)
    assert not a.alive and not b.alive


# ---- pinned nodes --------------------------------------------------------------------------
def test_locked_nodes_are_never_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = device_only()
    a = put(tree, seq(1, 2 * PAGE)).last_node
    b = put(tree, seq(2, PAGE)).last_node
    token = tree.lock(a)
    calls = record_device_calls(tree, monkeypatch)
    res = tree.evict_bytes(Tier.DEVICE, 1)
    assert calls == [(1, 0)]  # the locked, least recently used leaf is not even counted on
    assert (res.num_kv_pages, res.num_states) == (1, 1)
    assert not b.alive
    res = tree.evict_bytes(Tier.DEVICE, 10**15)
    assert calls == [(1, 0)]  # nothing left to try: no call at all
    assert res == EvictResult(tier=Tier.DEVICE)
    assert a.alive and a.device_kv is not None and a.device_state is not None
    tree.unlock(a, token)
    tree.check_integrity()


def test_loading_nodes_are_never_evicted() -> None:
    tree, transfer = make_tree()
    tokens = seq(1, 4 * PAGE) + seq(2, 3 * PAGE)
    r = put(tree, tokens, states=[4 * PAGE, 7 * PAGE])
    assert transfer.backup(r.backup_nodes) is not None
    tree.evict_device(num_kv_pages=3)  # the leaf is on the host only now
    m = tree.match_prefix(tokens)
    kv = tree.device_kv.alloc(3)
    slots = tree.device_mamba.alloc(1)
    assert kv is not None and slots is not None
    plan = tree.begin_load(m, kv, int(slots[0]))
    leaf = m.last_node
    assert leaf.loading and leaf.device_kv is not None
    tree.evict_bytes(Tier.DEVICE, 10**15)
    assert leaf.alive and leaf.device_kv is not None and leaf.device_state is not None
    path = tree.path_to(leaf)
    assert all(n.device_kv is not None for n in path)  # its ancestors stay (prefix-closed)
    tree.check_integrity()
    tree.abort_load(plan)


def test_host_locked_nodes_are_never_evicted_from_the_host() -> None:
    tree, transfer = make_tree()
    r = put(tree, seq(1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
    assert transfer.backup(r.backup_nodes) is not None
    other = put(tree, seq(2, 2 * PAGE))
    assert transfer.backup(other.backup_nodes) is not None
    tree.lock_host(r.last_node)
    res = tree.evict_bytes(Tier.HOST, 10**15)
    assert (res.tier, res.num_kv_pages, res.num_states) == (Tier.HOST, 2, 1)
    assert all(n.host_kv is not None and n.host_state is not None for n in tree.path_to(r.last_node))
    assert other.last_node.host_kv is None
    tree.unlock_host(r.last_node)
    tree.check_integrity()


# ---- the callbacks go through --------------------------------------------------------------
def test_host_victims_go_to_demote_before_their_copy() -> None:
    tree, transfer = make_tree()
    r = put(tree, seq(1, 2 * PAGE))
    assert transfer.backup(r.backup_nodes) is not None
    seen: list[tuple[list[int], str]] = []

    def demote(nodes: Sequence[TreeNode], list_key: str) -> None:
        assert all(n.host_kv is not None for n in nodes)
        seen.append(([n.node_id for n in nodes], list_key))

    kv, state = sizes(tree, Tier.HOST)
    free0 = free_bytes(tree, Tier.HOST)
    res = tree.evict_bytes(Tier.HOST, 1, demote=demote)
    assert seen == [([r.last_node.node_id], "host_kv")]
    assert free_bytes(tree, Tier.HOST) - free0 == freed_by(res, tree, Tier.HOST) == 2 * kv + state
    assert r.last_node.device_kv is not None  # the device copy stays
    tree.check_integrity()


def test_device_victims_go_to_the_write_back_given() -> None:
    tree, transfer = make_tree(write_policy="write_back")
    r = put(tree, seq(1, 2 * PAGE))
    handed: list[list[int]] = []

    def write_back(nodes: Sequence[TreeNode]) -> bool:
        handed.append([n.node_id for n in nodes])
        return transfer.write_back(nodes)

    res = tree.evict_bytes(Tier.DEVICE, 1, write_back=write_back)
    assert handed == [[r.last_node.node_id]]
    assert (res.num_kv_pages, res.num_states, res.num_written_back_nodes) == (2, 1, 1)
    assert r.last_node.device_kv is None and r.last_node.host_kv is not None
    tree.check_integrity()


# ---- refused -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_bytes", [-1, 1.5, "8", True, None])
def test_a_negative_or_non_integer_amount_is_refused(num_bytes: Any) -> None:
    tree, _, _ = two_leaves()
    with pytest.raises(ConfigError):
        tree.evict_bytes(Tier.DEVICE, num_bytes)
    assert tree.stats().num_nodes == 2


def test_storage_and_missing_tiers_and_misplaced_callbacks_are_refused() -> None:
    tree, _ = make_tree()
    with pytest.raises(ConfigError):
        tree.evict_bytes(Tier.STORAGE, 1)
    with pytest.raises(ConfigError):
        tree.evict_bytes("device", 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        tree.evict_bytes(Tier.DEVICE, 1, demote=lambda nodes, key: None)
    with pytest.raises(ConfigError):
        tree.evict_bytes(Tier.HOST, 1, write_back=lambda nodes: True)
    with pytest.raises(ConfigError):
        device_only().evict_bytes(Tier.HOST, 1)


def test_evict_bytes_accepts_numpy_integers() -> None:
    import numpy as np

    tree, a, _ = two_leaves()
    tree.evict_bytes(Tier.DEVICE, np.int64(1))
    assert not a.alive


def test_sync_transfer_tree_stays_consistent_after_mixed_byte_evictions() -> None:
    """Device then host by bytes, on a write-through tree with backups: every invariant holds."""
    tree, transfer = make_tree()
    for i in range(6):
        r = put(tree, seq(i + 1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
        assert transfer.backup(r.backup_nodes) is not None
    assert isinstance(transfer, SyncTransfer)
    kv, state = sizes(tree)
    tree.evict_bytes(Tier.DEVICE, 5 * kv + 2 * state)
    tree.check_integrity()
    hkv, hstate = sizes(tree, Tier.HOST)
    free0 = free_bytes(tree, Tier.HOST)
    res = tree.evict_bytes(Tier.HOST, 7 * hkv + hstate)
    assert free_bytes(tree, Tier.HOST) - free0 >= 7 * hkv + hstate
    assert res.num_kv_pages >= 1
    tree.check_integrity()


def test_a_model_without_attention_layers_frees_its_bytes_from_states() -> None:
    """Pages of a spec without attention layers hold no bytes: eviction by bytes takes states
    (and the nodes left without one), never dividing by a page's zero bytes."""
    base = make_tree()[0].spec
    spec = dataclasses.replace(base, attention_layer_ids=(), mamba_layer_ids=base.cached_layer_ids)
    tree = HybridRadixTree(spec, device_kv=DeviceKVPool(spec, 16), device_mamba=DeviceMambaPool(spec, 4))
    assert tree.device_kv.bytes_per_index == 0
    for tag in (1, 2):
        kv, slot = tree.device_kv.alloc(2), tree.device_mamba.alloc(1)
        assert kv is not None and slot is not None
        tree.insert(seq(tag, 2 * PAGE), kv, states={2 * PAGE: int(slot[0])})
    result = tree.evict_bytes(Tier.DEVICE, tree.device_mamba.bytes_per_index)
    assert result.num_states == 1 and tree.device_mamba.num_free == 3
    assert tree.match_prefix(seq(2, 2 * PAGE)).num_tokens == 2 * PAGE  # the least recent went
    tree.check_integrity()
