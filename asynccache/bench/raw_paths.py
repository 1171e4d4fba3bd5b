"""The raw path that ``asynccache bench storage`` compares a backend with: the same payloads
put and got by name with no object format (no header, checksum or put-if-absent).

Primitives:

- ``RawPath`` — put and get of one payload by name, the requests it keeps in flight
  (``in_flight``), dropping objects from the page cache (``evict``, ``file://`` only) and the
  removal of everything it wrote (``cleanup``).
- ``RawFile`` / ``RawS3`` — that path for a :class:`~storage_backends.local_disk.LocalDiskBackend`
  (plain sequential file I/O) and an :class:`~storage_backends.object_store.ObjectStoreBackend`
  (obstore requests on its store).
- ``drop_from_page_cache(paths)`` — write back and drop files' pages (``fdatasync`` +
  ``POSIX_FADV_DONTNEED``), so the next read comes from the device.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from asynccache.errors import AsyncCacheError
from storage_backends.base import ObjectBackend
from storage_backends.local_disk import LocalDiskBackend
from storage_backends.object_store import ObjectStoreBackend

__all__ = ["RawFile", "RawPath", "RawS3", "drop_from_page_cache"]


class RawPath:
    """The raw path of one URI: put and get of one payload by name."""

    def __init__(self, backend: ObjectBackend, run_id: str) -> None:
        self.backend = backend
        self.run_id = run_id

    def evict(self, names: list[str]) -> None:
        raise AsyncCacheError("--cold-reads needs a file:// URI")

    async def put(self, name: str, payload: memoryview) -> None:
        raise NotImplementedError

    async def get(self, name: str, dest: memoryview) -> None:
        raise NotImplementedError

    @property
    def in_flight(self) -> int:
        return 1

    async def cleanup(self) -> None:
        raise NotImplementedError


class RawFile(RawPath):
    """``file://``: one plain file per object under ``raw-bench-{run_id}`` of the root, written
    (and fsynced when the backend fsyncs) and read back sequentially."""

    def __init__(self, backend: LocalDiskBackend, run_id: str) -> None:
        super().__init__(backend, run_id)
        self.fsync = backend.fsync
        self.dir = os.path.join(backend.root, f"raw-bench-{run_id}")
        os.makedirs(self.dir, exist_ok=True)

    # Plain blocking file I/O on the loop is the baseline itself: one request at a time
    # (``in_flight`` is 1) with nothing else running beside it.
    async def put(self, name: str, payload: memoryview) -> None:
        with open(os.path.join(self.dir, name), "wb") as f:  # noqa: ASYNC230
            f.write(payload)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())

    async def get(self, name: str, dest: memoryview) -> None:
        with open(os.path.join(self.dir, name), "rb") as f:  # noqa: ASYNC230
            if f.readinto(dest) != len(dest):
                raise AsyncCacheError(f"raw read of {name} came back short")

    def evict(self, names: list[str]) -> None:
        drop_from_page_cache([os.path.join(self.dir, name) for name in names])

    async def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def drop_from_page_cache(paths: list[str]) -> None:
    """Write back and drop the files' pages, so the next read comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class RawS3(RawPath):
    """``s3://``: obstore ``put`` / ``get`` of each payload under ``raw-bench-{run_id}``, as many
    in flight as the backend allows, large payloads in the backend's multipart shape."""

    def __init__(self, backend: ObjectStoreBackend, run_id: str) -> None:
        import obstore

        super().__init__(backend, run_id)
        self.obstore = obstore
        self.store = backend.store
        self.prefix = f"raw-bench-{run_id}"
        self.names: list[str] = []

    @property
    def in_flight(self) -> int:
        return self.backend.max_concurrency

    async def put(self, name: str, payload: memoryview) -> None:
        b: Any = self.backend
        path = f"{self.prefix}/{name}"
        self.names.append(path)
        if len(payload) > b.multipart_threshold_bytes:
            await self.obstore.put_async(self.store, path, payload, use_multipart=True,
                                         chunk_size=b.multipart_part_bytes, max_concurrency=b.multipart_concurrency)
        else:
            await self.obstore.put_async(self.store, path, payload, use_multipart=False)

    async def get(self, name: str, dest: memoryview) -> None:
        result = await self.obstore.get_async(self.store, f"{self.prefix}/{name}")
        data = await result.bytes_async()
        if len(data) != len(dest):
            raise AsyncCacheError(f"raw read of {name} came back with {len(data)} bytes")
        dest[:] = memoryview(data)

    async def cleanup(self) -> None:
        for start in range(0, len(self.names), 500):
            await self.obstore.delete_async(self.store, self.names[start : start + 500])
