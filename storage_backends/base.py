"""Shared machinery of the built-in storage backends.

Primitives:

- :class:`BackendStatistics` — a frozen snapshot of a backend's counters (``statistics()``).
- :class:`ObjectBackend` — implements the V2 :class:`~asynccache.storage.StorageBackend`
  protocol once: validation, object names, the exists search (``longest_hit``), bounded
  concurrency, per-item timeouts, capacity and eviction, counters, failure logging. A backend
  subclass supplies five primitives: ``_object_sizes``, ``_read_object``, ``_write_object``,
  ``_delete_objects``, ``_list_objects``.
- :class:`LRUCapacity` — byte accounting of stored objects against ``capacity_bytes`` with
  least-recently-used eviction; objects being read or written are never chosen.
- :class:`~storage_backends.workers.WorkerPool` and
  :class:`~storage_backends.workers.PriorityLimiter` (re-exported here) — bounded threads and
  slots that serve reads and probes before write-back and deletes. A cancelled caller still
  waits for its job to stop, so no thread touches a host slot after the call that named it
  has returned.

Failure model: a missing object is a miss; an invalid object (truncated, corrupted, foreign,
other format version) is a miss and is removed; an I/O error, a timeout or a backend that is
down is a miss (or a skipped write) counted in the statistics and reported with one warning
per batch. Malformed calls (bad keys, unregistered pools, mismatched lengths) raise
:class:`~asynccache.errors.ConfigError` before any I/O.
"""

from __future__ import annotations

import asyncio
import logging
import os
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self, TypeVar

import numpy as np
import torch

from asynccache.checks import check_int, check_seconds
from asynccache.errors import BackendError, ConfigError, ObjectFormatError
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult, longest_hit
from storage_backends.object_format import ObjectCodec, ObjectGeometry, slot_buffers, validate_key
from storage_backends.workers import PriorityLimiter, WorkerPool

__all__ = ["BackendStatistics", "ObjectBackend", "BatchItem", "Outcome", "LRUCapacity", "PriorityLimiter", "WorkerPool", "check_common_options", "check_int", "check_seconds", "usable_cores"]

logger = logging.getLogger("asynccache.storage")

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendStatistics:
    """Counters since the backend was opened. ``num_hits``/``num_misses`` count items of
    ``batch_get_v2`` (a corrupt or failed item is also a miss); ``num_writes`` objects stored,
    ``num_write_skips`` objects already present (put-if-absent), ``num_rejected`` writes skipped
    for lack of room; ``num_failures`` I/O errors and timeouts of any call (``num_timeouts`` of
    them timeouts); ``used_bytes`` is ``None`` when no capacity is tracked."""

    uri: str
    num_hits: int = 0
    num_misses: int = 0
    num_corrupt: int = 0
    num_failures: int = 0
    num_timeouts: int = 0
    num_writes: int = 0
    num_write_skips: int = 0
    num_rejected: int = 0
    num_evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    used_bytes: int | None = None
    capacity_bytes: int | None = None


_COUNTERS = tuple(f for f in BackendStatistics.__dataclass_fields__ if f.startswith(("num_", "bytes_")))


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this OS
        return os.cpu_count() or 1


def check_common_options(
    *, capacity_bytes: int | None, max_concurrency: int, timeout_s: float
) -> None:
    if capacity_bytes is not None:
        check_int("capacity_bytes", capacity_bytes, minimum=1)
    check_int("max_concurrency", max_concurrency, minimum=1)
    check_seconds("timeout_s", timeout_s)


