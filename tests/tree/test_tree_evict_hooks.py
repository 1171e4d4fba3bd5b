"""Eviction hooks: ``evict_host(…, demote=)`` hands each host victim (after its ancestors not
archived yet) over before its host copy goes, in the tree's victim order; eviction listeners hear
every victim with how it went (demote, write back, drop, cascade, release)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from tree_builders import PAGE, make_tree, put, seq

from asynccache.errors import ConfigError
from asynccache.policy import EvictionPolicy, LRUEviction
from asynccache.tree import EvictHow, HybridRadixTree, LRUList, SyncTransfer, TreeNode

DEMOTE, WRITE_BACK, DROP, CASCADE, RELEASE = (
    EvictHow.DEMOTE,
    EvictHow.WRITE_BACK,
    EvictHow.DROP,
    EvictHow.CASCADE,
    EvictHow.RELEASE,
)


def host_only_chain(
    tree: HybridRadixTree, transfer: SyncTransfer, tokens: list[int], states: list[int]
) -> list[TreeNode]:
    """Insert ``tokens`` with ``states``, back the path up and demote it off the device: a chain
    of host-only nodes (top-down)."""
    r = put(tree, tokens, states=states)
    assert transfer.backup(r.backup_nodes) is not None
    tree.evict_device(num_kv_pages=len(tokens) // PAGE)
    path = tree.path_to(r.last_node)
    assert all(n.device_kv is None and n.host_kv is not None for n in path)
    return path


class Recorder:
    """A ``demote`` callback: records each call and what the tree still held then."""

    def __init__(self, tree: HybridRadixTree, *, archive: bool = False) -> None:
        self.tree = tree
        self.archive = archive
        self.calls: list[tuple[list[int], str]] = []

    def __call__(self, nodes: Sequence[TreeNode], list_key: str) -> None:
        victim = nodes[-1]
        # Called before anything of the victim goes: every node handed over still has its host copy.
        assert all(n.alive and n.host_kv is not None for n in nodes)
        if list_key == "host_state":
            assert victim.host_state is not None
        self.calls.append(([n.node_id for n in nodes], list_key))
        if self.archive:
            for n in self.tree.path_to(victim):
                self.tree.mark_archived(n)


def test_demote_gets_each_host_victim_after_its_unarchived_ancestors_before_the_copy_goes() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    a, b, c = host_only_chain(tree, transfer, seq(1, 6 * PAGE), [2 * PAGE, 4 * PAGE, 6 * PAGE])
    ids = (a.node_id, b.node_id, c.node_id)
    demote = Recorder(tree)
    res = tree.evict_host(num_kv_pages=6, demote=demote)
    assert res.num_kv_pages == 6 and tree.stats().num_nodes == 0
    # Leaf first (the tree's order); nothing is archived, so every call carries the whole path.
    assert demote.calls == [([ids[0], ids[1], ids[2]], "host_kv"), ([ids[0], ids[1]], "host_kv"), ([ids[0]], "host_kv")]
    tree.check_integrity()


class ShallowFirst(EvictionPolicy):
    """Offers parents before their children: the tree defers them until the child has gone."""

    def candidates(self, lru: LRUList, *, now: float) -> Iterator[TreeNode]:
        for node in sorted(lru.iter_oldest(), key=lambda n: n.start_page):
            if node in lru:
                yield node


def test_a_parent_taken_once_its_child_went_is_handed_over_after_it() -> None:
    tree, transfer = make_tree(write_policy="write_through", eviction=ShallowFirst())
    a, b = host_only_chain(tree, transfer, seq(1, 4 * PAGE), [2 * PAGE, 4 * PAGE])
    demote = Recorder(tree)
    tree.evict_host(num_kv_pages=4, demote=demote)
    # ``a`` is offered first but still has a host child; it goes right after ``b``, and was
    # handed over with ``b`` (not archived) while its host copy was still there.
    assert demote.calls == [([a.node_id, b.node_id], "host_kv"), ([a.node_id], "host_kv")]
    assert tree.stats().num_nodes == 0


def test_demote_leaves_out_ancestors_a_previous_call_archived() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    a, b, c = host_only_chain(tree, transfer, seq(1, 6 * PAGE), [2 * PAGE, 4 * PAGE, 6 * PAGE])
    demote = Recorder(tree, archive=True)
    tree.evict_host(num_kv_pages=6, demote=demote)
    assert demote.calls == [
        ([a.node_id, b.node_id, c.node_id], "host_kv"),
        ([b.node_id], "host_kv"),  # the victim is always handed over, archived or not
        ([a.node_id], "host_kv"),
    ]


def test_demote_follows_the_policy_order_and_stops_when_enough_is_free() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    (x,) = host_only_chain(tree, transfer, seq(1, 2 * PAGE), [2 * PAGE])
    (y,) = host_only_chain(tree, transfer, seq(2, 2 * PAGE), [2 * PAGE])
    (z,) = host_only_chain(tree, transfer, seq(3, 2 * PAGE), [2 * PAGE])
    tree.match_prefix(seq(1, 2 * PAGE))  # x is the most recent now: y, z, x
    demote = Recorder(tree)
    tree.evict_host(num_kv_pages=4, demote=demote)
    assert demote.calls == [([y.node_id], "host_kv"), ([z.node_id], "host_kv")]
    assert x.alive and not y.alive and not z.alive


def test_demote_skips_what_the_tree_does_not_evict() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    (x,) = host_only_chain(tree, transfer, seq(1, 2 * PAGE), [2 * PAGE])
    (y,) = host_only_chain(tree, transfer, seq(2, 2 * PAGE), [2 * PAGE])
    tree.lock_host(x)
    demote = Recorder(tree)
    tree.evict_host(num_kv_pages=4, demote=demote)
    assert demote.calls == [([y.node_id], "host_kv")]  # the pinned x is never handed over
    tree.unlock_host(x)
    demote.calls.clear()
    tree.evict_host(num_kv_pages=2, demote=demote, archived_only=True)
    assert demote.calls == [] and x.alive  # not archived: not a victim


def test_demote_hands_over_state_victims_and_a_node_still_on_the_device() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    a, b = host_only_chain(tree, transfer, seq(1, 4 * PAGE), [2 * PAGE, 4 * PAGE])
    demote = Recorder(tree)
    tree.evict_host(num_states=2, demote=demote)
    assert demote.calls == [([a.node_id, b.node_id], "host_state"), ([a.node_id], "host_state")]
    assert not a.alive and not b.alive  # host-only, stateless, childless: the cascade took them

    # A node on both tiers loses only its host copy; it is handed over all the same.
    r = put(tree, seq(2, 2 * PAGE))
    transfer.backup(r.backup_nodes)
    node = r.last_node
    demote.calls.clear()
    tree.evict_host(num_kv_pages=2, demote=demote)
    assert demote.calls == [([node.node_id], "host_kv")]
    assert node.alive and node.host_kv is None and node.device_kv is not None


def test_host_eviction_without_demote_is_unchanged() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    host_only_chain(tree, transfer, seq(1, 4 * PAGE), [2 * PAGE, 4 * PAGE])
    res = tree.evict_host(num_kv_pages=4)
    assert res.num_kv_pages == 4 and res.num_lost_states == 2 and tree.stats().num_nodes == 0


# ---- notifications ---------------------------------------------------------------------------
class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[int, str, EvictHow]] = []

    def __call__(self, node: TreeNode, list_key: str, how: EvictHow) -> None:
        self.events.append((node.node_id, list_key, how))


def listening(tree: HybridRadixTree) -> Listener:
    listener = Listener()
    tree.add_evict_listener(listener)
    return listener


def test_a_backed_up_device_victim_is_reported_demoted_with_its_state() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    r = put(tree, seq(1, 2 * PAGE))
    transfer.backup(r.backup_nodes)
    heard = listening(tree)
    tree.evict_device(num_kv_pages=2)
    n = r.last_node.node_id
    assert heard.events == [(n, "device_kv", DEMOTE), (n, "device_state", DEMOTE)]


def test_a_state_that_cannot_follow_its_demoted_kv_is_reported_dropped() -> None:
    tree, transfer = make_tree(write_policy="write_through", host_states=None)  # no host state pool
    r = put(tree, seq(1, 2 * PAGE))
    transfer.backup(r.backup_nodes)
    heard = listening(tree)
    res = tree.evict_device(num_kv_pages=2)
    n = r.last_node.node_id
    # Left on the host without any state, the childless node goes with the cascade.
    assert heard.events == [(n, "device_kv", DEMOTE), (n, "device_state", DROP), (n, "device_kv", CASCADE)]
    assert res.num_lost_states == 1 and not r.last_node.alive


def test_a_host_victim_still_on_the_device_keeps_its_device_state() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    r = put(tree, seq(1, 2 * PAGE))
    transfer.backup(r.backup_nodes)
    node = r.last_node
    heard = listening(tree)
    tree.evict_host(num_kv_pages=2)
    assert heard.events == [(node.node_id, "host_kv", DROP), (node.node_id, "host_state", DROP)]
    assert node.alive and node.has_state and node.device_state is not None  # nothing lost


def test_write_back_victims_are_reported_written_back() -> None:
    tree, _ = make_tree(write_policy="write_back")
    r = put(tree, seq(1, 4 * PAGE), states=[2 * PAGE, 4 * PAGE])
    upper, leaf = tree.path_to(r.last_node)
    heard = listening(tree)
    tree.evict_device(num_kv_pages=4)
    assert heard.events == [
        (leaf.node_id, "device_kv", WRITE_BACK),
        (leaf.node_id, "device_state", WRITE_BACK),
        (upper.node_id, "device_kv", WRITE_BACK),  # its ancestor, backed up by the same write-back
        (upper.node_id, "device_state", WRITE_BACK),
    ]
    assert leaf.host_kv is not None and upper.host_kv is not None


def test_a_dropped_leaf_is_reported_then_the_cascade_above_it() -> None:
    tree, _ = make_tree(host_pages=None, host_states=None)
    tokens = seq(1, 4 * PAGE)
    r = put(tree, tokens, states=[2 * PAGE, 4 * PAGE])
    upper, leaf = tree.path_to(r.last_node)
    assert tree.release_states([upper]).num_states == 1  # a tombstone: KV, no state
    heard = listening(tree)
    tree.evict_device(num_kv_pages=2)
    assert heard.events == [
        (leaf.node_id, "device_kv", DROP),
        (leaf.node_id, "device_state", DROP),
        (upper.node_id, "device_kv", CASCADE),  # childless and stateless now: deleted with it
    ]
    assert not leaf.alive and not upper.alive


def test_host_victims_are_dropped_without_demote_and_demoted_with_it() -> None:
    for demote, how in ((None, DROP), (lambda nodes, key: None, DEMOTE)):
        tree, transfer = make_tree(write_policy="write_through")
        (node,) = host_only_chain(tree, transfer, seq(1, 2 * PAGE), [2 * PAGE])
        heard = listening(tree)
        tree.evict_host(num_kv_pages=2, demote=demote)
        assert heard.events == [(node.node_id, "host_kv", how), (node.node_id, "host_state", how)]


def test_state_victims_report_their_list_and_the_cascade_they_set_off() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    (node,) = host_only_chain(tree, transfer, seq(1, 2 * PAGE), [2 * PAGE])
    heard = listening(tree)
    tree.evict_host(num_states=1)
    assert heard.events == [(node.node_id, "host_state", DROP), (node.node_id, "host_state", CASCADE)]

    tree2, _ = make_tree(host_pages=None, host_states=None)
    leaf = put(tree2, seq(2, 2 * PAGE)).last_node
    heard = listening(tree2)
    tree2.evict_device(num_states=1)
    assert heard.events == [(leaf.node_id, "device_state", DROP), (leaf.node_id, "device_state", CASCADE)]


def test_released_states_are_reported_per_tier() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    first = seq(1, 2 * PAGE)
    put(tree, first)
    r = put(tree, first + seq(2, 2 * PAGE))
    transfer.backup(tree.path_to(r.last_node))
    mid = tree.match_prefix(first).last_node
    assert mid.device_state is not None and mid.host_state is not None
    heard = listening(tree)
    tree.release_states([mid])
    assert heard.events == [(mid.node_id, "device_state", RELEASE), (mid.node_id, "host_state", RELEASE)]


def test_a_policy_that_overrides_on_evict_is_subscribed_and_listeners_can_leave() -> None:
    class Learning(LRUEviction):
        def __init__(self) -> None:
            self.heard: list[tuple[str, EvictHow]] = []

        def on_evict(self, node: TreeNode, list_key: str, how: EvictHow) -> None:
            self.heard.append((list_key, how))

    policy = Learning()
    tree, _ = make_tree(host_pages=None, host_states=None, eviction=policy)
    put(tree, seq(1, 2 * PAGE))
    tree.evict_device(num_kv_pages=2)
    assert policy.heard == [("device_kv", DROP), ("device_state", DROP)]

    plain, _ = make_tree(host_pages=None, host_states=None)
    assert plain._evict_listeners == []  # the base policy's no-op is not called at all
    heard = listening(plain)
    plain.remove_evict_listener(heard)
    put(plain, seq(1, 2 * PAGE))
    plain.evict_device(num_kv_pages=2)
    assert heard.events == []
    with pytest.raises(ConfigError):
        plain.remove_evict_listener(heard)


def test_an_aborted_load_is_not_an_eviction() -> None:
    tree, transfer = make_tree(write_policy="write_through")
    tokens = seq(1, 2 * PAGE)
    host_only_chain(tree, transfer, tokens, [2 * PAGE])
    match = tree.match_prefix(tokens)
    alloc = tree.alloc_device(match.num_load_kv_pages, match.num_load_states)
    assert alloc is not None
    plan = tree.begin_load(match, alloc.kv_indices, alloc.state_slot)
    heard = listening(tree)
    released = tree.abort_load(plan)
    tree.device_kv.free(released.kv_indices)
    tree.device_mamba.free(released.state_slots)
    assert heard.events == []
    tree.check_integrity()


def test_a_listener_that_leaves_while_told_does_not_hide_the_eviction_from_the_next() -> None:
    tree, _ = make_tree(host_pages=None, host_states=None)
    leaf = put(tree, seq(1, 2 * PAGE), states=[2 * PAGE]).last_node
    once = Listener()

    def leave(node: TreeNode, list_key: str, how: EvictHow) -> None:
        once(node, list_key, how)
        tree.remove_evict_listener(leave)

    tree.add_evict_listener(leave)
    heard = listening(tree)
    tree.evict_device(num_kv_pages=2)
    n = leaf.node_id
    assert once.events == [(n, "device_kv", DROP)]  # gone from the next notification on
    assert heard.events == [(n, "device_kv", DROP), (n, "device_state", DROP)]


def test_an_ancestor_backed_up_before_the_write_back_is_reported_demoted() -> None:
    """Write-back hands over a victim and its ancestors without a host copy; an ancestor that
    already had one and goes after it in the same call was not written back by it."""
    tree, transfer = make_tree(write_policy="write_back")
    first = seq(1, 2 * PAGE)
    upper = put(tree, first, states=[2 * PAGE]).last_node
    assert transfer.write_back([upper])  # on the host already
    leaf = put(tree, first + seq(2, 2 * PAGE), states=[4 * PAGE]).last_node
    assert leaf.parent is upper and leaf.host_kv is None
    handed: list[int] = []

    def write_back(nodes: Sequence[TreeNode]) -> bool:
        handed.extend(n.node_id for n in nodes)
        return transfer.write_back(nodes)

    heard = listening(tree)
    res = tree.evict_device(num_kv_pages=4, write_back=write_back)
    assert res.num_kv_pages == 4 and handed == [leaf.node_id]
    assert heard.events == [
        (leaf.node_id, "device_kv", WRITE_BACK),
        (leaf.node_id, "device_state", WRITE_BACK),
        (upper.node_id, "device_kv", DEMOTE),
        (upper.node_id, "device_state", DEMOTE),
    ]
    tree.check_integrity()
