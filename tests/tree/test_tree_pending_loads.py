"""Loads in flight and what depends on them: the loads a match reads (``pending_loads``), locks
taken on loading nodes by other requests (readers), what an insert computes below a pending
state (dependents), and what undoing a load does with each."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tree_builders import PAGE, check_contents, make_tree, put, seq

from asynccache.errors import AllocationError, StaleMatchError
from asynccache.policy import EveryPageAdmission
from asynccache.tree import (
    HybridRadixTree,
    LoadPlan,
    MatchResult,
    SyncTransfer,
    Tier,
    TreeError,
    pending,
)


def on_host(tree: HybridRadixTree, transfer: SyncTransfer, tokens: list[int], states: list[int]) -> None:
    """``tokens`` inserted with ``states``, backed up, and gone from the device."""
    r = put(tree, tokens, states=states)
    assert transfer.backup(r.backup_nodes) is not None
    tree.evict_device(num_kv_pages=100, num_states=100)


def owner_load(tree: HybridRadixTree, tokens: list[int]) -> tuple[MatchResult, LoadPlan, int]:
    """A request matches ``tokens``, locks its match (before its load, as an owner does) and
    begins the load it needs: returns the match, the load and the owner's lock token."""
    m = tree.match_prefix(tokens)
    assert m.needs_load
    token = tree.lock(m.last_node)
    alloc = tree.alloc_device(m.num_load_kv_pages, m.num_load_states)
    assert alloc is not None
    return m, tree.begin_load(m, alloc.kv_indices, alloc.state_slot), token


def free(tree: HybridRadixTree, kv: torch.Tensor, slots: torch.Tensor) -> None:
    tree.device_kv.free(kv)
    tree.device_mamba.free(slots)


def failed_under_reader(
    tree: HybridRadixTree, transfer: SyncTransfer, tokens: list[int]
) -> tuple[MatchResult, int, int]:
    """``tokens`` on the host; a load of them fails while a second request holds them (the
    owner has left): returns that request's locked match, the state slot it was told of and
    its lock token."""
    on_host(tree, transfer, tokens, [len(tokens)])
    owner, plan, owner_token = owner_load(tree, tokens)
    reader = tree.match_prefix(tokens)
    assert reader.pending_load and reader.last_node.device_state is not None
    reader_token = tree.lock(reader.last_node)
    slot = reader.last_node.device_state
    assert tree.abort_load(plan, drop_below=True).kv_indices.numel() == 0
    tree.unlock(owner.last_node, owner_token)
    return reader, slot, reader_token


def state_on_host_only(tree: HybridRadixTree, transfer: SyncTransfer) -> tuple[list[int], list[int]]:
    """``upper`` (2 pages) with its state on the host only and its KV on the device, and below
    it ``deep`` (2 more pages) on the device with its own state: data computed before any load."""
    upper = seq(1, 2 * PAGE)
    deep = upper + seq(2, 2 * PAGE)
    on_host(tree, transfer, upper, [2 * PAGE])
    put(tree, deep, states=[4 * PAGE])  # the upper pages come back to the device, not their state
    m = tree.match_prefix(upper)
    assert m.state_tier is Tier.HOST and m.num_host_tokens == 0
    return upper, deep


def test_a_cancel_is_refused_while_another_request_holds_what_the_load_brings() -> None:
    """A second request matched the pages while they were loading and locked them: cancelling the
    load would free pages it reads. The owner's own lock, taken before the load began, does not
    count; once the other request unlocks, the cancel goes through."""
    tree, transfer = make_tree()
    upper = seq(1, 2 * PAGE)
    s = upper + seq(2, 2 * PAGE)
    on_host(tree, transfer, s, [2 * PAGE, 4 * PAGE])
    owner, plan, owner_token = owner_load(tree, s)  # the KV of both nodes and the deep state
    second = tree.match_prefix(upper)
    assert second.pending_load and tree.pending_loads(second) == (plan,)
    second_token = tree.lock(second.last_node)
    with pytest.raises(TreeError, match="may read what it brings"):
        tree.abort_load(plan)
    assert tree.active_plans == (plan,) and second.last_node.device_kv is not None
    tree.check_integrity()
    tree.unlock(second.last_node, second_token)
    released = tree.abort_load(plan)  # only the owner holds the nodes now
    free(tree, released.kv_indices, released.state_slots)
    tree.unlock(owner.last_node, owner_token)
    assert tree.match_prefix(s).num_device_tokens == 0
    tree.check_integrity()


