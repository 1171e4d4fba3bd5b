"""Built-in L3 storage backends, opened by URI through ``asynccache.storage.open_backend``.

- ``memory://[name]`` — :mod:`storage_backends.memory` (tests, the fastest conformance target)
- ``file:///path`` — :mod:`storage_backends.local_disk` (preadv/pwritev straight into host slots;
  its worker jobs' work in :mod:`~storage_backends.disk_jobs`, its reader processes in
  :mod:`~storage_backends.reader_processes`, :mod:`~storage_backends.reader_batches` and
  :mod:`~storage_backends.reader_child`)
- ``s3://bucket/prefix?endpoint_url=…&region=…`` — :mod:`storage_backends.object_store` (obstore;
  its bucket requests in :mod:`~storage_backends.s3_requests`, the URI and endpoint in
  :mod:`~storage_backends.s3_location`, its errors' messages in :mod:`~storage_backends.s3_errors`)

Shared parts:

- :mod:`storage_backends.object_format` — the object codec; the format's parts in
  :mod:`~storage_backends.object_names` (names, key validation, geometry),
  :mod:`~storage_backends.object_header`, :mod:`~storage_backends.payload_checksum` and
  :mod:`~storage_backends.payload_pieces`.
- :mod:`storage_backends.base` — the V2 protocol implemented once over five primitives
  (:mod:`~storage_backends.backend_core`, :mod:`~storage_backends.exists_search`,
  :mod:`~storage_backends.batch_io`, :mod:`~storage_backends.batch_delete`), with statistics and failure warnings
  (:mod:`~storage_backends.reporting`), capacity and eviction (:mod:`~storage_backends.capacity`),
  the first-use setup (:mod:`~storage_backends.first_use`) and the worker pool
  (:mod:`~storage_backends.workers`).
"""

from storage_backends.base import BackendStatistics, ObjectBackend

__all__ = ["BackendStatistics", "ObjectBackend"]
