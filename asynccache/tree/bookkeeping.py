"""State and bookkeeping shared by the tree's operations (see ``asynccache.tree.tree``).

Primitives:

- :class:`TreeBookkeeping` — the state of a :class:`~asynccache.tree.HybridRadixTree`: its pools
  and policies, the tenants' roots, the four LRU lists, the counters, the active plans, what
  depends on the loads among them (``asynccache.tree.pending``) and the in-flight claims; node
  creation and walks (``iter_nodes``, ``path_to``, ``token_ids``); attach /
  detach of an index set on one tier, the only places that change what a node holds (keeping LRU
  membership, child counters and totals in step), and the frees of what the tree owns;
  ``stats`` and ``check_integrity``. Not used on its own.
- :data:`WriteBackFn` — the write-back callback device eviction hands nodes to.
- :data:`DemoteFn` — the callback host eviction hands each victim to before dropping its copy.
- :data:`EvictListener` — an eviction notification (``add_evict_listener``).
- :data:`POOL_NAMES` — the names of the four pools.

Nothing here allocates from a pool; frees happen only where the tree owns the indices.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from asynccache.errors import ConfigError
from asynccache.policy.admission import EndsAdmission
from asynccache.policy.base import AdmissionPolicy, EvictionPolicy
from asynccache.policy.lru import LRUEviction
from asynccache.policy.write import WriteMode, WritePolicy
from asynccache.pools.base import ItemPool
from asynccache.spec import HybridSpec
from asynccache.tree.hashing import TOKEN_BYTES, seed_hash
from asynccache.tree.lru import HostLRUList, LRUList
from asynccache.tree.node import EvictHow, Resource, Tier, TreeNode
from asynccache.tree.pending import PendingLoads
from asynccache.tree.results import TreeStats

if TYPE_CHECKING:
    from asynccache.tree.results import BackupPlan, LoadPlan

__all__ = ["POOL_NAMES", "DemoteFn", "EvictListener", "TreeBookkeeping", "WriteBackFn"]

#: ``write_back(nodes) -> bool``: start a device→host backup of ``nodes`` (top-down, ancestors
#: first) through ``tree.begin_backup``; return whether it was started.
WriteBackFn = Callable[[Sequence[TreeNode]], bool]

#: ``demote(nodes, list_key)``: host eviction is about to drop the host copy of the victim
#: ``nodes[-1]`` from list ``list_key`` (``"host_kv"`` or ``"host_state"``); ``nodes`` are its
#: ancestors not marked archived, then the victim, top-down. Called while the victim still holds
#: everything; it may ``mark_archived`` nodes and must not otherwise change the tree.
DemoteFn = Callable[[Sequence[TreeNode], str], None]

#: ``listener(node, list_key, how)``: ``node`` was evicted from list ``list_key``
#: (``"device_kv"``, ``"device_state"``, ``"host_kv"``, ``"host_state"``) in the way ``how`` says;
#: called after the tree has freed it. It must not change the tree; it may add or remove
#: listeners (from the next notification on).
EvictListener = Callable[[TreeNode, str, EvictHow], None]

#: Names of the four pools, as used by ``claim_in_flight`` / ``release_in_flight``.
POOL_NAMES = ("device_kv", "device_mamba", "host_kv", "host_mamba")


class TreeBookkeeping:
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
        #: called (no arguments) after every ``unlock`` and ``unlock_host``; it must not change the
        #: tree (the controller schedules the undo of failed operations a lock blocked, see
        #: ``asynccache.tree_ops``)
        self.release_hook: Callable[[], None] | None = None
        #: called with (KV keys, state keys) when a failed load's undo drops data computed on it:
        #: the storage keys that data may have been archived under (the storage tier no longer
        #: serves them); it must not change the tree
        self.stale_hook: Callable[[frozenset[str], frozenset[str]], None] | None = None
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
        # Readers and dependents of the loads in flight, and what failed ones left to free.
        self._pending = PendingLoads()
        # The next device lock's token (each locked node keeps its live ones: ``lock_tokens``).
        self._next_lock_token = 1
        self._in_flight: dict[str, set[int]] = {name: set() for name in POOL_NAMES}
        self._evict_listeners: list[EvictListener] = []
        # A policy that learns from its victims overrides ``on_evict``: it hears every eviction.
        if getattr(type(self.eviction), "on_evict", EvictionPolicy.on_evict) is not EvictionPolicy.on_evict:
            self._evict_listeners.append(self.eviction.on_evict)

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

    # ---- eviction notifications -----------------------------------------------------------
    def add_evict_listener(self, listener: EvictListener) -> None:
        """Call ``listener(node, list_key, how)`` after every eviction from then on (see
        ``asynccache.tree.evict``). The tree's eviction policy is subscribed at construction when
        it overrides ``EvictionPolicy.on_evict``."""
        self._evict_listeners.append(listener)

    def remove_evict_listener(self, listener: EvictListener) -> None:
        """Stop notifying ``listener`` (``ConfigError`` if it was not subscribed)."""
        try:
            self._evict_listeners.remove(listener)
        except ValueError:
            raise ConfigError(f"{listener!r} is not an eviction listener of this tree") from None

    def _notify_evict(self, node: TreeNode, list_key: str, how: EvictHow) -> None:
        # A copy: a listener may add or remove listeners (itself included) while it is told; the
        # change applies from the next notification and every other listener still hears this one.
        for listener in tuple(self._evict_listeners):
            listener(node, list_key, how)

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

