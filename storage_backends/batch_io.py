"""Batch reads and writes of a storage backend: ``batch_get_v2`` and ``batch_set_v2``.

Primitives:

- :class:`BatchIOMixin` — ``batch_get_v2`` (objects into host slots; a hit per item) and
  ``batch_set_v2`` (host slots into objects, put-if-absent; success per item), with the
  bookkeeping around the item I/O: the batch's plan (each transfer's keys paired with its host
  slots, checked before any I/O), room reserved against the capacity and eviction victims
  removed before a write, counters, invalid objects removed after a read (before the call
  returns, as foreground work), failures reported once per call.
- ``_read_many`` / ``_write_many`` — the item primitives over a whole batch: by default one
  task per item, ``max_concurrency`` at a time, each within ``timeout_s``, writes behind reads
  and probes, no item started once the backend is closing; a backend whose items are cheap
  overrides them to move several items per job.

Speculative writes (``PoolTransfer.speculative``): their room comes from free space and other
speculative objects only (``LRUCapacity.reserve(speculative=True)``); one that finds none is
skipped (``False``) and counted in ``num_speculative_skipped``, not reported as a failure. A
read that finds a speculative object, or a regular write of its key, makes it regular.

Order: a put waits for the ``batch_delete_v2`` calls of its objects made before it, and such a
delete waits for the puts of its objects made before it (``BackendCore._in_order``).

Capacity: a write waits until the deletes its room rests on have settled — its own eviction
victims' and any other call's in flight when it reserved (a victim larger than the object it
made room for leaves room that another call may take). A delete that failed leaves its objects
stored and counted: while the index counts more than ``capacity_bytes``, the batch's new objects
are skipped, last first, until it does not — skipped writes (``False``), counted as rejected and
reported — so deletes that keep failing never let the store outgrow its capacity.

A call returns only once no worker touches any of its slots: the item primitives never touch
a slot after they return or raise, also when cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from asynccache.errors import BackendError, ConfigError, ObjectFormatError
from asynccache.storage import PoolTransfer
from storage_backends.backend_core import BackendCore, BatchItem, Outcome
from storage_backends.capacity import Stored
from storage_backends.reporting import BatchReport, describe_error

__all__ = ["BatchIOMixin"]


@dataclass(slots=True)
class _Plan:
    items: list[BatchItem] = field(default_factory=list)


class BatchIOMixin(BackendCore):
    """``batch_get_v2`` and ``batch_set_v2`` of :class:`~storage_backends.base.ObjectBackend`."""

    def _plan(self, transfer: PoolTransfer, *, distinct_slots: bool) -> _Plan:
        pool, geometry = self._geometry(transfer.pool_name)
        indices = transfer.host_indices
        if indices.dtype != torch.int64 or indices.device.type != "cpu" or indices.dim() != 1:
            raise ConfigError("host_indices must be a 1-D int64 CPU tensor")
        if len(transfer.keys) != indices.numel():
            raise ConfigError(f"{len(transfer.keys)} keys but {indices.numel()} host indices")
        idx = indices.tolist()
        if idx and not (0 <= min(idx) and max(idx) < pool.num_items):
            raise ConfigError(f"host index outside pool {geometry.pool_name!r} of {pool.num_items} items")
        if distinct_slots and len(set(idx)) != len(idx):
            raise ConfigError("a batch reads two objects into one host slot")
        plan = _Plan()
        for key, index in zip(transfer.keys, idx, strict=True):
            name = self.object_name(geometry.pool_name, key)
            plan.items.append(BatchItem(name, key, geometry, pool, index, speculative=transfer.speculative))
        return plan

    async def batch_get_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        """Read ``keys[i]`` into ``host_indices[i]`` of each transfer's pool; success per item.
        On ``False`` the slot's bytes are unspecified; the call returns only once no worker
        touches any of its slots."""
        plans = [self._plan(t, distinct_slots=True) for t in transfers]
        items = [item for plan in plans for item in plan.items]
        if len({(id(item.pool), item.index) for item in items}) != len(items):
            raise ConfigError("a batch reads two objects into one host slot")
        with self._call():
            return _split(await self._read_batch(items), plans)

    async def _read_batch(self, items: list[BatchItem]) -> list[bool]:
        if not await self._ensure_ready("batch_get_v2", len(items)):
            self._counts["num_misses"] += len(items)
            return [False] * len(items)
        report = BatchReport(self, "batch_get_v2", len(items))
        since = None if self._capacity is None else self._capacity.mark()
        with self._checking() as puts_before:
            with self._busy(items):
                outcomes = await self._read_many(items)
            return await self._read_outcomes(items, outcomes, report, since, puts_before)

    async def _read_outcomes(
        self,
        items: list[BatchItem],
        outcomes: list[Outcome],
        report: BatchReport,
        since: int | None,
        puts_before: int,
    ) -> list[bool]:
        """Count a read's outcomes; remove the invalid objects no put came for since the read
        began (``puts_before``: see ``_still_invalid``)."""
        done: list[bool] = []
        invalid: list[str] = []
        for item, outcome in zip(items, outcomes, strict=True):
            done.append(outcome is True)
            if outcome is True:
                self._counts["num_hits"] += 1
                self._counts["bytes_read"] += item.geometry.payload_bytes
                if self._capacity is not None:
                    self._capacity.touch(item.name)
                continue
            self._counts["num_misses"] += 1
            if isinstance(outcome, ObjectFormatError):
                self._counts["num_corrupt"] += 1
                report.corrupt(item.name, outcome)
                invalid.append(item.name)
            elif isinstance(outcome, BaseException):
                self._count_failure(outcome)
                report.fail(item.name, outcome)
            elif self._capacity is not None:
                # Absent when read; a write of it that committed meanwhile keeps it counted.
                self._capacity.discard(item.name, since=since)
        invalid = self._still_invalid(invalid, puts_before)
        if invalid:
            await self._remove(invalid, report, background=False)
        report.emit()
        return done

    async def batch_set_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        """Write ``host_indices[i]`` under ``keys[i]`` (put-if-absent; an object already stored
        counts as success — on S3 one of a valid size); success per item. A key whose object is
        being deleted (an eviction victim, found invalid, or a ``batch_delete_v2`` called
        before this call) is written once the delete is done. Slots are only read."""
        plans = [self._plan(t, distinct_slots=False) for t in transfers]
        items = [item for plan in plans for item in plan.items]
        with self._call(), self._in_order([item.name for item in items], delete=False) as deletes_before:
            if deletes_before:
                await asyncio.wait(deletes_before)
            return _split(await self._write_batch(items), plans)

    async def _write_batch(self, items: list[BatchItem]) -> list[bool]:
        if not await self._ensure_ready("batch_set_v2", len(items)):
            return [False] * len(items)
        report = BatchReport(self, "batch_set_v2", len(items))
        sizes = [self.codec.object_bytes(item.geometry, item.key) for item in items]
        done = [False] * len(items)
        with self._busy(items):  # before reserving: no item of the batch is a victim
            reserved, victims = self._reserve(items, sizes, report)
            accepted = list(reserved)
            # The room reserved counts the objects out of the index as gone: its writes wait
            # until the deletes in flight (these victims', and other calls') have settled.
            settling = set(self._deleting.values()) if any(reserved.values()) else set()
            evicted: BaseException | None = None
            try:
                if victims:
                    names = [victim.name for victim in victims]
                    evicted = await self._remove(names, None, background=True, counted=victims)
                    if evicted is None:
                        self._counts["num_evictions"] += len(victims)
                deleting = {self._deleting[items[i].name] for i in accepted if items[i].name in self._deleting}
                # an object of the batch is being deleted (evicted, or found invalid)
                if deleting | settling:
                    await asyncio.wait(deleting | settling)
                accepted = self._skip_beyond_capacity(items, accepted, reserved, report, evicted)
                if evicted is not None and len(accepted) == len(reserved):
                    report.fail(victims[0][0], evicted)  # written all the same: room was found
                outcomes = await self._write_many([items[i] for i in accepted])
            except BaseException:
                # Cut short (cancelled): some writes may have landed. Count them all as stored,
                # so the index never undercounts the disk; one that did not land is dropped
                # from it by a later read's miss or by its eviction.
                for i in accepted:
                    self._commit(items[i], sizes[i], reserved[i])
                raise
        for i, outcome in zip(accepted, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if self._capacity is not None:
                    self._capacity.release(reserved[i])
                self._count_failure(outcome)
                report.fail(items[i].name, outcome)
                continue
            done[i] = True
            self._commit(items[i], sizes[i], reserved[i])
            if outcome:
                self._counts["num_writes"] += 1
                self._counts["bytes_written"] += items[i].geometry.payload_bytes
            else:
                self._counts["num_write_skips"] += 1
        report.emit()
        return done

    def _commit(self, item: BatchItem, size: int, reserved: int) -> None:
        """Count an object a write of this batch stored or found (``size``: the bytes reserved
        for it at most)."""
        stored = self._stored_size(item.name, size)
        if self._capacity is not None:
            self._capacity.commit(item.name, stored, reserved, speculative=item.speculative)

    def _reserve(
        self, items: Sequence[BatchItem], sizes: Sequence[int], report: BatchReport
    ) -> tuple[dict[int, int], list[Stored]]:
        """The items that may be written (in order) with the bytes reserved for each (nothing
        for an object the index already holds: the put finds it), and the victims to delete
        (already out of the index, with the sizes it counted)."""
        if self._capacity is None:
            return dict.fromkeys(range(len(items)), 0), []
        reserved: dict[int, int] = {}
        victims: list[Stored] = []
        for i, size in enumerate(sizes):
            if self._capacity.holds(items[i].name):
                reserved[i] = 0
                continue
            room = self._capacity.reserve(size, speculative=items[i].speculative)
            if room is None and items[i].speculative:
                self._counts["num_speculative_skipped"] += 1  # no room without displacing: expected
                continue
            if room is None:
                self._counts["num_rejected"] += 1
                report.fail(items[i].name, f"no room: {size} bytes, capacity {self._capacity.capacity_bytes}")
                continue
            reserved[i] = size
            victims.extend(room)
        return reserved, victims

    def _skip_beyond_capacity(
        self,
        items: Sequence[BatchItem],
        accepted: list[int],
        reserved: dict[int, int],
        report: BatchReport,
        evicted: BaseException | None,
    ) -> list[int]:
        """The accepted items to write, once the deletes the reservations rest on have settled.
        While the index counts more than the capacity (a delete failed: its objects are stored
        and counted again), the batch's new objects are skipped, last first, until it does not:
        their reservations released, each counted as rejected (no room) and reported."""
        cap = self._capacity
        if cap is None or not cap.excess_bytes:
            return accepted
        if evicted is not None:
            why = f"no room: deleting the eviction victims failed ({describe_error(evicted)})"
        else:
            why = f"no room: {cap.used_bytes} bytes counted, capacity {cap.capacity_bytes} (deletes failed)"
        skipped: set[int] = set()
        for i in reversed(accepted):
            if not cap.excess_bytes:
                break
            if reserved[i]:  # an object the index holds takes no room
                cap.release(reserved[i])
                skipped.add(i)
                self._counts["num_rejected"] += 1
                report.fail(items[i].name, why)
        return [i for i in accepted if i not in skipped]

    def _stored_size(self, name: str, largest: int) -> int:
        """The size of the object under ``name`` after a write of this batch stored it or found
        it (the capacity's count; called once for every such write); ``largest``: the size
        reserved for it. Backends whose objects vary in size (compressed ones) report it."""
        return largest

    # ---- item I/O: one task per item by default; backends may do better -----------------
    async def _read_many(self, items: Sequence[BatchItem]) -> list[Outcome]:
        """``_read_object`` of each item, ``max_concurrency`` at a time, each within
        ``timeout_s``: True (loaded), False (absent) or the error."""
        return await self._per_item(self._read_object, items)

    async def _write_many(self, items: Sequence[BatchItem]) -> list[Outcome]:
        """``_write_object`` of each item like :meth:`_read_many`, as background work (reads
        and probes waiting for a slot go first): True (stored), False (already present) or the
        error."""
        return await self._per_item(self._write_object, items, background=True)

    async def _per_item(
        self, fn: Callable[..., Awaitable[bool]], items: Sequence[BatchItem], *, background: bool = False
    ) -> list[Outcome]:
        async def one(item: BatchItem) -> Outcome:
            async with self._limit(background=background):
                if self._closed:  # closing: the items not started yet fail
                    return self._closed_error()
                try:
                    async with asyncio.timeout(self.timeout_s) as deadline:
                        self._item_deadlines.add(deadline)
                        try:
                            return await fn(item)
                        finally:
                            self._item_deadlines.discard(deadline)
                except TimeoutError as e:
                    return self._closed_error() if self._closed and deadline.expired() else e
                except (BackendError, OSError) as e:
                    return e

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(item)) for item in items]
        return [t.result() for t in tasks]


def _split(flat: list[bool], plans: list[_Plan]) -> list[list[bool]]:
    out, pos = [], 0
    for plan in plans:
        out.append(flat[pos : pos + len(plan.items)])
        pos += len(plan.items)
    return out
