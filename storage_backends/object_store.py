"""``s3://bucket/prefix?endpoint_url=…&region=…`` — objects in an S3-compatible bucket (obstore).

Object names are ``{prefix}/{namespace-digest}/{pool}/{key[:2]}/{key}``. Credentials come from
the environment only (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
or the instance's credential provider, as obstore resolves them); a URI that carries credentials
is refused, and neither the URI, the store nor any message of this module ever shows them. The
bucket must be a name S3 accepts (3–63 lowercase letters, digits, dots and hyphens, starting and
ending with a letter or digit, no ``..``, not an IP address): another is a ``ConfigError``.

The endpoint is the URI's ``endpoint_url``, else ``AWS_ENDPOINT_URL`` (else ``AWS_ENDPOINT``)
from the environment, else AWS. Plain HTTP is used exactly when that endpoint's scheme is
``http`` (in any case); an ``http`` endpoint from the environment while ``AWS_ALLOW_HTTP`` is
false is refused with a ``ConfigError`` at open. With no endpoint, ``AWS_ALLOW_HTTP`` is left to
obstore.

A failed request is a ``BackendError`` whose message leads with the HTTP status and the S3 error
code (``403 Forbidden SignatureDoesNotMatch``), then the request (method and URL, without its
query) and the server's message; obstore's error, in full, is its ``__cause__``. The requests
(HEAD, GET, ranged GET, DELETE, LIST) are those of the backend's base,
:class:`~storage_backends.s3_requests.S3RequestsMixin`; the conditional and multipart PUTs of a
write are made here.

- Reads: one GET per object; the length and header are verified, then the payload is copied
  into the host slot and checksummed there, piece by piece. Objects larger than
  ``multipart_threshold_bytes`` (Mamba states) are read as ranged GETs of
  ``multipart_part_bytes``, ``multipart_concurrency`` at a time, each range copied and
  checksummed as it arrives; the first carries the header and the object's size, the others are
  asked of the same version (``If-Match``).
- Writes: the payload checksum is computed over the slot, then the header and the slot's own
  bytes (no copy) are sent as one conditional PUT (``If-None-Match: *``: put-if-absent). On
  ``412``/``409`` the object there is checked with HEAD: one of a size a valid object of the
  key has counts as present (a skipped write); one of any other size (truncated, padded,
  foreign) is replaced by an unconditional PUT, so a reported success means an object of a
  valid size is stored. The size is all a write checks: an object of the right size with a
  damaged payload counts as present until a read finds the damage and removes it (the next
  write then stores it again). A write cut short by a timeout may still be sending for a moment
  after the call has returned; if the slot changes meanwhile, the object fails its payload check
  and is read as a miss. Objects larger than ``multipart_threshold_bytes`` are checked with HEAD
  the same way (a valid size: skipped) and otherwise uploaded in parts of
  ``multipart_part_bytes`` (``multipart_concurrency`` at a time), replacing any invalid object;
  S3 completes a multipart upload atomically, so a reader sees the old object, the new one or
  none — two racing writers of one key both store a valid object and the last completion wins.
  Uploads cut short by a timeout can leave incomplete multipart uploads behind: give the bucket a
  lifecycle rule that aborts them.
- The copy and checksum of an object up to ``inline_bytes`` run in the task that moves it, on
  the event loop, handing the loop back after every piece of ``IO_CHUNK_BYTES`` (~50 µs);
  larger objects go to a worker thread. By default the KV pages stay on the loop on a machine
  with at most 4 usable cores (a thread handoff costs more there than the copy) and every
  object goes to the workers on larger machines (where one loop thread would be the limit).
- Every request has a timeout (``timeout_s``) and is retried by obstore with exponential backoff
  and jitter (``max_retries``, bounded by ``timeout_s`` in total); the whole item is bounded by
  ``timeout_s`` as well.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Generator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from asynccache.errors import BackendError, ConfigError, ObjectFormatError
from asynccache.storage import PoolName
from storage_backends.base import BatchItem, check_int, usable_cores
from storage_backends.object_format import (
    CHECKSUM_BLOCK_BYTES,
    add_checksums,
    validate_pool_name,
)
from storage_backends.s3_errors import backend_error
from storage_backends.s3_location import S3Location, parse_s3_uri, store_endpoint
from storage_backends.s3_requests import S3RequestsMixin
from storage_backends.workers import WorkerPool

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = ["ObjectStoreBackend", "S3Location", "open_object_store", "parse_s3_uri"]

T = TypeVar("T")
#: Copy-and-checksum piece of a worker thread: one numpy call per piece runs without the GIL,
#: so a large piece leaves the GIL to the event loop for longer (pieces of ``IO_CHUNK_BYTES``
#: took it back 6 times per 1.5 MiB page).
WORKER_PIECE_BYTES = 4 << 20


class ObjectStoreBackend(S3RequestsMixin):
    """Objects in an S3-compatible bucket (see the module docstring)."""

    probe_window = 32
    default_max_concurrency = 16
    #: Default of ``inline_bytes`` on a machine with at most ``INLINE_MAX_CORES`` usable cores.
    #: Objects up to ``inline_bytes`` (KV pages) are verified and copied (read) or checksummed
    #: (write) in the task that moves them, one piece per event-loop step; larger ones (Mamba
    #: states) on a worker thread. On few cores two thread handoffs per page cost more than its
    #: copy: on 2 cores against SeaweedFS, reads ran at 0.84 of the raw path with every object
    #: on the 16 worker threads, at 0.94 with the pages on the loop. With cores to spare the one
    #: loop thread is the bottleneck instead: on 16 cores the pages on the loop read at 0.79 of
    #: the raw path (docs/benchmarks.md, Storage), so there every object goes to the workers.
    INLINE_BYTES_FEW_CORES = 4 << 20
    INLINE_MAX_CORES = 4

    def __init__(
        self,
        uri: str,
        *,
        max_retries: int = 3,
        multipart_threshold_bytes: int = 32 << 20,
        multipart_part_bytes: int = 8 << 20,
        multipart_concurrency: int = 4,
        inline_bytes: int | None = None,
        **options: Any,
    ) -> None:
        location = parse_s3_uri(uri)
        multipart_part_bytes = check_int("multipart_part_bytes", multipart_part_bytes, minimum=5 << 20)
        multipart_threshold_bytes = check_int(
            "multipart_threshold_bytes", multipart_threshold_bytes, minimum=multipart_part_bytes
        )
        max_retries = check_int("max_retries", max_retries, minimum=0)
        multipart_concurrency = check_int("multipart_concurrency", multipart_concurrency, minimum=1)
        if inline_bytes is None:
            inline_bytes = self.INLINE_BYTES_FEW_CORES if usable_cores() <= self.INLINE_MAX_CORES else 0
        if not isinstance(inline_bytes, int) or isinstance(inline_bytes, bool) or inline_bytes < 0:
            raise ConfigError(f"inline_bytes must be an int >= 0, got {inline_bytes!r}")
        self.inline_bytes = inline_bytes
        super().__init__(uri, **options)
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError as e:
            raise ConfigError("s3:// storage needs obstore (pip install 'asynccache[s3]')") from e
        self._obstore = obstore
        self._errors: tuple[type[BaseException], ...] = (obstore.exceptions.BaseError, ValueError)
        self.location = location
        self.multipart_threshold_bytes = multipart_threshold_bytes
        self.multipart_part_bytes = multipart_part_bytes
        self.multipart_concurrency = multipart_concurrency
        endpoint, allow_http = store_endpoint(location, os.environ)
        config: dict[str, Any] = {}
        if endpoint is not None:
            config["endpoint"] = endpoint
        if location.region is not None:
            config["region"] = location.region
        timeout = timedelta(seconds=self.timeout_s)
        client_options: dict[str, Any] = {"timeout": timeout, "connect_timeout": min(timeout, timedelta(seconds=5))}
        if allow_http is not None:
            client_options["allow_http"] = allow_http
        self._store: S3Store = S3Store(
            location.bucket,
            prefix=location.prefix or None,
            client_options=client_options,
            retry_config={
                "max_retries": max_retries,
                "retry_timeout": timeout,
                "backoff": {
                    "init_backoff": timedelta(milliseconds=50),
                    "max_backoff": timedelta(seconds=2),
                    "base": 2,
                },
            },
            **config,
        )
        self._workers = WorkerPool(self.max_concurrency, name="asynccache-s3")

    @property
    def store(self) -> S3Store:
        """The obstore store (bucket and prefix applied), for tools that need the raw path."""
        return self._store

    def object_name(self, pool_name: PoolName | str, key: str) -> str:
        """The object's name relative to ``bucket/prefix``."""
        return self.codec.relpath(validate_pool_name(pool_name), key)

    async def _close(self) -> None:
        await self._workers.aclose()

    # ---- item reads and writes (the other requests: S3RequestsMixin) -------------------------
    async def _read_object(self, item: BatchItem) -> bool:
        if self.codec.object_bytes(item.geometry, item.key) > self.multipart_threshold_bytes:
            return await self._read_ranges(item)
        data = await self._get(item.name)
        if data is None:
            return False
        if len(data) <= self.inline_bytes:
            await _on_loop(self.codec.decode_steps(data, item.geometry, item.key, item.buffers()))
        else:
            await self._workers.run(self._decode, data, item)
        return True

    async def _read_ranges(self, item: BatchItem) -> bool:
        """A large object (a Mamba state) as ranged GETs of ``multipart_part_bytes``,
        ``multipart_concurrency`` at a time, each copied into its place in the slot and
        checksummed on a worker as it arrives (the payload checksum is a sum over blocks, so
        ranges check independently). The first range carries the header and the object's size;
        the others are asked of that same version (``If-Match`` its ETag)."""
        geometry, key, name = item.geometry, item.key, item.name
        hlen = self.codec.header_bytes(geometry, key)
        total = geometry.payload_bytes
        step = max(CHECKSUM_BLOCK_BYTES, self.multipart_part_bytes // CHECKSUM_BLOCK_BYTES * CHECKSUM_BLOCK_BYTES)
        first = await self._get_range(name, 0, hlen + min(step, total), None)
        if first is None:
            return False
        data, meta = first
        if int(meta["size"]) != hlen + total:
            raise ObjectFormatError(f"object of {meta['size']} bytes, expected {hlen + total} (truncated or foreign)")
        _check_body(data, hlen + min(step, total))
        want = self.codec.verify_header(memoryview(data)[:hlen], geometry, key)
        etag = meta.get("e_tag")
        buffers = item.buffers()
        limit = asyncio.Semaphore(self.multipart_concurrency)

        async def one(offset: int) -> int:
            async with limit:
                got = await self._get_range(name, hlen + offset, hlen + min(offset + step, total), etag)
            if got is None:
                raise BackendError("object removed while it was being read")
            _check_body(got[0], min(offset + step, total) - offset)
            return await self._workers.run(self._decode_range, got[0], offset, min(offset + step, total), buffers)

        try:
            async with asyncio.TaskGroup() as tg:
                rest = [tg.create_task(one(off)) for off in range(step, total, step)]
                head = await self._workers.run(self._decode_range, memoryview(data)[hlen:], 0, min(step, total), buffers)
        except BaseExceptionGroup as group:  # report one error as the item's outcome: corruption first
            errors = _leaves(group)
            raise next((e for e in errors if isinstance(e, ObjectFormatError)), errors[0]) from None
        checksum = add_checksums([head, *(t.result() for t in rest)])
        if checksum != want:
            raise ObjectFormatError("payload checksum mismatch")
        return True

    def _decode_range(self, stop: threading.Event, data: Any, offset: int, end: int, buffers: list[Any]) -> int:
        return self.codec.decode_range_into(data, offset, end, buffers, stop, piece_bytes=WORKER_PIECE_BYTES)

    def _decode(self, stop: threading.Event, data: Any, item: BatchItem) -> None:
        self.codec.decode_into(data, item.geometry, item.key, item.buffers(), stop, piece_bytes=WORKER_PIECE_BYTES)

    async def _encode_parts(self, item: BatchItem, size: int) -> list[Any]:
        if size <= self.inline_bytes:
            return await _on_loop(self.codec.encode_parts_steps(item.geometry, item.key, item.buffers()))
        return await self._workers.run(self._encode_parts_blocking, item, background=True)

    def _encode_parts_blocking(self, stop: threading.Event, item: BatchItem) -> list[Any]:
        return self.codec.encode_parts(item.geometry, item.key, item.buffers(), stop, piece_bytes=WORKER_PIECE_BYTES)

    async def _write_object(self, item: BatchItem) -> bool:
        obstore, name = self._obstore, item.name
        size = self.codec.object_bytes(item.geometry, item.key)
        large = size > self.multipart_threshold_bytes
        if large and await self._holds_valid_size(item):
            return False
        parts = await self._encode_parts(item, size)
        try:
            if large:  # a multipart upload replaces whatever is there (an invalid object)
                await obstore.put_async(
                    self._store,
                    name,
                    _cut_at_parts(parts, self.multipart_part_bytes),
                    use_multipart=True,
                    chunk_size=self.multipart_part_bytes,
                    max_concurrency=self.multipart_concurrency,
                )
                return True
            try:
                await obstore.put_async(self._store, name, parts, mode="create", use_multipart=False)
                return True
            except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
                # Something holds the name. Only an object of a valid size counts as present: the
                # caller takes success as "stored" (the tier above may drop its host copy on it).
                if await self._holds_valid_size(item):
                    return False
            # An invalid object (or one deleted meanwhile): replace it. The PUT is atomic, and a
            # racing writer of the same key stores the same valid object.
            await obstore.put_async(self._store, name, parts, use_multipart=False)
        except self._errors as e:
            raise backend_error(e) from e
        return True

    async def _holds_valid_size(self, item: BatchItem) -> bool:
        """Whether an object of a size valid for ``item`` is stored under its name (one HEAD).
        The payload is not read: a damaged object of the right size passes, and is caught (and
        removed) by the next read."""
        size = await self._head_size(item.name)
        return size is not None and self.codec.valid_size(item.geometry, item.key, size)

async def _on_loop(steps: Generator[None, None, T]) -> T:
    """Run a stepwise codec operation (see :func:`~storage_backends.payload_pieces.run_steps`)
    in the calling task, handing the event loop back between steps. Cancelling the task stops
    it at once: nothing touches the slot after the task has left this function."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


def _check_body(data: Any, expected: int) -> None:
    """A ranged GET's body of another length than the range asked for is a failed read (the
    object may be whole; a short body would leave the rest of the slot's range as it was)."""
    if len(data) != expected:
        raise BackendError(f"a ranged read returned {len(data)} bytes, {expected} asked for")


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _cut_at_parts(parts: Sequence[Any], part_bytes: int) -> list[memoryview]:
    """``parts`` cut again (views, no copy) so that every multiple of ``part_bytes`` of their
    concatenation falls between two pieces. obstore waits for a free upload slot before taking
    each piece of a list, so a piece that completes a part starts exactly one part upload and
    at most ``multipart_concurrency`` parts are in flight (a larger piece would start all the
    parts it spans at once)."""
    out: list[memoryview] = []
    filled = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            take = min(len(view), part_bytes - filled)
            out.append(view[:take])
            view = view[take:]
            filled = (filled + take) % part_bytes
    return out


def open_object_store(uri: str, **options: Any) -> ObjectStoreBackend:
    """Open ``s3://bucket/prefix?endpoint_url=…&region=…`` (without ``endpoint_url``: the
    endpoint in ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT``, else AWS); options: ``namespace`` (required),
    ``capacity_bytes``, ``max_concurrency`` (16), ``timeout_s`` (30), ``max_retries`` (3),
    ``multipart_threshold_bytes`` (32 MiB), ``multipart_part_bytes`` (8 MiB),
    ``multipart_concurrency`` (4), ``inline_bytes`` (objects up to this size are copied and
    checksummed on the event loop, larger ones on worker threads; default 4 MiB on a machine
    with at most 4 usable cores, else 0)."""
    return ObjectStoreBackend(uri, **options)
