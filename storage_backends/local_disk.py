"""``file:///path`` — one file per object on a local (or mounted) filesystem.

Layout under the root directory::

    /path/{namespace-digest}/{pool}/{key[:2]}/{key}          objects (256 shard directories per pool)
    /path/{namespace-digest}/{pool}/{key[:2]}/{key}.*.tmp    a write in progress

I/O runs on a bounded pool of threads (``max_concurrency``; a batch is spread over at most that
many jobs, each taking the next unit of work as it finishes one; reads and probes go before
writes and deletes, and a write job gives its thread up between objects while a read waits, see
``storage_backends.workers``) with ``preadv``/``pwritev``
straight between the file and the host slot — no intermediate buffer, for page_first and
layer_first pools alike (a layer_first slot is a list of per-layer iovecs). The payload checksum
is computed in the same thread, piece by piece (``read_piece_bytes``), while the piece is hot in
cache. With the option ``direct_io`` reads bypass the page cache (``O_DIRECT``; probed on first
use): objects have 4 KiB headers, so a payload starts on a block boundary, and a range whose slot
views are 4 KiB-aligned is read by DMA straight into the slot (see ``storage_backends.file_io``);
other ranges read through the page cache, and so does a range the page cache holds whole
(``storage_backends.page_residency``). ``direct_io=None`` reads directly where the filesystem
allows and through the page cache where it does not. Direct reads are off by default here: on a
VM disk they read small objects at a third of the speed. ``HybridCache`` turns them on
(``None``) where it chooses the reader processes, on CUDA: on an H200 machine's local disk they
restored a 32k-token prefix the page cache had dropped 9 % faster whole and 3 % faster split
(docs/benchmarks.md, Long-prefix TTFT, run BD). They also keep restores out of the page cache.

With the option ``compression="zstd"`` objects are stored as frames of ``READ_RANGE_BYTES``
whose sign-and-exponent bytes are compressed (``storage_backends.compression``): the reference
model's objects take 0.70–0.72 of their bytes. A frame is read into a buffer of the job's thread
and decoded into the slot (``storage_backends.framed_io``). On an H200 machine's local disk this
restored prefixes no faster — the jobs' decoding, which takes the interpreter lock at every
step, cost what the smaller reads saved (docs/benchmarks.md, Long-prefix TTFT) — so it is off
by default: an option for capacity, or for disks slower than the cores decode.

With the option ``read_processes=N`` reads run in N child processes instead, straight into host
pools that live in shared memory (``storage_backends.reader_processes``): a child has an
interpreter of its own, so a forward pass beside the read does not hold up its Python steps.
They read directly too where ``direct_io`` says so. Pools not in shared memory, writes and
deletes stay on the threads. ``HybridCache`` sets this option itself on a CUDA device, and
``direct_io=None`` with it (``asynccache.cache.effective_storage_options``).

A read reports when its bytes were in (:func:`asynccache.read_landing.note_landed`), stamped on
the job's thread or in the child, so a caller whose event loop a forward pass held meanwhile
times the read, not the wait for the loop.

A payload larger than ``READ_RANGE_BYTES`` (a Mamba state of tens of MB) is read as ranges on
several jobs at once, first in the batch, and its checksum is the sum of the ranges' (the
checksum is linear): one thread reading it alone at the end of a batch would leave the disk's
other queues idle.

Writes are atomic and put-if-absent: the object is written to a temporary name, optionally
fsynced, then hard-linked to its final name (``link`` fails if the name exists, so exactly one
of several concurrent writers of a key wins) and the temporary name is removed (one that cannot
be is logged: the object is stored all the same). A crash leaves at most a stale ``.tmp`` file
(removed after ``STALE_TMP_S``, at first use: by the capacity's scan, or without a capacity by
a sweep beside the calls); the checksum catches anything a power
loss could leave behind an un-fsynced link.

With ``capacity_bytes`` the backend scans its namespace directory on first use (least recently
written first) and evicts least-recently-used objects to make room; the accounting covers the
objects of this namespace written through this process (and those found by the scan). The scan
of a large namespace may take longer than ``timeout_s``: it fails only when it finds nothing new
for that long (one shard directory), and calls are misses until it is done
(``storage_backends.first_use``).

Primitives:

- :class:`LocalDiskBackend` — the backend: its options, the event loop's side of its
  primitives, and reads sent to the worker jobs or to the reader processes. What the jobs run
  (the job runner, the file work: setup, range reads, writes, the scan) is its base,
  :class:`~storage_backends.disk_jobs.DiskJobsMixin`.
- :func:`open_local_disk` — the ``file://`` entry of the registry; :func:`parse_file_uri` — the
  root path a ``file://`` URI names.
- :data:`READ_RANGE_BYTES` — the range size large payloads are read in; :data:`STALE_TMP_S` —
  re-exported from :mod:`storage_backends.disk_jobs`, where it is defined.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from asynccache.errors import BackendError, ConfigError
from asynccache.read_landing import note_landed
from asynccache.storage import PoolName, redact_reason, redact_uri
from storage_backends.base import BatchItem, Outcome, check_int, usable_cores
from storage_backends.compression import check_compression
from storage_backends.disk_jobs import STALE_TMP_S, DiskJobsMixin
from storage_backends.file_io import DIRECT_ALIGN, stat_sizes, unlink_all
from storage_backends.object_format import (
    IO_CHUNK_BYTES,
    ObjectCodec,
    payload_range,
    validate_pool_name,
)
from storage_backends.object_reads import ReadUnit
from storage_backends.ranged_reads import item_outcomes, read_units
from storage_backends.reader_processes import ReaderLost, ReaderProcesses
from storage_backends.workers import WorkerPool

if TYPE_CHECKING:
    from asynccache.pools.base import ItemPool

logger = logging.getLogger("asynccache.storage")

__all__ = ["READ_RANGE_BYTES", "STALE_TMP_S", "LocalDiskBackend", "open_local_disk"]

#: Payloads larger than this are read as ranges of this size, several at once (a multiple of
#: the checksum block).
READ_RANGE_BYTES = 4 << 20


def parse_file_uri(uri: str) -> str:
    """``file:///absolute/path`` (or ``file://localhost/…``) → the normalized root path."""
    try:
        parts = urlsplit(uri)
    except ValueError as e:
        raise ConfigError(f"malformed file URI {redact_uri(uri)}: {redact_reason(e)}") from None
    if parts.scheme != "file":
        raise ConfigError(f"not a file URI: {redact_uri(uri)}")
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(f"file URI must be file:///absolute/path (no host), got {redact_uri(uri)}")
    if parts.query or parts.fragment:
        raise ConfigError(
            f"file URI takes no query or fragment (pass options as keyword arguments): {redact_uri(uri)}"
        )
    path = unquote(parts.path)
    if not path.startswith("/") or "\0" in path:
        raise ConfigError(f"file URI must name an absolute path, got {redact_uri(uri)}")
    return os.path.normpath(path)


