"""Lock tokens: ``lock`` returns one, ``unlock(node, token)`` releases exactly that lock (an
unlock without a live token of the node is refused), and a failed load's retired indices are
held for its readers' own locks, not for whoever locks the node after it failed."""

from __future__ import annotations

import pytest
from test_tree_pending_loads import on_host, owner_load
from tree_builders import PAGE, make_tree, put, seq

from asynccache.tree import HybridRadixTree, TreeError, TreeNode


def pool_free(tree: HybridRadixTree) -> tuple[int, int]:
    return tree.device_kv.num_free, tree.device_mamba.num_free


def failed_under_reader(tree: HybridRadixTree, tokens: list[int]) -> tuple[TreeNode, int, int]:
    """A load of ``tokens`` (on the host) fails while a second request holds them, and its owner
    unlocks by token: returns the node, the reader's token and the owner's (released)."""
    owner = tree.match_prefix(tokens)
    owner_token = tree.lock(owner.last_node)
    alloc = tree.alloc_device(owner.num_load_kv_pages, owner.num_load_states)
    assert alloc is not None
    plan = tree.begin_load(owner, alloc.kv_indices, alloc.state_slot)
    node = tree.match_prefix(tokens).last_node
    assert node is owner.last_node
    reader = tree.lock(node)
    assert tree.abort_load(plan, drop_below=True).kv_indices.numel() == 0
    tree.unlock(node, owner_token)
    return node, reader, owner_token


def test_locks_taken_after_a_failure_do_not_hold_its_retired_pages() -> None:
    """A load of a hot prefix fails while a reader holds it; new requests keep locking the node,
    their locks overlapping. The retired pages go back to the pool when the reader unlocks, at
    once, though the node is never without a lock."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    node, reader, _ = failed_under_reader(tree, s)
    num_free = pool_free(tree)
    held = [reader]
    for _ in range(5):  # requests after the failure, each arriving before the previous leaves
        held.append(tree.lock(tree.match_prefix(s).last_node))
        if held[0] != reader:
            tree.unlock(node, held.pop(0))
        tree.check_integrity()
    assert pool_free(tree) == num_free and len(tree._pending.retired) == 1
    tree.unlock(node, held.pop(0))  # the reader leaves: freed now, with the later locks held
    assert node.num_locks == len(held) == 5
    assert pool_free(tree) == (num_free[0] + 4, num_free[1] + 1) and not tree._pending.retired
    tree.check_integrity()
    for token in held:
        tree.unlock(node, token)
    assert node.device_lock == 0 and pool_free(tree) == (num_free[0] + 4, num_free[1] + 1)
    tree.check_integrity()


def test_an_unlock_without_a_token_is_refused() -> None:
    """Holders of a failed load's node (the owner, two readers, a request after the failure):
    an unlock that names no lock — the token left out, ``None``, a bool, not an int — is
    refused and changes nothing: no lock released, the readers still counted, the retired
    pages still held. Each holder's own token then releases its lock, the last of those that
    hold the retired pages (the readers and the owner) freeing them."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    owner, plan, owner_token = owner_load(tree, s)
    node = owner.last_node
    readers = [tree.lock(node), tree.lock(node)]
    assert tree.abort_load(plan, drop_below=True).kv_indices.numel() == 0
    later = tree.lock(tree.match_prefix(s).last_node)

    def state() -> tuple[object, ...]:
        retired = [(r.kv_indices.tolist(), r.state_slots.tolist(), dict(r.readers)) for r in tree._pending.retired]
        return (
            set(node.lock_tokens or ()),
            [n.device_lock for n in tree.path_to(node)],
            {t: n for n in tree.iter_nodes() for t in (n.lock_tokens or ())},
            retired,
            pool_free(tree),
            tree.stats(),
        )

    before = state()
    assert node.num_locks == 4 and len(tree._pending.retired) == 1
    assert sorted(tree._pending.retired[0].readers) == sorted([owner_token, *readers])
    with pytest.raises(TypeError):
        tree.unlock(node)  # type: ignore[call-arg]
    assert state() == before
    for token in (None, True, False, float(readers[0]), str(readers[0]), [readers[0]]):
        with pytest.raises(TreeError, match="not a lock token"):
            tree.unlock(node, token)  # type: ignore[arg-type]
        assert state() == before and node.num_locks == 4
        tree.check_integrity()
    root = tree.match_prefix(seq(9, PAGE)).last_node
    assert root.parent is None
    for token in (None, False):
        with pytest.raises(TreeError, match="not a lock token"):
            tree.unlock(root, token)  # type: ignore[arg-type]
        assert state() == before
    num_free = pool_free(tree)
    for token in (owner_token, later, readers[0]):
        tree.unlock(node, token)
        assert pool_free(tree) == num_free and len(tree._pending.retired) == 1, "freed while a reader holds them"
        tree.check_integrity()
    tree.unlock(node, readers[1])
    assert pool_free(tree) == (num_free[0] + 4, num_free[1] + 1) and not tree._pending.retired
    assert node.device_lock == 0
    tree.check_integrity()


def test_an_unlock_with_a_wrong_or_stale_token_is_refused() -> None:
    """A token of another node, one already released, or one never returned raises
    :class:`TreeError` and changes nothing; a root's lock is token 0."""
    tree, _ = make_tree()
    a = put(tree, seq(1, 2 * PAGE), states=[2 * PAGE]).last_node
    b = put(tree, seq(2, 2 * PAGE), states=[2 * PAGE]).last_node
    first, second, other = tree.lock(a), tree.lock(a), tree.lock(b)
    assert len({first, second, other}) == 3 and min(first, second, other) > 0
    tree.unlock(a, first)
    before = (a.num_locks, a.device_lock, b.num_locks, b.device_lock, tree.stats())
    for token in (first, other, max(first, second, other) + 1):
        with pytest.raises(TreeError, match="not a live lock"):
            tree.unlock(a, token)
        assert (a.num_locks, a.device_lock, b.num_locks, b.device_lock, tree.stats()) == before
        tree.check_integrity()
    root = tree.match_prefix(seq(9, PAGE)).last_node
    assert root.parent is None and tree.lock(root) == 0
    tree.unlock(root, 0)
    with pytest.raises(TreeError, match="not taken on it"):
        tree.unlock(root, second)
    tree.unlock(a, second)
    tree.unlock(b, other)
    assert a.device_lock == b.device_lock == 0
    tree.check_integrity()


def test_a_wrong_token_on_a_readers_node_frees_nothing() -> None:
    """A stale token presented for a reader's node is refused: the reader's lock stays, and so
    do the retired pages it holds."""
    tree, transfer = make_tree()
    s = seq(1, 4 * PAGE)
    on_host(tree, transfer, s, [4 * PAGE])
    node, reader, owner_token = failed_under_reader(tree, s)
    num_free = pool_free(tree)
    with pytest.raises(TreeError):
        tree.unlock(node, owner_token)
    assert node.num_locks == 1 and pool_free(tree) == num_free
    tree.check_integrity()
    tree.unlock(node, reader)
    assert pool_free(tree) == (num_free[0] + 4, num_free[1] + 1)
    tree.check_integrity()
