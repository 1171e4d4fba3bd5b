"""State and primitives shared by a storage backend's operations (see ``storage_backends.base``).

Primitives:

- :class:`BackendCore` — the state of an :class:`~storage_backends.base.ObjectBackend` (options,
  codec, registered pools, capacity, counters, the slots of objects in flight, the calls in
  flight), the five abstract item primitives a backend implements, first-use setup
  (``_ensure_ready``), and the helpers every operation uses: a call's registration
  (``_call``, which ``aclose`` waits for), pool lookup, failure counting, removal of objects,
  the order of puts and requested deletes of one object (``_in_order``), and marking a batch's
  objects busy. Not used on its own.
- :class:`BatchItem` / :data:`Outcome` — one object of a batch with its host slot, and what
  its I/O gave.
- :func:`check_common_options` — validation of the options every backend takes.
- :func:`usable_cores` — the CPU cores this process may run on (backends size their defaults
  by it).
- :func:`pool_value` — a pool name as the string the backend's tables are keyed by.

First-use setup (``_prepare``, bounded by ``timeout_s``, then with a capacity the listing of
the stored objects into the capacity index) runs as one task of the backend that the calls
share (:mod:`storage_backends.first_use`). The listing is bounded by its progress, not its
length: it fails only when ``timeout_s`` passes without a new page or directory (from the
setup's start to the first one, then between two), so a large namespace that takes minutes to
list is listed to its end. A call waits for the setup at most ``timeout_s`` after it started;
the calls after that are misses (and skipped writes) at once, counted and reported, until the
setup is done — no write takes room before the index knows what is stored. When it fails, the
calls that waited for it and the calls of the next ``setup_retry_s`` are misses, every item
counted and reported; the first call after that tries again. ``aclose`` cancels a setup in
progress (a listing stops between files).
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from asynccache.checks import check_int, check_seconds
from asynccache.errors import BackendError, ConfigError
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolName
from storage_backends.capacity import LRUCapacity, Stored
from storage_backends.first_use import (
    FirstUseSetup,
    SetupProgress,
    list_bounded_by_progress,
)
from storage_backends.object_format import ObjectCodec, ObjectGeometry, slot_buffers
from storage_backends.reporting import BatchReport
from storage_backends.workers import PriorityLimiter

__all__ = [
    "BackendCore",
    "BatchItem",
    "Outcome",
    "check_common_options",
    "pool_value",
    "usable_cores",
]

#: Put numbers kept per object beyond which those no read or probe in flight needs are dropped.
_PUT_MARKS_KEPT = 4096


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this OS
        return os.cpu_count() or 1


def check_common_options(
    *, capacity_bytes: int | None, max_concurrency: int, timeout_s: float
) -> tuple[int | None, int]:
    """The options every backend takes, checked; returns ``capacity_bytes`` and
    ``max_concurrency`` as Python ints (NumPy integers are taken)."""
    if capacity_bytes is not None:
        capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=1)
    check_seconds("timeout_s", timeout_s)
    return capacity_bytes, check_int("max_concurrency", max_concurrency, minimum=1)


def pool_value(pool_name: PoolName | str) -> str:
    return str(getattr(pool_name, "value", pool_name))


@dataclass(slots=True)
class BatchItem:
    """One object of a batch and the host slot it moves to or from; ``speculative``: a write of
    a speculative object (see :class:`~asynccache.storage.PoolTransfer`)."""

    name: str
    key: str
    geometry: ObjectGeometry
    pool: ItemPool
    index: int
    speculative: bool = False

    def buffers(self) -> list[np.ndarray]:
        return slot_buffers(self.pool, self.index)


#: The outcome of one item's I/O: True (done), False (absent / already present), or the error.
Outcome = bool | BaseException


class BackendCore(ABC):
    """Shared state of :class:`~storage_backends.base.ObjectBackend` (whose docstring states
    the primitives' contract); not used on its own. Event-loop bound."""

    #: objects in flight when ``max_concurrency`` is not given
    default_max_concurrency: int = 8
    #: objects' headers are padded to a multiple of this (see ``ObjectCodec``)
    header_align: int = 64
    #: after a failed first-use setup, calls are misses for this long before it is tried again
    #: (a store that is down is not asked again by every call, each waiting ``timeout_s``)
    setup_retry_s: float = 1.0
    #: how long a close waits for the calls in flight before it releases the resources they may
    #: be stuck on (and then waits for them to end)
    close_grace_s: float = 5.0

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
        capacity_bytes, max_concurrency = check_common_options(
            capacity_bytes=capacity_bytes, max_concurrency=max_concurrency, timeout_s=timeout_s
        )
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
        #: objects whose delete is in flight, and the future that ends with it: a put of one of
        #: them waits (it would find the old object, count it stored, and lose it to the delete)
        self._deleting: dict[str, asyncio.Future[None]] = {}
        #: the puts (``batch_set_v2``) and the requested deletes (``batch_delete_v2``) in flight
        #: per object, each a future that ends with its call: a call of one kind waits for those
        #: of the other kind that came before it (see ``_in_order``)
        self._putting: dict[str, set[asyncio.Future[None]]] = {}
        self._purging: dict[str, set[asyncio.Future[None]]] = {}
        #: puts counted as they are called, the latest one's number per object, and the count
        #: a read or probe in flight began at (``_checking``): an object it finds invalid is
        #: not removed when a put of it came since (``_still_invalid``)
        self._num_puts = 0
        self._put_at: dict[str, int] = {}  # only while a read or probe is in flight
        self._checks: Counter[int] = Counter()
        #: the deadlines of the items in flight of the backends that read and write item by
        #: item (``_per_item``): a close past its grace ends them (``_end_items``)
        self._item_deadlines: set[asyncio.Timeout] = set()
        self._ready = False
        #: the first-use setup's attempts (shared by the calls that come while one runs)
        self._setup = FirstUseSetup(uri)
        #: set by ``aclose``: no call starts, and the calls in flight start no more items
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._num_calls = 0
        self._calls_done: asyncio.Event | None = None  # made by ``aclose``, on its loop

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
    async def _delete_objects(self, names: Sequence[str], *, background: bool) -> None: ...

    @abstractmethod
    async def _list_objects(self, progress: Callable[[int], None]) -> list[tuple[str, int]]: ...

    async def _prepare(self) -> None:
        """First-use setup (create directories, connect); default: nothing."""

    async def _close(self) -> None:
        """Release the backend's resources; default: nothing."""

    @abstractmethod
    def object_name(self, pool_name: PoolName | str, key: str) -> str:
        """Where ``key``'s object of ``pool_name`` lives in this backend (validated)."""

    # ---- shared by the operations ----------------------------------------------------------
    @contextmanager
    def _call(self) -> Iterator[None]:
        """One call of the protocol (a batch) in flight: ``aclose`` waits for it to end. A
        closed backend raises."""
        if self._closed:
            raise self._closed_error()
        self._num_calls += 1
        try:
            yield
        finally:
            self._num_calls -= 1
            if not self._num_calls and self._calls_done is not None:
                self._calls_done.set()

    def _end_items(self) -> None:
        """End the items in flight now (a close past its grace): each fails as closed. A
        request stuck on a store that stopped answering would otherwise hold the close until
        its own ``timeout_s``."""
        now = asyncio.get_running_loop().time()
        for deadline in list(self._item_deadlines):
            deadline.reschedule(now)

    async def _wait_calls_done(self) -> None:
        self._calls_done = asyncio.Event()
        while self._num_calls:
            self._calls_done.clear()
            await self._calls_done.wait()

    def _closed_error(self) -> BackendError:
        return BackendError(f"storage {self.uri}: backend is closed")

    async def first_use(self) -> None:
        """Set the backend up now, as its first call would (see the module docstring), and
        raise :class:`BackendError` naming why when it cannot be — where a call would count
        its items as failed. For a caller that wants a bad root or endpoint found up front."""
        with self._call():
            if self._ready:
                return
            not_ready = await self._setup.join(self._set_up, retry_s=self.setup_retry_s, closed=self._closed_error)
            if not_ready is not None:
                raise BackendError(f"storage {self.uri}: not ready: {not_ready.why}")

    async def _ensure_ready(self, call: str, num_items: int, *, closed_raises: bool = False) -> bool:
        """Set the backend up at its first use (see the module docstring). ``False`` when it is
        not (yet) set up: every item of the call is counted as failed and reported (a read's
        items are also counted as misses by the caller). A call registered before the backend
        closed starts no item: ``False``, its items counted as failed (``closed_raises``: it
        raises instead)."""
        if self._closed:
            if closed_raises:
                raise self._closed_error()
            self._counts["num_failures"] += num_items
            return False
        if self._ready:
            return True
        not_ready = await self._setup.join(self._set_up, retry_s=self.setup_retry_s, closed=self._closed_error)
        if not_ready is None:
            return True
        if not_ready.of_this_call:
            self._count_failure(not_ready.error, count=num_items)
        else:  # not a timeout of this call
            self._counts["num_failures"] += num_items
        report = BatchReport(self, call, num_items)
        report.fail(self.uri, f"not ready: {not_ready.why}", count=num_items)
        report.emit()
        return False

    async def _set_up(self, progress: SetupProgress) -> BaseException | None:
        """One setup attempt (see ``storage_backends.first_use``): ``_prepare`` bounded by
        ``timeout_s``, then with a capacity the listing of the stored objects, bounded by its
        progress (``timeout_s`` without a new page or directory). ``None`` once the backend is
        ready, else the store's error."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._prepare()
            if self._capacity is not None:
                entries = await list_bounded_by_progress(self._list_objects, progress, self.timeout_s)
                self._capacity.load(entries)
        except (BackendError, OSError, TimeoutError) as e:
            return e
        self._ready = True
        return None

    def _geometry(self, pool_name: PoolName | str) -> tuple[ItemPool, ObjectGeometry]:
        name = pool_value(pool_name)
        try:
            return self._pools[name]
        except KeyError:
            raise ConfigError(f"pool {name!r} is not registered (register_host_pool_v2 first)") from None

    def _count_failure(self, error: BaseException, *, count: int = 1) -> None:
        """``count`` items (or deletes) failed with ``error``."""
        self._counts["num_failures"] += count
        if isinstance(error, TimeoutError):
            self._counts["num_timeouts"] += count

    async def _remove(
        self,
        names: Sequence[str],
        report: BatchReport | None,
        *,
        background: bool,
        counted: Sequence[Stored] | None = None,
    ) -> BaseException | None:
        """Delete objects: invalid ones found by a read or a probe (``background=False``: the
        call waits for it, so it goes before write-back like the read itself), or eviction
        victims (``background=True``, ``counted``: the entries ``reserve`` took out of the
        capacity index). They leave the index at once — no concurrent writer chooses them again
        — and go back into it when the delete fails or is cut short: objects that may still be
        stored stay counted. A failure is counted, reported to ``report`` (``None``: the caller
        reports it) and returned; ``None`` once the objects are gone."""
        names = list(dict.fromkeys(names))  # a batch may read one object into several slots
        if self._capacity is not None and counted is None:
            counted = self._capacity.take(names)
        gone = asyncio.get_running_loop().create_future()
        mine = [name for name in names if name not in self._deleting]
        for name in mine:
            self._deleting[name] = gone
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._delete_objects(names, background=background)
        except (BackendError, OSError, TimeoutError) as e:
            if self._capacity is not None and counted:
                self._capacity.restore(counted)
            self._count_failure(e)
            if report is not None:
                report.fail(names[0], e)
            return e
        except BaseException:  # cancelled: whether the objects are gone is not known
            if self._capacity is not None and counted:
                self._capacity.restore(counted)
            raise
        finally:
            for name in mine:
                del self._deleting[name]
            gone.set_result(None)
        return None

    @contextmanager
    def _in_order(self, names: Sequence[str], *, delete: bool) -> Iterator[set[asyncio.Future[None]]]:
        """Register a put (``delete=False``) or a requested delete of ``names`` as in flight until
        the block ends; yields the futures of the calls of the other kind already in flight on
        any of them, which the call waits for before its I/O. So a put and a delete of one
        object take effect in the order they were called: a delete removes what a put called
        before it stored (else that put could land after it), and a put called after a delete
        stores its object anew (else it could find the old one, count it stored, and lose it to
        the delete). Each call waits only for calls registered before it: no cycle."""
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        own, other = (self._purging, self._putting) if delete else (self._putting, self._purging)
        unique = list(dict.fromkeys(names))
        if not delete:
            self._num_puts += 1
            if self._checks:  # a read or probe that begins later sees this put in its mark
                for name in unique:
                    self._put_at[name] = self._num_puts
        before = {f for name in unique for f in other.get(name, ())}
        for name in unique:
            own.setdefault(name, set()).add(mine)
        try:
            yield before
        finally:
            for name in unique:
                futures = own[name]
                futures.discard(mine)
                if not futures:
                    del own[name]
            mine.set_result(None)

    @contextmanager
    def _checking(self) -> Iterator[int]:
        """A read or probe that may find invalid objects: yields the number of puts called so
        far, for :meth:`_still_invalid` after its I/O."""
        mark = self._num_puts
        self._checks[mark] += 1
        try:
            yield mark
        finally:
            self._checks[mark] -= 1
            if not self._checks[mark]:
                del self._checks[mark]
            if not self._checks:
                self._put_at.clear()
            elif len(self._put_at) > _PUT_MARKS_KEPT:
                oldest = min(self._checks)
                self._put_at = {name: n for name, n in self._put_at.items() if n > oldest}

    def _still_invalid(self, names: Sequence[str], mark: int) -> list[str]:
        """The objects a read or probe begun at ``mark`` (:meth:`_checking`) found invalid that
        it may remove: not those a put was called for since, or is still in flight for. Such a
        put may have stored a valid object after the read looked (or will), and it reports
        success; removing by name would lose it. (An object a put skipped as present stays as
        it is, invalid: the next read finds it again.)"""
        return [name for name in names if name not in self._putting and self._put_at.get(name, 0) <= mark]

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
