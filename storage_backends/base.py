"""The base of the built-in storage backends: the V2 protocol implemented once.

Primitives:

- :class:`ObjectBackend` — implements the V2 :class:`~asynccache.storage.StorageBackend`
  protocol once: validation, object names, the exists search (``longest_hit``), bounded
  concurrency, per-item timeouts, capacity and eviction, counters, failure logging. A backend
  subclass supplies five primitives: ``_object_sizes``, ``_read_object``, ``_write_object``,
  ``_delete_objects``, ``_list_objects``. It is assembled from
  :class:`~storage_backends.backend_core.BackendCore` (state, primitives, shared helpers),
  :class:`~storage_backends.exists_search.ExistsSearchMixin` (``batch_exists_v2``) and
  :class:`~storage_backends.batch_io.BatchIOMixin` (``batch_get_v2``, ``batch_set_v2``, the
  item I/O) and :class:`~storage_backends.batch_delete.BatchDeleteMixin` (``batch_delete_v2``:
  requested deletes, ordered with the puts of the same objects), and adds the lifecycle (``aclose`` waits for the calls in flight and survives
  its caller's cancellation), pool registration and ``statistics()``.

Re-exported here, where backends import them from:

- :class:`~storage_backends.reporting.BackendStatistics` — a frozen snapshot of a backend's
  counters (``statistics()``).
- :class:`~storage_backends.capacity.LRUCapacity` — byte accounting of stored objects against
  ``capacity_bytes`` with least-recently-used eviction; objects being read or written are
  never chosen.
- :class:`~storage_backends.backend_core.BatchItem`, ``Outcome``, ``usable_cores``,
  ``check_common_options`` (:mod:`storage_backends.backend_core`); ``check_int``,
  ``check_seconds`` (:mod:`asynccache.checks`).
- :class:`~storage_backends.workers.WorkerPool` and
  :class:`~storage_backends.workers.PriorityLimiter` — bounded threads and slots that serve
  reads and probes (and the removal of invalid objects they found) before write-back and
  eviction deletes. A cancelled caller still waits for its job to stop, so no thread touches
  a host slot after the call that named it has returned.

Failure model: a missing object is a miss; an invalid object (truncated, corrupted, foreign,
other format version) is a miss and is removed before the call returns; an I/O error, a
timeout or a backend that is down is a miss (or a skipped write) counted in the statistics and
reported with one warning per batch; so is a write that a failed eviction left no room for
(see :mod:`storage_backends.batch_io`). A first-use setup that failed makes every call a miss for
``setup_retry_s`` before it is tried again, and one still running ``timeout_s`` after it started
(a long listing) makes every call a miss until it is done (see
:mod:`storage_backends.first_use`). Malformed
calls (bad keys, unregistered pools, mismatched lengths) raise
:class:`~asynccache.errors.ConfigError` before any I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Self

from asynccache.checks import check_int, check_seconds
from asynccache.errors import ConfigError
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolName
from storage_backends.backend_core import (
    BatchItem,
    Outcome,
    check_common_options,
    usable_cores,
)
from storage_backends.batch_delete import BatchDeleteMixin
from storage_backends.batch_io import BatchIOMixin
from storage_backends.capacity import LRUCapacity
from storage_backends.exists_search import ExistsSearchMixin
from storage_backends.object_format import ObjectGeometry
from storage_backends.reporting import COUNTER_NAMES, BackendStatistics
from storage_backends.workers import PriorityLimiter, WorkerPool

__all__ = [
    "BackendStatistics",
    "BatchItem",
    "LRUCapacity",
    "ObjectBackend",
    "Outcome",
    "PriorityLimiter",
    "WorkerPool",
    "check_common_options",
    "check_int",
    "check_seconds",
    "usable_cores",
]


class ObjectBackend(ExistsSearchMixin, BatchIOMixin, BatchDeleteMixin):
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
    - ``_delete_objects(names, background=...)`` (an object already gone is fine):
      ``background=True`` for eviction victims (part of a write-back) and requested deletes
      (``batch_delete_v2``), ``False`` for invalid
      objects that a read or a probe found and waits to have removed — a backend that serves
      reads before writes serves those deletes like reads; ``_list_objects(progress)`` →
      ``(name, size)`` of this namespace, least recently used first (only called when a
      capacity is set), calling ``progress(found)`` with the number of objects found so far
      after each page or directory (from the event loop or any one worker thread): the listing
      fails only when ``timeout_s`` passes without a report.

    ``_read_many`` / ``_write_many`` run the item primitives for a whole batch (by default one
    task per item, ``max_concurrency`` at a time, each within ``timeout_s``); a backend whose
    items are cheap may override them to move several items per worker job, and then starts no
    item once ``_closed`` is set.
    """

    # ---- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the backend: no call starts any more (they raise :class:`BackendError`), the
        calls in flight start no more items (those fail: misses, skipped writes) and finish
        the ones they have (within ``close_grace_s``), then the backend's resources are
        released and the calls still in flight are waited for. Returns once that is
        done: nothing writes into a host slot or sends a request for the backend after it.
        The close runs as a task of the backend, so a caller cancelled meanwhile does not cut
        it short; a repeated or concurrent call waits for the same close."""
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.get_running_loop().create_task(self._shut_down(), name=f"close {self.uri}")
        await asyncio.shield(self._closing)

    async def _shut_down(self) -> None:
        self._setup.cancel()  # the calls waiting for it fail (closed)
        # The calls in flight finish the items they have — within a grace period: one held by
        # something stuck (a reader process or a store that stopped answering, with a long
        # ``timeout_s``) ends when its item's deadline is brought forward (backends that go
        # item by item) or when releasing the resources stops what it waits for, and is waited
        # for then.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.close_grace_s):
                await self._wait_calls_done()
        self._end_items()
        await self._close()
        await self._wait_calls_done()

    def statistics(self) -> BackendStatistics:
        cap = self._capacity
        return BackendStatistics(
            uri=self.uri,
            used_bytes=None if cap is None else cap.used_bytes,
            capacity_bytes=None if cap is None else cap.capacity_bytes,
            **{name: self._counts[name] for name in COUNTER_NAMES},
        )

    # ---- V2 protocol -----------------------------------------------------------------------
    async def register_host_pool_v2(self, pool_name: PoolName, host_pool: ItemPool) -> None:
        """Register the host pool of ``pool_name``. Registering the same geometry again
        replaces the pool; a different geometry under a registered name raises, and so does a
        closed backend."""
        if self._closed:
            raise self._closed_error()
        geometry = ObjectGeometry.of_pool(pool_name, host_pool)
        known = self._pools.get(geometry.pool_name)
        if known is not None and known[1] != geometry:
            raise ConfigError(f"pool {geometry.pool_name!r} is already registered with {known[1]}")
        self._pools[geometry.pool_name] = (host_pool, geometry)
