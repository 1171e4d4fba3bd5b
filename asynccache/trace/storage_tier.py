"""The storage tier (L3) as trace replay drives it: archive, demote, look up, prefetch.

It follows the controller's storage tier (``asynccache.tiering``) — objects keyed by the tree's
chained page hashes, a state stored under the hash of the last page it covers, KV checked with
``ALL_PAGES`` and the state with ``TRAILING_PAGES`` — but runs synchronously against an
:class:`~asynccache.trace.storage_index.AccountingStorage`, so nothing waits and only keys and
bytes are kept.

- **Archive** (``write="through"``): every node that reaches the host with a state is written with
  the KV of its whole path (put-if-absent, which also refreshes the path's recency in storage).
- **Demote** (``write="demote"``): nothing is written on backup; a host victim is written just
  before host eviction drops it (:meth:`demote`, the tree's ``evict_host(demote=…)`` callback), so
  storage holds what the host lets go — GPU → host → storage by the tree's own victim order.
- **Dense states** (:meth:`archive_states`): states the admission policy wants in storage only
  (e.g. at every page) are written straight from the request's snapshots, as *speculative*
  objects (they fill free space and never displace proven data); they never enter the tree
  until a later request fetches one.
- **Lookup** (:meth:`lookup`): the deepest page ``n`` of a prompt such that the tree holds the
  KV of its first pages (any tier), storage the KV of the pages past them up to ``n``, and
  storage the state at ``n``.
- **Prefetch** (:meth:`prefetch`): read only the pages past the tree's and the state into fresh
  host slots and insert them as host-only nodes below the tree's pages (``tree.insert_host``
  with ``start_page``; tree pages on the device only are backed up to the host first, through
  the ``backup`` callback); the next match sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from asynccache.errors import ConfigError
from asynccache.prefetch import held_node
from asynccache.storage import PoolName
from asynccache.trace.storage_index import AccountingStorage
from asynccache.tree import HybridRadixTree, MatchResult, TreeNode

__all__ = ["STORAGE_WRITE_MODES", "ReplayStorageTier"]

STORAGE_WRITE_MODES = ("through", "demote")


class ReplayStorageTier:
    """Synchronous storage tier over an :class:`AccountingStorage` (see the module docstring).
    ``backup(nodes)``: the replay's device → host backup (False when the host has no room),
    which a prefetch uses for tree pages on the device only (without it such a prefix is not
    extended)."""

    def __init__(
        self,
        tree: HybridRadixTree,
        storage: AccountingStorage,
        *,
        write: str = "through",
        backup: Callable[[Sequence[TreeNode]], bool] | None = None,
    ) -> None:
        if write not in STORAGE_WRITE_MODES:
            raise ConfigError(f"unknown storage write mode {write!r}; known: {list(STORAGE_WRITE_MODES)}")
        if tree.host_kv is None or tree.host_mamba is None:
            raise ConfigError("the storage tier needs host KV and host state pools (prefetch lands on the host)")
        self.tree = tree
        self.storage = storage
        self.write = write
        self.backup = backup
        #: Archive on backup (``write="through"``); off when the controller's tier does it.
        self.archive_backups = write == "through"
        storage.set_object_bytes(PoolName.KV, tree.host_kv.bytes_per_index)
        storage.set_object_bytes(PoolName.MAMBA, tree.host_mamba.bytes_per_index)
        self.num_prefetches = 0
        self.num_prefetch_no_room = 0
        self.staged_state_bytes = 0  # device → host bytes of storage-only snapshots

    # ---- writing -----------------------------------------------------------------------
    def _path_keys(self, node: TreeNode) -> list[str]:
        keys: list[str] = []
        for n in self.tree.path_to(node):
            keys.extend(n.page_hashes)
        return keys

    def archive_node(self, node: TreeNode) -> None:
        """Write ``node``'s path KV and, if it holds one on any tier, its state."""
        if not node.alive or node.parent is None:
            return
        keys = self._path_keys(node)
        if not all(self.storage.put(PoolName.KV, keys)):
            return
        if node.has_state:
            self.storage.put(PoolName.MAMBA, keys[-1:])
        for n in self.tree.path_to(node):
            self.tree.mark_archived(n)

    def on_backup(self, nodes: Iterable[TreeNode]) -> None:
        """After a device → host backup (``write="through"``): archive the nodes with a state."""
        if not self.archive_backups:
            return
        for node in nodes:
            if node.host_state is not None:
                self.archive_node(node)

    def demote(self, nodes: Sequence[TreeNode], list_key: str) -> None:
        """``evict_host``'s ``demote`` callback (``write="demote"``): before the tree drops the
        host copy of victim ``nodes[-1]``, write it to storage with its path (which covers the
        ancestors ``nodes`` names)."""
        if self.write != "demote":
            return
        victim = nodes[-1]
        if list_key == "host_kv" and not victim.has_state:
            return  # KV past the deepest state: dead weight, not worth a write
        self.archive_node(victim)

    def archive_states(self, last_node: TreeNode, positions: Sequence[int]) -> None:
        """Write snapshots at page-aligned ``positions`` (tokens, on ``last_node``'s path) to
        storage only, with the KV of the path up to the deepest one."""
        if not positions or not last_node.alive:
            return
        page = self.tree.page_size
        keys = self._path_keys(last_node)
        deepest = max(positions) // page
        if deepest > len(keys):
            raise ConfigError(f"position {max(positions)} is past the inserted path ({len(keys)} pages)")
        if not all(self.storage.put(PoolName.KV, keys[:deepest])):
            return
        state_keys = [keys[p // page - 1] for p in sorted(positions)]
        before = self.storage.written_bytes(PoolName.MAMBA)
        self.storage.put(PoolName.MAMBA, state_keys, speculative=True)
        self.staged_state_bytes += self.storage.written_bytes(PoolName.MAMBA) - before

    # ---- reading -----------------------------------------------------------------------
    def lookup(self, match: MatchResult, *, max_pages: int) -> int:
        """Deepest page count ``n`` (≤ ``max_pages``) servable with storage's help, or 0 when
        storage adds nothing past ``match``."""
        page = self.tree.page_size
        hashes = match.page_hashes
        limit = min(max_pages, len(hashes))
        start = match.num_tokens // page
        # As the controller's tier does: the tree holds the KV of the first pages (any tier);
        # storage is asked for the KV past them, and for a state anywhere past ``start``.
        kv_end = max(start, min(match.num_matched_tokens // page, limit))
        while kv_end < limit and self.storage.contains(PoolName.KV, hashes[kv_end]):
            kv_end += 1
        for n in range(kv_end, start, -1):
            if self.storage.contains(PoolName.MAMBA, hashes[n - 1]):
                return n
        return 0

    def prefetch(self, tokens: np.ndarray, match: MatchResult, num_pages: int) -> bool:
        """Fetch the pages past the tree's up to ``num_pages`` and the state at ``num_pages`` into
        host slots and insert them below the tree's pages, as the controller's tier does (tree
        pages on the device only are backed up first: host copies stay contiguous). False when
        the host has no room (or a backup is needed and there is no ``backup``)."""
        tree = self.tree
        page = tree.page_size
        hashes = match.page_hashes
        first = min(match.num_matched_tokens // page, num_pages)  # the first page read
        node = held_node(match)
        # The tree's pages are combined with the fetched ones: nothing may evict them meanwhile.
        tree.lock(node)
        tree.lock_host(node)
        try:
            gap = tree.host_gap(node, first) if first else []
            if gap and (self.backup is None or not self.backup(gap)):
                self.num_prefetch_no_room += 1
                return False
            alloc = tree.alloc_host(num_pages - first, 1)
            if alloc is None:
                self.num_prefetch_no_room += 1
                return False
            self.storage.get(PoolName.KV, hashes[first:num_pages])
            self.storage.get(PoolName.MAMBA, [hashes[num_pages - 1]])
            assert alloc.state_slot is not None
            tree.insert_host(
                tokens[: num_pages * page],
                alloc.kv_indices,
                host_states={num_pages * page: alloc.state_slot},
                start_page=first,
                salt=match.salt,
            )
        finally:
            tree.unlock(node)
            tree.unlock_host(node)
        self.num_prefetches += 1
        return True
