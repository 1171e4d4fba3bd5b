"""Failed copies of several steps, completed in submission order: every plan is undone (the
controller's ``TreeOps``), even when a head's undo first meets a later op that builds on it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tree_builders import PAGE, make_tree, seq

from asynccache.errors import TransferError
from asynccache.ops import OpState
from asynccache.stats import StatsRecorder
from asynccache.storage import PoolName
from asynccache.tree_ops import TreeOps


def tree_ops(tree: Any) -> TreeOps:
    pools = {PoolName.KV: (tree.device_kv, tree.host_kv), PoolName.MAMBA: (tree.device_mamba, tree.host_mamba)}
    return TreeOps(tree, pools, StatsRecorder())


def free_counts(tree: Any) -> tuple[int, ...]:
    return tuple(p.num_free for p in (tree.device_kv, tree.device_mamba, tree.host_kv, tree.host_mamba))


def two_nodes(tree: Any) -> tuple[list[int], list[int]]:
    """A 2-page node and its 2-page child, each ending in a state, on the device."""
    head = seq(1, 2 * PAGE)
    both = head + seq(2, 2 * PAGE)
    kv, slots = tree.device_kv.alloc(4), tree.device_mamba.alloc(2)
    tree.insert(both, kv, states={2 * PAGE: int(slots[0]), 4 * PAGE: int(slots[1])})
    return head, both


async def failed_together(ops: TreeOps, first: Any, second: Any) -> None:
    error = RuntimeError("a CUDA fault fails an op and every op queued behind it")
    for op in (first, second):
        ops.complete(op, error, tiering=None)
        with pytest.raises(TransferError):
            await op
        assert op.state is OpState.FAILED


async def test_failed_backups_of_a_node_and_its_child_are_both_undone() -> None:
    tree, _ = make_tree()
    ops, loop = tree_ops(tree), asyncio.get_running_loop()
    head, both = two_nodes(tree)
    before = free_counts(tree)
    node, child = tree.match_prefix(head).last_node, tree.match_prefix(both).last_node
    first = ops.write_op([node], priority=0, loop=loop)  # one step
    second = ops.write_op([child], priority=0, loop=loop)  # the next: hangs below the first
    await failed_together(ops, first, second)
    assert ops.num_blocked == 0 and tree.active_plans == ()
    assert (node.device_lock, node.host_lock, child.device_lock, child.host_lock) == (0, 0, 0, 0)
    assert node.host_kv is None and child.host_kv is None
    assert free_counts(tree) == before
    tree.evict_device(num_kv_pages=4, num_states=2)  # nothing stays pinned
    assert tree.stats().device_kv_pages == 0
    tree.check_integrity()


async def test_failed_loads_of_a_node_and_its_child_are_both_undone() -> None:
    tree, sync = make_tree()
    ops, loop = tree_ops(tree), asyncio.get_running_loop()
    head, both = two_nodes(tree)
    sync.backup(tree.path_to(tree.match_prefix(both).last_node))
    tree.evict_device(num_kv_pages=4)  # both on the host only
    before = free_counts(tree)
    first = ops.load_op(tree.match_prefix(head), priority=0, state_to=(), loop=loop)
    second = ops.load_op(tree.match_prefix(both), priority=0, state_to=(), loop=loop)  # below the first
    assert first is not None and second is not None
    await failed_together(ops, first, second)
    assert ops.num_blocked == 0 and tree.active_plans == ()
    match = tree.match_prefix(both)
    assert (match.num_device_tokens, match.num_host_tokens, match.pending_load) == (0, 4 * PAGE, False)
    assert free_counts(tree) == before
    tree.check_integrity()
