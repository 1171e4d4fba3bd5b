"""Deliberately broken trees: ``check_integrity`` names each broken invariant."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import pytest
import torch
from tree_builders import PAGE, make_tree, put, seq

from asynccache.tree import HybridRadixTree, MatchResult, SyncTransfer, TreeNode


def _tree() -> tuple[HybridRadixTree, SyncTransfer, TreeNode, TreeNode]:
    """root → parent (2 pages, state) → leaf (2 pages, state), backed up; plus another request."""
    tree, transfer = make_tree()
    r = put(tree, seq(1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
    transfer.backup(r.backup_nodes)
    put(tree, seq(2, 3 * PAGE))
    leaf = r.last_node
    parent = leaf.parent
    assert isinstance(parent, TreeNode) and parent.parent is tree.root
    tree.check_integrity()
    return tree, transfer, parent, leaf


def _broken(corrupt: Callable[[HybridRadixTree, TreeNode, TreeNode], None], pattern: str) -> None:
    tree, _, parent, leaf = _tree()
    corrupt(tree, parent, leaf)
    with pytest.raises(AssertionError, match=pattern):
        tree.check_integrity()


def test_healthy_tree_passes() -> None:
    tree, _, _, _ = _tree()
    tree.check_integrity()


def test_leaked_index() -> None:
    _broken(lambda t, p, l: t.device_kv.alloc(1) and None, r"\[ownership\].*leak")


def test_index_owned_twice() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        assert l.device_kv is not None and p.device_kv is not None
        t.device_kv.free(l.device_kv[:1])
        l.device_kv = torch.cat([p.device_kv[:1], l.device_kv[1:]])

    _broken(corrupt, r"\[ownership\].*owned twice")


def test_claimed_index_also_owned_by_a_node() -> None:
    _broken(lambda t, p, l: t.claim_in_flight("host_kv", l.host_kv[:1]), r"\[ownership\].*owned twice")  # type: ignore[index]


def test_owned_index_that_is_free() -> None:
    _broken(lambda t, p, l: t.host_kv.free(l.host_kv[:1]), r"\[ownership\].*owned but free")  # type: ignore[union-attr,index]


def test_lru_missing_member() -> None:
    _broken(lambda t, p, l: t.device_kv_lru.remove(l), r"\[lru\]")


def test_lru_stale_member() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        slot = l.device_state
        l.device_state = None
        t.device_mamba.free([slot])  # type: ignore[list-item]

    _broken(corrupt, r"\[lru\].*device_state")


def test_lru_broken_links() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        slot = t.host_kv_lru._p
        l.links[slot] = l  # prev pointer to itself

    _broken(corrupt, r"\[lru\]")


def test_state_without_kv_on_its_tier() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        t.device_kv.free(t._clear_device_kv(l))  # leaf keeps its device state

    _broken(corrupt, r"\[tiers\].*device state without device KV")


def test_device_kv_not_prefix_closed() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        t.device_mamba.free([t._clear_device_state(p)])
        t.device_kv.free(t._clear_device_kv(p))  # the parent leaves the device, the leaf stays

    _broken(corrupt, r"\[tiers\].*parent does not")


def test_host_copies_not_contiguous() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        t.host_mamba.free([t._clear_host_state(p)])  # type: ignore[union-attr]
        t.host_kv.free(t._clear_host_kv(p))  # type: ignore[union-attr]

    _broken(corrupt, r"\[contiguity\]")


def test_node_without_kv() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        for n in t.iter_nodes():
            if n.host_kv is None and not n.children:  # the second request: device only
                t.device_mamba.free([t._clear_device_state(n)])
                t.device_kv.free(t._clear_device_kv(n))

    _broken(corrupt, r"\[tiers\].*no tier")


def test_negative_lock_count() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        l.host_lock = -1

    _broken(corrupt, r"\[locks\].*negative")


def test_loading_without_a_load_plan() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        l.loading = 1

    _broken(corrupt, r"\[locks\].*loading")


def test_in_flight_plan_node_not_pinned() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        other = next(n for n in t.iter_nodes() if n.host_kv is None)
        alloc = t.alloc_host(other.num_pages, 1)
        assert alloc is not None
        t.begin_backup([other], alloc.kv_indices, alloc.state_slots)
        other.device_lock = 0
        t._device_locked_pages -= other.num_pages

    _broken(corrupt, r"\[locks\].*in-flight")


def test_counters() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        t._host_pages += 1

    _broken(corrupt, r"\[counters\].*host pages")


def test_child_counters() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        p.num_host_children = 0

    _broken(corrupt, r"\[counters\].*child counters")


def test_structure_wrong_offset() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        l.start_page += 1

    _broken(corrupt, r"\[structure\].*starts at page")


def test_structure_child_under_wrong_key() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        l.key = bytes(len(l.key))

    _broken(corrupt, r"\[structure\].*another first page")


def test_deleted_node_still_reachable() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        l.alive = False

    _broken(corrupt, r"\[structure\].*deleted")


def test_root_holding_data() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        t.root.device_state = 3

    _broken(corrupt, r"\[structure\].*root")


def test_wrong_cached_page_hashes() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        hashes = l.raw_page_hashes()
        hashes[0] = bytes(16)

    _broken(corrupt, r"\[hashes\]")


def test_match_past_the_available_state() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        # A broken match that ignores where states are: it reports every matched page.
        original = t._match

        def broken(self: HybridRadixTree, buf: bytes, num_pages: int, salt: str, *, touch: bool) -> MatchResult:
            r = original(buf, num_pages, salt, touch=touch)
            return dataclasses.replace(r, num_tokens=r.num_matched_tokens)

        # Make the state that bounds the match disappear consistently, then break the match.
        t.host_mamba.free([t._clear_host_state(l)])  # type: ignore[union-attr]
        t.device_mamba.free([t._clear_device_state(l)])
        t._match = types.MethodType(broken, t)  # type: ignore[method-assign]

    _broken(corrupt, r"\[match\]")


def test_match_reporting_a_dropped_state_tier() -> None:
    def corrupt(t: HybridRadixTree, p: TreeNode, l: TreeNode) -> None:
        original = t._match

        def broken(self: HybridRadixTree, buf: bytes, num_pages: int, salt: str, *, touch: bool) -> MatchResult:
            r = original(buf, num_pages, salt, touch=touch)
            return dataclasses.replace(r, num_device_tokens=r.num_tokens, num_host_tokens=0)

        t.device_mamba.free([t._clear_device_state(l)])
        t.device_kv.free(t._clear_device_kv(l))  # the leaf is on the host only now
        t._match = types.MethodType(broken, t)  # type: ignore[method-assign]

    _broken(corrupt, r"\[match\].*device tokens")
