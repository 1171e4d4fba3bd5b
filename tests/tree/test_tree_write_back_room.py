"""Device eviction under the ``write_back`` policy when the host cannot take a whole write-back
batch (the victims with their ancestors need more host state slots than the host pool holds):
a victim whose backup did not start is dropped, and the parents that drop leaves as device
leaves are evicted in the same call — handed to the write-back in a smaller batch, dropped in
their turn if that fails too — so one call frees what it was asked for."""

from __future__ import annotations

from collections.abc import Sequence

from tree_builders import PAGE, check_contents, make_tree, put, seq

from asynccache.tree import EvictHow, HybridRadixTree, SyncTransfer, Tier, TreeNode

WRITE_BACK, DROP = EvictHow.WRITE_BACK, EvictHow.DROP


def chain(tree: HybridRadixTree, seed: int) -> tuple[list[int], list[TreeNode]]:
    """A chain of three device nodes, each with a state: [0,2) [2,3) [3,4) pages."""
    tokens = seq(seed, 4 * PAGE)
    r = put(tree, tokens, states=[2 * PAGE, 3 * PAGE, 4 * PAGE])
    nodes = tree.path_to(r.last_node)
    assert [n.end_tokens for n in nodes] == [2 * PAGE, 3 * PAGE, 4 * PAGE]
    return tokens, nodes


def recording(transfer: SyncTransfer, calls: list[list[int]]):  # type: ignore[no-untyped-def]
    def write_back(nodes: Sequence[TreeNode]) -> bool:
        calls.append([n.end_tokens for n in nodes])
        return transfer.write_back(nodes)

    return write_back


def test_an_allocation_gets_its_pages_in_one_call_when_the_batch_exceeds_the_host_states() -> None:
    """Two chains fill 8 of 10 device pages; the host has 2 state slots. Allocating 9 pages
    evicts 7: the first batch (both chains, 6 states) and the second (the upper two nodes of
    each, 4 states) cannot be backed up and their leaves are dropped; the third (the chains'
    first nodes, 2 states) is written back and demoted. Nothing is locked: the allocation
    succeeds at once."""
    tree, transfer = make_tree(device_pages=10, device_states=8, host_pages=32, host_states=2, write_policy="write_back")
    calls: list[list[int]] = []
    tree.write_back = recording(transfer, calls)
    (tokens_a, nodes_a), (tokens_b, nodes_b) = chain(tree, 1), chain(tree, 2)
    alloc = tree.alloc_device(9, 0)
    assert alloc is not None
    assert [len(c) for c in calls] == [6, 4, 2]
    assert tree.stats().device_kv_pages == 0
    for tokens, nodes in ((tokens_a, nodes_a), (tokens_b, nodes_b)):
        head = nodes[0]
        assert head.alive and head.host_kv is not None and head.host_state is not None
        assert not nodes[1].alive and not nodes[2].alive
        m = tree.match_prefix(tokens)
        assert m.num_tokens == 2 * PAGE and m.state_tier is Tier.HOST  # the first node, from the host
        check_contents(tree, tokens, m)
    tree.device_kv.free(alloc.kv_indices)
    tree.check_integrity()


def test_one_call_writes_back_the_part_of_a_chain_the_host_can_hold() -> None:
    """A chain of three states, two host state slots: the leaf cannot be backed up with its
    ancestors (three states) and is dropped; its parent and the first node then go to the
    write-back on their own and are demoted, all within the one call."""
    tree, transfer = make_tree(device_pages=8, device_states=8, host_pages=32, host_states=2, write_policy="write_back")
    calls: list[list[int]] = []
    tree.write_back = recording(transfer, calls)
    tokens, (first, middle, leaf) = chain(tree, 1)
    heard: list[tuple[int, str, EvictHow]] = []
    tree.add_evict_listener(lambda node, key, how: heard.append((node.node_id, key, how)))
    res = tree.evict_device(num_kv_pages=4)
    assert res.num_kv_pages == 4 and res.num_pending_kv_pages == 0
    assert res.num_lost_states == 1 and res.num_deleted_nodes == 1
    assert res.num_written_back_nodes == 3  # each node handed over is counted once
    assert calls == [[2 * PAGE, 3 * PAGE, 4 * PAGE], [2 * PAGE, 3 * PAGE]]
    assert heard == [
        (leaf.node_id, "device_kv", DROP),
        (leaf.node_id, "device_state", DROP),
        (middle.node_id, "device_kv", WRITE_BACK),
        (middle.node_id, "device_state", WRITE_BACK),
        (first.node_id, "device_kv", WRITE_BACK),
        (first.node_id, "device_state", WRITE_BACK),
    ]
    m = tree.match_prefix(tokens)
    assert m.num_tokens == 3 * PAGE and m.num_host_tokens == 3 * PAGE and m.state_tier is Tier.HOST
    check_contents(tree, tokens, m)
    tree.check_integrity()


