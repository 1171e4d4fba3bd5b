"""Synchronous stand-in for the controller's copies.

:class:`SyncTransfer` performs the tree's load and backup protocols with
``kernels.copy_items`` and completes them before returning. It serves the CPU tests, the
property tests and trace replay in accounting mode (where a copy only counts bytes). The
asynchronous controller replaces it in serving: there ``finish_*`` runs once the CUDA copy has
completed.

``transfer.write_back`` is a ready-made ``write_back`` callback for the tree: it backs the nodes
up at once, so ``evict_device`` demotes them in the same call.
"""

from __future__ import annotations

from collections.abc import Sequence

from asynccache.tree.errors import TreeError
from asynccache.tree.node import TreeNode
from asynccache.tree.results import BackupPlan, LoadPlan, MatchResult
from asynccache.tree.tree import HybridRadixTree
from kernels.api import copy_items

__all__ = ["SyncTransfer"]


class SyncTransfer:
    """Loads and backups for ``tree``, copied synchronously (see the module docstring)."""

    def __init__(self, tree: HybridRadixTree) -> None:
        self.tree = tree
        self.bytes_loaded = 0
        self.bytes_backed_up = 0
        #: the states' share of the two
        self.state_bytes_loaded = 0
        self.state_bytes_backed_up = 0

    def backup(self, nodes: Sequence[TreeNode]) -> BackupPlan | None:
        """Back ``nodes`` up (parents first; ancestors without a host copy must be included),
        evicting the host for room. ``None`` when the host has no room (nothing changed)."""
        tree = self.tree
        if tree.host_kv is None:
            return None
        tree.check_alive(nodes)
        num_kv, num_states = tree.backup_pages_needed(nodes)
        # Pin the nodes on the host while making room: host eviction must neither delete them
        # nor drop the host copies of their ancestors (contiguity).
        for n in nodes:
            tree.lock_host(n)
        try:
            alloc = tree.alloc_host(num_kv, num_states)
        finally:
            for n in nodes:
                tree.unlock_host(n)
        if alloc is None:
            return None
        try:
            plan = tree.begin_backup(nodes, alloc.kv_indices, alloc.state_slots)
        except Exception:
            tree.host_kv.free(alloc.kv_indices)
            if tree.host_mamba is not None:
                tree.host_mamba.free(alloc.state_slots)
            raise
        self.bytes_backed_up += copy_items(tree.device_kv, tree.host_kv, plan.device_kv_indices, plan.host_kv_indices)
        if tree.host_mamba is not None:
            n = copy_items(tree.device_mamba, tree.host_mamba, plan.device_state_slots, plan.host_state_slots)
            self.bytes_backed_up += n
            self.state_bytes_backed_up += n
        tree.finish_backup(plan)
        return plan

    def write_back(self, nodes: Sequence[TreeNode]) -> bool:
        """``write_back`` callback: back up now; ``False`` when the host has no room."""
        return self.backup(nodes) is not None

    def load(self, match: MatchResult) -> LoadPlan | None:
        """Load the host-only part of ``match`` to the device, evicting the device for room.
        ``None`` when the device has no room (nothing changed). The match must be current."""
        tree = self.tree
        # Pinned on both tiers while room is made: making device room may write a victim back,
        # and making host room for that must not evict what this load is about to read.
        token = tree.lock(match.last_node)
        tree.lock_host(match.last_node)
        try:
            alloc = tree.alloc_device(match.num_load_kv_pages, match.num_load_states)
        finally:
            tree.unlock(match.last_node, token)
            tree.unlock_host(match.last_node)
        if alloc is None:
            return None
        try:
            plan = tree.begin_load(match, alloc.kv_indices, alloc.state_slot)
        except (TreeError, ValueError):
            tree.device_kv.free(alloc.kv_indices)
            tree.device_mamba.free(alloc.state_slots)
            raise
        if plan.num_kv_pages:
            assert tree.host_kv is not None
            self.bytes_loaded += copy_items(tree.host_kv, tree.device_kv, plan.host_kv_indices, plan.device_kv_indices)
        if plan.num_states:
            assert tree.host_mamba is not None
            n = copy_items(tree.host_mamba, tree.device_mamba, plan.host_state_slots, plan.device_state_slots)
            self.bytes_loaded += n
            self.state_bytes_loaded += n
        tree.finish_load(plan)
        return plan
