"""What the local disk's worker jobs run (see ``storage_backends.local_disk``).

Primitives:

- :class:`DiskJobsMixin` — a batch's units on at most ``max_concurrency`` worker jobs, each
  taking the next unit as it finishes one (``_in_jobs``), and the blocking work of those jobs:
  the root's setup and the ``O_DIRECT`` probe (``_make_root``), a payload range read into its
  place in the slot (``_read_range``), an atomic put-if-absent write (``_write_file``), the sizes
  of compressed objects for the capacity (``_record_size``, ``_stored_size``), and the scan of
  the namespace's objects, which removes stale temporary files (``_scan``). The base of
  :class:`~storage_backends.local_disk.LocalDiskBackend`; not used on its own.
- :data:`STALE_TMP_S` — the age past which a temporary file is a crashed writer's leftover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from asynccache.errors import BackendError, ConfigError
from storage_backends.base import BatchItem, ObjectBackend
from storage_backends.file_io import (
    groups,
    probe_direct,
    pwritev_all,
    subdirs,
    unlink_all,
)
from storage_backends.framed_io import read_frame, write_frames
from storage_backends.object_format import (
    IO_CHUNK_BYTES,
    PayloadChecksum,
    StopRequested,
    check_stop,
    payload_range,
    validate_key,
)
from storage_backends.object_reads import read_object_range
from storage_backends.workers import YIELD, JobControl, WorkerPool

log = logging.getLogger("asynccache.storage")

__all__ = ["STALE_TMP_S", "DiskJobsMixin"]

#: A temporary file older than this is a leftover of a crashed writer.
STALE_TMP_S = 600.0
#: The first-use scan reports its progress after every this many files of a shard directory
#: (and after each directory): a scan fails only when it reports nothing for ``timeout_s``.
SCAN_REPORT_EVERY = 1024


class DiskJobsMixin(ObjectBackend):
    """The worker jobs of :class:`~storage_backends.local_disk.LocalDiskBackend` (see the module
    docstring); not used on its own."""

    # Set by LocalDiskBackend's constructor.
    root: str
    namespace_dir: str
    fsync: bool
    read_piece_bytes: int
    direct_io: bool | None
    _direct_io_option: bool | None
    _workers: WorkerPool
    _written_sizes: dict[str, int]
    _dirs: set[str]

    # ---- worker jobs (event loop) ---------------------------------------------------------
    async def _in_jobs(
        self,
        fn: Callable[[threading.Event, float, Any], Any],
        work: Sequence[Any],
        *,
        background: bool = False,
        landed: Callable[[float], None] | None = None,
    ) -> list[Any]:
        """Run ``fn(stop, deadline, unit)`` for every unit of ``work`` on at most
        ``max_concurrency`` worker jobs, each taking the next unit when it finishes one: one
        thread handoff per job instead of one per unit (a handoff costs as much as reading a
        page from the page cache on a busy 2-core machine). Each unit has its own deadline,
        ``timeout_s`` from its start, checked between pieces. A unit's result is what ``fn``
        returned or the :class:`BackendError` / :class:`OSError` it raised. ``background``
        jobs (writes) give their thread up between units while a read or a probe waits for one.
        Once the backend is closing, no unit starts (those fail). ``landed(t)`` gets the latest
        time (``time.perf_counter()``, stamped on the worker thread) at which a unit finished,
        once all have: when the bytes were in, however late the loop took the jobs' ends."""
        outcomes: list[Any] = [BackendError("not started: the call was cancelled or the backend closed")] * len(work)
        lock = threading.Lock()
        pending = iter(range(len(work)))
        finished: list[float] = []  # each unit's end, on its thread (list.append is atomic)

        def job(stop: JobControl) -> object:
            while not (stop.is_set() or self._closed):
                if background and stop.foreground_waiting():
                    return YIELD  # queued again behind other background work; resumes here
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                deadline = time.monotonic() + self.timeout_s
                try:
                    outcomes[i] = fn(stop, deadline, work[i])
                except StopRequested:
                    return
                except (BackendError, OSError) as e:
                    outcomes[i] = e
                finished.append(time.perf_counter())

        async def one_job() -> None:
            with contextlib.suppress(BackendError):  # closed meanwhile: its units stay failed
                await self._workers.run(job, background=background)

        if work:
            async with asyncio.TaskGroup() as tg:
                for _ in range(min(self.max_concurrency, len(work))):
                    tg.create_task(one_job())
        if landed is not None and finished:
            landed(max(finished))
        return outcomes

    # ---- blocking parts (worker threads) --------------------------------------------------
    def _make_root(self, stop: threading.Event) -> None:
        os.makedirs(self.namespace_dir, exist_ok=True)
        if self._direct_io_option is False:
            self.direct_io = False
            return
        refused = probe_direct(self.namespace_dir)
        if refused is not None and self._direct_io_option:
            raise ConfigError(f"direct_io=True, but {refused} under {self.root}")
        self.direct_io = refused is None

    def _read_range(
        self, stop: threading.Event, deadline: float, item: BatchItem, offset: int, length: int
    ) -> tuple[int | None, int, tuple[int, int]] | bool:
        """Payload bytes ``[offset, offset + length)`` of ``item`` into their place in its slot.
        ``False`` when the object is absent; else ``(want, partial, file)``: the checksum the
        header records (read and checked with the first range — in the same ``preadv`` as the
        first piece — ``None`` for the others), the range's partial checksum, and the file's
        ``(device, inode)``. Read directly (``O_DIRECT``) when the backend does and the slot's
        views allow it."""
        if self.codec.compression != "none":
            return read_frame(item.name, self.codec, item, offset, length, stop, deadline)
        views = payload_range(item.buffers(), offset, offset + length)
        return read_object_range(
            item.name, self.codec, item.geometry, item.key, offset, views,
            piece_bytes=self.read_piece_bytes, stop=stop, deadline=deadline, direct=bool(self.direct_io),
        )

    def _write_file(self, stop: threading.Event, deadline: float, item: BatchItem) -> bool:
        """Write ``item`` put-if-absent: into a temporary file, then linked to its name.
        ``True`` when stored, ``False`` when an object was there. Only an object of a size valid
        for the key counts as there (the caller takes success as "stored", and the tier above
        may drop its host copy on it): one of another size — an empty or short file a power
        loss left behind an un-fsynced link, a foreign one — is replaced. The temporary file is
        removed in any case; a failure to remove it is logged — not a failure of the write (a
        link done is an object stored); with a capacity, its scan removes it after
        ``STALE_TMP_S``."""
        path = item.name
        if self._holds_valid_size(item):
            self._record_size(path)
            return False  # put-if-absent; the link below settles races
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        fd = self._create(tmp)
        try:
            try:
                if self.codec.compression != "none":
                    size = write_frames(fd, self.codec, item, stop, deadline)
                else:
                    size = self._write_payload(fd, stop, deadline, item)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                if self._holds_valid_size(item):
                    self._record_size(path)
                    return False
                os.replace(tmp, path)  # an invalid object: replaced atomically
            self._record_size(path, size)
            return True
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # it replaced an invalid object
            except OSError as e:
                log.warning("could not remove the temporary file %s: %s", tmp, e)

    def _holds_valid_size(self, item: BatchItem) -> bool:
        """Whether an object of a size valid for ``item`` is stored under its name. The payload
        is not read: a damaged object of the right size passes, and is caught (and removed) by
        the next read."""
        try:
            size = os.stat(item.name).st_size
        except FileNotFoundError:
            return False
        return self.codec.valid_size(item.geometry, item.key, size)

    def _stored_size(self, name: str, largest: int) -> int:
        return self._written_sizes.pop(name, largest)

    def _record_size(self, path: str, size: int | None = None) -> None:
        """Note the size of the object at ``path`` for the capacity (``None``: one found there,
        as stored by another writer). Only compressed objects vary in size, and only a capacity
        counts it."""
        if self.codec.compression == "none" or self._capacity is None:
            return
        if size is None:
            try:
                size = os.stat(path).st_size
            except OSError:
                return  # removed meanwhile: the largest size stays reserved
        self._written_sizes[path] = size

    def _write_payload(self, fd: int, stop: threading.Event, deadline: float, item: BatchItem) -> int:
        geometry, key = item.geometry, item.key
        check, offset = PayloadChecksum(), self.codec.header_bytes(geometry, key)
        for group in groups(item.buffers(), IO_CHUNK_BYTES):
            check_stop(stop, deadline)
            for view in group:
                check.update(view)
            pwritev_all(fd, group, offset)
            offset += sum(len(v) for v in group)
        pwritev_all(fd, [memoryview(self.codec.encode_header(geometry, key, check.digest()))], 0)
        return offset

    def _create(self, tmp: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        directory = os.path.dirname(tmp)
        if directory not in self._dirs:
            os.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)
        try:
            return os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # the shard directory was removed behind our back
            os.makedirs(directory, exist_ok=True)
            return os.open(tmp, flags, 0o644)

    def _scan(
        self, stop: threading.Event, progress: Callable[[int], None] | None = None, *, list_objects: bool = True
    ) -> list[tuple[str, int]]:
        """Objects of this namespace, oldest first; removes stale temporary files. Reports the
        objects found so far to ``progress`` after each shard directory and every
        ``SCAN_REPORT_EVERY`` files. Without ``list_objects`` it only removes the stale
        temporary files (and returns nothing)."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for pool_dir in subdirs(self.namespace_dir):
            for shard_dir in subdirs(pool_dir):
                try:
                    entries = list(os.scandir(shard_dir))
                except FileNotFoundError:  # removed meanwhile (another process)
                    continue
                for n, entry in enumerate(entries, 1):
                    check_stop(stop)
                    if progress is not None and n % SCAN_REPORT_EVERY == 0:
                        progress(len(found))
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # removed meanwhile (another process)
                        continue
                    if entry.name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TMP_S:
                            unlink_all(stop, [entry.path])
                        continue
                    if not list_objects:
                        continue
                    try:
                        validate_key(entry.name)
                    except ConfigError:
                        continue  # not ours
                    found.append((st.st_mtime, entry.path, st.st_size))
                if progress is not None:
                    progress(len(found))
        found.sort()
        return [(path, size) for _, path, size in found]
