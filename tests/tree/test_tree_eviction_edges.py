"""Eviction and loading edge cases: parents (or, past a cascade, ancestors) that become leaves
during a ranked eviction, the ancestors a synchronous write-back backs up, a load that must keep
its host data while room is made, and a ranking whose scores must not depend on the order they
are computed in."""

from __future__ import annotations

import pytest
from tree_builders import PAGE, make_spec, make_tree, put, seq

from asynccache.errors import ConfigError
from asynccache.policy import LRUEviction
from asynccache.policy.cost_aware import CostAwareEviction
from asynccache.trace.flops import FlopModel


def cost_aware() -> CostAwareEviction:
    spec = make_spec()
    return CostAwareEviction(spec=spec, flops=FlopModel.from_spec(spec))


def test_a_ranked_eviction_takes_a_parent_its_victim_made_a_leaf() -> None:
    """A chain's parent is not evictable when the list is ranked (its child holds device KV);
    once the child goes in the same call, the parent is offered too, as LRU does."""
    for eviction in (LRUEviction(), cost_aware()):
        tree, _ = make_tree(device_pages=8, device_states=8, host_pages=None, host_states=None, eviction=eviction)
        put(tree, seq(1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])  # [0,2) with a state, child [2,4)
        alloc = tree.alloc_device(8, 0)
        assert alloc is not None, type(eviction).__name__
        assert tree.stats().device_kv_pages == 0
        tree.device_kv.free(alloc.kv_indices)
        tree.check_integrity()


def test_a_ranked_eviction_takes_the_ancestor_a_cascade_made_a_leaf() -> None:
    """A chain [0,1) [1,2) [2,4) whose middle node lost its state: evicting the last node deletes
    the stateless middle with it (tombstone cascade), which makes the first node a leaf; one
    call asked for every page frees it too (ranked orders offered only the deleted parent)."""
    for eviction in (LRUEviction(), cost_aware()):
        tree, _ = make_tree(device_pages=8, device_states=8, host_pages=None, host_states=None, eviction=eviction)
        tokens = seq(1, 4 * PAGE)
        put(tree, tokens, states=[PAGE, 2 * PAGE, 4 * PAGE])
        middle = tree.match_prefix(tokens[: 2 * PAGE]).last_node
        assert middle.end_tokens == 2 * PAGE
        assert tree.release_states([middle]).num_states == 1
        res = tree.evict_device(num_kv_pages=4)
        assert res.num_kv_pages == 4, type(eviction).__name__
        assert tree.stats().device_kv_pages == 0 and tree.stats().num_nodes == 0
        tree.check_integrity()