def test_a_smaller_batch_still_in_flight_is_pending() -> None:
    """The write-back of the smaller batch only begins (an asynchronous copy): its nodes are
    pinned and counted pending, the dropped leaf freed; once the copy finishes, the next call
    demotes them."""
    tree, _ = make_tree(device_pages=8, device_states=8, host_pages=32, host_states=2, write_policy="write_back")
    plans = []

    def begin_only(nodes: Sequence[TreeNode]) -> bool:
        need_kv, need_states = tree.backup_pages_needed(nodes)
        alloc = tree.alloc_host(need_kv, need_states)
        if alloc is None:
            return False
        plans.append(tree.begin_backup(nodes, alloc.kv_indices, alloc.state_slots))
        return True

    tree.write_back = begin_only
    tokens, (first, middle, leaf) = chain(tree, 1)
    res = tree.evict_device(num_kv_pages=4)
    # (pending: the victim, the middle node; its ancestor goes with it once backed up)
    assert (res.num_kv_pages, res.num_pending_kv_pages, res.num_pending_states) == (1, 1, 1)
    assert not leaf.alive and len(plans) == 1 and plans[0].nodes == (first, middle)
    tree.check_integrity()
    tree.finish_backup(plans[0])
    res = tree.evict_device(num_kv_pages=3)
    assert res.num_kv_pages == 3 and res.num_pending_kv_pages == 0 and res.num_lost_states == 0
    assert tree.match_prefix(tokens).num_tokens == 3 * PAGE
    tree.check_integrity()


def test_a_write_back_that_never_starts_drops_whole_chains_in_one_call() -> None:
    tree, _ = make_tree(device_pages=8, device_states=8, host_pages=32, host_states=8, write_policy="write_back")
    calls: list[int] = []

    def refuse(nodes: Sequence[TreeNode]) -> bool:
        calls.append(len(nodes))
        return False

    tree.write_back = refuse
    chain(tree, 1)
    chain(tree, 2)
    res = tree.evict_device(num_kv_pages=8)
    assert res.num_kv_pages == 8 and res.num_lost_states == 6
    assert calls == [6, 4, 2]
    assert tree.stats().num_nodes == 0 and tree.stats().host_kv_pages == 0
    tree.check_integrity()


def test_locked_ancestors_stop_the_rounds() -> None:
    """A lock on the middle node pins it and the first: the leaf, whose batch cannot be backed
    up, is dropped, and the call ends there, the locked nodes kept."""
    tree, transfer = make_tree(device_pages=8, device_states=8, host_pages=32, host_states=2, write_policy="write_back")
    calls: list[list[int]] = []
    tree.write_back = recording(transfer, calls)
    tokens, (first, middle, leaf) = chain(tree, 1)
    token = tree.lock(middle)
    res = tree.evict_device(num_kv_pages=4)
    assert res.num_kv_pages == 1 and res.num_pending_kv_pages == 0
    assert len(calls) == 1 and not leaf.alive
    assert first.device_kv is not None and middle.device_kv is not None and middle.device_state is not None
    tree.unlock(middle, token)
    tree.check_integrity()
    assert tree.match_prefix(tokens).num_tokens == 3 * PAGE
