"""``release_states``: freeing chosen states at once, KV kept, tombstone cascade."""

from __future__ import annotations

from tree_builders import PAGE, make_tree, put, seq

from asynccache.tree import Tier


def test_release_of_an_interior_state_keeps_its_kv_and_the_deeper_match() -> None:
    tree, _ = make_tree(host_pages=None, host_states=None)
    first = seq(1, 2 * PAGE)
    second = first + seq(2, 2 * PAGE)
    put(tree, first)
    put(tree, second)
    mid = tree.match_prefix(first).last_node
    assert mid.end_tokens == 2 * PAGE and mid.device_state is not None
    result = tree.release_states([mid])
    assert result.num_states == 1 and result.num_kv_pages == 0 and result.num_lost_states == 1
    assert mid.alive and mid.device_state is None and mid.device_kv is not None
    assert tree.match_prefix(first).num_tokens == 0  # no state there any more
    assert tree.match_prefix(second).num_tokens == 4 * PAGE  # the deeper state still serves
    tree.check_integrity()


def test_release_of_a_leaf_state_deletes_its_dead_kv_up_to_the_next_state() -> None:
    tree, _ = make_tree(host_pages=None, host_states=None)
    first = seq(1, 2 * PAGE)
    put(tree, first)
    leaf = put(tree, first + seq(2, 3 * PAGE)).last_node
    pages_before = tree.stats().device_kv_pages
    result = tree.release_states([leaf])
    assert result.num_states == 1 and result.num_kv_pages == 3 and result.num_deleted_nodes == 1
    assert not leaf.alive
    assert tree.stats().device_kv_pages == pages_before - 3
    assert tree.match_prefix(first + seq(2, 3 * PAGE)).num_tokens == 2 * PAGE
    tree.check_integrity()


def test_release_frees_host_copies_and_skips_locked_roots_and_dead_nodes() -> None:
    tree, transfer = make_tree()  # write_through: the host mirrors the device
    first = seq(1, 2 * PAGE)
    r = put(tree, first)
    assert transfer.backup(r.backup_nodes) is not None
    node = r.last_node
    assert node.device_state is not None and node.host_state is not None
    token = tree.lock(node)
    assert tree.release_states([node, tree.root]).num_states == 1  # host copy only: device is pinned
    assert node.device_state is not None and node.host_state is None
    tree.unlock(node, token)
    result = tree.release_states([node])
    assert result.num_states == 1 and not node.alive  # leaf without state: deleted on both tiers
    assert tree.release_states([node]).num_states == 0  # already gone
    assert tree.stats().host_kv_pages == 0 and tree.stats().device_kv_pages == 0
    assert result.tier is Tier.DEVICE
    tree.check_integrity()