def test_a_failed_load_keeps_its_pages_from_the_pool_until_its_readers_unlock() -> None:
    """The copy failed while a second request holds the pages: they leave the tree at once (a
    new match loads them afresh), but go back to the pool only when that request unlocks."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, owner_token = owner_load(tree, s)
    second = tree.match_prefix(s)
    assert second.pending_load and tree.match_is_current(second)
    second_token = tree.lock(second.last_node)
    num_free = (tree.device_kv.num_free, tree.device_mamba.num_free)
    released = tree.abort_load(plan, drop_below=True)
    assert released.kv_indices.numel() == 0 and released.state_slots.numel() == 0
    again = tree.match_prefix(s)
    assert again.needs_load and not again.pending_load and again.num_device_tokens == 0
    assert not tree.match_is_current(second)
    tree.check_integrity()
    tree.unlock(owner.last_node, owner_token)
    assert (tree.device_kv.num_free, tree.device_mamba.num_free) == num_free  # the second one still holds them
    tree.unlock(second.last_node, second_token)
    assert (tree.device_kv.num_free, tree.device_mamba.num_free) == (num_free[0] + 4, num_free[1] + 1)
    tree.check_integrity()
    # Loaded afresh, it serves the right bytes.
    assert transfer.load(tree.match_prefix(s)) is not None
    check_contents(tree, s, tree.match_prefix(s))
    tree.check_integrity()


def test_a_load_of_a_state_alone_is_pending_only_for_what_resumes_from_that_state() -> None:
    """A match that ends below the loading state reads only KV that was there (and its own
    state): nothing of it is pending, and its lock does not hold the load up."""
    tree, transfer = make_tree()
    upper, deep = state_on_host_only(tree, transfer)
    owner, plan, owner_token = owner_load(tree, upper)
    assert plan.num_kv_pages == 0 and plan.num_states == 1
    below = tree.match_prefix(deep)
    assert not below.pending_load and tree.pending_loads(below) == ()
    check_contents(tree, deep, below)
    at = tree.match_prefix(upper)
    assert at.pending_load and tree.pending_loads(at) == (plan,)
    below_token = tree.lock(below.last_node)
    released = tree.abort_load(plan)
    free(tree, released.kv_indices, released.state_slots)
    tree.unlock(below.last_node, below_token)
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()


def test_what_was_computed_on_a_pending_state_goes_when_its_load_fails() -> None:
    """A load brings a boundary state alone; meanwhile a request resumes from it and inserts a
    branch, and another gives a node below it a new state. A cancel is refused (that data rests
    on the load); the failed copy takes that data along once nothing uses it: the branch's
    device pages (also the part split off it since), the new state, and the host copies
    restored below the pending state meanwhile — while data computed before the load stays."""
    tree, transfer = make_tree(admission=EveryPageAdmission())
    upper, deep = state_on_host_only(tree, transfer)
    owner, plan, owner_token = owner_load(tree, upper)
    branch = upper + seq(3, 2 * PAGE)
    computed = put(tree, branch, states=[4 * PAGE]).last_node
    deep_node = tree.match_prefix(deep).last_node
    put(tree, deep, states=[3 * PAGE])  # a state computed from the pending one, in the old node
    mid = deep_node.parent
    assert mid is not None and mid.end_page == 3 and mid.device_state is not None
    with pytest.raises(TreeError, match="already uses the loaded state"):
        tree.abort_load(plan)
    split = tree.host_gap(computed, 3)[-1]  # splits the branch's node without an insert
    assert split is computed.parent and split.device_kv is not None
    # Restored below the pending state (host copies of the split part and a page below it,
    # with a state): it may be what was computed on it, archived and evicted, so it goes too.
    stored = branch[: 3 * PAGE] + seq(4, PAGE)
    alloc = tree.alloc_host(4, 1)
    assert alloc is not None and alloc.state_slot is not None
    tree.insert_host(stored, alloc.kv_indices, host_states={4 * PAGE: alloc.state_slot})
    computed_token = tree.lock(computed)
    with pytest.raises(TreeError, match="in use"):
        tree.abort_load(plan, drop_below=True)
    tree.unlock(computed, computed_token)
    released = tree.abort_load(plan, drop_below=True)
    free(tree, released.kv_indices, released.state_slots)
    assert not computed.alive and not split.alive
    assert tree.match_prefix(branch).num_tokens == 2 * PAGE  # back to the state on the host
    assert tree.match_prefix(stored).num_device_tokens == 2 * PAGE
    assert mid.alive and mid.device_state is None and mid.device_kv is not None
    before = tree.match_prefix(deep)
    assert before.num_device_tokens == 4 * PAGE and before.state_tier is Tier.DEVICE
    check_contents(tree, deep, before)
    tree.unlock(owner.last_node, owner_token)
    tree.check_integrity()


def test_unlocking_a_node_that_was_not_locked_itself_is_refused() -> None:
    """A lock is counted on the node it was taken on: unlocking its parent instead (which the
    path lock also pins) is a protocol error, not a silent transfer of the lock."""
    tree, _ = make_tree()
    r = put(tree, seq(1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
    parent = r.last_node.parent
    assert parent is not None and parent.parent is not None
    token = tree.lock(r.last_node)
    with pytest.raises(TreeError, match="without a matching lock"):
        tree.unlock(parent, token)
    tree.unlock(r.last_node, token)
    tree.check_integrity()


@pytest.mark.parametrize("reloaded", [False, True], ids=["nodes-empty", "reloaded-meanwhile"])
def test_an_insert_passing_back_a_failed_loads_pages_is_refused(reloaded: bool) -> None:
    """A request that read a failed load's pages passes its match back in an insert (as a
    finished request does): those pages never got their bytes and the tree still holds them for
    it, so the insert is refused and nothing changes — whether the nodes have had no device
    pages since, or another request loaded the prefix again. Its own page freed and its lock
    released, the failed load's pages and slot go back to the pools, once."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    reader, slot, reader_token = failed_under_reader(tree, transfer, s)
    if reloaded:
        assert transfer.load(tree.match_prefix(s)) is not None
    own = tree.device_kv.alloc(1)
    fresh = tree.device_kv.alloc(4)
    assert own is not None and fresh is not None
    num_free = (tree.device_kv.num_free, tree.device_mamba.num_free)
    with pytest.raises(StaleMatchError, match=r"device pages \[0, 1, 2, 3\] of a failed load"):
        tree.insert(s + seq(9, PAGE), torch.cat([reader.device_kv_indices, own]))
    with pytest.raises(StaleMatchError, match=rf"state slots \[{slot}\] of a failed load"):
        tree.insert(s, fresh, states={4 * PAGE: slot})
    assert (tree.device_kv.num_free, tree.device_mamba.num_free) == num_free
    tree.device_kv.free(torch.cat([own, fresh]))
    tree.check_integrity()  # the tree as it was: the failed load's pages and slot still held
    tree.unlock(reader.last_node, reader_token)
    assert (tree.device_kv.num_free, tree.device_mamba.num_free) == (num_free[0] + 9, num_free[1] + 1)
    tree.check_integrity()
    if reloaded:
        check_contents(tree, s, tree.match_prefix(s))


