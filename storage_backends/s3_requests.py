"""The requests an :class:`~storage_backends.object_store.ObjectStoreBackend` makes of its
bucket (obstore), each failure a :class:`BackendError` (``storage_backends.s3_errors``) and an
absent object ``None``.

Primitives:

- :class:`S3RequestsMixin` — ``_head_size`` (one HEAD: an object's size), ``_object_sizes``
  (a window of HEADs, ``max_concurrency`` at a time), ``_get`` (one GET of a whole object),
  ``_get_range`` (a ranged GET, optionally of one version: ``If-Match``), ``_delete_objects``
  and ``_list_objects`` (the namespace's objects, oldest first). The base of
  :class:`~storage_backends.object_store.ObjectStoreBackend`; not used on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asynccache.errors import BackendError
from storage_backends.base import ObjectBackend
from storage_backends.s3_errors import backend_error

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = ["S3RequestsMixin"]


class S3RequestsMixin(ObjectBackend):
    """The bucket requests of :class:`~storage_backends.object_store.ObjectStoreBackend` (see
    the module docstring); not used on its own."""

    # Set by ObjectStoreBackend's constructor.
    _obstore: Any
    _store: S3Store
    _errors: tuple[type[BaseException], ...]

    async def _head_size(self, name: str) -> int | None:
        try:
            meta = await self._obstore.head_async(self._store, name)
        except FileNotFoundError:
            return None
        except self._errors as e:
            raise backend_error(e) from e
        return int(meta["size"])

    async def _object_sizes(self, names: Sequence[str]) -> list[int | None]:
        async def one(name: str) -> int | None | BackendError:
            async with self._limit():
                if self._closed:  # closing: no more requests
                    return self._closed_error()
                try:
                    return await self._head_size(name)
                except BackendError as e:
                    return e

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(n)) for n in names]
        sizes = [t.result() for t in tasks]
        for size in sizes:
            if isinstance(size, BackendError):
                raise size  # the window fails as a whole: its keys count as absent
        return sizes  # type: ignore[return-value]

    async def _get(self, name: str) -> Any | None:
        """The whole object ``name`` (one GET), or ``None`` when absent."""
        try:
            result = await self._obstore.get_async(self._store, name)
            return await result.bytes_async()
        except FileNotFoundError:
            return None
        except self._errors as e:
            raise backend_error(e) from e

    async def _get_range(self, name: str, start: int, end: int, etag: str | None) -> tuple[Any, dict[str, Any]] | None:
        """Bytes ``[start, end)`` of ``name`` and its metadata, or ``None`` when absent. With
        ``etag``, only from that version of the object (another version fails the request)."""
        options: dict[str, Any] = {"range": (start, end)}
        if etag is not None:
            options["if_match"] = etag
        try:
            result = await self._obstore.get_async(self._store, name, options=options)
            meta = result.meta
            return await result.bytes_async(), meta
        except FileNotFoundError:
            return None
        except self._errors as e:
            raise backend_error(e) from e

    async def _delete_objects(self, names: Sequence[str], *, background: bool) -> None:
        # no request slot taken, in either class of work: a DELETE is one short request
        try:
            await self._obstore.delete_async(self._store, list(names))
        except FileNotFoundError:
            return  # already gone: the state we want
        except self._errors as e:
            raise backend_error(e) from e

    async def _list_objects(self, progress: Callable[[int], None]) -> list[tuple[str, int]]:
        found: list[tuple[Any, str, int]] = []
        try:
            async for batch in self._obstore.list(self._store, prefix=self.codec.digest_hex, chunk_size=1000):
                found.extend((m["last_modified"], m["path"], int(m["size"])) for m in batch)
                progress(len(found))
        except self._errors as e:
            raise backend_error(e) from e
        found.sort()
        return [(path, size) for _, path, size in found]
