"""The structural primitives the tree's operations are built from (see ``asynccache.tree.tree``).

Primitives:

- :class:`TreeCore` — on top of the state (:class:`~asynccache.tree.bookkeeping.TreeBookkeeping`)
  and the pins (:class:`~asynccache.tree.locks.TreeLocks`): split a node, delete a node, the
  tombstone cascade, a node's LRU touch on every tier; the backup selection (whether a node is
  backed up, nodes with their ancestors that lack a host copy, the nodes of a path the write
  policy wants backed up now); the checks of a call's page indices and state slots. The base of
  :class:`~asynccache.tree.match.MatchMixin`, :class:`~asynccache.tree.evict.EvictionMixin` and
  :class:`~asynccache.tree.transfer.TransferMixin`; not used on its own.
- :data:`WriteBackFn`, :data:`DemoteFn`, :data:`EvictListener`, :data:`POOL_NAMES` — re-exported
  from :mod:`asynccache.tree.bookkeeping`.

Nothing here allocates from a pool; frees happen only where the tree owns the indices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from asynccache.checks import as_int
from asynccache.errors import ConfigError
from asynccache.policy.write import WriteMode
from asynccache.tree.bookkeeping import POOL_NAMES, DemoteFn, EvictListener, WriteBackFn
from asynccache.tree.locks import TreeLocks
from asynccache.tree.node import EvictHow, TreeNode
from kernels.api import all_distinct

if TYPE_CHECKING:
    from asynccache.pools.base import ItemPool

__all__ = ["POOL_NAMES", "DemoteFn", "EvictListener", "TreeCore", "WriteBackFn"]


class TreeCore(TreeLocks):
    """Shared primitives of :class:`~asynccache.tree.HybridRadixTree`; not used on its own."""

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

    def _cascade(self, node: TreeNode, list_key: str | None = None) -> None:
        """Tombstone cascade: delete ``node`` and then its ancestors while each is childless,
        holds no state on any tier (its KV can never be part of a usable match) and is unpinned.
        ``list_key``: the list of the eviction that caused it; each deleted node is then reported
        to the eviction listeners as ``CASCADE``."""
        notify = list_key is not None and bool(self._evict_listeners)
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
            if notify:
                self._notify_evict(node, list_key, EvictHow.CASCADE)  # type: ignore[arg-type]
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
    def _check_indices(
        self, indices: torch.Tensor | Sequence[int], num_pages: int, what: str, pool: ItemPool | None
    ) -> torch.Tensor:
        """``indices`` as a private int64 CPU tensor: one per page, distinct, each in ``pool``
        (when there is one)."""
        try:
            t = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(list(indices), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{what} must be a 1-D integer tensor or a sequence of ints ({e})") from None
        if t.dim() != 1 or t.numel() != num_pages:
            raise ConfigError(f"{what} must hold one index per full page ({num_pages}), got shape {tuple(t.shape)}")
        if t.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"{what} must be an integer tensor, got {t.dtype}")
        # A private copy: the caller may reuse its tensor (e.g. a row of its page table).
        t = t.clone() if t.dtype is torch.int64 and t.device.type == "cpu" else t.to("cpu", torch.int64)
        if pool is not None and t.numel() and not (0 <= int(t.min()) and int(t.max()) < pool.num_items):
            # The tree would hold them, and the eviction that frees them fail (AllocationError).
            raise ConfigError(f"{what}: indices outside {pool.name}'s 0..{pool.num_items - 1}")
        if not all_distinct(t.numpy()):
            raise ConfigError(f"{what}: the same page index is given twice")
        return t

    def _check_states(
        self, states: Mapping[int, int] | None, num_pages: int, what: str, pool: ItemPool | None
    ) -> dict[int, int]:
        """``{token position: slot}`` → ``{page position: slot}``, validated: integer positions
        on page boundaries, integer slots in ``pool`` (when there is one)."""
        if not states:
            return {}
        out: dict[int, int] = {}
        for position, state_slot in states.items():
            pos, slot = as_int(position), as_int(state_slot)
            if pos is None or slot is None:
                raise ConfigError(f"{what}: positions and slots are integers, got {position!r}: {state_slot!r}")
            if pos % self.page_size or not 0 < pos <= num_pages * self.page_size:
                raise ConfigError(
                    f"{what}: position {pos} is not a page boundary in (0, {num_pages * self.page_size}]"
                )
            if slot < 0:
                raise ConfigError(f"{what}: negative slot {slot} at position {pos}")
            if pool is not None and slot >= pool.num_items:
                where = f"{pool.name}'s 0..{pool.num_items - 1}"
                raise ConfigError(f"{what}: slot {slot} at position {pos} is outside {where}")
            out[pos // self.page_size] = slot
        if len(set(out.values())) != len(out):
            raise ConfigError(f"{what}: the same slot is given at two positions")
        return out
