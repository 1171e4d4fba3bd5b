"""Scenario tests of the hybrid radix tree: the behaviours a scheduler and controller rely on."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tree_builders import PAGE, check_contents, make_tree, put, seq

from asynccache.errors import ConfigError
from asynccache.policy import (
    BlockGridAdmission,
    EveryPageAdmission,
    ScoredEviction,
    WritePolicy,
)
from asynccache.tree import LRUList, Tier, TreeError, TreeNode


def test_multi_turn_conversation_reuses_up_to_the_last_state() -> None:
    tree, _ = make_tree()
    prompt1 = seq(1, 10 * PAGE + 2)
    turn1 = prompt1 + seq(2, 3 * PAGE + 1)  # prompt + output: 13 full pages + 3 tokens
    put(tree, turn1, prompt_len=len(prompt1))
    assert {n.end_tokens for n in tree.iter_nodes() if n.has_state} == {10 * PAGE, 13 * PAGE}

    prompt2 = turn1 + seq(3, 2 * PAGE)
    m = tree.match_prefix(prompt2[:-1])
    assert m.num_tokens == 13 * PAGE  # end of the previous output, floored to a page
    assert m.num_device_tokens == 13 * PAGE and m.state_tier is Tier.DEVICE and not m.needs_load
    assert m.last_node.end_tokens == 13 * PAGE
    check_contents(tree, prompt2, m)

    # Without a state at the end of the output the match is cut back to the prompt's state:
    # the output's KV is cached but unusable (dead weight).
    tree2, _ = make_tree()
    put(tree2, turn1, states=[10 * PAGE])
    m2 = tree2.match_prefix(prompt2[:-1])
    assert m2.num_matched_tokens == 13 * PAGE
    assert m2.num_tokens == 10 * PAGE
    assert m2.device_kv_indices.numel() == 10
    tree.check_integrity()
    tree2.check_integrity()


def test_identical_prompt_resend_recomputes_at_most_one_page() -> None:
    for prompt_len in (9 * PAGE, 9 * PAGE + 1, 9 * PAGE + PAGE - 1):
        tree, _ = make_tree()
        prompt = seq(7, prompt_len)
        put(tree, prompt + seq(8, 5), prompt_len=prompt_len)
        m = tree.match_prefix(prompt[:-1])
        assert 0 < prompt_len - m.num_tokens <= PAGE, prompt_len
        assert m.num_tokens == (prompt_len - 1) // PAGE * PAGE
        assert m.state_tier is Tier.DEVICE
        check_contents(tree, prompt, m)
        tree.check_integrity()


def test_near_identical_prompt_reuses_up_to_the_difference() -> None:
    tree, _ = make_tree(admission=EveryPageAdmission())
    prompt = seq(1, 12 * PAGE)
    put(tree, prompt, prompt_len=len(prompt))
    edited = prompt[:-3] + [1, 2, 3]  # last three tokens differ
    m = tree.match_prefix(edited[:-1])
    assert m.num_tokens == 11 * PAGE


def test_branching_prefixes_split_nodes_and_keep_states_at_node_ends() -> None:
    tree, _ = make_tree()
    common = seq(1, 3 * PAGE)
    a = common + seq(2, 4 * PAGE)
    b = common + seq(3, 2 * PAGE)
    put(tree, a)
    put(tree, b)
    top = tree.root.children
    assert len(top) == 1
    (shared,) = top.values()
    assert shared.num_pages == 3 and len(shared.children) == 2
    assert shared.device_state is None  # the branch point has no state under EndsAdmission
    assert tree.match_prefix(a).num_tokens == len(a)
    assert tree.match_prefix(b).num_tokens == len(b)
    c = common + seq(4, 3 * PAGE)
    mc = tree.match_prefix(c)
    assert mc.num_tokens == 0 and mc.num_matched_tokens == 3 * PAGE and mc.last_node is tree.root

    # With a state on every page the third branch reuses the shared prefix.
    tree2, _ = make_tree(admission=EveryPageAdmission())
    put(tree2, a, prompt_len=len(a))
    put(tree2, b, prompt_len=len(b))
    m = tree2.match_prefix(c)
    assert m.num_tokens == 3 * PAGE
    check_contents(tree2, c, m)
    tree.check_integrity()
    tree2.check_integrity()


def test_block_grid_admission_splits_at_grid_points() -> None:
    tree, _ = make_tree(admission=BlockGridAdmission(2, include_ends=False))
    s = seq(5, 7 * PAGE + 1)
    put(tree, s, prompt_len=len(s))
    ends = sorted(n.end_tokens for n in tree.iter_nodes())
    assert ends == [2 * PAGE, 4 * PAGE, 6 * PAGE, 7 * PAGE]
    assert tree.match_prefix(s).num_tokens == 6 * PAGE
    tree.check_integrity()


def test_insert_frees_duplicates_and_reinsert_reuses_new_device_pages() -> None:
    tree, transfer = make_tree()
    s = seq(1, 6 * PAGE)
    put(tree, s)
    free_before = tree.device_kv.num_free
    r = put(tree, s)
    assert r.num_duplicate_pages == 6 and r.num_new_pages == 0
    assert r.num_freed_states == 1 and r.num_new_states == 0
    assert tree.device_kv.num_free == free_before
    tree.check_integrity()

    # Back up, evict from the device, insert the same tokens again: the new pages are reused.
    transfer.backup(tree.match_prefix(s).backup_nodes or tuple(tree.iter_nodes()))
    tree.evict_device(num_kv_pages=6)
    m = tree.match_prefix(s)
    assert m.num_device_tokens == 0 and m.num_host_tokens == 6 * PAGE
    r = put(tree, s)
    assert r.num_new_pages == 6 and r.num_duplicate_pages == 0 and r.num_new_states == 1
    m = tree.match_prefix(s)
    assert m.num_device_tokens == 6 * PAGE and not m.needs_load
    check_contents(tree, s, m)
    tree.check_integrity()


def test_insert_accepts_the_trees_own_prefix_pages() -> None:
    tree, _ = make_tree()
    prompt = seq(1, 4 * PAGE)
    put(tree, prompt)
    full = prompt + seq(2, 2 * PAGE)
    m = tree.match_prefix(full[:-1])
    assert m.num_device_tokens == 4 * PAGE
    own = tree.device_kv.alloc(2)
    slot = tree.device_mamba.alloc(1)
    assert own is not None and slot is not None
    r = tree.insert(full, torch.cat([m.device_kv_indices, own]), states={6 * PAGE: int(slot[0])})
    assert r.num_new_pages == 2 and r.num_duplicate_pages == 0
    assert tree.device_kv.num_free == tree.device_kv.num_items - 6
    assert torch.equal(tree.match_prefix(full).device_kv_indices[:4], m.device_kv_indices)
    # A mix: the first two pages passed back, the next two fresh copies of cached pages.
    mixed = torch.cat([m.device_kv_indices[:2], tree.device_kv.alloc(2), tree.device_kv.alloc(2)])  # type: ignore[list-item]
    r = tree.insert(full, mixed)
    assert r.num_duplicate_pages == 4
    assert tree.device_kv.num_free == tree.device_kv.num_items - 6
    tree.check_integrity()
    # The node's own state slot passed back (as its pages are) stays the node's, not freed.
    free_slots = tree.device_mamba.num_free
    own_slot = tree.match_prefix(full).last_node.device_state
    r = tree.insert(full, tree.match_prefix(full).device_kv_indices, states={6 * PAGE: own_slot})
    assert r.num_freed_states == 0 and tree.device_mamba.num_free == free_slots
    tree.check_integrity()


def test_insert_refuses_a_page_given_twice() -> None:
    tree, _ = make_tree()
    tokens = seq(1, 4 * PAGE)
    alloc = tree.alloc_device(4, 1)
    assert alloc is not None
    kv = alloc.kv_indices.clone()
    kv[1] = kv[0]
    with pytest.raises(ConfigError, match="twice"):
        tree.insert(tokens, kv, states={4 * PAGE: int(alloc.state_slots[0])})
    assert tree.stats().num_nodes == 0


@pytest.mark.parametrize(
    ("tier", "bad", "message"),
    [
        ("device", {"page": 64}, "kv_indices: indices outside device_kv's 0..63"),
        ("device", {"page": -1}, "kv_indices: indices outside device_kv's 0..63"),
        ("device", {"slot": 16}, "states: slot 16 at position 16 is outside device_mamba's 0..15"),
        ("device", {"slot": 0.5}, "states: positions and slots are integers"),  # was taken as slot 0
        ("device", {"position": 16.0}, "states: positions and slots are integers"),
        ("host", {"page": 128}, "host_kv_indices: indices outside host_kv's 0..127"),
        ("host", {"slot": 32}, "host_states: slot 32 at position 16 is outside host_mamba's 0..31"),
    ],
)
def test_insert_refuses_indices_outside_the_pools(tier: str, bad: dict[str, float], message: str) -> None:
    """The tree took them, failed its integrity check, and the eviction that freed them raised
    AllocationError (inside whatever allocation evicted: another request's admission)."""
    tree, _ = make_tree()
    tokens = seq(1, 4 * PAGE)
    alloc = tree.alloc_device(4, 1) if tier == "device" else tree.alloc_host(4, 1)
    assert alloc is not None
    kv = alloc.kv_indices.clone()
    if "page" in bad:
        kv[2] = int(bad["page"])
    slot = bad.get("slot", int(alloc.state_slots[0]))
    position = bad.get("position", 4 * PAGE)
    insert = tree.insert if tier == "device" else tree.insert_host
    keyword = "states" if tier == "device" else "host_states"
    with pytest.raises(ConfigError, match=re.escape(message)):
        insert(tokens, kv, **{keyword: {position: slot}})
    assert tree.stats().num_nodes == 0
    # Nothing changed: the caller still owns what it allocated, and gives it back.
    kv_pool, state_pool = (tree.device_kv, tree.device_mamba) if tier == "device" else (tree.host_kv, tree.host_mamba)
    assert kv_pool is not None and state_pool is not None
    kv_pool.free(alloc.kv_indices)
    state_pool.free(alloc.state_slots)
    tree.check_integrity()


@pytest.mark.parametrize("slot", [10**6, -1, 0.5])
def test_begin_load_refuses_a_device_state_slot_outside_the_pool(slot: float) -> None:
    """The plan would copy the state to a slot the pool does not have (a device fault in the
    copy, or a slot the tree later frees twice); nothing is planned or pinned."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    r = put(tree, s, states=[4 * PAGE])
    transfer.backup(r.backup_nodes)
    tree.evict_device(num_kv_pages=100, num_states=100)
    m = tree.match_prefix(s)
    assert m.needs_load and m.state_tier is Tier.HOST
    kv = tree.device_kv.alloc(4)
    with pytest.raises(ConfigError, match="device_state_slot must be an integer"):
        tree.begin_load(m, kv, slot)
    assert not tree.match_prefix(s).pending_load
    tree.device_kv.free(kv)
    tree.check_integrity()


def test_a_salt_that_is_not_a_str_is_refused() -> None:
    tree, _ = make_tree()
    with pytest.raises(ConfigError, match="salt must be a str"):
        tree.match_prefix(seq(1, 2 * PAGE), salt=5)  # type: ignore[arg-type]


def test_unlocking_a_root_does_nothing_as_locking_it_does() -> None:
    """A miss's last_node is the root: a scheduler locks and unlocks it like any match."""
    tree, _ = make_tree()
    m = tree.match_prefix(seq(1, 2 * PAGE))
    assert m.num_tokens == 0 and m.last_node.parent is None
    token = tree.lock(m.last_node)
    assert token == 0
    tree.unlock(m.last_node, token)
    tree.unlock(m.last_node, token)
    tree.check_integrity()


def test_host_only_state_triggers_load_back_even_when_kv_is_on_device() -> None:
    tree, transfer = make_tree()
    s = seq(1, 5 * PAGE)
    r = put(tree, s)
    assert transfer.backup(r.backup_nodes) is not None
    ev = tree.evict_device(num_states=1)
    assert ev.num_states == 1 and ev.num_kv_pages == 0 and ev.num_lost_states == 0
    m = tree.match_prefix(s)
    assert m.num_tokens == 5 * PAGE
    assert m.num_device_tokens == 5 * PAGE and m.num_host_tokens == 0
    assert m.state_tier is Tier.HOST and m.needs_load
    assert m.load_nodes == (m.last_node,)
    assert m.num_load_kv_pages == 0 and m.num_load_states == 1
    plan = transfer.load(m)
    assert plan is not None and plan.num_states == 1 and plan.num_kv_pages == 0
    m2 = tree.match_prefix(s)
    assert m2.state_tier is Tier.DEVICE and not m2.needs_load
    check_contents(tree, s, m2)
    tree.check_integrity()


def test_load_back_of_kv_and_state_from_host() -> None:
    tree, transfer = make_tree()
    base = seq(1, 4 * PAGE)
    s = base + seq(2, 3 * PAGE)
    r = put(tree, s, states=[4 * PAGE, 7 * PAGE])
    transfer.backup(r.backup_nodes)
    tree.evict_device(num_kv_pages=3)  # the leaf goes to the host only
    m = tree.match_prefix(s)
    assert (m.num_tokens, m.num_device_tokens, m.num_host_tokens) == (7 * PAGE, 4 * PAGE, 3 * PAGE)
    assert m.state_tier is Tier.HOST and [n.end_tokens for n in m.load_nodes] == [7 * PAGE]
    plan = tree.begin_load(m, tree.device_kv.alloc(3), int(tree.device_mamba.alloc(1)[0]))
    assert plan.num_kv_pages == 3
    # While the copy is in flight the data cannot be evicted and a match reports it pending.
    assert tree.match_prefix(s).pending_load
    ev = tree.evict_device(num_kv_pages=100, num_states=100)
    assert tree.match_prefix(s).num_device_tokens == 7 * PAGE
    assert ev.num_kv_pages == 0
    tree.check_integrity()
    from kernels.api import copy_items

    assert tree.host_kv is not None and tree.host_mamba is not None
    copy_items(tree.host_kv, tree.device_kv, plan.host_kv_indices, plan.device_kv_indices)
    copy_items(tree.host_mamba, tree.device_mamba, plan.host_state_slots, plan.device_state_slots)
    tree.finish_load(plan)
    m = tree.match_prefix(s)
    assert not m.pending_load and not m.needs_load
    check_contents(tree, s, m)
    with pytest.raises(TreeError):
        tree.finish_load(plan)
    tree.check_integrity()


def _three_requests(tree, n_pages: int = 3) -> list[list[int]]:  # type: ignore[no-untyped-def]
    reqs = [seq(i, n_pages * PAGE) for i in (1, 2, 3)]
    for r in reqs:
        put(tree, r)
    return reqs


def test_eviction_order_write_through_demotes_least_recently_used_first() -> None:
    tree, transfer = make_tree()
    a, b, c = _three_requests(tree)
    for r in (a, b, c):
        transfer.backup(tree.match_prefix(r).backup_nodes or tree.path_to(tree.match_prefix(r).last_node))
    tree.match_prefix(a)  # a becomes most recent; b is now the oldest
    ev = tree.evict_device(num_kv_pages=3)
    assert ev.num_kv_pages == 3 and ev.num_states == 1 and ev.num_lost_states == 0
    assert tree.match_prefix(b).state_tier is Tier.HOST  # demoted, still cached on the host
    assert tree.match_prefix(a).state_tier is Tier.DEVICE
    assert tree.match_prefix(c).state_tier is Tier.DEVICE
    tree.check_integrity()


def test_write_through_insert_asks_for_backup_of_new_nodes_only() -> None:
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    r = put(tree, s)
    assert [n.end_tokens for n in r.backup_nodes] == [4 * PAGE]
    transfer.backup(r.backup_nodes)
    r2 = put(tree, s + seq(2, 2 * PAGE))
    assert [n.end_tokens for n in r2.backup_nodes] == [6 * PAGE]
    # Dead weight (KV past the last state) is never proposed for backup.
    r3 = put(tree, seq(3, 4 * PAGE), states=[2 * PAGE])
    assert [n.end_tokens for n in r3.backup_nodes] == [2 * PAGE]


def test_eviction_order_write_through_selective_backs_up_hot_nodes_only() -> None:
    tree, transfer = make_tree(write_policy=WritePolicy.write_through_selective(2))
    hot, cold = seq(1, 3 * PAGE), seq(2, 3 * PAGE)
    assert put(tree, hot).backup_nodes == ()
    put(tree, cold)
    assert tree.match_prefix(hot).backup_nodes == ()
    m = tree.match_prefix(hot)
    assert [n.end_tokens for n in m.backup_nodes] == [3 * PAGE]
    assert transfer.backup(m.backup_nodes) is not None
    ev = tree.evict_device(num_kv_pages=6)
    assert ev.num_kv_pages == 6
    assert ev.num_lost_states == 1  # the cold request was dropped (not backed up)
    assert tree.match_prefix(hot).state_tier is Tier.HOST
    assert tree.match_prefix(cold).num_tokens == 0
    tree.check_integrity()


def test_eviction_order_write_back_backs_up_before_freeing() -> None:
    tree, transfer = make_tree(write_policy="write_back")
    calls: list[list[int]] = []

    def write_back(nodes):  # type: ignore[no-untyped-def]
        calls.append([n.end_tokens for n in nodes])
        return transfer.write_back(nodes)

    tree.write_back = write_back
    base = seq(1, 2 * PAGE)
    leaf = base + seq(2, 2 * PAGE)
    put(tree, leaf, states=[2 * PAGE, 4 * PAGE])  # interior state at 2 pages, leaf state at 4
    assert tree.stats().host_kv_pages == 0  # nothing copied before eviction
    ev = tree.evict_device(num_kv_pages=2)
    assert calls == [[2 * PAGE, 4 * PAGE]]  # the victim and its ancestor without a host copy
    assert ev.num_kv_pages == 2 and ev.num_lost_states == 0 and ev.num_written_back_nodes == 2
    m = tree.match_prefix(leaf)
    assert m.num_tokens == 4 * PAGE and m.state_tier is Tier.HOST and m.num_host_tokens == 2 * PAGE
    # Interior states are backed up, not silently lost, when device states are evicted.
    ev = tree.evict_device(num_states=1)
    assert ev.num_lost_states == 0
    assert tree.match_prefix(base).state_tier is Tier.HOST
    check_contents(tree, leaf, tree.match_prefix(leaf))
    tree.check_integrity()


def test_write_back_saves_a_state_attached_after_the_kv_was_backed_up() -> None:
    tree, _transfer = make_tree(write_policy="write_back")
    s = seq(1, 4 * PAGE)
    put(tree, s)
    tree.evict_device(num_kv_pages=4)  # written back and demoted
    put(tree, s, states=[2 * PAGE, 4 * PAGE])  # back on the device, with a new state at 2 pages
    upper = tree.match_prefix(s[: 2 * PAGE]).last_node
    assert upper.host_kv is not None and upper.device_state is not None and upper.host_state is None
    ev = tree.evict_device(num_kv_pages=4)
    assert ev.num_kv_pages == 4 and ev.num_lost_states == 0
    assert upper.host_state is not None and tree.match_prefix(s[: 2 * PAGE]).state_tier is Tier.HOST
    check_contents(tree, s, tree.match_prefix(s))
    tree.check_integrity()


def test_write_back_with_an_in_flight_copy_frees_only_after_finish() -> None:
    tree, _ = make_tree(write_policy="write_back")
    plans = []

    def begin_only(nodes):  # type: ignore[no-untyped-def]
        need_kv, need_states = tree.backup_pages_needed(nodes)
        alloc = tree.alloc_host(need_kv, need_states)
        assert alloc is not None
        plans.append(tree.begin_backup(nodes, alloc.kv_indices, alloc.state_slots))
        return True

    tree.write_back = begin_only
    s = seq(1, 3 * PAGE)
    put(tree, s)
    free0 = tree.device_kv.num_free
    ev = tree.evict_device(num_kv_pages=3)
    assert ev.num_kv_pages == 0 and ev.num_pending_kv_pages == 3 and ev.num_pending_states == 1
    assert tree.device_kv.num_free == free0  # nothing freed while the copy is in flight
    tree.check_integrity()
    assert tree.evict_device(num_kv_pages=3).num_kv_pages == 0  # still pinned
    tree.finish_backup(plans[0])
    ev = tree.evict_device(num_kv_pages=3)
    assert ev.num_kv_pages == 3 and ev.num_pending_kv_pages == 0 and ev.num_lost_states == 0
    assert len(plans) == 1
    assert tree.match_prefix(s).state_tier is Tier.HOST
    tree.check_integrity()


def test_write_back_without_host_room_drops() -> None:
    tree, _transfer = make_tree(write_policy="write_back", host_pages=2, host_states=4)
    s = seq(1, 3 * PAGE)
    put(tree, s)
    ev = tree.evict_device(num_kv_pages=3)
    assert ev.num_kv_pages == 3 and ev.num_lost_states == 1
    assert tree.match_prefix(s).num_tokens == 0
    tree.check_integrity()


def test_write_back_policy_needs_a_callback() -> None:
    tree, _ = make_tree(write_policy="write_back")
    tree.write_back = None
    put(tree, seq(1, PAGE))
    with pytest.raises(ConfigError):
        tree.evict_device(num_kv_pages=1)


def test_lru_scan_evicts_leaves_before_their_ancestors() -> None:
    tree, _ = make_tree(host_pages=None, host_states=None)
    base = seq(1, 2 * PAGE)
    put(tree, base)
    put(tree, base + seq(2, 2 * PAGE))
    put(tree, seq(3, 2 * PAGE))
    tree.match_prefix(base)  # base (interior) is the most recent
    ev = tree.evict_device(num_kv_pages=2)
    # The leaf under base is older than base and goes first.
    assert ev.num_kv_pages == 2
    assert tree.match_prefix(base + seq(2, 2 * PAGE)).num_tokens == 2 * PAGE
    tree.check_integrity()


def test_one_eviction_call_takes_an_ancestor_offered_before_its_leaf() -> None:
    """The LRU order offers an older parent before its newer child (backing up only the child
    touched it last): once the child is gone, the same call takes the parent too (device and
    host), so flushing a tier empties it."""
    tree, transfer = make_tree()
    base = seq(1, 2 * PAGE)
    transfer.backup(put(tree, base).backup_nodes)
    long = base + seq(2, 2 * PAGE)
    transfer.backup(put(tree, long).backup_nodes)
    assert [n.end_tokens for n in tree.eviction.candidates(tree.device_kv_lru, now=0.0)] == [2 * PAGE, 4 * PAGE]
    ev = tree.evict_device(num_kv_pages=tree.device_kv.num_items, num_states=tree.device_mamba.num_items)
    assert ev.num_kv_pages == 4 and tree.device_kv.num_free == tree.device_kv.num_items
    m = tree.match_prefix(long)
    assert (m.num_tokens, m.num_device_tokens, m.num_host_tokens) == (4 * PAGE, 0, 4 * PAGE)
    ev = tree.evict_host(num_kv_pages=tree.host_kv.num_items, num_states=tree.host_mamba.num_items)
    assert ev.num_kv_pages == 4 and tree.stats().num_nodes == 0
    tree.check_integrity()


class ShallowFirst(ScoredEviction):
    """A deliberately odd order through the utility hook: shallowest nodes first."""

    def score(self, node: TreeNode, *, lru: LRUList, now: float) -> float:
        return float(node.end_tokens)


def test_tombstones_and_the_cascade() -> None:
    tree, _ = make_tree(
        host_pages=None, host_states=None, admission=EveryPageAdmission(), eviction=ShallowFirst(window=None)
    )
    s = seq(1, 3 * PAGE)
    put(tree, s, prompt_len=len(s))
    nodes = sorted(tree.iter_nodes(), key=lambda n: n.start_page)
    assert [n.end_tokens for n in nodes] == [PAGE, 2 * PAGE, 3 * PAGE]
    # Dropping an interior state leaves a tombstone: KV kept, no state, match cut above it.
    ev = tree.evict_device(num_states=1)
    assert ev.num_states == 1 and ev.num_lost_states == 1 and ev.num_deleted_nodes == 0
    assert nodes[0].alive and nodes[0].device_state is None and nodes[0].device_kv is not None
    assert tree.match_prefix(s[:PAGE]).num_tokens == 0
    assert tree.match_prefix(s[: 2 * PAGE]).num_tokens == 2 * PAGE
    ev = tree.evict_device(num_states=1)
    assert ev.num_deleted_nodes == 0 and nodes[1].device_state is None
    assert tree.match_prefix(s).num_tokens == 3 * PAGE
    tree.check_integrity()
    # Dropping the leaf's state: the leaf holds nothing usable and goes, and the cascade takes
    # the tombstones above it.
    ev = tree.evict_device(num_states=1)
    assert ev.num_deleted_nodes == 3 and ev.num_kv_pages == 3
    assert not any(n.alive for n in nodes)
    assert tree.stats().num_nodes == 0 and tree.device_kv.num_free == tree.device_kv.num_items
    tree.check_integrity()


def test_scored_eviction_hook_orders_candidates() -> None:
    class FewestHitsFirst(ScoredEviction):
        def score(self, node: TreeNode, *, lru: LRUList, now: float) -> float:
            return float(node.hit_count)

    tree, _ = make_tree(host_pages=None, host_states=None, eviction=FewestHitsFirst(window=None))
    a, b = seq(1, 2 * PAGE), seq(2, 2 * PAGE)
    put(tree, a)
    put(tree, b)
    for _ in range(3):
        tree.match_prefix(a)
    tree.match_prefix(b)  # b is the most recent but has fewer hits
    tree.evict_device(num_kv_pages=2)
    assert tree.match_prefix(a).num_tokens == 2 * PAGE
    assert tree.match_prefix(b).num_tokens == 0
    with pytest.raises(ConfigError):
        FewestHitsFirst(window=0)


def test_locked_nodes_are_never_evicted() -> None:
    tree, _ = make_tree(host_pages=None, host_states=None)
    a, b = seq(1, 3 * PAGE), seq(2, 3 * PAGE)
    ra = put(tree, a)
    put(tree, b)
    token = tree.lock(ra.last_node)
    assert tree.stats().device_locked_pages == 3
    ev = tree.evict_device(num_kv_pages=100, num_states=100)
    assert ev.num_kv_pages == 3  # only b
    assert tree.match_prefix(a).num_tokens == 3 * PAGE
    tree.check_integrity()
    tree.unlock(ra.last_node, token)
    with pytest.raises(TreeError):
        tree.unlock(ra.last_node, token)
    assert tree.evict_device(num_kv_pages=100).num_kv_pages == 3
    assert tree.stats().num_nodes == 0
    tree.check_integrity()


def test_pool_exhaustion_returns_none_and_leaks_nothing() -> None:
    tree, transfer = make_tree(device_pages=8, device_states=2, host_pages=4, host_states=1)
    s = seq(1, 6 * PAGE)
    r = put(tree, s)
    token = tree.lock(r.last_node)
    free = (tree.device_kv.num_free, tree.device_mamba.num_free)
    assert tree.alloc_device(4, 0) is None
    assert tree.alloc_device(2, 2) is None  # pages fit, states do not: nothing taken
    assert (tree.device_kv.num_free, tree.device_mamba.num_free) == free
    assert transfer.backup(r.backup_nodes) is None  # 6 pages do not fit in a 4-page host pool
    tree.check_integrity()
    tree.unlock(r.last_node, token)
    alloc = tree.alloc_device(4, 2)  # evicts the request now
    assert alloc is not None and alloc.kv_indices.numel() == 4
    tree.claim_in_flight("device_kv", alloc.kv_indices)
    tree.claim_in_flight(tree.device_mamba, alloc.state_slots)
    tree.check_integrity()
    tree.release_in_flight("device_kv", alloc.kv_indices)
    with pytest.raises(TreeError):
        tree.release_in_flight("device_kv", alloc.kv_indices)
    with pytest.raises(AssertionError, match="leak"):
        tree.check_integrity()


def test_sync_load_returns_none_without_device_room() -> None:
    tree, transfer = make_tree(device_pages=6, device_states=2)
    s = seq(1, 4 * PAGE)
    r = put(tree, s)
    transfer.backup(r.backup_nodes)
    tree.evict_device(num_kv_pages=4)
    other = put(tree, seq(2, 6 * PAGE), states=[6 * PAGE])
    token = tree.lock(other.last_node)
    m = tree.match_prefix(s)
    assert m.needs_load
    assert transfer.load(m) is None
    tree.check_integrity()
    tree.unlock(other.last_node, token)
    assert transfer.load(tree.match_prefix(s)) is not None
    check_contents(tree, s, tree.match_prefix(s))
    tree.check_integrity()


def test_tenant_isolation() -> None:
    tree, _ = make_tree()
    s = seq(1, 4 * PAGE)
    ra = put(tree, s, salt="tenant-a")
    assert tree.match_prefix(s).num_tokens == 0
    assert tree.match_prefix(s, salt="tenant-b").num_tokens == 0
    mb = tree.match_prefix(s, salt="tenant-b")
    assert mb.last_node.parent is None and mb.last_node is not tree.root
    rb = put(tree, s, salt="tenant-b")
    assert rb.num_new_pages == 4  # no sharing across salts
    ma, mb = tree.match_prefix(s, salt="tenant-a"), tree.match_prefix(s, salt="tenant-b")
    assert ma.num_tokens == mb.num_tokens == 4 * PAGE
    assert ma.last_node is not mb.last_node
    assert set(ma.device_kv_indices.tolist()).isdisjoint(mb.device_kv_indices.tolist())
    assert list(ma.page_hashes).__len__() == 4
    assert set(ma.page_hashes).isdisjoint(mb.page_hashes)
    assert ra.last_node.page_hashes == tuple(ma.page_hashes)
    check_contents(tree, s, ma, salt="tenant-a")
    check_contents(tree, s, mb, salt="tenant-b")
    tree.check_integrity()
    # An emptied tenant root is forgotten.
    tree.evict_device(num_kv_pages=100)
    assert set(tree.roots) == {""}
    tree.check_integrity()


def test_page_hashes_are_chained_and_namespaced() -> None:
    t1, _ = make_tree(model_id="model-a")
    t2, _ = make_tree(model_id="model-b")
    s = seq(1, 3 * PAGE + 2)
    h1 = t1.match_prefix(s).page_hashes
    h2 = t2.match_prefix(s).page_hashes
    assert len(h1) == 3 and set(h1).isdisjoint(h2)
    # A shared prefix shares hashes; the chain makes later pages depend on earlier ones.
    other = seq(1, 2 * PAGE) + seq(9, PAGE)
    h3 = t1.match_prefix(other).page_hashes
    assert h3[:2] == h1[:2] and h3[2] != h1[2]
    swapped = s[PAGE : 2 * PAGE] + s[:PAGE] + s[2 * PAGE :]
    assert t1.match_prefix(swapped).page_hashes[2] != h1[2]
    r = put(t1, s)
    assert r.last_node.page_hashes == tuple(h1)


def test_split_while_copies_are_in_flight_keeps_plans_whole() -> None:
    tree, _ = make_tree()
    s = seq(1, 6 * PAGE)
    r = put(tree, s)
    node = r.last_node
    alloc = tree.alloc_host(6, 1)
    assert alloc is not None
    backup = tree.begin_backup([node], alloc.kv_indices, alloc.state_slots)
    # A branch inside the node splits it while the backup is in flight.
    put(tree, s[: 3 * PAGE] + seq(2, 2 * PAGE))
    assert node.num_pages == 3 and node.parent is not None and node.parent.num_pages == 3
    assert node.parent.host_lock == 1 and node.parent.device_lock == 1
    tree.check_integrity()
    tree.finish_backup(backup)
    assert node.parent.host_lock == 0 and node.parent.device_lock == 0
    tree.check_integrity()

    # Same for a load.
    tree.evict_device(num_kv_pages=100, num_states=100)
    m = tree.match_prefix(s)
    assert m.num_host_tokens == 6 * PAGE
    plan = tree.begin_load(m, tree.device_kv.alloc(6), int(tree.device_mamba.alloc(1)[0]))
    put(tree, s[: 2 * PAGE] + seq(3, PAGE), states=[3 * PAGE])
    tree.check_integrity()
    tree.finish_load(plan)
    assert all(n.loading == 0 and n.device_lock == 0 for n in tree.iter_nodes())
    tree.check_integrity()


def test_abort_load_and_backup_return_indices() -> None:
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    r = put(tree, s)
    alloc = tree.alloc_host(4, 1)
    assert alloc is not None
    plan = tree.begin_backup(r.backup_nodes, alloc.kv_indices, alloc.state_slots)
    released = tree.abort_backup(plan)
    assert torch.equal(released.kv_indices, alloc.kv_indices)
    assert r.last_node.host_kv is None and r.last_node.host_lock == 0
    with pytest.raises(AssertionError, match="leak"):
        tree.check_integrity()
    assert tree.host_kv is not None and tree.host_mamba is not None
    tree.host_kv.free(released.kv_indices)
    tree.host_mamba.free(released.state_slots)
    tree.check_integrity()

    transfer.backup(r.backup_nodes)
    tree.evict_device(num_kv_pages=4)
    m = tree.match_prefix(s)
    kv, slot = tree.device_kv.alloc(4), int(tree.device_mamba.alloc(1)[0])
    plan2 = tree.begin_load(m, kv, slot)
    released2 = tree.abort_load(plan2)
    assert torch.equal(released2.kv_indices, kv) and released2.state_slots.tolist() == [slot]
    tree.device_kv.free(kv)
    tree.device_mamba.free(released2.state_slots)
    assert tree.match_prefix(s).state_tier is Tier.HOST
    tree.check_integrity()


def test_abort_load_drops_what_was_inserted_below_it_unless_that_is_in_use() -> None:
    """Device data inserted below a failed load (computed on top of the prefix) would be served
    after pages the copy never filled: it leaves the device with the load; while a request
    holds it, the abort is refused."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    transfer.backup(put(tree, s).backup_nodes)
    tree.evict_device(num_kv_pages=4)
    for in_use in (True, False):
        m = tree.match_prefix(s)
        kv, slot = tree.device_kv.alloc(4), int(tree.device_mamba.alloc(1)[0])
        plan = tree.begin_load(m, kv, slot)
        longer = s + seq(2, 2 * PAGE)
        below = put(tree, longer).last_node
        with pytest.raises(TreeError, match="already uses"):
            tree.abort_load(plan)  # a plain abort (a cancel) refuses: the load completes instead
        if in_use:
            token = tree.lock(below)
            with pytest.raises(TreeError, match="in use"):
                tree.abort_load(plan, drop_below=True)
            tree.unlock(below, token)
        released = tree.abort_load(plan, drop_below=True)
        tree.device_kv.free(released.kv_indices)
        tree.device_mamba.free(released.state_slots)
        assert tree.match_prefix(longer).num_device_tokens == 0 and tree.stats().num_active_plans == 0
        tree.check_integrity()


def test_abort_backup_takes_a_later_host_state_of_its_nodes_along() -> None:
    """A backup of a node's KV is in flight when the node gets a state and a second backup saves
    that state; aborting the first detaches the host KV and the host state with it (a host
    state never outlives the host KV it resumes) and returns both slots."""
    tree, _ = make_tree()
    s = seq(1, 2 * PAGE)
    r = put(tree, s, states=[])
    node = r.last_node
    a1 = tree.alloc_host(2, 0)
    assert a1 is not None
    p1 = tree.begin_backup([node], a1.kv_indices, a1.state_slots)
    put(tree, s, states=[2 * PAGE])  # the same tokens again, now with a state at their end
    assert node.device_state is not None and node.host_state is None
    a2 = tree.alloc_host(0, 1)
    assert a2 is not None
    p2 = tree.begin_backup([node], a2.kv_indices, a2.state_slots)
    tree.finish_backup(p2)
    assert node.host_state == int(a2.state_slots[0])
    released = tree.abort_backup(p1)
    assert node.host_kv is None and node.host_state is None
    assert torch.equal(released.kv_indices, a1.kv_indices) and released.state_slots.tolist() == a2.state_slots.tolist()
    assert tree.host_kv is not None and tree.host_mamba is not None
    tree.host_kv.free(released.kv_indices)
    tree.host_mamba.free(released.state_slots)
    tree.check_integrity()
    assert tree.match_prefix(s).state_tier is Tier.DEVICE


def test_abort_refuses_when_later_data_depends_on_it() -> None:
    tree, _ = make_tree()
    parent_tokens = seq(1, 2 * PAGE)
    child_tokens = parent_tokens + seq(2, 2 * PAGE)
    r = put(tree, child_tokens, states=[2 * PAGE, 4 * PAGE])
    parent, child = r.last_node.parent, r.last_node
    assert isinstance(parent, TreeNode)
    a1 = tree.alloc_host(2, 1)
    assert a1 is not None
    p1 = tree.begin_backup([parent], a1.kv_indices, a1.state_slots)
    a2 = tree.alloc_host(2, 1)
    assert a2 is not None
    p2 = tree.begin_backup([child], a2.kv_indices, a2.state_slots)
    with pytest.raises(TreeError):
        tree.abort_backup(p1)
    tree.check_integrity()
    tree.abort_backup(p2)
    tree.abort_backup(p1)
    assert tree.host_kv is not None and tree.host_mamba is not None
    for a in (a1, a2):
        tree.host_kv.free(a.kv_indices)
        tree.host_mamba.free(a.state_slots)
    tree.check_integrity()


def test_abort_refuses_while_another_copy_covers_the_nodes() -> None:
    tree, transfer = make_tree()
    upper = seq(1, 2 * PAGE)
    s = upper + seq(2, 2 * PAGE)
    r = put(tree, s, states=[2 * PAGE, 4 * PAGE])
    transfer.backup(r.backup_nodes)
    tree.evict_device(num_kv_pages=4, num_states=2)
    # Load the whole path (KV of both nodes and the deep state) …
    deep = tree.match_prefix(s)
    plan_deep = tree.begin_load(deep, tree.device_kv.alloc(4), int(tree.device_mamba.alloc(1)[0]))
    # … then the upper node's state alone, whose KV is now (being) loaded by the first plan.
    shallow = tree.match_prefix(upper)
    assert shallow.num_host_tokens == 0 and shallow.state_tier is Tier.HOST
    plan_shallow = tree.begin_load(shallow, torch.empty(0, dtype=torch.int64), int(tree.device_mamba.alloc(1)[0]))
    for plan in (plan_deep, plan_shallow):
        with pytest.raises(TreeError, match="also covers"):
            tree.abort_load(plan)
    tree.check_integrity()
    tree.finish_load(plan_shallow)
    released = tree.abort_load(plan_deep)  # alone now; the upper state stays (another plan's)
    tree.device_kv.free(released.kv_indices)
    tree.device_mamba.free(released.state_slots)
    m = tree.match_prefix(s)
    assert m.num_device_tokens == 0 and m.state_tier is Tier.HOST
    assert tree.match_prefix(upper).num_tokens == 2 * PAGE
    tree.check_integrity()


def test_backup_must_keep_host_copies_contiguous() -> None:
    tree, _ = make_tree()
    r = put(tree, seq(1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
    alloc = tree.alloc_host(2, 1)
    assert alloc is not None
    with pytest.raises(TreeError, match="contiguous"):
        tree.begin_backup([r.last_node], alloc.kv_indices, alloc.state_slots)
    assert tree.backup_pages_needed(r.backup_nodes) == (4, 2)
    tree.host_kv.free(alloc.kv_indices)  # type: ignore[union-attr]
    tree.host_mamba.free(alloc.state_slots)  # type: ignore[union-attr]
    tree.check_integrity()


def test_stale_match_is_refused() -> None:
    tree, transfer = make_tree()
    s = seq(1, 3 * PAGE)
    r = put(tree, s)
    transfer.backup(r.backup_nodes)
    tree.evict_device(num_kv_pages=3)
    m = tree.match_prefix(s)
    put(tree, s)  # the device copy is back: the match no longer describes the tree
    with pytest.raises(TreeError, match="stale"):
        tree.begin_load(m, torch.tensor([0, 1, 2]), 0)
    tree.check_integrity()


def test_host_eviction_and_archived_only() -> None:
    tree, transfer = make_tree()
    a, b = seq(1, 2 * PAGE), seq(2, 2 * PAGE)
    for s in (a, b):
        transfer.backup(put(tree, s).backup_nodes)
    tree.evict_device(num_kv_pages=4)
    ma = tree.match_prefix(a)
    tree.mark_archived(ma.last_node)
    tree.match_prefix(b)  # b is more recent, a is archived
    ev = tree.evict_host(num_kv_pages=2, archived_only=True)
    assert ev.num_kv_pages == 2 and ev.num_deleted_nodes == 1 and ev.tier is Tier.HOST
    assert tree.match_prefix(a).num_tokens == 0 and tree.match_prefix(b).num_tokens == 2 * PAGE
    assert tree.evict_host(num_kv_pages=2, archived_only=True).num_kv_pages == 0
    assert tree.evict_host(num_kv_pages=2).num_kv_pages == 2
    assert tree.stats().num_nodes == 0
    tree.check_integrity()


def test_insert_host_creates_host_only_nodes() -> None:
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    assert tree.host_kv is not None and tree.host_mamba is not None
    kv, slot = tree.host_kv.alloc(4), int(tree.host_mamba.alloc(1)[0])
    r = tree.insert_host(s, kv, host_states={4 * PAGE: slot})
    assert r.num_new_pages == 4 and r.num_new_states == 1
    m = tree.match_prefix(s)
    assert m.num_tokens == 4 * PAGE and m.num_host_tokens == 4 * PAGE and m.state_tier is Tier.HOST
    # Duplicates go back to the host pool.
    kv2, slot2 = tree.host_kv.alloc(4), int(tree.host_mamba.alloc(1)[0])
    r2 = tree.insert_host(s, kv2, host_states={4 * PAGE: slot2})
    assert r2.num_duplicate_pages == 4 and r2.num_freed_states == 1
    assert transfer.load(m) is not None
    tree.check_integrity()


def test_insert_host_past_a_prefix_already_on_the_host() -> None:
    tree, transfer = make_tree()
    prefix = seq(1, 3 * PAGE)
    r = put(tree, prefix, states=[3 * PAGE])
    transfer.backup(r.backup_nodes)
    longer = prefix + seq(2, 2 * PAGE)
    assert tree.host_kv is not None and tree.host_mamba is not None
    # The first 2 pages are on the host (inside the 3-page node): the tree splits there.
    kv, slot = tree.host_kv.alloc(3), int(tree.host_mamba.alloc(1)[0])
    tree.lock_host(r.last_node)
    res = tree.insert_host(longer, kv, host_states={5 * PAGE: slot}, start_page=2)
    tree.unlock_host(r.last_node)
    assert res.num_new_pages == 2 and res.num_duplicate_pages == 1
    m = tree.match_prefix(longer)
    assert m.num_tokens == 5 * PAGE and m.num_host_tokens == 2 * PAGE and m.state_tier is Tier.HOST
    tree.check_integrity()
    # Pages before start_page must be on the host.
    spare = tree.host_kv.alloc(1)
    assert spare is not None
    with pytest.raises(ConfigError, match="not all on the host"):
        tree.insert_host(seq(3, 2 * PAGE), spare, start_page=1)
    with pytest.raises(ConfigError, match="before start_page"):
        tree.insert_host(longer, spare, host_states={PAGE: slot}, start_page=4)
    tree.host_kv.free(spare)
    tree.check_integrity()


def test_no_host_tier_and_accounting_mode() -> None:
    tree, transfer = make_tree(host_pages=None, host_states=None, materialize=False)
    s = seq(1, 5 * PAGE)
    r = put(tree, s)
    assert r.backup_nodes == ()
    assert transfer.backup([r.last_node]) is None
    assert tree.alloc_host(1) is None
    with pytest.raises(ConfigError):
        tree.insert_host(s, torch.arange(5))
    ev = tree.evict_device(num_kv_pages=5)
    assert ev.num_kv_pages == 5 and ev.num_lost_states == 1
    tree.check_integrity()


def test_kv_only_host_tier_demotes_without_state() -> None:
    tree, transfer = make_tree(host_states=None)
    s = seq(1, 3 * PAGE)
    r = put(tree, s, states=[PAGE, 3 * PAGE])
    assert transfer.backup(r.backup_nodes) is not None
    assert tree.backup_pages_needed(tree.path_to(r.last_node)) == (0, 0)
    ev = tree.evict_device(num_kv_pages=3)
    assert ev.num_kv_pages == 3
    # States could not follow to the host: the path held nothing usable and is gone.
    assert tree.match_prefix(s).num_tokens == 0
    tree.check_integrity()


def test_bad_arguments_raise_config_errors() -> None:
    tree, _ = make_tree()
    s = seq(1, 2 * PAGE + 1)
    kv = tree.device_kv.alloc(2)
    assert kv is not None
    with pytest.raises(ConfigError):
        tree.insert(s, kv[:1])
    with pytest.raises(ConfigError):
        tree.insert(s, kv, states={3: 0})
    with pytest.raises(ConfigError):
        tree.insert(s, kv, states={3 * PAGE: 0})
    with pytest.raises(ConfigError):
        tree.insert(s, kv, states={PAGE: 0, 2 * PAGE: 0})
    with pytest.raises(ConfigError):
        tree.match_prefix(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(ConfigError):
        tree.match_prefix(np.zeros(4, dtype=np.float32))
    with pytest.raises(ConfigError):
        tree.evict_device(num_kv_pages=-1)
    tree.device_kv.free(kv)
    tree.check_integrity()


def test_token_inputs_are_equivalent() -> None:
    tree, _ = make_tree()
    s = seq(1, 3 * PAGE)
    put(tree, s)
    for t in (s, tuple(s), np.asarray(s, dtype=np.int32), torch.tensor(s)):
        assert tree.match_prefix(t).num_tokens == 3 * PAGE


@pytest.mark.parametrize("tokens", [[1.7] * 8, [1, 1, 1, 1, 1, 1, 1, 1.5], [True] * 8, [[1] * 4, [1] * 4], [None] * 8])
def test_a_list_of_token_ids_that_are_not_integers_is_refused(tokens: list[object]) -> None:
    """A list of floats was truncated: it matched, and was cached as, the prompt of its integer
    parts (arrays and tensors of a float dtype were refused already)."""
    tree, _ = make_tree()
    put(tree, [1] * 8)
    with pytest.raises(ConfigError, match="token ids must be"):
        tree.match_prefix(tokens)
    alloc = tree.alloc_device(2, 0)
    assert alloc is not None
    with pytest.raises(ConfigError, match="token ids must be"):
        tree.insert(tokens, alloc.kv_indices)
    tree.device_kv.free(alloc.kv_indices)
    tree.check_integrity()


def test_evicted_and_deleted_nodes_cannot_be_locked() -> None:
    tree, _ = make_tree(host_pages=None, host_states=None)
    r = put(tree, seq(1, PAGE))
    tree.evict_device(num_kv_pages=1)
    assert not r.last_node.alive
    with pytest.raises(TreeError):
        tree.lock(r.last_node)