def _check_root(root: str) -> None:
    """Refuse a root that exists and is not a directory (a usage error, not a run whose every
    call misses). A file above the root is an obstacle that may go away: the setup at first use
    fails, and the next call tries again."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"file:// root {root} is not a directory")


class LocalDiskBackend(DiskJobsMixin):
    """Objects as files under ``root`` (see the module docstring). ``fsync`` (default on)
    makes a stored object durable before it becomes visible; other options: those of
    :class:`~storage_backends.base.ObjectBackend`."""

    probe_window = 256
    #: One I/O job per core, up to 8: reads served from the page cache are memory-bound, and
    #: more jobs than cores only contend (measured on 2 cores: 2 jobs read at 0.93 of the raw
    #: path, 8 jobs at 0.59); 8 in flight is where cold disk reads stop gaining.
    default_max_concurrency = max(1, min(8, usable_cores()))
    #: Default ``read_piece_bytes`` on machines with more than ``SMALL_PIECE_MAX_CORES`` usable
    #: cores. A read job takes the GIL back after every piece: with 8 jobs reading 256 KiB
    #: pieces beside a launch-bound forward pass, both slowed down (a 32k-token restore on an
    #: H200 machine, 16 cores: 397–409 ms with 256 KiB pieces, 338–355 ms with 4 MiB;
    #: docs/benchmarks.md, Long-prefix TTFT). On few cores page-cache reads are memory-bound and
    #: a piece checksummed while it is still in L2 wins (see the module docstring).
    LARGE_READ_PIECE_BYTES = 4 << 20
    SMALL_PIECE_MAX_CORES = 4
    #: Objects' payloads start on a 4 KiB boundary, for direct reads.
    header_align = DIRECT_ALIGN

    def __init__(
        self,
        uri: str,
        *,
        fsync: bool = True,
        read_piece_bytes: int | None = None,
        direct_io: bool | None = False,
        compression: str = "none",
        read_processes: int = 0,
        **options: Any,
    ) -> None:
        self.root = parse_file_uri(uri)
        _check_root(self.root)
        self._compression = check_compression(compression)
        super().__init__(uri, **options)
        if compression != "none":
            if direct_io:
                raise ConfigError("direct_io=True cannot be combined with compression: direct reads land in the "
                                  "slot as stored, compressed frames are decoded into it")
            direct_io = False
        if read_piece_bytes is None:
            small = usable_cores() <= self.SMALL_PIECE_MAX_CORES
            read_piece_bytes = IO_CHUNK_BYTES if small else self.LARGE_READ_PIECE_BYTES
        if (
            not isinstance(read_piece_bytes, int)
            or isinstance(read_piece_bytes, bool)
            or read_piece_bytes <= 0
            or read_piece_bytes % DIRECT_ALIGN
        ):
            raise ConfigError(f"read_piece_bytes must be a positive multiple of {DIRECT_ALIGN}, got {read_piece_bytes!r}")
        if direct_io is not None and not isinstance(direct_io, bool):
            raise ConfigError(f"direct_io must be None (when the filesystem allows), True or False, got {direct_io!r}")
        self.read_piece_bytes = read_piece_bytes
        if not isinstance(fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {fsync!r}")
        self.fsync = fsync
        #: ``None`` until first use, then whether reads bypass the page cache (``O_DIRECT``)
        self.direct_io: bool | None = None
        self._direct_io_option = direct_io
        self.namespace_dir = os.path.join(self.root, self.codec.digest_hex)
        self._workers = WorkerPool(self.max_concurrency, name="asynccache-disk")
        #: sizes of compressed objects that this backend's writes stored or found, until their
        #: batch counts them (only with a capacity; ``dict`` item assignment and ``pop`` are
        #: atomic under the GIL)
        self._written_sizes: dict[str, int] = {}
        self._dirs: set[str] = set()
        read_processes = check_int("read_processes", read_processes, minimum=0)
        if read_processes and compression != "none":
            raise ConfigError("read_processes reads plain objects: it cannot be combined with compression")
        #: child processes that read into shared-memory pools (``read_processes``; see
        #: ``storage_backends.reader_processes``), or ``None``: the worker threads read
        self._readers = (
            ReaderProcesses(
                read_processes,
                namespace=self.namespace,
                header_align=self.header_align,
                piece_bytes=self.read_piece_bytes,
                timeout_s=self.timeout_s,
            )
            if read_processes
            else None
        )
        self._readers_start: asyncio.Task[None] | None = None
        self._sweep: asyncio.Task[Any] | None = None  # stale temporary files, without a capacity
        if self._readers is not None:  # dropped unclosed: its children are killed, not left running
            weakref.finalize(self, self._readers.kill_children)

    def _make_codec(self, namespace: str) -> ObjectCodec:
        return ObjectCodec(
            namespace, header_align=self.header_align, compression=self._compression, frame_bytes=READ_RANGE_BYTES
        )

    def object_name(self, pool_name: PoolName | str, key: str) -> str:
        """The object's file path."""
        return os.path.join(self.root, *self.codec.relpath(validate_pool_name(pool_name), key).split("/"))

    # ---- primitives (event loop) ---------------------------------------------------------
    async def _prepare(self) -> None:
        await self._workers.run(self._make_root)
        if self._capacity is None:
            # The capacity's listing removes crashed writers' temporary files; without one, a
            # sweep does, beside the calls (detached, like the listing: it touches only those).
            sweep = self._workers.run(functools.partial(self._scan, list_objects=False), background=True, detach=True)
            self._sweep = asyncio.get_running_loop().create_task(sweep, name="asynccache-disk-tmp-sweep")
            self._sweep.add_done_callback(_report_sweep)

    async def register_host_pool_v2(self, pool_name: PoolName, host_pool: ItemPool) -> None:
        """Register the pool; with reader processes and a pool in shared memory, also start the
        children (a few hundred milliseconds) and have them map it, so that the first reads
        neither wait for that nor run beside it. A child that cannot start is logged; reads
        start it again."""
        await super().register_host_pool_v2(pool_name, host_pool)
        memory = getattr(host_pool, "shared_memory", None)
        if self._readers is None or memory is None or self._closed:
            return
        if self._readers_start is not None:  # a start for another pool still running
            await asyncio.wait([self._readers_start])
        self._readers.memory_id(memory)  # mapped by every child that start() readies
        self._readers_start = asyncio.get_running_loop().create_task(
            self._readers.start(), name="asynccache-disk-readers"
        )
        self._readers_start.add_done_callback(_report_start)
        await asyncio.wait([self._readers_start])

    async def _close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()  # its thread stops at the workers' close
        if self._readers is not None:
            # Not waiting for a start in progress first: the readers' close stops it (a child
            # that never answers is killed after their grace), where the start would take its
            # own, longer timeout.
            await self._readers.aclose()
            if self._readers_start is not None:
                await asyncio.wait([self._readers_start])
        await self._workers.aclose()

    async def _object_sizes(self, names: Sequence[str]) -> list[int | None]:
        return await self._workers.run(stat_sizes, list(names))

    async def _read_object(self, item: BatchItem) -> bool:
        return _settled((await self._read_many([item]))[0])

    async def _write_object(self, item: BatchItem) -> bool:
        return _settled((await self._write_many([item]))[0])

    async def _read_many(self, items: Sequence[BatchItem]) -> list[Outcome]:
        units = read_units(items, READ_RANGE_BYTES)

        def read_range(stop: threading.Event, deadline: float, unit: tuple[int, int, int]) -> Any:
            return self._read_range(stop, deadline, items[unit[0]], unit[1], unit[2])

        if not self._processes_read(items):
            return item_outcomes(len(items), units, await self._in_jobs(read_range, units, landed=note_landed))
        assert self._readers is not None
        try:
            results: list[Any] = await self._readers.read(
                [self._read_unit(items[i], off, n) for i, off, n in units],
                stopping=lambda: self._closed,
                landed=note_landed,
            )
        except BackendError as e:  # closed meanwhile: every unit failed (misses)
            results = [e] * len(units)
        lost = [k for k, r in enumerate(results) if isinstance(r, ReaderLost)]
        if lost and not self._closed:  # a child died or never started: the threads read those
            rest = await self._in_jobs(read_range, [units[k] for k in lost], landed=note_landed)
            for k, r in zip(lost, rest, strict=True):
                results[k] = r
        return item_outcomes(len(items), units, results)

    def _processes_read(self, items: Sequence[BatchItem]) -> bool:
        """Whether the reader processes read ``items``: there are some, every item's pool is in
        shared memory, and a child is up (else the threads read; none waits for a start)."""
        if self._readers is None or not all(item.pool.shared_memory is not None for item in items):
            return False
        try:
            return self._readers.available()
        except BackendError:  # closed meanwhile
            return False

    def _read_unit(self, item: BatchItem, offset: int, length: int) -> ReadUnit:
        assert self._readers is not None and item.pool.shared_memory is not None
        mem_id = self._readers.memory_id(item.pool.shared_memory)
        views = payload_range(item.buffers(), offset, offset + length)
        pieces = self._readers.pieces(mem_id, views)
        return ReadUnit(item.name, item.geometry, item.key, offset, pieces, direct=bool(self.direct_io))

    async def _write_many(self, items: Sequence[BatchItem]) -> list[Outcome]:
        return await self._in_jobs(self._write_file, items, background=True)

    async def _delete_objects(self, names: Sequence[str], *, background: bool) -> None:
        await self._workers.run(unlink_all, list(names), background=background)

    async def _list_objects(self, progress: Callable[[int], None]) -> list[tuple[str, int]]:
        # detached: a scan stuck in a system call (a hung mount) holds neither the setup's
        # cancellation nor aclose; it touches nothing but its own list (and stale temp files)
        return await self._workers.run(self._scan, progress, detach=True)


