"""Built-in L3 storage backends, opened by URI through ``asynccache.storage.open_backend``.

- ``memory://[name]`` — :mod:`storage_backends.memory` (tests, the fastest conformance target)
- ``file:///path`` — :mod:`storage_backends.local_disk` (preadv/pwritev straight into host slots)
- ``s3://bucket/prefix?endpoint_url=…&region=…`` — :mod:`storage_backends.object_store` (obstore)

Shared parts: :mod:`storage_backends.object_format` (object header, names, key validation) and
:mod:`storage_backends.base` (the V2 protocol implemented once over five primitives, statistics,
capacity and eviction, the worker pool).
"""

from storage_backends.base import BackendStatistics, ObjectBackend

__all__ = ["BackendStatistics", "ObjectBackend"]
