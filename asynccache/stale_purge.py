"""Removing from storage what was computed on a failed load: the storage tier's purges.

When the tree undoes a failed host → device load, what inserts computed on it may already be in
storage: a host copy archived, or a storage-only snapshot stored, before the failure was known.
The tree reports the storage keys such data would be stored under (``tree.stale_hook``, see
``asynccache.tree.pending``: KV keys and state keys). :class:`StalePurges` takes the report
(:meth:`StalePurges.report`, the hook) and purges the keys:

1. They are unservable at once (:class:`~asynccache.stored_lookup.UnservableKeys`): no lookup
   of the tier restores from them.
2. The purge waits until every task of the tier in flight at the report has ended: the backup
   archives (``asynccache.host_archive``) and storage-only snapshots (``asynccache.snapshots``)
   queued or writing then are the only writers of that data — after the undo the tree holds no
   copy of it and refuses the inserts of the requests that computed on it (``StaleMatchError``),
   and both kinds of archive start from tree nodes, so none begun later carries any of it.
   Those tasks land or drop their writes meanwhile: a backup archive drops a write that names a
   key whose purge is pending (:meth:`StalePurges.blocks`, checked before its KV, again
   before its states, and once more before it marks its nodes archived).
3. The objects are deleted (``batch_delete_v2`` of a
   :class:`~asynccache.storage.DeletingBackend`: the KV keys in the ``kv`` pool, the state keys
   in ``mamba``) — after every write that could bring them back, so none of them is stored once
   the delete has landed: not for this process, another one on the same storage, nor a later
   run.
4. Once the delete has landed the keys are servable again: nothing is stored under them and no
   writer of the failed data is left, so what a later archive stores there was computed anew.

The mark is cleared when the delete lands, not when a good write lands: it guards against the
objects the failed data left, and once the delete has landed there are none. Clearing it at a
good write would be no safer and could be wrong: put-if-absent reports success when it finds
the old object, so such a write tells nothing unless the delete landed first — the same
condition. While a purge is pending, a backup of its keys is dropped: it would be deleted with
the rest, or — finding the wrong object — count it stored and mark its nodes archived. A
storage-only snapshot written then is deleted at worst (a miss).

A delete that fails, or a backend without ``batch_delete_v2``, leaves the keys unservable for
the tier's lifetime, and writes of them dropped (the wrong objects may still be stored: an
archive would find one, count it stored and mark its nodes archived); a later report of a key
whose delete lands clears it. Purges are tasks of the tier (``wait_idle`` and ``aclose`` wait
for them). Every purge whose delete has not landed — failed, never run (reported while the
controller shuts down), or cut short by the group's cancellation, before its first step too —
is deleted once more by :meth:`StalePurges.run_late` as the controller closes, after the group
has ended (no writer is left) and before the backend is closed, in the task that closes it (a
close cancelled meanwhile leaves both running; a later close waits for them).

A restore whose lookup ran before a report may read the reported objects after it, before
their delete: the tier watches the keys of each restore in flight (:meth:`StalePurges.watching`,
a :class:`StaleWatch`), and a restore that a report touched meanwhile is a miss — its bytes are
neither inserted nor handed to the engine.

Primitives: :class:`StalePurges` (one per :class:`~asynccache.tiering.StorageTier`),
:class:`StaleWatch`. Loop-only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from asynccache.storage import PoolName
from asynccache.stored_lookup import UnservableKeys

if TYPE_CHECKING:
    from asynccache.tiering import StorageTier

__all__ = ["StalePurges", "StaleWatch"]

log = logging.getLogger("asynccache.tiering")

_POOLS = (PoolName.KV, PoolName.MAMBA)


class _Purge:
    """The keys of one report (per pool) whose objects go."""

    __slots__ = ("keys",)

    def __init__(self, kv_keys: Iterable[str], state_keys: Iterable[str]) -> None:
        self.keys = {PoolName.KV: frozenset(kv_keys), PoolName.MAMBA: frozenset(state_keys)}


class StaleWatch:
    """The storage keys a restore in flight reads (KV and state keys alike); ``stale`` turns
    true when a report names one of them before the watch ends."""

    __slots__ = ("keys", "stale")

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = frozenset(keys)
        self.stale = False


class StalePurges:
    """The purges of one storage tier (see the module docstring)."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier
        #: the keys the tier does not restore from
        self.unservable = UnservableKeys()
        #: (pool, key) → the purge of the key's latest report, until that purge's delete has
        #: landed (a failed one keeps its keys here: writes of them stay dropped)
        self._pending: dict[tuple[PoolName, str], _Purge] = {}
        #: purge tasks in flight (a later purge does not wait for them: they write nothing)
        self._tasks: set[asyncio.Task[None]] = set()
        #: every purge whose delete has not landed — not run yet, running, cut short by a
        #: cancellation (even before its first step), or failed — for :meth:`run_late`
        self._unsettled: dict[int, _Purge] = {}
        #: :meth:`run_late`'s delete, a task of its own (a close cancelled meanwhile leaves it
        #: running, and the backend is closed only after it)
        self._late_task: asyncio.Task[None] | None = None
        #: the restores in flight (:meth:`watching`)
        self._watches: set[StaleWatch] = set()

    def report(self, kv_keys: Collection[str], state_keys: Collection[str]) -> None:
        """The tree's ``stale_hook``: the KV under ``kv_keys`` and the states under
        ``state_keys`` were computed on a failed load. Marks them unservable and starts their
        purge; changes nothing in the tree."""
        purge = _Purge(kv_keys, state_keys)
        self.unservable.add(kv_keys, state_keys)
        for watch in self._watches:
            if not (watch.keys.isdisjoint(purge.keys[PoolName.KV]) and watch.keys.isdisjoint(purge.keys[PoolName.MAMBA])):
                watch.stale = True
        for pool in _POOLS:
            for key in purge.keys[pool]:
                self._pending[pool, key] = purge
        self._unsettled[id(purge)] = purge
        tier = self.tier
        tier.counts["stale_reports"] += 1
        writers = [t for t in tier._in_flight if not t.done() and t not in self._tasks]
        coro = self._run(purge, writers)
        try:
            task = tier.spawn(coro, name="asynccache-purge")
        except RuntimeError:  # shutting down: purged as the controller closes
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def blocks(self, kv_keys: Iterable[str], state_keys: Iterable[str]) -> bool:
        """Whether a write of these keys is to be dropped: one of them has a purge pending."""
        pending = self._pending
        if not pending:
            return False
        return any((PoolName.KV, k) in pending for k in kv_keys) or any(
            (PoolName.MAMBA, k) in pending for k in state_keys
        )

    def watch(self, keys: Iterable[str]) -> StaleWatch:
        """Watch the keys a restore reads from now until :meth:`unwatch` (see
        :class:`StaleWatch`)."""
        watch = StaleWatch(keys)
        self._watches.add(watch)
        return watch

    def unwatch(self, watch: StaleWatch) -> None:
        self._watches.discard(watch)

    @contextmanager
    def watching(self, keys: Iterable[str]) -> Iterator[StaleWatch]:
        """:meth:`watch` for the block."""
        watch = self.watch(keys)
        try:
            yield watch
        finally:
            self.unwatch(watch)

    @property
    def num_pending(self) -> int:
        """Keys (per pool) whose purge has not settled."""
        return len(self._pending)

    async def run_late(self) -> None:
        """Purge what the tier's task group did not (see the module docstring), in one delete
        per pool. Called as the controller closes, once the group has ended and before the
        backend closes; the delete is a task of its own, which a cancelled call leaves running
        and a later call waits for again."""
        if self._late_task is None or self._late_task.done():
            late = list(self._unsettled.values())
            if not late:
                return
            self._late_task = asyncio.ensure_future(self._run_late(late))
        await asyncio.shield(self._late_task)

    async def _run_late(self, late: list[_Purge]) -> None:
        merged = _Purge(*(frozenset().union(*(purge.keys[pool] for purge in late)) for pool in _POOLS))
        gone = await self._delete(merged)
        for purge in late:
            self._settle(purge, gone)

    async def _run(self, purge: _Purge, writers: list[asyncio.Task[object]]) -> None:
        if writers:  # not gather: a purge cancelled must not cancel them
            await asyncio.wait(writers)
        self._settle(purge, await self._delete(purge))

    async def _delete(self, purge: _Purge) -> bool:
        """Delete the purge's objects; whether they are gone (a failure counted and logged)."""
        tier = self.tier
        delete = getattr(tier.backend, "batch_delete_v2", None)
        if delete is None:
            tier.counts["stale_purge_unsupported"] += 1
            return False
        try:
            for pool in _POOLS:
                keys = sorted(purge.keys[pool])
                if keys and not all(await delete(keys, [pool])):
                    tier.counts["stale_purge_failed"] += 1
                    return False
        except Exception as e:  # noqa: BLE001 — a storage failure keeps the keys unservable, never a crash
            tier.counts["stale_purge_failed"] += 1
            log.warning("deleting the objects of a failed load failed (their keys stay unservable): %s", e)
            return False
        return True

    def _settle(self, purge: _Purge, gone: bool) -> None:
        """The purge's delete landed (``gone``): its keys are servable and writable again —
        a key whose latest report is a later one is that one's to settle. A failed delete
        changes nothing: the keys stay unservable, writes of them stay dropped (one could find
        an old object, count it stored and mark its nodes archived), and the purge is tried
        again as the controller closes (:meth:`run_late`)."""
        if not gone:
            return
        self.tier.counts["stale_purges"] += 1
        self._unsettled.pop(id(purge), None)
        servable: dict[PoolName, list[str]] = {pool: [] for pool in _POOLS}
        for pool in _POOLS:
            for key in purge.keys[pool]:
                if self._pending.get((pool, key)) is purge:
                    del self._pending[pool, key]
                    servable[pool].append(key)
        self.unservable.discard(servable[PoolName.KV], servable[PoolName.MAMBA])
