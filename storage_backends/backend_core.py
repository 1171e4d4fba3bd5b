"""State and primitives shared by a storage backend's operations (see ``storage_backends.base``).

Primitives:

- :class:`BackendCore` — the state of an :class:`~storage_backends.base.ObjectBackend` (options,
  codec, registered pools, capacity, counters, the slots of objects in flight), the five
  abstract item primitives a backend implements, first-use setup (``_ensure_ready``), and the
  helpers every operation uses: pool lookup, failure counting, removal of objects, and marking
  a batch's objects busy. Not used on its own.
- :class:`BatchItem` / :data:`Outcome` — one object of a batch with its host slot, and what
  its I/O gave.
- :func:`check_common_options` — validation of the options every backend takes.
- :func:`usable_cores` — the CPU cores this process may run on (backends size their defaults
  by it).
- :func:`pool_value` — a pool name as the string the backend's tables are keyed by.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from asynccache.checks import check_int, check_seconds
from asynccache.errors import BackendError, ConfigError
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolName
from storage_backends.capacity import LRUCapacity
from storage_backends.object_format import ObjectCodec, ObjectGeometry, slot_buffers
from storage_backends.reporting import BatchReport, describe_error
from storage_backends.workers import PriorityLimiter

__all__ = [
    "BackendCore",
    "BatchItem",
    "Outcome",
    "check_common_options",
    "pool_value",
    "usable_cores",
]

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


def pool_value(pool_name: PoolName | str) -> str:
    return str(getattr(pool_name, "value", pool_name))


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


class BackendCore(ABC):
    """Shared state of :class:`~storage_backends.base.ObjectBackend` (whose docstring states
    the primitives' contract); not used on its own. Event-loop bound."""

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

    # ---- shared by the operations ----------------------------------------------------------
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
                report = BatchReport(self, call, num_items)
                report.fail(self.uri, f"not ready: {describe_error(e)}")
                report.emit()
                return False
            self._ready = True
            return True

    def _geometry(self, pool_name: PoolName | str) -> tuple[ItemPool, ObjectGeometry]:
        name = pool_value(pool_name)
        try:
            return self._pools[name]
        except KeyError:
            raise ConfigError(f"pool {name!r} is not registered (register_host_pool_v2 first)") from None

    def _count_failure(self, error: BaseException) -> None:
        self._counts["num_failures"] += 1
        if isinstance(error, TimeoutError):
            self._counts["num_timeouts"] += 1

    async def _remove(self, names: list[str], report: BatchReport) -> None:
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
