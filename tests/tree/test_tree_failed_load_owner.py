"""A failed load whose owner still holds its match: the owner locked the prefix before the load
began (no reader of it), but computes on the loaded pages — a copy that fails after the step's
last layer was issued (the boundary state into the node's own slot) leaves the owner's forward
running on them — and passes them back in its insert. The failed copy's pages and slot leave
the tree at once but stay out of the pools until every lock on the loaded nodes is released,
the owner's included; a cancel still ignores the owner's lock."""

from __future__ import annotations

import pytest
import torch
from test_tree_pending_loads import on_host, owner_load, state_on_host_only
from tree_builders import PAGE, make_tree, seq

from asynccache.errors import StaleMatchError
from asynccache.tree import HybridRadixTree, Tier


def pool_free(tree: HybridRadixTree) -> tuple[int, int]:
    return tree.device_kv.num_free, tree.device_mamba.num_free


def test_a_failed_load_keeps_its_pages_from_the_pool_while_its_owner_holds_them() -> None:
    """No reader: the owner alone holds the failed load's nodes. Its pages and slot leave the
    tree (a new match loads the prefix afresh), are not returned for freeing, and are refused
    in the owner's insert (nothing changed); the owner's unlock frees them."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, owner_token = owner_load(tree, s)
    loaded_kv, loaded_slot = plan.device_kv_indices.clone(), plan.device_state_slot
    assert loaded_slot is not None
    num_free = pool_free(tree)
    released = tree.abort_load(plan, drop_below=True)
    assert released.kv_indices.numel() == 0 and released.state_slots.numel() == 0
    assert pool_free(tree) == num_free  # held for the owner, which computes on them
    (retired,) = tree._pending.retired
    assert torch.equal(retired.kv_indices, loaded_kv) and retired.state_slots.tolist() == [loaded_slot]
    assert list(retired.readers) == [owner_token]
    again = tree.match_prefix(s)
    assert again.needs_load and not again.pending_load and again.num_device_tokens == 0
    tree.check_integrity()
    # The owner finishes: its insert of the match's pages and its own is refused, nothing changed.
    longer = s + seq(2, 2 * PAGE)
    own = tree.device_kv.alloc(2)
    slot = tree.device_mamba.alloc(1)
    assert own is not None and slot is not None
    before = (pool_free(tree), tree.stats())
    with pytest.raises(StaleMatchError):
        tree.insert(longer, torch.cat([loaded_kv, own]), states={len(longer): int(slot[0])})
    assert (pool_free(tree), tree.stats()) == before
    tree.device_kv.free(own)  # the owner frees what it allocated itself
    tree.device_mamba.free(slot)
    tree.check_integrity()
    tree.unlock(owner.last_node, owner_token)
    assert pool_free(tree) == (num_free[0] + 4, num_free[1] + 1) and not tree._pending.retired
    tree.check_integrity()


@pytest.mark.parametrize("last", ["owner", "reader"])
def test_a_failed_load_with_an_owner_and_a_reader_frees_with_the_last_of_them(last: str) -> None:
    """The owner's lock and a reader's both hold the retired pages: whichever is released last
    frees them."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, owner_token = owner_load(tree, s)
    reader = tree.match_prefix(s)
    assert reader.pending_load
    reader_token = tree.lock(reader.last_node)
    num_free = pool_free(tree)
    assert tree.abort_load(plan, drop_below=True).kv_indices.numel() == 0
    assert sorted(tree._pending.retired[0].readers) == sorted([owner_token, reader_token])
    order = [(owner.last_node, owner_token), (reader.last_node, reader_token)]
    if last == "owner":
        order.reverse()
    tree.unlock(*order[0])
    assert pool_free(tree) == num_free and len(tree._pending.retired) == 1
    tree.check_integrity()
    tree.unlock(*order[1])
    assert pool_free(tree) == (num_free[0] + 4, num_free[1] + 1) and not tree._pending.retired
    tree.check_integrity()


def test_a_failed_load_of_a_state_alone_keeps_its_slot_while_its_owner_holds_it() -> None:
    """A load of the boundary state alone: the slot leaves the node and returns to the pool
    with the owner's unlock; the KV, on the device before the load, stays the tree's."""
    tree, transfer = make_tree()
    upper, _ = state_on_host_only(tree, transfer)
    owner, plan, owner_token = owner_load(tree, upper)
    assert plan.num_kv_pages == 0 and plan.device_state_slot is not None
    num_free = pool_free(tree)
    released = tree.abort_load(plan, drop_below=True)
    assert released.state_slots.numel() == 0 and pool_free(tree) == num_free
    node = owner.last_node
    assert node.device_state is None and node.device_kv is not None
    assert tree.match_prefix(upper).state_tier is Tier.HOST
    tree.check_integrity()
    tree.unlock(node, owner_token)
    assert pool_free(tree) == (num_free[0], num_free[1] + 1) and not tree._pending.retired
    tree.check_integrity()


def test_a_cancel_still_ignores_the_owner_s_lock() -> None:
    """Without ``drop_below`` (a queued load cancelled) the owner's lock, taken before the load
    began, neither refuses the cancel nor holds the indices: they are returned for freeing."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, owner_token = owner_load(tree, s)
    released = tree.abort_load(plan)
    assert released.kv_indices.numel() == 4 and released.state_slots.numel() == 1
    assert not tree._pending.retired
    tree.device_kv.free(released.kv_indices)
    tree.device_mamba.free(released.state_slots)
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()
