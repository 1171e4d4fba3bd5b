"""Copies of what was computed on a load that then fails. While a load is in flight, a request may
compute on what it brings and insert the result; a backup may copy that to the host, and the
host copy may be archived to storage. A failed copy's undo drops the device data (as before)
and now those host copies too, whether or not the device copy is still there (a host copy of
data that rests on nothing pending stays); it is refused while such a host copy is in use, and
a cancel is refused while one exists; and the tree reports the storage keys that data would
have been stored under (``stale_hook``)."""

from __future__ import annotations

from typing import Any

import pytest
from test_tree_pending_loads import free, on_host, owner_load, state_on_host_only
from tree_builders import PAGE, make_tree, put, seq

from asynccache.tree import HybridRadixTree, SyncTransfer, Tier, TreeError

Heard = list[tuple[frozenset[str], frozenset[str]]]


def host_free(tree: HybridRadixTree) -> tuple[int, int]:
    assert tree.host_kv is not None and tree.host_mamba is not None
    return tree.host_kv.num_free, tree.host_mamba.num_free


def hear_stale(tree: HybridRadixTree) -> Heard:
    """What ``stale_hook`` hears from now on."""
    heard: Heard = []
    tree.stale_hook = lambda kv, states: heard.append((kv, states))
    return heard


def backed_up(transfer: SyncTransfer, node: Any) -> None:
    assert transfer.backup([node]) is not None
    assert node.host_kv is not None


def branch_on_pending_state(tree: HybridRadixTree, transfer: SyncTransfer) -> tuple[Any, int, list[int], Any, Any]:
    """``upper``'s state on the host only (its KV and a deeper node on the device, computed
    before), an owner's load of that state in flight, and meanwhile a branch computed on it,
    inserted and backed up; the deeper node is backed up meanwhile too. Returns the load's
    owner match and token, the branch's tokens, its node and the deeper node."""
    upper, deep = state_on_host_only(tree, transfer)
    owner, plan, owner_token = owner_load(tree, upper)
    branch = upper + seq(3, 2 * PAGE)
    node = put(tree, branch, states=[4 * PAGE]).last_node
    backed_up(transfer, node)
    deep_node = tree.match_prefix(deep).last_node
    backed_up(transfer, deep_node)  # computed before the load: not on it
    return (owner, plan, owner_token), branch, node, deep_node


def test_a_failed_state_load_drops_the_host_copy_of_what_was_computed_on_it() -> None:
    """The copy of a state alone fails: the branch computed on it leaves the device and the
    host (no copy on any tier: the node goes), and its storage keys are reported; the node that
    was computed before the load keeps the host copy made of it meanwhile."""
    tree, transfer = make_tree()
    heard = hear_stale(tree)
    (owner, plan, owner_token), branch, node, deep_node = branch_on_pending_state(tree, transfer)
    keys = frozenset(node.page_hashes)
    hosted = host_free(tree)
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    assert not node.alive and host_free(tree) == (hosted[0] + 2, hosted[1] + 1)
    assert tree.match_prefix(branch).num_tokens == 2 * PAGE
    assert deep_node.alive and deep_node.host_kv is not None and deep_node.host_state is not None
    assert heard == [(keys, keys)]
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()


def test_a_host_copy_left_alone_on_the_host_goes_too_and_waits_while_in_use() -> None:
    """The branch's device copy was evicted (demoted: only its host copy is left): a cancel is
    refused (that copy rests on the load), a failure's undo waits while the host copy is read
    (an archive's ``lock_host``), then drops it."""
    tree, transfer = make_tree()
    heard = hear_stale(tree)
    (owner, plan, owner_token), branch, node, _ = branch_on_pending_state(tree, transfer)
    tree.evict_device(num_kv_pages=100, num_states=100)
    assert node.alive and node.device_kv is None and node.host_kv is not None
    with pytest.raises(TreeError, match="already uses the loaded state"):
        tree.abort_load(plan)
    tree.lock_host(node)
    with pytest.raises(TreeError, match="in use"):
        tree.abort_load(plan, drop_below=True)
    assert node.host_kv is not None and not heard and tree.active_plans == (plan,)
    tree.check_integrity()
    tree.unlock_host(node)
    hosted = host_free(tree)
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    assert not node.alive and host_free(tree) == (hosted[0] + 2, hosted[1] + 1)
    assert tree.match_prefix(branch).num_tokens == 2 * PAGE and len(heard) == 1
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()


