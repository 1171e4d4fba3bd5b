"""What the storage tier needs from the tree to extend the KV a match already holds: the node
holding the last matched page (``MatchResult.matched_node``), the nodes to back up so those
pages get host copies (``host_gap``), and a state for a prefix the host holds
(``insert_host`` with a state at ``start_page``)."""

from __future__ import annotations

import pytest
from tree_builders import PAGE, check_contents, make_tree, put, seq

from asynccache.errors import ConfigError
from asynccache.tree import Tier


def test_matched_node_is_the_node_holding_the_last_matched_page() -> None:
    tree, _ = make_tree()
    a = seq(1, 6 * PAGE)
    put(tree, a, states=[2 * PAGE])  # nodes [0, 2) with a state and [2, 6) without one
    # A prompt that branches off inside [2, 6), at page 4.
    m = tree.match_prefix(a[: 4 * PAGE] + seq(2, 2 * PAGE))
    assert m.num_tokens == 2 * PAGE and m.num_matched_tokens == 4 * PAGE
    assert m.matched_node is not None and (m.matched_node.start_page, m.matched_node.end_page) == (2, 6)
    assert m.last_node is m.matched_node.parent
    # A prompt that ends on a node boundary: the node ending there.
    m = tree.match_prefix(a[: 2 * PAGE])
    assert m.matched_node is m.last_node and m.last_node.end_page == 2
    # Branching off at the root, and a salt the tree has never seen: the root.
    assert tree.match_prefix(seq(3, 3 * PAGE)).matched_node is tree.root
    m = tree.match_prefix(a, salt="other")
    assert m.matched_node is m.last_node and m.last_node.parent is None


def test_host_gap_splits_the_node_it_ends_in_and_a_backup_fills_it() -> None:
    tree, transfer = make_tree()
    a = seq(1, 6 * PAGE)
    r = put(tree, a, states=[2 * PAGE, 6 * PAGE])
    top = tree.path_to(r.last_node)[0]
    assert transfer.backup([top]) is not None  # [0, 2) on the host too; [2, 6) on the device only
    node = r.last_node
    token = tree.lock(node)
    tree.lock_host(node)
    gap = tree.host_gap(node, 4)
    assert [(n.start_page, n.end_page) for n in gap] == [(2, 4)]  # split at page 4: nothing past it
    assert (node.start_page, node.end_page) == (4, 6) and node.parent is gap[0]
    assert gap[0].device_lock == node.device_lock and gap[0].host_lock == node.host_lock
    assert tree.host_gap(node, 2) == [] and tree.host_gap(node, 0) == []
    plan = transfer.backup(gap)
    assert plan is not None and plan.num_kv_pages == 2 and plan.num_states == 0
    assert tree.host_gap(node, 4) == []
    # The first 4 pages are on the host now: a fetched state for page 4 can go there.
    assert tree.host_mamba is not None
    slot = int(tree.host_mamba.alloc(1)[0])
    res = tree.insert_host(a[: 4 * PAGE], [], host_states={4 * PAGE: slot}, start_page=4)
    assert res.num_new_pages == 0 and res.num_new_states == 1 and res.last_node is gap[0]
    tree.unlock(node, token)
    tree.unlock_host(node)
    m = tree.match_prefix(a[: 5 * PAGE])
    assert m.num_tokens == 4 * PAGE and m.state_tier is Tier.HOST
    assert m.last_node is gap[0] and gap[0].host_state == slot
    tree.check_integrity()
    check_contents(tree, a, tree.match_prefix(a))


def test_host_gap_refuses_pages_past_the_node() -> None:
    tree, _ = make_tree()
    r = put(tree, seq(1, 3 * PAGE))
    with pytest.raises(ConfigError, match="outside the path"):
        tree.host_gap(r.last_node, 4)
    with pytest.raises(ConfigError, match="outside the path"):
        tree.host_gap(tree.root, 1)
    assert tree.host_gap(tree.root, 0) == []
