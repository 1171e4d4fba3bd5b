"""``check_integrity``: every invariant of the tree, checked from scratch.

Invariants (the message of the ``AssertionError`` starts with the name in brackets):

- ``[structure]`` parent/child links, child keys = first page of the child, page offsets
  contiguous, key length = pages × page bytes, roots hold nothing, deleted nodes unreachable.
- ``[tiers]`` every node holds KV on some tier; index tensors are int64 with one index per page;
  a state implies the node's KV on the same tier; device KV is prefix-closed.
- ``[contiguity]`` host copies form a contiguous prefix from the root.
- ``[locks]`` lock and loading counts ≥ 0; ``loading`` equals the load plans covering the node;
  every node of an in-flight plan is pinned on both tiers and holds what the plan attached; a
  node's device lock is the locks taken on it and below it plus the plans covering it; the
  node's own locks are lock tokens handed out, none held by two nodes; the readers of loads and of
  retired indices are live lock tokens of the nodes they name, of loads in flight, and the index
  of reader tokens lists exactly the records counting each.
- ``[counters]`` the incremental totals (nodes, pages, states, locked pages, child counts).
- ``[lru]`` each of the four lists is well linked and holds exactly the nodes with its resource.
- ``[ownership]`` every allocated index of every pool is owned by exactly one node, one
  in-flight claim or one failed load's retired indices, and nothing owned is free.
- ``[hashes]`` cached page hashes equal the chain recomputed from the root's seed.
- ``[match]`` for every leaf path, ``match_prefix`` (without touching anything) stops at the
  deepest node whose state is really available, and splits device / host parts correctly.

O(tree + pools); meant for tests, not for the serving path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from asynccache.tree.hashing import chain_hashes, seed_hash
from asynccache.tree.lru import LRUList
from asynccache.tree.node import Tier, TreeNode
from asynccache.tree.results import BackupPlan, LoadPlan

if TYPE_CHECKING:
    from asynccache.tree.core import TreeCore

__all__ = ["check_integrity"]


def _ok(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _check_indices(node: TreeNode, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    _ok(isinstance(t, torch.Tensor), f"[tiers] {node}: {name} is not a tensor")
    _ok(t.dtype == torch.int64 and t.dim() == 1, f"[tiers] {node}: {name} must be 1-D int64, got {t.dtype} {tuple(t.shape)}")
    _ok(t.numel() == node.num_pages, f"[tiers] {node}: {name} has {t.numel()} indices for {node.num_pages} pages")


def check_integrity(tree: TreeCore, *, check_matches: bool = True) -> None:
    """Raise ``AssertionError`` naming the first broken invariant (see the module docstring)."""
    page_bytes = tree.page_bytes
    owned: dict[str, list[np.ndarray]] = {name: [] for name in ("device_kv", "device_mamba", "host_kv", "host_mamba")}
    members: dict[str, set[int]] = {lst.name: set() for lst in _lists(tree)}
    num_nodes = device_pages = host_pages = device_states = host_states = 0
    device_locked = host_locked = 0
    leaves: list[tuple[TreeNode, bytes, TreeNode | None]] = []
    own_below: dict[int, int] = {}  # node id → locks taken on it and on the nodes below it
    lock_nodes: list[tuple[TreeNode, int]] = []
    load_cover: dict[int, int] = {}
    plan_cover: dict[int, int] = {}
    for plan in tree._plans.values():
        for n in _plan_nodes(plan):
            plan_cover[n.node_id] = plan_cover.get(n.node_id, 0) + 1
            if isinstance(plan, LoadPlan):
                load_cover[n.node_id] = load_cover.get(n.node_id, 0) + 1

    for salt, root in tree._roots.items():
        _ok(root.parent is None and root.alive, f"[structure] root of salt {salt!r} is not a live root")
        _ok(root.salt == salt, f"[structure] root registered for salt {salt!r} has salt {root.salt!r}")
        _ok(root.seed_hash == seed_hash(tree.namespace, salt), f"[hashes] root seed of salt {salt!r} is wrong")
        _ok(
            root.device_kv is None and root.host_kv is None and root.device_state is None and root.host_state is None,
            f"[structure] root of salt {salt!r} holds data",
        )
        _ok(all(link is None for link in root.links[0::2]), f"[lru] root of salt {salt!r} is in an LRU list")
        _ok(
            root.device_lock == 0 and root.host_lock == 0 and root.loading == 0,
            f"[locks] root of salt {salt!r} carries locks",
        )
        stack: list[tuple[TreeNode, bytes, TreeNode | None, bytes]] = [(root, b"", None, root.seed_hash)]
        while stack:
            node, prefix, deepest_state, prev_hash = stack.pop()
            n_dev_children = n_host_children = 0
            for first, child in node.children.items():
                _ok(child.parent is node, f"[structure] {child} is listed under {node} but its parent is {child.parent}")
                _ok(child.alive, f"[structure] deleted {child} is still reachable")
                _ok(child.key[:page_bytes] == first, f"[structure] {child} is filed under another first page")
                n_dev_children += child.device_kv is not None
                n_host_children += child.host_kv is not None
            _ok(
                node.num_device_children == n_dev_children and node.num_host_children == n_host_children,
                f"[counters] {node}: child counters {node.num_device_children}/{node.num_host_children}, "
                f"actual {n_dev_children}/{n_host_children}",
            )
            if node.parent is not None:
                num_nodes += 1
                _check_node(tree, node)
                path_key = prefix + node.key
                hashes = chain_hashes(prev_hash, node.key, tree.page_size)
                if node._hashes is not None:
                    _ok(node._hashes == hashes, f"[hashes] cached page hashes of {node} do not match the chain")
                prev_hash = hashes[-1]
                if node.has_state:
                    deepest_state = node
                device_pages += node.num_pages if node.device_kv is not None else 0
                host_pages += node.num_pages if node.host_kv is not None else 0
                device_states += node.device_state is not None
                host_states += node.host_state is not None
                device_locked += node.num_pages if node.device_kv is not None and node.device_lock else 0
                host_locked += node.num_pages if node.host_kv is not None and node.host_lock else 0
                for name, value in (
                    ("device_kv", node.device_kv),
                    ("host_kv", node.host_kv),
                    ("device_mamba", node.device_state),
                    ("host_mamba", node.host_state),
                ):
                    if value is None:
                        continue
                    arr = value.numpy() if isinstance(value, torch.Tensor) else np.asarray([value], dtype=np.int64)
                    owned[name].append(arr)
                for lst in _lists(tree):
                    holds = _holds(node, lst)
                    _ok((node in lst) == holds, f"[lru] {node}: membership of {lst.name} is {node in lst}, holds {holds}")
                    if holds:
                        members[lst.name].add(node.node_id)
                _ok(
                    node.loading == load_cover.get(node.node_id, 0),
                    f"[locks] {node}: loading={node.loading} but {load_cover.get(node.node_id, 0)} load plans cover it",
                )
                cover = plan_cover.get(node.node_id, 0)
                _ok(
                    node.device_lock >= cover and node.host_lock >= cover,
                    f"[locks] {node}: {cover} in-flight plans but locks {node.device_lock}/{node.host_lock}",
                )
                if node.num_locks:
                    up: TreeNode | None = node
                    while up is not None and up.parent is not None:
                        own_below[up.node_id] = own_below.get(up.node_id, 0) + node.num_locks
                        up = up.parent
                lock_nodes.append((node, cover))
            else:
                path_key = prefix
            if not node.children and node.parent is not None:
                leaves.append((node, path_key, deepest_state))
            for child in node.children.values():
                stack.append((child, path_key, deepest_state, prev_hash))

    _ok(tree._num_nodes == num_nodes, f"[counters] node count {tree._num_nodes}, actual {num_nodes}")
    for what, mine, actual in (
        ("device pages", tree._device_pages, device_pages),
        ("host pages", tree._host_pages, host_pages),
        ("device states", tree._device_states, device_states),
        ("host states", tree._host_states, host_states),
        ("locked device pages", tree._device_locked_pages, device_locked),
        ("locked host pages", tree._host_locked_pages, host_locked),
    ):
        _ok(mine == actual, f"[counters] {what}: counted {mine}, actual {actual}")

    for lst in _lists(tree):
        try:
            linked = lst.check_links()
        except AssertionError as e:
            raise AssertionError(f"[lru] {e}") from None
        ids = {n.node_id for n in linked}
        _ok(len(ids) == len(linked), f"[lru] {lst.name} links a node twice")
        _ok(ids == members[lst.name], f"[lru] {lst.name} links {len(ids)} nodes, {len(members[lst.name])} hold its resource")

    for node, cover in lock_nodes:
        taken = own_below.get(node.node_id, 0)
        _ok(
            node.device_lock == taken + cover,
            f"[locks] {node}: device lock {node.device_lock}, but {taken} locks at or below it and {cover} plans",
        )
    _check_readers(tree)
    for r in tree._pending.retired:
        owned["device_kv"].append(r.kv_indices.numpy())
        owned["device_mamba"].append(r.state_slots.numpy())
    _check_ownership(tree, owned)
    _check_plans(tree)
    if check_matches:
        _check_matches(tree, leaves)


def _lists(tree: TreeCore) -> tuple[LRUList, ...]:
    return (tree.device_kv_lru, tree.device_state_lru, tree.host_kv_lru, tree.host_state_lru)


def _holds(node: TreeNode, lst: LRUList) -> bool:
    if lst.name == "device_kv":
        return node.device_kv is not None
    if lst.name == "device_state":
        return node.device_state is not None
    if lst.name == "host_kv":
        return node.host_kv is not None
    return node.host_state is not None


def _check_node(tree: TreeCore, node: TreeNode) -> None:
    parent = node.parent
    assert parent is not None
    _ok(node.alive, f"[structure] {node} is reachable but marked deleted")
    _ok(node.num_pages >= 1, f"[structure] {node} covers no page")
    _ok(len(node.key) == node.num_pages * tree.page_bytes, f"[structure] {node}: key length does not match its pages")
    _ok(node.page_size == tree.page_size, f"[structure] {node}: page size {node.page_size}")
    _ok(node.start_page == parent.end_page, f"[structure] {node} starts at page {node.start_page}, parent ends at {parent.end_page}")
    _ok(node.device_kv is not None or node.host_kv is not None, f"[tiers] {node} holds KV on no tier")
    _check_indices(node, "device_kv", node.device_kv)
    _check_indices(node, "host_kv", node.host_kv)
    _ok(node.device_state is None or node.device_kv is not None, f"[tiers] {node} has a device state without device KV")
    _ok(node.host_state is None or node.host_kv is not None, f"[tiers] {node} has a host state without host KV")
    if parent.parent is not None:
        _ok(node.device_kv is None or parent.device_kv is not None, f"[tiers] {node} holds device KV but its parent does not")
        _ok(node.host_kv is None or parent.host_kv is not None, f"[contiguity] {node} has a host copy but its parent does not")
    _ok(node.device_lock >= 0 and node.host_lock >= 0, f"[locks] {node}: negative lock count")
    _ok(node.loading >= 0, f"[locks] {node}: negative loading count")
    if tree.host_kv is None:
        _ok(node.host_kv is None, f"[tiers] {node} has a host copy but the tree has no host pool")
    if tree.host_mamba is None:
        _ok(node.host_state is None, f"[tiers] {node} has a host state but the tree has no host state pool")


def _check_readers(tree: TreeCore) -> None:
    loads = {pid for pid, plan in tree._plans.items() if isinstance(plan, LoadPlan) and plan._last is not None}
    _ok(tree._pending.plan_ids == loads, "[locks] the loads whose readers are counted are not the loads in flight")
    _ok(tree._pending.index_matches(), "[locks] the index of reader tokens does not list the records that count them")
    tokens = [t for n in tree.iter_nodes() for t in (n.lock_tokens or ())]
    _ok(
        len(tokens) == len(set(tokens)) and all(0 < t < tree._next_lock_token for t in tokens),
        "[locks] a lock token is held by two nodes, or was never handed out",
    )
    for plan_id, token, node in tree._pending.reader_locks():
        what = f"load plan {plan_id}" if plan_id >= 0 else "retired indices"
        _ok(node.alive, f"[locks] {what}: reader lock on deleted {node}")
        _ok(token in (node.lock_tokens or ()), f"[locks] {what}: reader lock {token} is not a live lock of {node}")


def _check_ownership(tree: TreeCore, owned: dict[str, list[np.ndarray]]) -> None:
    for name, indices in owned.items():
        pool = tree.pool(name)
        claims = tree._in_flight[name]
        parts = indices + ([np.fromiter(claims, dtype=np.int64)] if claims else [])
        arr = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if pool is None:
            _ok(arr.size == 0, f"[ownership] {name}: indices held but the pool does not exist")
            continue
        _ok(bool(((arr >= 0) & (arr < pool.num_items)).all()), f"[ownership] {name}: index outside the pool")
        uniq, counts = np.unique(arr, return_counts=True)
        twice = uniq[counts > 1]
        _ok(twice.size == 0, f"[ownership] {name}: indices {twice[:4].tolist()} are owned twice")
        allocated = pool.allocator.allocated_indices()
        free_owned = np.setdiff1d(uniq, allocated)
        _ok(free_owned.size == 0, f"[ownership] {name}: indices {free_owned[:4].tolist()} are owned but free")
        leaked = np.setdiff1d(allocated, uniq)
        _ok(leaked.size == 0, f"[ownership] {name}: indices {leaked[:4].tolist()} are allocated but owned by nothing (leak)")


def _plan_nodes(plan: LoadPlan | BackupPlan) -> list[TreeNode]:
    from asynccache.tree.transfer import plan_nodes

    return plan_nodes(plan)


def _check_plans(tree: TreeCore) -> None:
    for plan in tree._plans.values():
        if isinstance(plan, LoadPlan):
            nodes = _plan_nodes(plan)
            for n in nodes:
                _ok(n.alive, f"[locks] load plan {plan.plan_id} covers deleted {n}")
                _ok(n.device_kv is not None, f"[locks] load plan {plan.plan_id}: {n} lost its device pages")
            if plan._last is not None and plan.device_state_slot is not None:
                _ok(
                    plan._last.device_state == plan.device_state_slot,
                    f"[locks] load plan {plan.plan_id}: the loaded state slot left {plan._last}",
                )
        else:
            from asynccache.tree.transfer import _walk_up

            for node, top, kv, state in plan._segments:
                _ok(node.alive, f"[locks] backup plan {plan.plan_id} covers deleted {node}")
                _ok(not state or node.host_state is not None, f"[locks] backup plan {plan.plan_id}: {node} lost its host state")
                _ok(node.device_kv is not None, f"[locks] backup plan {plan.plan_id}: source {node} lost its device pages")
                if kv:
                    for n in _walk_up(node, top):
                        _ok(n.host_kv is not None, f"[locks] backup plan {plan.plan_id}: {n} lost its host pages")


def _check_matches(tree: TreeCore, leaves: list[tuple[TreeNode, bytes, TreeNode | None]]) -> None:
    for leaf, key, deepest in leaves:
        root = leaf
        while root.parent is not None:
            root = root.parent
        num_pages = len(key) // tree.page_bytes
        result = tree._match(key, num_pages, root.salt, touch=False)  # type: ignore[attr-defined]
        expected = deepest if deepest is not None else root
        _ok(
            result.num_tokens == expected.end_tokens and result.last_node is expected,
            f"[match] the path to {leaf} matches {result.num_tokens} tokens at {result.last_node}; "
            f"the deepest available state is at {expected.end_tokens} tokens ({expected})",
        )
        usable = tree.path_to(expected) if expected.parent is not None else []
        on_device = 0
        while on_device < len(usable) and usable[on_device].device_kv is not None:
            on_device += 1
        device_tokens = usable[on_device - 1].end_tokens if on_device else 0
        _ok(
            result.num_device_tokens == device_tokens and result.num_host_tokens == result.num_tokens - device_tokens,
            f"[match] the path to {leaf}: {result.num_device_tokens} device tokens reported, {device_tokens} on the device",
        )
        if on_device:
            expected_kv = torch.cat([n.device_kv for n in usable[:on_device]])  # type: ignore[misc]
            _ok(torch.equal(result.device_kv_indices, expected_kv), f"[match] the path to {leaf}: wrong device page indices")
        if expected.parent is not None:
            tier = Tier.DEVICE if expected.device_state is not None else Tier.HOST
            _ok(result.state_tier is tier, f"[match] the path to {leaf}: state tier {result.state_tier}, actual {tier}")
        else:
            _ok(result.state_tier is None and not result.needs_load, "[match] a miss reports a state or a load")