def test_a_backup_still_writing_what_was_computed_on_a_failed_load_holds_its_undo() -> None:
    """A backup of the branch is still in flight when the load fails: the undo waits for it
    (its host pages are being written), and goes through once it finished."""
    tree, transfer = make_tree()
    upper, _ = state_on_host_only(tree, transfer)
    owner, plan, owner_token = owner_load(tree, upper)
    node = put(tree, upper + seq(3, 2 * PAGE), states=[4 * PAGE]).last_node
    alloc = tree.alloc_host(2, 1)
    assert alloc is not None
    backup = tree.begin_backup([node], alloc.kv_indices, alloc.state_slots)
    with pytest.raises(TreeError, match="in use"):
        tree.abort_load(plan, drop_below=True)
    tree.finish_backup(backup)
    hosted = host_free(tree)
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    assert not node.alive and host_free(tree) == (hosted[0] + 2, hosted[1] + 1)
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()


def test_a_failed_kv_load_drops_the_host_copies_below_its_nodes_and_keeps_its_sources() -> None:
    """A load of KV pages fails after a branch computed on them was inserted below and backed
    up: the branch leaves both tiers (its keys reported), while the loaded nodes keep the host
    copies the load read, and a new match loads them afresh."""
    tree, transfer = make_tree()
    heard = hear_stale(tree)
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, owner_token = owner_load(tree, s)
    node = put(tree, s + seq(2, 2 * PAGE), states=[6 * PAGE]).last_node
    backed_up(transfer, node)
    keys = frozenset(node.page_hashes)
    hosted = host_free(tree)
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    assert not node.alive and host_free(tree) == (hosted[0] + 2, hosted[1] + 1)
    again = tree.match_prefix(s + seq(2, 2 * PAGE))
    assert again.num_tokens == 4 * PAGE and again.state_tier is Tier.HOST and again.needs_load
    (kv_keys, state_keys), = heard
    assert kv_keys == keys and keys <= state_keys  # (the loaded pages' state keys too)
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()


def test_a_branch_off_an_upper_loaded_node_leaves_the_host_too() -> None:
    """A load of KV pages covers two nodes (A | B); a branch C computed meanwhile hangs off A,
    not below the load's last node, and is backed up. The failure drops C from both tiers: a
    later match of A + C is not offered the host copy computed on A's pages that never came."""
    tree, transfer = make_tree()
    heard = hear_stale(tree)
    a, b, c = seq(1, 2 * PAGE), seq(2, 2 * PAGE), seq(4, 2 * PAGE)
    on_host(tree, transfer, a + b, [4 * PAGE])
    on_host(tree, transfer, a + seq(3, 2 * PAGE), [4 * PAGE])  # the prefix splits: A | B, A | X
    owner, plan, owner_token = owner_load(tree, a + b)
    assert len(plan.nodes) == 2
    node = put(tree, a + c, states=[4 * PAGE]).last_node
    assert node.parent is plan.nodes[0]
    backed_up(transfer, node)
    keys = frozenset(node.page_hashes)
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    assert not node.alive
    again = tree.match_prefix(a + c)
    assert again.num_tokens == 0 and again.num_host_tokens == 0
    assert keys <= heard[0][0]
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()


def test_a_state_given_to_a_loaded_node_and_backed_up_does_not_block_the_undo() -> None:
    """An insert gives a loaded node a state meanwhile (the loaded node splits), and a backup
    copies that state to the host. The failure's undo goes through at once — the load's own
    pin on that node is no one else's use of its host copy — and drops that host state."""
    tree, transfer = make_tree()
    a, b = seq(1, 2 * PAGE), seq(2, 2 * PAGE)
    on_host(tree, transfer, a + b, [4 * PAGE])
    owner, plan, owner_token = owner_load(tree, a + b)
    put(tree, a, states=[2 * PAGE])
    node = tree.match_prefix(a).last_node
    assert node.loading and node.device_state is not None
    assert transfer.backup([node]) is not None and node.host_state is not None
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    assert node.alive and node.host_state is None and node.host_kv is not None
    assert tree.active_plans == ()
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()
