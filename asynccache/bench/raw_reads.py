"""Raw reads of the objects a local-disk store holds, for ``asynccache bench prefix``: what the
disk gives with no cache in the way, to set the physical optimum beside.

Primitives:

- :func:`raw_read_bytes_per_s` — plain reads of every stored object (or of some), whole files,
  on one or more threads, optionally with ``O_DIRECT``.
- :func:`ranged_read_bytes_per_s` — the same reads cut as the backend cuts them (states in
  ``READ_RANGE_BYTES`` ranges), threads taking the next range.
- :func:`drop_page_cache` / :func:`object_files` / :func:`stored_fraction` — forgetting the objects'
  cached pages, listing them, and their on-disk bytes over their payload bytes.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from asynccache.spec import HybridSpec
from storage_backends.file_io import aligned_empty, open_read
from storage_backends.local_disk import READ_RANGE_BYTES

__all__ = ["drop_page_cache", "object_files", "ranged_read_bytes_per_s", "raw_read_bytes_per_s", "stored_fraction"]


def drop_page_cache(root: Path) -> None:
    """Ask the kernel to forget the stored objects' pages (best effort; a no-op where unsupported)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_files(files: list[Path], direct: bool = False) -> int:
    buf = memoryview(aligned_empty(8 << 20))
    total = 0
    for path in files:
        fd = open_read(str(path), direct)
        try:
            offset = 0
            while True:  # a short read is the end (a direct read past it could be refused)
                n = os.preadv(fd, [buf], offset)
                offset += n
                if n < len(buf):
                    break
        finally:
            os.close(fd)
        total += offset
    return total


def object_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".tmp")}


def raw_read_bytes_per_s(
    root: Path, threads: int = 1, *, direct: bool = False, only: set[Path] | None = None
) -> tuple[float, int]:
    """Plain reads of every stored object (``only``: of those files), after dropping them from
    the page cache, one file after another on each of ``threads`` threads, into one buffer per
    thread; ``direct``: with ``O_DIRECT`` (past the page cache)."""
    drop_page_cache(root)
    files = sorted(object_files(root) if only is None else only)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda part: _read_files(part, direct), [files[i::threads] for i in range(threads)]))
    return total / (time.perf_counter() - t0), total


def ranged_read_bytes_per_s(root: Path, files: set[Path], threads: int) -> tuple[float, int]:
    """Plain reads of ``files`` cut as the backend cuts them, after dropping them from the page
    cache: a file above ``READ_RANGE_BYTES`` (a state) as ranges of that size, the largest
    files' ranges first, each of ``threads`` threads taking the next range when it is done. One
    whole-file list per thread (:func:`raw_read_bytes_per_s`) leaves the thread that got a
    51.5 MB state reading it alone at the end."""
    drop_page_cache(root)
    sizes = sorted(((p.stat().st_size, str(p)) for p in files), reverse=True)
    work = iter([(path, off, min(READ_RANGE_BYTES, size - off)) for size, path in sizes
                 for off in range(0, size, READ_RANGE_BYTES)])  # fmt: skip
    lock = threading.Lock()

    def reader() -> int:
        buf = memoryview(aligned_empty(READ_RANGE_BYTES))
        total = 0
        while True:
            with lock:
                item = next(work, None)
            if item is None:
                return total
            path, offset, n = item
            fd = os.open(path, os.O_RDONLY)
            try:
                total += os.preadv(fd, [buf[:n]], offset)
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda _: reader(), range(threads)))
    return total / (time.perf_counter() - t0), total


def stored_fraction(root: Path, spec: HybridSpec) -> float:
    """Bytes the stored objects take on disk (headers included) over the payload bytes they
    hold: 1 and a little for plain objects, less for compressed ones."""
    stored = payload = 0
    for path in object_files(root):
        stored += path.stat().st_size
        payload += spec.state_bytes if path.parent.parent.name == "mamba" else spec.kv_page_bytes
    return stored / payload if payload else 1.0