def _report_sweep(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("removing stale temporary files failed: %s", task.exception())


def _report_start(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("starting the reader processes failed (reads start them again): %s", task.exception())


def _settled(outcome: Outcome) -> bool:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def open_local_disk(uri: str, **options: Any) -> LocalDiskBackend:
    """Open ``file:///path``; options: ``namespace`` (required), ``capacity_bytes``,
    ``max_concurrency`` (one per core, at most 8), ``timeout_s`` (30), ``fsync`` (True),
    ``read_piece_bytes`` (bytes read and checksummed per step, a multiple of 4 KiB: 256 KiB on
    up to 4 usable cores, 4 MiB on more), ``direct_io`` (``False``, the default: read through
    the page cache; ``True``: read with ``O_DIRECT``, an error where the filesystem refuses it;
    ``None``: ``O_DIRECT`` where the filesystem allows it), ``compression`` (``"none"``, the
    default, or ``"zstd"``: objects stored as compressed frames, see
    ``storage_backends.compression``; read through the page cache), ``read_processes`` (0, the
    backend's default: worker threads read; ``N``: N child processes read plain objects —
    directly where ``direct_io`` says so — into
    host pools allocated in shared memory — ``HostKVPool(..., shared=True)``, which
    ``HybridCache`` does when this option is set, and which it sets to ``max_concurrency`` on a
    CUDA device unless told otherwise — see ``storage_backends.reader_processes``)."""
    return LocalDiskBackend(uri, **options)