def test_the_last_readers_unlock_frees_the_retired_slot_even_when_freeing_the_pages_fails() -> None:
    """Misuse: the retired pages went back to the pool behind the tree's back. The unlock that
    would free them reports the double free, but leaves nothing half done: its lock is gone and
    the retired slot is back in the pool (not leaked)."""
    tree, transfer = make_tree()
    reader, _, reader_token = failed_under_reader(tree, transfer, seq(1, 4 * PAGE))
    tree.device_kv.free(reader.device_kv_indices)
    num_free_slots = tree.device_mamba.num_free
    with pytest.raises(AllocationError, match="double free"):
        tree.unlock(reader.last_node, reader_token)
    assert reader.last_node.num_locks == 0 and tree.device_mamba.num_free == num_free_slots + 1
    tree.check_integrity()


class _CountingReaders(dict[Any, Any]):
    """A load's reader counts, counting how often they are read."""

    reads = 0

    def get(self, *args: Any) -> Any:
        _CountingReaders.reads += 1
        return super().get(*args)

    def __getitem__(self, key: Any) -> Any:
        _CountingReaders.reads += 1
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        _CountingReaders.reads += 1
        return super().__contains__(key)


def test_locks_and_unlocks_do_not_redo_per_load_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """With loads in flight, each with a reader: a lock on a loading path finds each load's top
    node once (not at every lock), and an unlock of a node no load counts as a reader reads no
    load's reader counts."""
    tree, transfer = make_tree(device_pages=96, device_states=24, host_pages=96, host_states=24)
    prompts = [seq(i + 1, 4 * PAGE) for i in range(8)]
    for tokens in prompts:
        r = put(tree, tokens, states=[4 * PAGE])
        assert transfer.backup(r.backup_nodes) is not None
    tree.evict_device(num_kv_pages=100, num_states=100)
    for tokens in prompts:
        owner_load(tree, tokens)
        tree.lock(tree.match_prefix(tokens).last_node)  # a reader
    tops = 0
    real_top = pending._top

    def counting_top(plan: LoadPlan) -> Any:
        nonlocal tops
        tops += 1
        return real_top(plan)

    monkeypatch.setattr(pending, "_top", counting_top)
    node = tree.match_prefix(prompts[0]).last_node
    for _ in range(10):
        tree.unlock(node, tree.lock(node))
    assert tops <= len(prompts)
    for rec in tree._pending._loads.values():
        rec.readers = _CountingReaders(rec.readers)
    other = put(tree, seq(99, 4 * PAGE), states=[4 * PAGE]).last_node
    for _ in range(10):
        tree.unlock(other, tree.lock(other))
    assert _CountingReaders.reads == 0
    tree.check_integrity()
