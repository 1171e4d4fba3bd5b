"""State and bookkeeping shared by the tree's operations (see ``asynccache.tree.tree``).

:class:`TreeCore` owns the roots, the four LRU lists, the counters, the active plans and the
in-flight claims, and the primitive mutations every operation is built from: attach / detach an
index set on one tier (keeping LRU membership, child counters and totals in step), split a node,
delete a node, the tombstone cascade, and path locks. Nothing here allocates from a pool; frees
happen only where the tree owns the indices.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from asynccache.errors import ConfigError
from asynccache.policy.admission import EndsAdmission
from asynccache.policy.base import AdmissionPolicy, EvictionPolicy
from asynccache.policy.lru import LRUEviction
from asynccache.policy.write import WriteMode, WritePolicy
from asynccache.pools.base import ItemPool
from asynccache.spec import HybridSpec
from asynccache.tree.errors import TreeError
from asynccache.tree.hashing import TOKEN_BYTES, seed_hash
from asynccache.tree.lru import HostLRUList, LRUList
from asynccache.tree.node import Resource, Tier, TreeNode
from asynccache.tree.results import TreeStats
from kernels.api import all_distinct

if TYPE_CHECKING:
    from asynccache.tree.results import BackupPlan, LoadPlan

__all__ = ["POOL_NAMES", "TreeCore", "WriteBackFn"]

#: ``write_back(nodes) -> bool``: start a device→host backup of ``nodes`` (top-down, ancestors
#: first) through ``tree.begin_backup``; return whether it was started.
WriteBackFn = Callable[[Sequence[TreeNode]], bool]

#: Names of the four pools, as used by ``claim_in_flight`` / ``release_in_flight``.
POOL_NAMES = ("device_kv", "device_mamba", "host_kv", "host_mamba")


class TreeCore:
    """Shared state of :class:`~asynccache.tree.HybridRadixTree`; not used on its own."""

    def __init__(
        self,
        spec: HybridSpec,
        *,
        device_kv: ItemPool,
        device_mamba: ItemPool,
        host_kv: ItemPool | None = None,
        host_mamba: ItemPool | None = None,
        admission: AdmissionPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        write_policy: WritePolicy | WriteMode | str | None = None,
        model_id: str | None = None,
        write_back: WriteBackFn | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if host_mamba is not None and host_kv is None:
            raise ConfigError("a host state pool needs a host KV pool (a host state needs its KV on the host)")
        for dev, host, what in ((device_kv, host_kv, "KV"), (device_mamba, host_mamba, "state")):
            if host is not None and (host.item_bytes != dev.item_bytes or host.num_layers != dev.num_layers):
                raise ConfigError(
                    f"host {what} pool items ({host.num_layers}×{host.item_bytes} B) do not match the device "
                    f"pool's ({dev.num_layers}×{dev.item_bytes} B)"
                )
        self.spec = spec
        self.page_size = spec.page_size
        self.page_bytes = spec.page_size * TOKEN_BYTES
        self.device_kv = device_kv
        self.device_mamba = device_mamba
        self.host_kv = host_kv
        self.host_mamba = host_mamba
        self.admission: AdmissionPolicy = admission if admission is not None else EndsAdmission()
        self.eviction: EvictionPolicy = eviction if eviction is not None else LRUEviction()
        self.write_policy = WritePolicy.parse(write_policy) if write_policy is not None else WritePolicy.write_through()
        self.write_back: WriteBackFn | None = write_back
        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self.namespace = spec.namespace_id if model_id is None else f"{model_id}|{spec.namespace_id}"

        self.device_kv_lru = LRUList(0, name="device_kv", tier=Tier.DEVICE, resource=Resource.KV)
        self.device_state_lru = LRUList(1, name="device_state", tier=Tier.DEVICE, resource=Resource.STATE)
        self.host_kv_lru = HostLRUList(2, name="host_kv", resource=Resource.KV)
        self.host_state_lru = HostLRUList(3, name="host_state", resource=Resource.STATE)

        self._next_node_id = 0
        self._roots: dict[str, TreeNode] = {}
        self.root = self._root_for("", create=True)
        self._num_nodes = 0
        self._device_pages = 0
        self._host_pages = 0
        self._device_states = 0
        self._host_states = 0
        self._device_locked_pages = 0
        self._host_locked_pages = 0
        # Running totals read by eviction to build its result.
        self._lost_states = 0
        self._deleted_nodes = 0
        self._plans: dict[int, LoadPlan | BackupPlan] = {}
        self._next_plan_id = 0
        self._in_flight: dict[str, set[int]] = {name: set() for name in POOL_NAMES}

    # ---- configuration -------------------------------------------------------------------
    @property
    def has_host(self) -> bool:
        """A host tier exists (host KV pool; states need ``host_mamba`` too)."""
        return self.host_kv is not None

    def pool(self, name: str) -> ItemPool | None:
        """The pool called ``name`` (one of :data:`POOL_NAMES`); ``None`` for an absent host pool."""
        if name not in POOL_NAMES:
            raise ConfigError(f"unknown pool {name!r}; known: {list(POOL_NAMES)}")
        pool: ItemPool | None = getattr(self, name)
        return pool

    def _pool_name(self, pool: str | ItemPool) -> str:
        if isinstance(pool, str):
            self.pool(pool)
            return pool
        for name in POOL_NAMES:
            if getattr(self, name) is pool:
                return name
        raise ConfigError(f"{pool!r} is not one of this tree's pools")

    # ---- roots and nodes -----------------------------------------------------------------
    def _new_node_id(self) -> int:
        self._next_node_id += 1
        return self._next_node_id

    def _root_for(self, salt: str, *, create: bool) -> TreeNode:
        """The root of tenant ``salt``; a fresh unregistered root when absent and not ``create``."""
        root = self._roots.get(salt)
        if root is None:
            root = TreeNode(
                node_id=self._new_node_id(),
                parent=None,
                key=b"",
                start_page=0,
                num_pages=0,
                page_size=self.page_size,
                salt=salt,
                seed_hash=seed_hash(self.namespace, salt),
            )
            if create:
                self._roots[salt] = root
        return root

    @property
    def roots(self) -> dict[str, TreeNode]:
        """Tenant salt → root (read-only view by convention)."""
        return self._roots

    def _new_child(self, parent: TreeNode, key: bytes, start_page: int) -> TreeNode:
        node = TreeNode(
            node_id=self._new_node_id(),
            parent=parent,
            key=key,
            start_page=start_page,
            num_pages=len(key) // self.page_bytes,
            page_size=self.page_size,
        )
        parent.children[key[: self.page_bytes]] = node
        self._num_nodes += 1
        return node

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children (no mutation allowed meanwhile)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def path_to(self, node: TreeNode) -> list[TreeNode]:
        """Non-root nodes from the top down to ``node``."""
        path: list[TreeNode] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def token_ids(self, node: TreeNode) -> torch.Tensor:
        """The tokens from the root to the end of ``node`` (int64)."""
        return torch.frombuffer(bytearray(b"".join(n.key for n in self.path_to(node))), dtype=torch.int64)

    # ---- attach / detach (the only places that change what a node holds) -------------------
    def _set_device_kv(self, node: TreeNode, indices: torch.Tensor) -> None:
        node.device_kv = indices
        self.device_kv_lru.push(node)
        node.parent.num_device_children += 1  # type: ignore[union-attr]
        self._device_pages += node.num_pages
        if node.device_lock:
            self._device_locked_pages += node.num_pages

    def _clear_device_kv(self, node: TreeNode) -> torch.Tensor:
        indices = node.device_kv
        assert indices is not None
        node.device_kv = None
        self.device_kv_lru.remove(node)
        node.parent.num_device_children -= 1  # type: ignore[union-attr]
        self._device_pages -= node.num_pages
        if node.device_lock:
            self._device_locked_pages -= node.num_pages
        return indices

    def _set_host_kv(self, node: TreeNode, indices: torch.Tensor) -> None:
        node.host_kv = indices
        self.host_kv_lru.push(node)
        node.parent.num_host_children += 1  # type: ignore[union-attr]
        self._host_pages += node.num_pages
        if node.host_lock:
            self._host_locked_pages += node.num_pages

    def _clear_host_kv(self, node: TreeNode) -> torch.Tensor:
        indices = node.host_kv
        assert indices is not None
        node.host_kv = None
        self.host_kv_lru.remove(node)
        node.parent.num_host_children -= 1  # type: ignore[union-attr]
        self._host_pages -= node.num_pages
        if node.host_lock:
            self._host_locked_pages -= node.num_pages
        return indices

    def _set_device_state(self, node: TreeNode, slot: int) -> None:
        node.device_state = slot
        self.device_state_lru.push(node)
        self._device_states += 1

    def _clear_device_state(self, node: TreeNode) -> int:
        slot = node.device_state
        assert slot is not None
        node.device_state = None
        self.device_state_lru.remove(node)
        self._device_states -= 1
        return slot

    def _set_host_state(self, node: TreeNode, slot: int) -> None:
        node.host_state = slot
        # ``archived`` covers what the node holds on the host: a state that arrives (e.g. at a
        # branch point split off an archived node) is not in storage yet, so the tier archives it.
        node.archived = False
        self.host_state_lru.push(node)
        self._host_states += 1

    def _clear_host_state(self, node: TreeNode) -> int:
        slot = node.host_state
        assert slot is not None
        node.host_state = None
        self.host_state_lru.remove(node)
        self._host_states -= 1
        return slot

    def _free_device_state(self, node: TreeNode) -> None:
        self.device_mamba.free(torch.tensor([self._clear_device_state(node)], dtype=torch.int64))

    def _free_host_state(self, node: TreeNode) -> None:
        assert self.host_mamba is not None
        self.host_mamba.free(torch.tensor([self._clear_host_state(node)], dtype=torch.int64))

    def _free_device_kv(self, node: TreeNode) -> None:
        self.device_kv.free(self._clear_device_kv(node))

    def _free_host_kv(self, node: TreeNode) -> None:
        assert self.host_kv is not None
        self.host_kv.free(self._clear_host_kv(node))

    # ---- structure -----------------------------------------------------------------------
    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Split ``node`` after its first ``num_pages`` pages; return the new upper node.

        ``node`` keeps its identity, its end, its state and its children; the upper node takes
        the first pages of every tier's indices and copies the counters (locks, hits, loading):
        whatever pinned ``node`` pins the upper part too, and plans that walk up from ``node``
        to their first page cover both.
        """
        assert 0 < num_pages < node.num_pages and node.parent is not None
        page_bytes = self.page_bytes
        cut = num_pages * page_bytes
        parent = node.parent
        first = node.key[:page_bytes]
        upper = TreeNode(
            node_id=self._new_node_id(),
            parent=parent,
            key=node.key[:cut],
            start_page=node.start_page,
            num_pages=num_pages,
            page_size=self.page_size,
        )
        node.key = node.key[cut:]
        node.start_page += num_pages
        node.num_pages -= num_pages
        parent.children[first] = upper
        upper.children[node.key[:page_bytes]] = node
        node.parent = upper
        upper.device_lock = node.device_lock
        upper.host_lock = node.host_lock
        upper.loading = node.loading
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        upper.archived = node.archived
        if node._hashes is not None:
            upper._hashes = node._hashes[:num_pages]
            node._hashes = node._hashes[num_pages:]
        if node.device_kv is not None:
            upper.device_kv = node.device_kv[:num_pages]
            node.device_kv = node.device_kv[num_pages:]
            upper.num_device_children = 1
            self.device_kv_lru.insert_after(node, upper)
        if node.host_kv is not None:
            upper.host_kv = node.host_kv[:num_pages]
            node.host_kv = node.host_kv[num_pages:]
            upper.num_host_children = 1
            self.host_kv_lru.insert_after(node, upper)
        self._num_nodes += 1
        return upper

    def _delete(self, node: TreeNode) -> None:
        """Remove a childless, unpinned node and free everything it holds on every tier."""
        assert not node.children and node.parent is not None
        assert node.device_lock == 0 and node.host_lock == 0 and node.loading == 0
        if node.device_state is not None or node.host_state is not None:
            self._lost_states += 1
        if node.device_state is not None:
            self._free_device_state(node)
        if node.host_state is not None:
            self._free_host_state(node)
        if node.device_kv is not None:
            self._free_device_kv(node)
        if node.host_kv is not None:
            self._free_host_kv(node)
        parent = node.parent
        del parent.children[node.key[: self.page_bytes]]
        node.alive = False
        self._num_nodes -= 1
        self._deleted_nodes += 1
        if parent.parent is None and not parent.children and parent.salt and self._roots.get(parent.salt) is parent:
            del self._roots[parent.salt]
            parent.alive = False

    def _cascade(self, node: TreeNode) -> None:
        """Tombstone cascade: delete ``node`` and then its ancestors while each is childless,
        holds no state on any tier (its KV can never be part of a usable match) and is unpinned."""
        while (
            node.parent is not None
            and node.alive
            and not node.children
            and node.device_state is None
            and node.host_state is None
            and node.device_lock == 0
            and node.host_lock == 0
            and node.loading == 0
        ):
            parent = node.parent
            self._delete(node)
            node = parent

    def _touch(self, node: TreeNode) -> None:
        if node.device_kv is not None:
            self.device_kv_lru.touch(node)
        if node.device_state is not None:
            self.device_state_lru.touch(node)
        if node.host_kv is not None:
            self.host_kv_lru.touch(node)
        if node.host_state is not None:
            self.host_state_lru.touch(node)

    def _backed_up(self, node: TreeNode) -> bool:
        """The host holds everything the device holds for this node (its KV, and its state when
        states can go to the host)."""
        return node.host_kv is not None and (
            node.device_state is None or node.host_state is not None or self.host_mamba is None
        )

    def _with_ancestors(self, nodes: Iterable[TreeNode]) -> tuple[TreeNode, ...]:
        """``nodes`` plus every ancestor without a host copy (host copies must stay a contiguous
        prefix from the root), parents before children."""
        chosen: dict[int, TreeNode] = {}
        for node in nodes:
            if node.node_id in chosen:
                continue
            chosen[node.node_id] = node
            up = node.parent
            while up is not None and up.parent is not None and up.host_kv is None and up.node_id not in chosen:
                chosen[up.node_id] = up
                up = up.parent
        return tuple(sorted(chosen.values(), key=lambda n: n.start_page))

    def _backup_candidates(self, path: Sequence[TreeNode], *, on_hit: bool) -> tuple[TreeNode, ...]:
        """Nodes of ``path`` (one root path, top-down) the write policy wants backed up now,
        with their ancestors that lack a host copy, top-down.

        KV past the deepest state of the path is dead weight and is never proposed."""
        if self.host_kv is None or self.write_policy.mode is WriteMode.WRITE_BACK:
            return ()
        cut = len(path)
        while cut and path[cut - 1].device_state is None and path[cut - 1].host_state is None:
            cut -= 1
        wants = self.write_policy.backup_on_hit if on_hit else self.write_policy.backup_on_insert
        states_follow = self.host_mamba is not None
        chosen: set[int] = set()
        last = -1
        for i in range(cut):
            n = path[i]
            if n.host_kv is not None and (not states_follow or n.device_state is None or n.host_state is not None):
                continue  # backed up (or being backed up)
            if wants(n):
                chosen.add(i)
                last = i
        if last < 0:
            return ()
        # Every ancestor of a chosen node is above it on the path; those without a host copy go too.
        return tuple(n for i, n in enumerate(path[: last + 1]) if i in chosen or n.host_kv is None)

    # ---- argument checks -------------------------------------------------------------------
    def _check_indices(self, indices: torch.Tensor | Sequence[int], num_pages: int, what: str) -> torch.Tensor:
        t = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(list(indices), dtype=torch.int64)
        if t.dim() != 1 or t.numel() != num_pages:
            raise ConfigError(f"{what} must hold one index per full page ({num_pages}), got shape {tuple(t.shape)}")
        if t.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"{what} must be an integer tensor, got {t.dtype}")
        # A private copy: the caller may reuse its tensor (e.g. a row of its page table).
        t = t.clone() if t.dtype is torch.int64 and t.device.type == "cpu" else t.to("cpu", torch.int64)
        if not all_distinct(t.numpy()):
            raise ConfigError(f"{what}: the same page index is given twice")
        return t

    def _check_states(self, states: Mapping[int, int] | None, num_pages: int, what: str) -> dict[int, int]:
        """``{token position: slot}`` → ``{page position: slot}``, validated."""
        if not states:
            return {}
        out: dict[int, int] = {}
        for pos, slot in states.items():
            pos, slot = int(pos), int(slot)
            if pos % self.page_size or not 0 < pos <= num_pages * self.page_size:
                raise ConfigError(
                    f"{what}: position {pos} is not a page boundary in (0, {num_pages * self.page_size}]"
                )
            if slot < 0:
                raise ConfigError(f"{what}: negative slot {slot} at position {pos}")
            out[pos // self.page_size] = slot
        if len(set(out.values())) != len(out):
            raise ConfigError(f"{what}: the same slot is given at two positions")
        return out

    # ---- locks -----------------------------------------------------------------------------
    def _check_alive(self, node: TreeNode) -> None:
        if not node.alive and node.parent is not None:
            raise TreeError(f"{node} was deleted from the tree")

    def check_alive(self, nodes: Iterable[TreeNode]) -> None:
        """Raise :class:`TreeError` if a node was deleted: before locking several, so that a
        stale list leaves none of them locked."""
        for node in nodes:
            self._check_alive(node)

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors on the device: their device data is never evicted and
        the nodes are never deleted until :meth:`unlock`. Locking a root does nothing."""
        self._check_alive(node)
        while node.parent is not None:
            if node.device_lock == 0 and node.device_kv is not None:
                self._device_locked_pages += node.num_pages
            node.device_lock += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``. Raises :class:`TreeError` below zero."""
        path = self.path_to(node)
        if any(n.device_lock <= 0 for n in path):
            raise TreeError(f"unlock of {node} without a matching lock")
        for n in path:
            n.device_lock -= 1
            if n.device_lock == 0 and n.device_kv is not None:
                self._device_locked_pages -= n.num_pages

    def lock_host(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors on the host (host copies kept, nodes not deleted)."""
        self._check_alive(node)
        while node.parent is not None:
            if node.host_lock == 0 and node.host_kv is not None:
                self._host_locked_pages += node.num_pages
            node.host_lock += 1
            node = node.parent

    def unlock_host(self, node: TreeNode) -> None:
        """Undo one :meth:`lock_host`. Raises :class:`TreeError` below zero."""
        path = self.path_to(node)
        if any(n.host_lock <= 0 for n in path):
            raise TreeError(f"unlock_host of {node} without a matching lock_host")
        for n in path:
            n.host_lock -= 1
            if n.host_lock == 0 and n.host_kv is not None:
                self._host_locked_pages -= n.num_pages

    def _pin(self, node: TreeNode, delta: int, *, loading: bool) -> None:
        """Per-node pin of an in-flight copy: device and host lock (and ``loading``) += delta."""
        before_d, before_h = node.device_lock, node.host_lock
        node.device_lock += delta
        node.host_lock += delta
        if loading:
            node.loading += delta
        if node.device_kv is not None and (before_d == 0) != (node.device_lock == 0):
            self._device_locked_pages += node.num_pages if before_d == 0 else -node.num_pages
        if node.host_kv is not None and (before_h == 0) != (node.host_lock == 0):
            self._host_locked_pages += node.num_pages if before_h == 0 else -node.num_pages

    # ---- in-flight ownership -----------------------------------------------------------------
    def claim_in_flight(self, pool: str | ItemPool, indices: torch.Tensor | Iterable[int]) -> None:
        """Record that an in-flight operation owns ``indices`` of ``pool`` (so
        ``check_integrity`` does not report them as leaked). Raises :class:`TreeError` when an
        index is already claimed."""
        name = self._pool_name(pool)
        values = _as_ints(indices)
        claimed = self._in_flight[name]
        if len(set(values)) != len(values) or any(v in claimed for v in values):
            raise TreeError(f"{name}: indices claimed twice")
        claimed.update(values)

    def release_in_flight(self, pool: str | ItemPool, indices: torch.Tensor | Iterable[int]) -> None:
        """Undo :meth:`claim_in_flight`. Raises :class:`TreeError` for unclaimed indices."""
        name = self._pool_name(pool)
        values = _as_ints(indices)
        claimed = self._in_flight[name]
        if any(v not in claimed for v in values):
            raise TreeError(f"{name}: releasing indices that were not claimed")
        claimed.difference_update(values)

    def in_flight_owned(self, pool: str) -> frozenset[int]:
        """Indices of ``pool`` claimed by in-flight operations."""
        return frozenset(self._in_flight[self._pool_name(pool)])

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> TreeStats:
        return TreeStats(
            num_nodes=self._num_nodes,
            device_kv_pages=self._device_pages,
            host_kv_pages=self._host_pages,
            device_states=self._device_states,
            host_states=self._host_states,
            device_locked_pages=self._device_locked_pages,
            host_locked_pages=self._host_locked_pages,
            num_active_plans=len(self._plans),
        )

    @property
    def active_plans(self) -> tuple[LoadPlan | BackupPlan, ...]:
        return tuple(self._plans.values())

    def check_integrity(self, *, check_matches: bool = True) -> None:
        """Verify every invariant (see ``asynccache.tree.integrity``); raises ``AssertionError``
        naming the broken one. O(tree + pools); for tests and debugging."""
        from asynccache.tree.integrity import check_integrity

        check_integrity(self, check_matches=check_matches)


def _as_ints(indices: torch.Tensor | Iterable[int]) -> list[int]:
    if isinstance(indices, torch.Tensor):
        return [int(v) for v in indices.reshape(-1).tolist()]
    if isinstance(indices, np.ndarray):
        return [int(v) for v in indices.reshape(-1).tolist()]
    return [int(v) for v in indices]
