"""Pins of the tree's nodes: path locks, the pins of in-flight copies, in-flight ownership.

Primitives:

- :class:`TreeLocks` — ``lock`` / ``unlock`` and ``lock_host`` / ``unlock_host``: a node and its
  ancestors pinned on the device (on the host), their data never evicted and the nodes never
  deleted until the matching unlock (a device lock has a token, which ``unlock`` takes back,
  and is counted on the locked node too; the loads in flight on the path hear of it:
  ``asynccache.tree.pending``); ``check_alive``,
  before locking several nodes; ``_pin``, the per-node pin of an in-flight copy (both tiers,
  and ``loading`` for a load); ``release_hook`` (set on the tree) hears of every unlock, so that
  the controller retries the undo of a failed operation a lock blocked;
  ``claim_in_flight`` / ``release_in_flight`` / ``in_flight_owned``: the pool indices in-flight
  operations own, which ``check_integrity`` does not report as leaked. The locked-page totals
  follow every pin. Not used on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from asynccache.pools.base import ItemPool
from asynccache.tree.bookkeeping import TreeBookkeeping
from asynccache.tree.errors import TreeError
from asynccache.tree.node import TreeNode
from asynccache.tree.pending import Retired

__all__ = ["TreeLocks"]


class TreeLocks(TreeBookkeeping):
    """Locks, pins and in-flight claims of :class:`~asynccache.tree.HybridRadixTree`; not used on
    its own."""

    # ---- locks -----------------------------------------------------------------------------
    def _check_alive(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise TreeError(_not_a_node(node))
        if not node.alive and node.parent is not None:
            raise TreeError(f"{node} was deleted from the tree")

    def check_alive(self, nodes: Iterable[TreeNode]) -> None:
        """Raise :class:`TreeError` if a node was deleted (or is no tree node at all): before
        locking several, so that a stale list leaves none of them locked."""
        for node in nodes:
            self._check_alive(node)

    def lock(self, node: TreeNode) -> int:
        """Pin ``node`` and its ancestors on the device: their device data is never evicted and
        the nodes are never deleted until :meth:`unlock`. Returns the lock's token (a unique
        positive int) for ``unlock(node, token)``; locking a root does nothing and returns 0.

        A lock taken on a path that a load is filling makes its token a reader of that load
        (``asynccache.tree.pending``): a load's owner locks its match before the load begins.
        Raises :class:`TreeError` for a deleted node or anything not a :class:`TreeNode`."""
        self._check_alive(node)
        if node.parent is None:
            return 0
        token = self._next_lock_token
        self._next_lock_token += 1
        if node.lock_tokens is None:
            node.lock_tokens = set()
        node.lock_tokens.add(token)
        loading = False
        n = node
        while n.parent is not None:
            if n.device_lock == 0 and n.device_kv is not None:
                self._device_locked_pages += n.num_pages
            n.device_lock += 1
            loading = loading or n.loading > 0
            n = n.parent
        if loading:
            self._pending.on_lock(node, self.path_to(node), token)
        return token

    def unlock(self, node: TreeNode, token: int) -> None:
        """Undo the :meth:`lock` of ``node`` that returned ``token``; the token is required.
        Raises :class:`TreeError` (nothing changed) without a lock on ``node`` itself, or for a
        token that is not a live lock of ``node``: another node's, one released already, one
        never returned, or not an int at all (``None`` and bools included). Unlocking a root (a
        miss's ``last_node``) with its token 0 does nothing, as locking it does. A reader's
        unlock that was the last lock holding a failed load's retired indices frees them.
        ``release_hook`` (when set) hears of every unlock, as of every :meth:`unlock_host`.
        ``node`` not a :class:`TreeNode`: :class:`TreeError` too."""
        if not isinstance(node, TreeNode):
            raise TreeError(_not_a_node(node))
        if not isinstance(token, int) or isinstance(token, bool):
            raise TreeError(f"unlock of {node} with {token!r}, which is not a lock token")
        path = self.path_to(node)
        if not path:
            if token:
                raise TreeError(f"unlock of {node} with lock {token}, which was not taken on it")
            return
        tokens = node.lock_tokens
        if not tokens or any(n.device_lock <= 0 for n in path):
            raise TreeError(f"unlock of {node} without a matching lock")
        if token not in tokens:
            raise TreeError(f"unlock of {node} with lock {token}, which is not a live lock of it")
        tokens.remove(token)
        if not tokens:
            node.lock_tokens = None
        for n in path:
            n.device_lock -= 1
            if n.device_lock == 0 and n.device_kv is not None:
                self._device_locked_pages -= n.num_pages
        freed = self._pending.on_unlock(token) if self._pending.has_readers else []
        if self.release_hook is not None:
            self.release_hook()
        if freed:
            self._free_retired(freed)

    def _free_retired(self, freed: Sequence[Retired]) -> None:
        # The records are gone from the tree already: the slots are freed even when the pages'
        # free raises (then the pool's error propagates), so nothing stays owned by no one.
        kv = torch.cat([r.kv_indices for r in freed])
        slots = torch.cat([r.state_slots for r in freed])
        try:
            if kv.numel():
                self.device_kv.free(kv)
        finally:
            if slots.numel():
                self.device_mamba.free(slots)

    def lock_host(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors on the host (host copies kept, nodes not deleted).
        Raises :class:`TreeError` as :meth:`lock` does."""
        self._check_alive(node)
        while node.parent is not None:
            if node.host_lock == 0 and node.host_kv is not None:
                self._host_locked_pages += node.num_pages
            node.host_lock += 1
            node = node.parent

    def unlock_host(self, node: TreeNode) -> None:
        """Undo one :meth:`lock_host`. Raises :class:`TreeError` below zero (a root: nothing),
        and for anything not a :class:`TreeNode`."""
        if not isinstance(node, TreeNode):
            raise TreeError(_not_a_node(node))
        path = self.path_to(node)
        if any(n.host_lock <= 0 for n in path):
            raise TreeError(f"unlock_host of {node} without a matching lock_host")
        for n in path:
            n.host_lock -= 1
            if n.host_lock == 0 and n.host_kv is not None:
                self._host_locked_pages -= n.num_pages
        if self.release_hook is not None:
            self.release_hook()

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


def _not_a_node(node: object) -> str:
    return f"expected a TreeNode (a match's last_node), got {type(node).__name__}"


def _as_ints(indices: torch.Tensor | Iterable[int]) -> list[int]:
    if isinstance(indices, torch.Tensor):
        return [int(v) for v in indices.reshape(-1).tolist()]
    if isinstance(indices, np.ndarray):
        return [int(v) for v in indices.reshape(-1).tolist()]
    return [int(v) for v in indices]
