"""Requested deletes of a storage backend: ``batch_delete_v2``.

Primitives:

- :class:`BatchDeleteMixin` — ``batch_delete_v2(keys, pool_names)``: remove the objects of
  ``keys`` in each named pool, through the backend's ``_delete_objects`` (the primitive that
  eviction and the removal of invalid objects use).

What a key names: one object per pool, ``object_name(pool, key)`` — in ``kv`` the KV page whose
chained page hash is ``key``, in ``mamba`` the recurrent state at the end of that page. The two
are separate objects: a call names the pools whose objects go (the storage tier deletes the KV
keys of a failed load from ``kv`` and its state keys from ``mamba``).

Contract:

- The result is per key: ``True`` once every object of the key in those pools is gone —
  deleted now, or absent already (another process removed it, or it was never stored);
  ``False`` when the delete failed (an I/O error, a timeout, a backend whose first-use setup
  failed): the objects may still be stored. Failures are counted and reported once per call,
  like a failed write; the objects of one call are deleted together, so they fail together.
- Order with puts of the same objects: a delete waits for the ``batch_set_v2`` calls of its
  objects that were in flight when it was called, so it also removes what they store; a put
  called while the delete is in flight waits for it, so it stores its object anew (else it
  could find the old one, count it stored, and lose it to the delete). Reads are not ordered:
  one in flight finds the object or a miss (a read cut short by the delete is a miss).
- With a capacity, the objects leave the index as their delete starts and go back into it
  when the delete fails (``BackendCore._remove``).
- Malformed calls raise :class:`~asynccache.errors.ConfigError` before any I/O (a key that is not
  8–128 lowercase hex characters, a pool not registered, keys without a pool, a string where a
  sequence is expected); a closed backend raises :class:`~asynccache.errors.BackendError`, also
  when it closes while the call waits for the puts before it.
- Deletes are background work (reads and probes go first), bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from asynccache.errors import ConfigError
from asynccache.storage import PoolName
from storage_backends.backend_core import BackendCore, pool_value
from storage_backends.object_names import short_repr, validate_key
from storage_backends.reporting import BatchReport

__all__ = ["BatchDeleteMixin"]


class BatchDeleteMixin(BackendCore):
    """``batch_delete_v2`` of :class:`~storage_backends.base.ObjectBackend` (see the module
    docstring)."""

    async def batch_delete_v2(self, keys: Sequence[str], pool_names: Sequence[PoolName | str]) -> list[bool]:
        """Delete the objects of ``keys`` in each pool of ``pool_names``; per key, whether they
        are gone (see the module docstring)."""
        names = self._delete_names(keys, pool_names)
        with self._call(), self._in_order(names, delete=True) as puts_before:
            if puts_before:
                await asyncio.wait(puts_before)
            if not names:
                return []
            gone = await self._delete_batch(names)
        return [gone] * len(keys)

    def _delete_names(self, keys: Sequence[str], pool_names: Sequence[PoolName | str]) -> list[str]:
        """The distinct object names of a call, checked (:class:`ConfigError` before any I/O)."""
        for what, value in (("keys", keys), ("pool_names", pool_names)):
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise ConfigError(f"batch_delete_v2: {what} must be a sequence, got {short_repr(value)}")
        for key in keys:
            validate_key(key)
        pools = [pool_value(p) for p in pool_names]
        for pool in pools:
            self._geometry(pool)  # registered
        if keys and not pools:
            raise ConfigError(f"batch_delete_v2 of {len(keys)} key(s) names no pool")
        return list(dict.fromkeys(self.object_name(pool, key) for key in keys for pool in pools))

    async def _delete_batch(self, names: list[str]) -> bool:
        """Whether the objects ``names`` are gone (failures counted and reported)."""
        if not await self._ensure_ready("batch_delete_v2", len(names), closed_raises=True):
            return False
        report = BatchReport(self, "batch_delete_v2", len(names))
        error = await self._remove(names, report, background=True)
        report.emit()
        if error is not None:
            return False
        self._counts["num_deletes"] += len(names)
        return True
