"""Archiving completed host writes to storage: the storage tier's backup (host → storage).

For each node of a completed device → host backup that holds a host state,
:class:`HostWriteArchiver` writes the KV pages of its path, then the host states of the path's
nodes (KV first, states last), so a stored state always has its KV. What the path's nodes hold
is written depends on whether the backend evicts for room (it reports a ``capacity_bytes`` in
its ``statistics()``: ``StorageTier.storage_evicts``):

- **A backend that never drops objects**: only the nodes not marked archived are written, and
  they are marked archived once both writes succeeded (not one whose state reached the host
  while the write ran: its own archive follows), so ``evict_host(archived_only=True)`` may drop
  their host copies later.
- **A backend that evicts**: no archive flag could stay true (the backend may drop what it
  claims), so none is set or trusted: every archive writes the node's whole path.
  ``batch_set_v2`` is put-if-absent, so the objects still stored are not written again but
  refreshed, as a read refreshes them: a path the tree keeps using ages in storage no faster
  than in the tree, and what the backend dropped is written again.

An archive that names a key whose objects are being purged (computed on a failed load,
:mod:`asynccache.stale_purge`) is dropped (``backup_skipped_stale``), checked before its KV,
again before its states, and once more before it marks its nodes archived: it would be deleted
with them, or find one and count it stored.

From the moment a backup completes until its archive has read the host copies, the node's path
is locked on the host: a host eviction meanwhile (the room of a later backup) must not drop the
only copy of what storage is about to get. Archives run in the controller's TaskGroup, at most
``config.max_backups_in_flight`` at once (the tier's ``sem``); the queue behind them is bounded
too (past it a backup is skipped and counted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from asynccache.storage import PoolName, PoolTransfer
from asynccache.storage_admission import Ticket

if TYPE_CHECKING:
    from asynccache.tiering import StorageTier

__all__ = ["HostWriteArchiver"]

log = logging.getLogger("asynccache.tiering")

#: Backups waiting for one of the ``max_backups_in_flight`` places; past this they are skipped
#: (and counted) rather than queued without bound.
_MAX_PENDING_BACKUPS = 4096


class HostWriteArchiver:
    """The archives of one :class:`~asynccache.tiering.StorageTier` (see the module docstring)."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier
        self.tree = tier.tree

    def on_host_write(self, plan: Any) -> None:
        """A device → host backup completed: archive each of its nodes with a host state (those
        the tier's storage admission rule, if any, admits when the archive is written)."""
        tier = self.tier
        for node in plan.nodes:
            if node.host_state is None or node.archived:
                continue
            if len(tier._in_flight) >= _MAX_PENDING_BACKUPS:
                tier.counts["backup_skipped_busy"] += 1
                continue
            self.queue(node, ticket=self.ticket(node))

    def ticket(self, node: Any) -> Ticket | None:
        """The storage admission rule's ticket for ``node`` now (None: no rule applies)."""
        rule = self.tier.admission
        return rule.ticket(node) if rule is not None and self.tier.storage_evicts else None

    def queue(self, node: Any, *, ticket: Ticket | None = None) -> asyncio.Task[None] | None:
        """Start archiving ``node``, its path locked on the host until the archive has read it
        (or ends without writing); the task, or None when the controller is shutting down.
        ``ticket``: the storage admission rule's, taken when the host write completed (None:
        the archive is written)."""
        self.tree.lock_host(node)
        held = [True]

        def release(_: object = None) -> None:
            if held[0]:
                held[0] = False
                self.tree.unlock_host(node)

        coro = self._archive(node, release, ticket)
        try:
            task = self.tier.spawn(coro, name="asynccache-backup")
        except RuntimeError:  # shutting down (a background task failed): the host copy stays
            coro.close()
            release()
            self.tier.counts["backup_skipped_closing"] += 1
            return None
        task.add_done_callback(release)  # a task cancelled before it ran
        return task

    async def _archive(self, node: Any, release: Callable[[], None], ticket: Ticket | None) -> None:
        try:
            async with self.tier.sem:
                await self._write_path(node, release, ticket)
        finally:
            release()

    async def _write_path(self, node: Any, release: Callable[[], None], ticket: Ticket | None) -> None:
        tier = self.tier
        if node.host_state is None or node.archived or not node.alive:
            return
        path = self.tree.path_to(node)  # (alive, checked above)
        if any(n.host_kv is None for n in path):
            tier.counts["backup_skipped_not_on_host"] += 1
            return
        evicts = tier.storage_evicts
        rule = tier.admission if evicts else None
        if rule is not None and not rule.admit(node, path, tier.backend, ticket):
            tier.counts["backup_not_admitted"] += 1
            return
        todo = path if evicts else [n for n in path if not n.archived]
        with_state = [n for n in todo if n.host_state is not None]
        kv_keys = tuple(h for n in todo for h in n.page_hashes)
        state_keys = tuple(n.page_hashes[-1] for n in with_state)
        try:
            kv = PoolTransfer(
                pool_name=PoolName.KV, keys=kv_keys, host_indices=torch.cat([n.host_kv for n in todo])
            )
            state = PoolTransfer(
                pool_name=PoolName.MAMBA,
                keys=state_keys,
                host_indices=torch.tensor([n.host_state for n in with_state], dtype=torch.int64),
            )
            # A key whose objects are being purged (computed on a failed load): this write would
            # be deleted with them, or find one and count it stored.
            if self._purging(kv_keys, state_keys):
                return
            # KV first, the states last: a state in storage always has its KV.
            kv_ok = all((await tier.backend.batch_set_v2([kv]))[0])
            if kv_ok and self._purging((), state_keys):  # reported meanwhile
                return
            state_ok = kv_ok and all((await tier.backend.batch_set_v2([state]))[0])
        except Exception as e:  # noqa: BLE001 — a backend failure is a skipped backup, never a crash
            tier.counts["backup_failed"] += 1
            log.warning("backup to storage failed: %s", e)
            return
        finally:
            release()  # the host copies are read
        if not state_ok:
            tier.counts["backup_failed"] += 1
            return
        if self._purging(kv_keys, state_keys):
            # Reported while the states were written: what it wrote goes with the purge (which
            # waits for this task), so nothing of it counts as stored.
            return
        if rule is not None:
            rule.written(node, ticket, tier.backend)
        if not evicts:
            # Not a node whose state arrived on the host while this was written: its own
            # archive follows.
            written = {id(n) for n in with_state}
            for n in todo:
                if n.alive and (id(n) in written or n.host_state is None):
                    self.tree.mark_archived(n)
        tier.counts["backup_ok"] += 1

    def _purging(self, kv_keys: tuple[str, ...], state_keys: tuple[str, ...]) -> bool:
        """Whether one of these keys has a purge pending: the archive is dropped (counted)."""
        if not self.tier.purges.blocks(kv_keys, state_keys):
            return False
        self.tier.counts["backup_skipped_stale"] += 1
        return True
