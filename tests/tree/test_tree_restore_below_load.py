"""Host copies restored from storage below a load in flight go with that load if its copy fails.

While a host → device load is in flight, a request may compute on what it brings; a backup
copies that to the host, an archive to storage; evictions may then drop every tree copy of it,
and a prefetch restore it from storage (``insert_host``) below the loading nodes — all before
the load's failure is known. A restore cannot tell data computed on the load from data computed
before, so the failed copy's undo (``abort_load(drop_below=True)``) drops every host copy
restored below the loaded nodes meanwhile (for a load of a state alone: below that state), as it
drops the host copies backups made of data computed on the load; it waits while one is in use.
A load that lands keeps them. The nodes left holding keys the undo reports (``stale_hook``: the
storage tier may delete their objects) are no longer marked archived.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_tree_pending_loads import free, on_host, owner_load, state_on_host_only
from tree_builders import PAGE, make_tree, put, seq

from asynccache.tree import (
    HybridRadixTree,
    LoadPlan,
    SyncTransfer,
    Tier,
    TreeError,
    TreeNode,
)

Heard = list[tuple[frozenset[str], frozenset[str]]]


def host_free(tree: HybridRadixTree) -> tuple[int, int]:
    assert tree.host_kv is not None and tree.host_mamba is not None
    return tree.host_kv.num_free, tree.host_mamba.num_free


def computed_archived_evicted(tree: HybridRadixTree, transfer: SyncTransfer, branch: list[int], state: int) -> None:
    """``branch`` computed on the load in flight, backed up (then archived), and evicted from
    the device and the host: the tree holds no copy of it any more."""
    node = put(tree, branch, states=[state]).last_node
    assert transfer.backup([node]) is not None
    tree.evict_device(num_kv_pages=100, num_states=100)
    tree.evict_host(num_kv_pages=100, num_states=100)
    assert not node.alive


def restore(tree: HybridRadixTree, tokens: list[int], start_page: int) -> Any:
    """``tokens`` read from storage past ``start_page`` with the state at their end, inserted
    as a prefetch does; returns the node restored last."""
    alloc = tree.alloc_host(len(tokens) // PAGE - start_page, 1)
    assert alloc is not None and alloc.state_slot is not None
    res = tree.insert_host(tokens, alloc.kv_indices, host_states={len(tokens): alloc.state_slot}, start_page=start_page)
    return res.last_node


def fail(tree: HybridRadixTree, plan: LoadPlan, owner: Any, token: int) -> None:
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    tree.unlock(owner.last_node, token)


def test_a_restore_below_a_failed_kv_load_leaves_the_host() -> None:
    tree, transfer = make_tree()
    heard: Heard = []
    tree.stale_hook = lambda kv, states: heard.append((kv, states))
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, token = owner_load(tree, s)
    branch = s + seq(2, 2 * PAGE)
    computed_archived_evicted(tree, transfer, branch, 6 * PAGE)
    hosted = host_free(tree)
    node = restore(tree, branch, 4)
    assert tree.match_prefix(branch).num_tokens == 6 * PAGE
    fail(tree, plan, owner, token)
    assert not node.alive and host_free(tree) == hosted
    again = tree.match_prefix(branch)  # the loaded prefix again, from its host copy
    assert again.num_tokens == 4 * PAGE and again.state_tier is Tier.HOST and again.needs_load
    assert set(node.page_hashes) <= heard[0][0]
    tree.check_integrity()


def test_a_restore_below_a_failed_state_load_leaves_the_host() -> None:
    tree, transfer = make_tree()
    upper, _ = state_on_host_only(tree, transfer)
    owner, plan, token = owner_load(tree, upper)
    assert plan.num_kv_pages == 0
    branch = upper + seq(3, 2 * PAGE)
    computed_archived_evicted(tree, transfer, branch, 4 * PAGE)
    hosted = host_free(tree)
    node = restore(tree, branch, 2)
    fail(tree, plan, owner, token)
    assert not node.alive and host_free(tree) == hosted
    assert tree.match_prefix(branch).num_tokens == 2 * PAGE  # back to the state on the host
    tree.check_integrity()


def restored_below_a_kv_load() -> tuple[HybridRadixTree, Any, LoadPlan, int, list[int], TreeNode]:
    """A 4-page prefix loaded from the host (in flight), and a 2-page branch below it computed,
    archived and evicted, then restored: (tree, the owner's match, the load, its lock token, the
    branch, the restored node)."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, token = owner_load(tree, s)
    branch = s + seq(2, 2 * PAGE)
    computed_archived_evicted(tree, transfer, branch, 6 * PAGE)
    return tree, owner, plan, token, branch, restore(tree, branch, 4)


def test_a_restored_copy_in_use_holds_the_undo_and_one_elsewhere_stays() -> None:
    tree, owner, plan, token, _, node = restored_below_a_kv_load()
    elsewhere = restore(tree, seq(5, 3 * PAGE), 0)  # below no load
    with pytest.raises(TreeError, match="already uses the loaded pages"):
        tree.abort_load(plan)  # a cancel is refused: the restore may rest on the load
    tree.lock_host(node)  # e.g. read by an archive
    with pytest.raises(TreeError, match="in use"):
        tree.abort_load(plan, drop_below=True)
    assert node.host_kv is not None and tree.active_plans == (plan,)
    tree.unlock_host(node)
    fail(tree, plan, owner, token)
    assert not node.alive and elsewhere.alive and elsewhere.host_kv is not None
    tree.check_integrity()


def test_a_restore_below_a_load_that_lands_stays() -> None:
    tree, owner, plan, token, branch, node = restored_below_a_kv_load()
    tree.finish_load(plan)
    tree.unlock(owner.last_node, token)
    m = tree.match_prefix(branch)
    assert node.alive and m.num_tokens == 6 * PAGE and m.num_host_tokens == 2 * PAGE
    tree.check_integrity()


def test_nodes_left_holding_reported_keys_are_no_longer_archived() -> None:
    """A load of KV pages fails after a state was computed on them: its state keys cover the
    loaded nodes' pages (a storage-only snapshot may have stored one there), so the storage
    tier may delete what is stored under them; the loaded nodes stay, unmarked."""
    tree, transfer = make_tree()
    heard: Heard = []
    tree.stale_hook = lambda kv, states: heard.append((kv, states))
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    loaded = tree.match_prefix(s).last_node
    tree.mark_archived(loaded)
    owner, plan, token = owner_load(tree, s)
    put(tree, s + seq(2, 2 * PAGE), states=[6 * PAGE])
    fail(tree, plan, owner, token)
    assert loaded.alive and loaded.host_kv is not None and not loaded.archived
    assert set(loaded.page_hashes) <= heard[0][1]
    tree.check_integrity()