def test_a_synchronous_write_back_demotes_the_ancestors_it_backed_up() -> None:
    tree, _ = make_tree(device_pages=8, device_states=8, host_pages=32, host_states=8, write_policy="write_back")
    put(tree, seq(1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
    res = tree.evict_device(num_kv_pages=4)
    assert res.num_kv_pages == 4 and res.num_pending_kv_pages == 0
    assert tree.stats().device_kv_pages == 0 and tree.stats().host_kv_pages == 4
    assert tree.match_prefix(seq(1, 4 * PAGE)).num_tokens > 0  # still served, from the host
    tree.check_integrity()


def test_a_sync_load_keeps_its_host_data_while_making_device_room() -> None:
    """Making device room writes a victim back (write-back policy), which needs host room: the
    host copy the load is about to read must not be what gets evicted for it."""
    tree, transfer = make_tree(device_pages=4, device_states=2, host_pages=8, host_states=1, write_policy="write_back")
    prefix = seq(1, 2 * PAGE)
    put(tree, prefix)
    tree.evict_device(num_kv_pages=4)  # the prefix written back and demoted: host only
    put(tree, seq(2, 3 * PAGE))  # device only, filling the device
    match = tree.match_prefix(prefix)
    assert match.needs_load
    transfer.load(match)
    assert tree.match_prefix(prefix).num_tokens == match.num_tokens > 0
    tree.check_integrity()


def test_cost_aware_scores_do_not_depend_on_the_scan_order() -> None:
    """Efficiency is relative to the largest in the ranking, taken before any is scored: the
    oldest, least efficient state goes first, not the one scanned after a larger reference."""
    eviction = cost_aware()
    tree, _ = make_tree(device_pages=64, device_states=8, host_pages=None, host_states=None, eviction=eviction)
    nodes = {name: put(tree, seq(seed, pages * PAGE)).last_node for name, seed, pages in (("A", 1, 1), ("B", 2, 10), ("C", 3, 5))}
    tree.evict_device(num_states=1)
    assert [k for k, n in nodes.items() if n.device_state is None] == ["A"]


def test_cost_aware_remembers_every_state_its_evictions_lose() -> None:
    """The tree reports each eviction to the policy: every victim whose last state went is a
    ghost — the last victim of a KV eviction call too (the tree stops iterating the ranking
    there, so a check after each yield never saw it) — and one whose state only moved to the
    host is not."""
    policy = cost_aware()
    tree, _ = make_tree(device_pages=16, device_states=8, host_pages=None, host_states=None, eviction=policy)
    for i in range(3):
        put(tree, seq(10 + i, 2 * PAGE), states=[2 * PAGE])
    res = tree.evict_device(num_kv_pages=2)  # one leaf, the only victim of the call
    assert res.num_kv_pages == 2
    assert len(policy._ghosts._by_key) == 1
    tree.evict_device(num_kv_pages=4)
    assert len(policy._ghosts._by_key) == 3
    tree.check_integrity()

    policy = cost_aware()
    tree, _ = make_tree(device_pages=16, device_states=8, host_pages=32, host_states=8, eviction=policy,
                        write_policy="write_back")  # fmt: skip
    put(tree, seq(20, 2 * PAGE), states=[2 * PAGE])
    assert tree.evict_device(num_kv_pages=2).num_kv_pages == 2
    assert tree.match_prefix(seq(20, 2 * PAGE)).num_tokens > 0  # on the host now
    assert not policy._ghosts._by_key


def test_cost_aware_counts_a_state_victim_once_and_no_released_state() -> None:
    """A state victim the cascade then deletes is reported twice (its state list, then
    ``CASCADE``): one ghost. A released state is no victim, nor is the node the cascade after
    ``release_states`` deletes."""
    for host in (False, True):
        policy = cost_aware()
        tree, transfer = make_tree(eviction=policy, write_policy="write_through",
                                   host_pages=32 if host else None, host_states=8 if host else None)  # fmt: skip
        r = put(tree, seq(1, 2 * PAGE), states=[2 * PAGE])
        put(tree, seq(2, 2 * PAGE), states=[2 * PAGE])
        if host:
            transfer.backup(r.backup_nodes)
            tree.evict_device(num_kv_pages=4)  # both tiers' copies of the first on the host only
            before = len(policy._ghosts._order)
            res = tree.evict_host(num_states=1)
        else:
            before = len(policy._ghosts._order)
            res = tree.evict_device(num_states=1)
        assert res.num_states == 1 and res.num_deleted_nodes == 1
        assert len(policy._ghosts._order) - before == 1, host

    policy = cost_aware()
    tree, _ = make_tree(eviction=policy, host_pages=None, host_states=None)
    nodes = [put(tree, seq(i, 2 * PAGE), states=[2 * PAGE]).last_node for i in (1, 2)]
    tree.evict_device(num_states=1)  # a ranking: the survivor has terms
    (kept,) = [n for n in nodes if n.alive]
    assert kept.has_state
    before = len(policy._ghosts._order)
    assert tree.release_states([kept]).num_deleted_nodes == 1
    assert len(policy._ghosts._order) == before
    tree.check_integrity()


def test_counts_and_positions_that_are_not_integers_are_refused() -> None:
    """Typed errors for what is not a whole number, before anything changes."""
    tree, _ = make_tree()
    tokens = seq(1, 2 * PAGE)
    kv, slot = tree.device_kv.alloc(2), tree.device_mamba.alloc(1)
    assert kv is not None and slot is not None
    node = tree.insert(tokens, kv, states={2 * PAGE: int(slot[0])}).last_node
    calls = [
        lambda: tree.evict_device(num_kv_pages="2"),
        lambda: tree.evict_host(num_kv_pages=None),
        lambda: tree.evict_device(num_states=1.0),
        lambda: tree.alloc_device(True, 0),
        lambda: tree.host_gap(node, 1.5),
        lambda: tree.insert_host(tokens, [], start_page=1.0),
        lambda: tree.insert(tokens, tree.match_prefix(tokens).device_kv_indices, prompt_len="5"),
    ]
    for call in calls:
        with pytest.raises(ConfigError):
            call()
    assert tree.match_prefix(tokens).num_device_tokens == 2 * PAGE
    tree.check_integrity()
