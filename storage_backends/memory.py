"""``memory://[name]`` — objects in a Python dict: tests, and the fastest conformance target.

Objects are stored whole, in the same format as on disk or in a bucket (header + payload), so
corruption handling is exercised exactly as elsewhere. Work runs inline on the event loop
(copies and checksums of large objects block it for their duration: this backend is for tests
and small caches). Several backends share one store by passing the same ``objects`` dict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from asynccache.errors import ConfigError
from asynccache.storage import PoolName
from storage_backends.base import BatchItem, ObjectBackend
from storage_backends.object_format import validate_pool_name

__all__ = ["MemoryBackend", "open_memory"]


class MemoryBackend(ObjectBackend):
    """Objects live in ``objects`` (name → encoded object); the name is
    ``[{uri name}/]{namespace-digest}/{pool}/{key[:2]}/{key}``. Options: those of
    :class:`~storage_backends.base.ObjectBackend`."""

    probe_window = 256

    def __init__(self, uri: str, *, objects: dict[str, bytes | bytearray] | None = None, **options: Any) -> None:
        try:
            parts = urlsplit(uri)
        except ValueError as e:
            raise ConfigError(f"malformed memory URI {uri!r}: {e}") from None
        if parts.scheme != "memory" or parts.query or parts.fragment or parts.path not in ("", "/"):
            raise ConfigError(f"memory URI must be memory:// or memory://NAME, got {uri!r}")
        if parts.netloc:
            validate_pool_name(parts.netloc)  # the same safe alphabet as pool names
        super().__init__(uri, **options)
        self._prefix = f"{parts.netloc}/" if parts.netloc else ""
        self.objects: dict[str, bytes | bytearray] = {} if objects is None else objects

    def object_name(self, pool_name: PoolName | str, key: str) -> str:
        return self._prefix + self.codec.relpath(validate_pool_name(pool_name), key)

    async def _object_sizes(self, names: Sequence[str]) -> list[int | None]:
        return [len(self.objects[n]) if n in self.objects else None for n in names]

    async def _read_object(self, item: BatchItem) -> bool:
        data = self.objects.get(item.name)
        if data is None:
            return False
        self.codec.decode_into(data, item.geometry, item.key, item.buffers())
        return True

    async def _write_object(self, item: BatchItem) -> bool:
        stored = self.objects.get(item.name)
        if stored is not None and self.codec.valid_size(item.geometry, item.key, len(stored)):
            return False  # an object of another size is replaced: success means a valid one is stored
        self.objects[item.name] = self.codec.encode(item.geometry, item.key, item.buffers())
        return True

    async def _delete_objects(self, names: Sequence[str], *, background: bool) -> None:
        for name in names:
            self.objects.pop(name, None)

    async def _list_objects(self, progress: Callable[[int], None]) -> list[tuple[str, int]]:
        mine = f"{self._prefix}{self.codec.digest_hex}/"
        return [(n, len(d)) for n, d in self.objects.items() if n.startswith(mine)]


def open_memory(uri: str = "memory://", **options: Any) -> MemoryBackend:
    """Open ``memory://[name]``; options: ``namespace`` (required), ``objects``,
    ``capacity_bytes``, ``max_concurrency``, ``timeout_s``."""
    return MemoryBackend(uri, **options)
