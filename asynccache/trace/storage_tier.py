"""The storage tier (L3) as trace replay drives it: archive, demote, look up, prefetch.

It follows the controller's storage tier (``asynccache.tiering``) — objects keyed by the tree's
chained page hashes, a state stored under the hash of the last page it covers, KV checked with
``ALL_PAGES`` and the state with ``TRAILING_PAGES`` — but runs synchronously against an
:class:`~asynccache.trace.storage_index.AccountingStorage`, so nothing waits and only keys and
bytes are kept.

- **Archive** (``write="through"``): every node that reaches the host with a state is written
  with its whole path, as the controller's tier writes to a storage that evicts (an
  :class:`~asynccache.trace.storage_index.AccountingStorage` reports its capacity): the KV of
  every page, then the states of the path's nodes on the host, put-if-absent, which refreshes
  what is stored; no node is marked archived. The nodes a prefetch backs up are archived when
  the prefetch ends, after its read, as the controller's tier does.
- **Demote** (``write="demote"``): nothing is written on backup; a host victim is written just
  before host eviction drops it (:meth:`demote`, the tree's ``evict_host(demote=…)`` callback), so
  storage holds what the host lets go — GPU → host → storage by the tree's own victim order.
- **Dense states** (:meth:`archive_states`): states the admission policy wants in storage only
  (e.g. at every page) are written from the request's snapshots, after its backup's archive
  (as the controller engine queues them), as *speculative* objects (they fill free space and
  never displace proven data); they never enter the tree until a later request fetches one.
  As the controller's tier (``controller.archive_snapshots``) they are staged first, and their
  device → host bytes counted whatever storage then takes: the states, and the KV pages of the
  path up to the deepest one that have no host copy (under write-back), copied into free host
  slots; without free slots for them nothing is staged or written.
- **Lookup** (:meth:`lookup`): the deepest page ``n`` of a prompt such that the tree holds the
  KV of its first pages (any tier), storage the KV of the pages past them up to ``n``, and
  storage the state at ``n``; asked as the controller's tier asks (``longest_hit``, which
  refreshes the objects of a hit, as ``batch_exists_v2`` does).
- **Prefetch** (:meth:`prefetch`): read only the pages past the tree's and the state into fresh
  host slots and insert them as host-only nodes below the tree's pages (``tree.insert_host``
  with ``start_page``; tree pages on the device only are backed up to the host first, through
  the ``backup`` callback); the next match sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from asynccache.errors import ConfigError
from asynccache.prefetch import held_node
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer
from asynccache.storage_admission import ArchiveAdmission, Ticket
from asynccache.trace.storage_index import AccountingStorage
from asynccache.tree import HybridRadixTree, MatchResult, TreeNode

__all__ = ["STORAGE_WRITE_MODES", "ReplayStorageTier"]

STORAGE_WRITE_MODES = ("through", "demote")

_KV_ALL = PoolTransfer(pool_name=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES)
_STATE_TRAILING = PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES)


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
        #: device → host bytes staging storage-only snapshots (:meth:`archive_states`): their
        #: states, and the KV pages of their paths that had no host copy
        self.staged_state_bytes = 0
        self.staged_kv_bytes = 0
        #: requests whose storage-only snapshots found no free host slots to be staged in
        self.num_snapshot_no_room = 0
        #: nodes a prefetch backed up, archived when it ends (as the controller's tier does)
        self._deferred: list[tuple[TreeNode, Ticket | None]] | None = None
        #: which backups a tight storage takes (:mod:`asynccache.storage_admission`; None: all)
        self.admission: ArchiveAdmission | None = None
        self.num_not_admitted = 0

    # ---- writing -----------------------------------------------------------------------
    def archive_node(self, node: TreeNode) -> bool:
        """Write ``node``'s path as the controller's tier does for a storage that evicts: the KV
        of every page, then the state of each path node with a host state (``node``'s own
        wherever it is). Put-if-absent: what is stored already is refreshed, so a path in use
        ages in storage no faster than in the tree. Nothing is marked archived (the storage may
        drop what a flag would claim). True when everything was stored."""
        if not node.alive or node.parent is None:
            return False
        return self._write_path(node, self.tree.path_to(node))

    def _write_path(self, node: TreeNode, path: list[TreeNode]) -> bool:
        keys = [h for n in path for h in n.page_hashes]
        if not all(self.storage.put(PoolName.KV, keys)):
            return False
        states = [n.page_hashes[-1] for n in path if n.host_state is not None or (n is node and n.has_state)]
        return all(self.storage.put(PoolName.MAMBA, states))

    def _archive_backup(self, node: TreeNode, ticket: Ticket | None) -> None:
        """Archive a backed-up ``node`` if the storage admission rule lets it (``ticket``: taken
        when the backup completed), as the controller's tier does."""
        if not node.alive or node.parent is None:
            return
        path = self.tree.path_to(node)
        rule = self.admission
        if rule is not None and not rule.admit(node, path, self.storage, ticket):
            self.num_not_admitted += 1
            return
        if self._write_path(node, path) and rule is not None:
            rule.written(node, ticket, self.storage)

    def on_backup(self, nodes: Iterable[TreeNode]) -> None:
        """After a device → host backup (``write="through"``): archive the nodes with a state
        (those the storage admission rule, if any, admits)."""
        if not self.archive_backups:
            return
        rule = self.admission
        with_state = [(n, rule.ticket(n) if rule is not None else None) for n in nodes if n.host_state is not None]
        if self._deferred is not None:  # archived once the prefetch or the eviction ends
            self._deferred.extend(with_state)
            return
        for node, t in with_state:
            self._archive_backup(node, t)

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Archive the backups made inside the block when it ends, in their order, as the
        controller's tier does with those of a device eviction's write-backs (it writes them
        once the eviction is over: each path is then read as the whole eviction left it)."""
        if self._deferred is not None:
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            backed_up, self._deferred = self._deferred, None
            for n, ticket in backed_up:
                self._archive_backup(n, ticket)

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
        storage only, with the KV of the path up to the deepest one, once staged as the
        controller's tier stages them (module docstring)."""
        if not positions or not last_node.alive:
            return
        tree, page = self.tree, self.tree.page_size
        path = tree.path_to(last_node)
        keys = [h for n in path for h in n.page_hashes]
        positions = sorted(set(positions))
        deepest = positions[-1] // page
        if deepest > len(keys):
            raise ConfigError(f"position {positions[-1]} is past the inserted path ({len(keys)} pages)")
        # The pages the staging copies from the device: those before the deepest position with no
        # host copy. (The controller's tier skips the pages of nodes marked archived where storage
        # never evicts; an AccountingStorage evicts for room, so none are skipped.)
        staged_pages = sum(
            min(n.end_page, deepest) - n.start_page for n in path if n.start_page < deepest and n.host_kv is None
        )
        host_kv, host_state = tree.host_kv, tree.host_mamba
        assert host_kv is not None and host_state is not None  # checked when made
        if host_kv.num_free < staged_pages or host_state.num_free < len(positions):
            self.num_snapshot_no_room += 1
            return
        self.staged_kv_bytes += staged_pages * host_kv.bytes_per_index
        self.staged_state_bytes += len(positions) * host_state.bytes_per_index
        if not all(self.storage.put(PoolName.KV, keys[:deepest])):
            return
        state_keys = [keys[p // page - 1] for p in positions]
        self.storage.put(PoolName.MAMBA, state_keys, speculative=True)

    # ---- reading -----------------------------------------------------------------------
    def lookup(self, match: MatchResult, *, max_pages: int) -> int:
        """Deepest page count ``n`` (≤ ``max_pages``) servable with storage's help, or 0 when
        storage adds nothing past ``match``. As the controller's tier asks (``batch_exists_v2``,
        which refreshes the objects of a hit): the tree holds the KV of the first pages (any
        tier), so storage is asked for the KV past them with a state at their end; failing
        that, for a state within them."""
        page = self.tree.page_size
        hashes = match.page_hashes
        limit = min(max_pages, len(hashes))
        start = match.num_tokens // page
        held = max(start, min(match.num_matched_tokens // page, limit))
        if held < limit:
            hit = self.storage.longest_hit(hashes[held:limit], (_KV_ALL, _STATE_TRAILING))
            if hit.num_hit_pages:
                return held + hit.num_hit_pages
        if held > start:
            hit = self.storage.longest_hit(hashes[start:held], (_STATE_TRAILING,))
            if hit.num_hit_pages:
                return start + hit.num_hit_pages
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
        token = tree.lock(node)
        tree.lock_host(node)
        self._deferred = []
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
            tree.unlock(node, token)
            tree.unlock_host(node)
            backed_up, self._deferred = self._deferred or [], None
            for n, ticket in backed_up:
                self._archive_backup(n, ticket)
        self.num_prefetches += 1
        return True