class LRUCapacity:
    """Stored bytes against a capacity, with LRU victims. Event-loop only (not thread-safe).

    ``reserve`` counts a new object's bytes before it is written and picks victims (removed
    from the index at once, so concurrent writers never pick the same victim); ``commit`` /
    ``release`` settle the reservation. An object the index already holds reserves nothing (a
    put of it is a put-if-absent that finds it) and is never its own victim."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._busy: Counter[str] = Counter()

    def load(self, entries: Iterable[tuple[str, int]]) -> None:
        """Add existing objects, least recently used first."""
        for name, size in entries:
            if name not in self._sizes:
                self._sizes[name] = size
                self.used_bytes += size

    def touch(self, name: str) -> None:
        if name in self._sizes:
            self._sizes.move_to_end(name)

    def discard(self, name: str) -> None:
        size = self._sizes.pop(name, None)
        if size is not None:
            self.used_bytes -= size

    def holds(self, name: str) -> bool:
        return name in self._sizes

    def reserve(self, size: int) -> list[str] | None:
        """Room for ``size`` more bytes: the victims to delete, or ``None`` (nothing changed).
        Busy objects (:meth:`busy`) are never victims."""
        if size > self.capacity_bytes:
            return None
        need = self.used_bytes + size - self.capacity_bytes
        victims: list[str] = []
        if need > 0:
            for name, nbytes in self._sizes.items():
                if self._busy[name]:
                    continue
                victims.append(name)
                need -= nbytes
                if need <= 0:
                    break
            if need > 0:
                return None
            for name in victims:
                self.discard(name)
        self.used_bytes += size
        return victims

    def commit(self, name: str, size: int, reserved: int) -> None:
        """An object of ``size`` bytes exists under ``name``, for which ``reserved`` bytes were
        reserved (0 when the index held it at the time)."""
        if name in self._sizes:
            self.used_bytes -= reserved
            self._sizes.move_to_end(name)
        else:
            self._sizes[name] = size
            self.used_bytes += size - reserved

    def release(self, reserved: int) -> None:
        self.used_bytes -= reserved

    @contextmanager
    def busy(self, name: str) -> Iterator[None]:
        self._busy[name] += 1
        try:
            yield
        finally:
            self._busy[name] -= 1
            if not self._busy[name]:
                del self._busy[name]


class _BatchReport:
    """Failures of one batch call, reported as one warning."""

    def __init__(self, backend: ObjectBackend, call: str, num_items: int) -> None:
        self.backend = backend
        self.call = call
        self.num_items = num_items
        self.failed: list[tuple[str, str]] = []
        self.invalid: list[tuple[str, str]] = []

    def fail(self, name: str, error: BaseException | str) -> None:
        self.failed.append((name, _describe(error)))

    def corrupt(self, name: str, error: BaseException) -> None:
        self.invalid.append((name, _describe(error)))

    def emit(self) -> None:
        uri = self.backend.uri
        if self.failed:
            name, why = self.failed[0]
            logger.warning(
                "storage %s: %s: %d of %d items failed; first: %s: %s",
                uri, self.call, len(self.failed), self.num_items, name, why,
            )
        if self.invalid:
            name, why = self.invalid[0]
            logger.warning(
                "storage %s: %s: %d invalid objects treated as misses and removed; first: %s: %s",
                uri, self.call, len(self.invalid), name, why,
            )


def _value(pool_name: PoolName | str) -> str:
    return str(getattr(pool_name, "value", pool_name))


def _describe(error: BaseException | str) -> str:
    if isinstance(error, str):
        return error
    if isinstance(error, TimeoutError) and not str(error):
        return "timed out"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:300]}"


@dataclass(slots=True)
class BatchItem:
    """One object of a batch and the host slot it moves to or from."""

    name: str
    key: str
    geometry: ObjectGeometry
    pool: ItemPool
    index: int

    def buffers(self) -> list[np.ndarray]:
        return slot_buffers(self.pool, self.index)


#: The outcome of one item's I/O: True (done), False (absent / already present), or the error.
Outcome = bool | BaseException


@dataclass(slots=True)
class _Plan:
    items: list[BatchItem] = field(default_factory=list)


class ObjectBackend(ABC):
    """Base of the built-in backends (see the module docstring). Event-loop bound: every method
    is called from one event loop; blocking work goes to the backend's :class:`WorkerPool`
    (a backend may run short CPU steps, such as checksumming one piece of a page, on the loop).

    Subclasses implement the primitives on *names* (from :meth:`object_name`):

    - ``_object_sizes(names)`` → stored size per name (``None`` when absent).
    - ``_read_object(item)`` → ``True`` once ``item.name`` is verified and copied into
      ``item.buffers()``; ``False`` when absent; raises :class:`ObjectFormatError` when
      invalid, :class:`BackendError` / :class:`OSError` on failure. Must not touch the slot
      after returning or raising (also when cancelled).
    - ``_write_object(item)`` → ``True`` when stored, ``False`` when an object already existed
      (put-if-absent); atomic: a half-written object is never visible.
    - ``_delete_objects(names)``; ``_list_objects()`` → ``(name, size)`` of this namespace,
      least recently used first (only called when a capacity is set).

    ``_read_many`` / ``_write_many`` run the item primitives for a whole batch (by default one
    task per item, ``max_concurrency`` at a time, each within ``timeout_s``); a backend whose
    items are cheap may override them to move several items per worker job.
    """

    #: keys probed per round of the exists search
    probe_window: int = 32
    #: objects in flight when ``max_concurrency`` is not given
    default_max_concurrency: int = 8
    #: objects' headers are padded to a multiple of this (see ``ObjectCodec``)
    header_align: int = 64

    def __init__(
        self,
        uri: str,
        *,
        namespace: str,
        capacity_bytes: int | None = None,
        max_concurrency: int | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Common options: ``namespace`` (required: the spec's ``namespace_id``; every object
        records its digest and another namespace's object is a miss), ``capacity_bytes`` (None:
        unlimited, no accounting), ``max_concurrency`` (objects in flight), ``timeout_s`` (per
        object and request)."""
        if max_concurrency is None:
            max_concurrency = self.default_max_concurrency
        check_common_options(capacity_bytes=capacity_bytes, max_concurrency=max_concurrency, timeout_s=timeout_s)
        self.uri = uri
        self.namespace = namespace
        self.codec = self._make_codec(namespace)
        self.max_concurrency = max_concurrency
        self.timeout_s = float(timeout_s)
        #: objects in flight, reads and probes served before writes and deletes
        self._limit = PriorityLimiter(max_concurrency)
        self._capacity = LRUCapacity(capacity_bytes) if capacity_bytes is not None else None
        self._pools: dict[str, tuple[ItemPool, ObjectGeometry]] = {}
        self._counts: Counter[str] = Counter()
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(uri={self.uri!r}, namespace={self.namespace!r})"

    def _make_codec(self, namespace: str) -> ObjectCodec:
        """The codec of this backend's objects (backends that frame or compress them override)."""
        return ObjectCodec(namespace, header_align=self.header_align)

    # ---- primitives ------------------------------------------------------------------------
    @abstractmethod
    async def _object_sizes(self, names: Sequence[str]) -> list[int | None]: ...

    @abstractmethod
    async def _read_object(self, item: BatchItem) -> bool: ...

    @abstractmethod
    async def _write_object(self, item: BatchItem) -> bool: ...

    @abstractmethod
    async def _delete_objects(self, names: Sequence[str]) -> None: ...

    @abstractmethod
    async def _list_objects(self) -> list[tuple[str, int]]: ...

    async def _prepare(self) -> None:
        """First-use setup (create directories, connect); default: nothing."""

    async def _close(self) -> None:
        """Release the backend's resources; default: nothing."""

    @abstractmethod
    def object_name(self, pool_name: PoolName | str, key: str) -> str:
        """Where ``key``'s object of ``pool_name`` lives in this backend (validated)."""

    # ---- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the backend; later calls raise :class:`BackendError`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._close()

    async def _ensure_ready(self, call: str, num_items: int) -> bool:
        """Set the backend up at its first use. ``False`` when that failed (the store is down,
        the root cannot be made): counted and reported, the call's items are misses, and the
        next call tries again. A closed backend raises."""
        if self._closed:
            raise BackendError(f"storage {self.uri}: backend is closed")
        if self._ready:
            return True
        async with self._ready_lock:
            if self._ready:
                return True
            try:
                await self._prepare()
                if self._capacity is not None:
                    self._capacity.load(await self._list_objects())
            except (BackendError, OSError, TimeoutError) as e:
                self._count_failure(e)
                report = _BatchReport(self, call, num_items)
                report.fail(self.uri, f"not ready: {_describe(e)}")
                report.emit()
                return False
            self._ready = True
            return True

    def statistics(self) -> BackendStatistics:
        cap = self._capacity
        return BackendStatistics(
            uri=self.uri,
            used_bytes=None if cap is None else cap.used_bytes,
            capacity_bytes=None if cap is None else cap.capacity_bytes,
            **{name: self._counts[name] for name in _COUNTERS},
        )

    # ---- V2 protocol -----------------------------------------------------------------------
    async def register_host_pool_v2(self, pool_name: PoolName, host_pool: ItemPool) -> None:
        """Register the host pool of ``pool_name``. Registering the same geometry again
        replaces the pool; a different geometry under a registered name raises."""
        geometry = ObjectGeometry.of_pool(pool_name, host_pool)
        known = self._pools.get(geometry.pool_name)
        if known is not None and known[1] != geometry:
            raise ConfigError(f"pool {geometry.pool_name!r} is already registered with {known[1]}")
        self._pools[geometry.pool_name] = (host_pool, geometry)

    def _geometry(self, pool_name: PoolName | str) -> tuple[ItemPool, ObjectGeometry]:
        name = _value(pool_name)
        try:
            return self._pools[name]
        except KeyError:
            raise ConfigError(f"pool {name!r} is not registered (register_host_pool_v2 first)") from None

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
            plan.items.append(BatchItem(self.object_name(geometry.pool_name, key), key, geometry, pool, index))
        return plan

    async def batch_exists_v2(self, keys: Sequence[str], transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose objects exist as every transfer's hit policy
        asks. ALL_PAGES pools are probed window by window up to their first miss; TRAILING_PAGES
        pools downwards from there (first only the keys their policy needs there, then window
        by window). ``exists`` flags are ``False`` for keys not probed."""
        for key in keys:
            validate_key(key)
        pool_names = [_value(t.pool_name) for t in transfers]
        for name in pool_names:
            self._geometry(name)
        n = len(keys)
        flags: dict[str, list[bool]] = {name: [False] * n for name in pool_names}
        if not await self._ensure_ready("batch_exists_v2", n):
            return PoolTransferResult(num_hit_pages=0, exists={t.pool_name: (False,) * n for t in transfers})
        report = _BatchReport(self, "batch_exists_v2", 0)

        async def probe(names: Iterable[str], lo: int, hi: int) -> None:
            async with asyncio.TaskGroup() as tg:
                for name in set(names):
                    tg.create_task(self._probe(name, keys, lo, hi, flags[name], report))

        all_pages = [nm for nm, t in zip(pool_names, transfers) if t.hit_policy is PoolHitPolicy.ALL_PAGES]
        trailing = [(nm, t.num_trailing) for nm, t in zip(pool_names, transfers) if t.hit_policy is PoolHitPolicy.TRAILING_PAGES]
        n_all, lo = n, 0
        while all_pages and lo < n:
            hi = min(n, lo + self.probe_window)
            await probe(all_pages, lo, hi)
            first_miss = min(next((i for i in range(lo, hi) if not flags[nm][i]), hi) for nm in all_pages)
            if first_miss < hi:
                n_all = first_miss
                break
            lo = hi
        m, probed_lo = n_all, n_all
        span = max((num for _, num in trailing), default=0)
        while trailing and m > 0:
            need_lo = max(0, m - span)
            if need_lo < probed_lo:
                # The deepest keys alone first (a prefix stored whole has its state there), then
                # window by window downwards.
                step = span if probed_lo == n_all else self.probe_window
                new_lo = max(0, min(need_lo, probed_lo - step))
                await probe([nm for nm, _ in trailing], new_lo, probed_lo)
                probed_lo = new_lo
            if all(all(flags[nm][max(0, m - num) : m]) for nm, num in trailing):
                break
            m -= 1
        report.emit()
        exists = {t.pool_name: flags[nm] for nm, t in zip(pool_names, transfers)}
        num_hit = longest_hit(n, transfers, exists)
        return PoolTransferResult(num_hit_pages=num_hit, exists={p: tuple(f) for p, f in exists.items()})

    async def _probe(
        self, pool_name: str, keys: Sequence[str], lo: int, hi: int, out: list[bool], report: _BatchReport
    ) -> None:
        _, geometry = self._geometry(pool_name)
        names = [self.object_name(pool_name, keys[i]) for i in range(lo, hi)]
        report.num_items += len(names)
        try:
            async with asyncio.timeout(self.timeout_s):
                sizes = await self._object_sizes(names)
        except (BackendError, OSError, TimeoutError) as e:
            self._count_failure(e)
            report.fail(names[0], e)
            return
        invalid: list[str] = []
        for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
            if size is None:
                continue
            if self.codec.valid_size(geometry, keys[lo + i], size):
                out[lo + i] = True
            else:
                invalid.append(name)
                report.corrupt(name, ObjectFormatError(f"object of {size} bytes (truncated or foreign)"))
        if invalid:
            self._counts["num_corrupt"] += len(invalid)
            await self._remove(invalid, report)

    async def batch_get_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        """Read ``keys[i]`` into ``host_indices[i]`` of each transfer's pool; success per item.
        On ``False`` the slot's bytes are unspecified; the call returns only once no worker
        touches any of its slots."""
        plans = [self._plan(t, distinct_slots=True) for t in transfers]
        items = [item for plan in plans for item in plan.items]
        if len({(id(item.pool), item.index) for item in items}) != len(items):
            raise ConfigError("a batch reads two objects into one host slot")
        if not await self._ensure_ready("batch_get_v2", len(items)):
            return _split([False] * len(items), plans)
        report = _BatchReport(self, "batch_get_v2", len(items))
        with self._busy(items):
            outcomes = await self._read_many(items)
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
                self._capacity.discard(item.name)
        if invalid:
            await self._remove(invalid, report)
        report.emit()
        return _split(done, plans)

    async def batch_set_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        """Write ``host_indices[i]`` under ``keys[i]`` (put-if-absent; an existing object counts
        as success); success per item. Slots are only read."""
        plans = [self._plan(t, distinct_slots=False) for t in transfers]
        items = [item for plan in plans for item in plan.items]
        if not await self._ensure_ready("batch_set_v2", len(items)):
            return _split([False] * len(items), plans)
        report = _BatchReport(self, "batch_set_v2", len(items))
        sizes = [self.codec.object_bytes(item.geometry, item.key) for item in items]
        done = [False] * len(items)
        with self._busy(items):  # before reserving: no item of the batch is a victim
            reserved, victims = self._reserve(items, sizes, report)
            accepted = list(reserved)
            try:
                if victims:
                    await self._remove(victims, report)
                outcomes = await self._write_many([items[i] for i in accepted])
            except BaseException:
                # Cut short (cancelled): some writes may have landed. Count them all as stored,
                # so the index never undercounts the disk; one that did not land is dropped
                # from it by a later read's miss or by its eviction.
                for i in accepted:
                    size = self._stored_size(items[i].name, sizes[i])
                    if self._capacity is not None:
                        self._capacity.commit(items[i].name, size, reserved[i])
                raise
        for i, outcome in zip(accepted, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if self._capacity is not None:
                    self._capacity.release(reserved[i])
                self._count_failure(outcome)
                report.fail(items[i].name, outcome)
                continue
            done[i] = True
            size = self._stored_size(items[i].name, sizes[i])
            if self._capacity is not None:
                self._capacity.commit(items[i].name, size, reserved[i])
            if outcome:
                self._counts["num_writes"] += 1
                self._counts["bytes_written"] += items[i].geometry.payload_bytes
            else:
                self._counts["num_write_skips"] += 1
        report.emit()
        return _split(done, plans)

    def _reserve(
        self, items: Sequence[BatchItem], sizes: Sequence[int], report: _BatchReport
    ) -> tuple[dict[int, int], list[str]]:
        """The items that may be written (in order) with the bytes reserved for each (nothing
        for an object the index already holds: the put finds it), and the victims to delete
        (already out of the index)."""
        if self._capacity is None:
            return dict.fromkeys(range(len(items)), 0), []
        reserved: dict[int, int] = {}
        victims: list[str] = []
        for i, size in enumerate(sizes):
            if self._capacity.holds(items[i].name):
                reserved[i] = 0
                continue
            room = self._capacity.reserve(size)
            if room is None:
                self._counts["num_rejected"] += 1
                report.fail(items[i].name, f"no room: {size} bytes, capacity {self._capacity.capacity_bytes}")
                continue
            reserved[i] = size
            victims.extend(room)
        self._counts["num_evictions"] += len(victims)
        return reserved, victims

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
                try:
                    async with asyncio.timeout(self.timeout_s):
                        return await fn(item)
                except (BackendError, OSError, TimeoutError) as e:
                    return e

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(item)) for item in items]
        return [t.result() for t in tasks]

    def _count_failure(self, error: BaseException) -> None:
        self._counts["num_failures"] += 1
        if isinstance(error, TimeoutError):
            self._counts["num_timeouts"] += 1

    async def _remove(self, names: list[str], report: _BatchReport) -> None:
        """Delete objects (invalid ones, eviction victims); failures are counted and reported."""
        if self._capacity is not None:
            for name in names:
                self._capacity.discard(name)
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._delete_objects(names)
        except (BackendError, OSError, TimeoutError) as e:
            self._count_failure(e)
            report.fail(names[0], e)

    @contextmanager
    def _busy(self, items: Sequence[BatchItem]) -> Iterator[None]:
        """Objects in use are never chosen as eviction victims."""
        if self._capacity is None:
            yield
            return
        with ExitStack() as stack:
            for item in items:
                stack.enter_context(self._capacity.busy(item.name))
            yield


def _split(flat: list[bool], plans: list[_Plan]) -> list[list[bool]]:
    out, pos = [], 0
    for plan in plans:
        out.append(flat[pos : pos + len(plan.items)])
        pos += len(plan.items)
    return out
