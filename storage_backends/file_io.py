"""File I/O for the local disk backend: iovec groups, ``preadv`` / ``pwritev`` loops, direct
(``O_DIRECT``) reads straight into host slots, and the metadata helpers of its jobs (sizes,
removal, directory listing), which stop between files when the job's caller has gone.

A direct read moves the bytes from the drive into the slot by DMA, past the page cache: no copy
by a core, no page-cache pages to fill and evict. Linux requires the file offset, the address and
the length of every iovec of a direct read to be multiples of the device's logical block size;
``DIRECT_ALIGN`` (4 KiB) is a multiple of every block size in use. The local disk writes its
objects with 4 KiB headers so that payloads start on such a boundary, host pools are allocated
4 KiB-aligned, and every shipped spec's items are multiples of 4 KiB (a page of any layer, a
state component). :func:`direct_views` says whether a range can be read directly — its views
aligned, except the end of the last one, which is read through a one-block bounce buffer
(:func:`read_tail`) — and a range that cannot is read through the page cache instead (same
bytes, same checks).
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import threading
from collections.abc import Sequence

import numpy as np

from asynccache.errors import ObjectFormatError
from storage_backends.object_format import check_stop

__all__ = [
    "DIRECT_ALIGN",
    "MAX_IOVECS",
    "aligned_empty",
    "direct_views",
    "groups",
    "open_read",
    "preadv_all",
    "probe_direct",
    "pwritev_all",
    "read_tail",
    "stat_sizes",
    "stop_direct",
    "subdirs",
    "unlink_all",
]

DIRECT_ALIGN = 4096
MAX_IOVECS = 512
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def groups(buffers: Sequence[np.ndarray], piece_bytes: int) -> list[list[memoryview]]:
    """iovec groups of at most ``piece_bytes`` and ``MAX_IOVECS`` views each, in order."""
    out: list[list[memoryview]] = []
    group: list[memoryview] = []
    size = 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        for start in range(0, len(view), piece_bytes):
            piece = view[start : start + piece_bytes]
            if group and (size + len(piece) > piece_bytes or len(group) == MAX_IOVECS):
                out.append(group)
                group, size = [], 0
            group.append(piece)
            size += len(piece)
    if group:
        out.append(group)
    return out


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    while views and n >= len(views[0]):
        n -= len(views[0])
        views = views[1:]
    if n:
        views = [views[0][n:], *views[1:]]
    return views


def preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` from ``offset``; a file that ends first is an :class:`ObjectFormatError`."""
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            raise ObjectFormatError("object ends early (truncated while reading)")
        offset += n
        views = _advance(views, n)


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        views = _advance(views, n)


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose address is a multiple of ``DIRECT_ALIGN``."""
    raw = np.empty(nbytes + DIRECT_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN
    return raw[start : start + nbytes]


def direct_views(views: Sequence[np.ndarray], file_offset: int) -> tuple[list[np.ndarray], np.ndarray | None] | None:
    """Views that receive file bytes from ``file_offset`` on, split for a direct read:
    ``(body, tail)`` — ``body`` all aligned in address and length, ``tail`` the last view's
    unaligned end (under ``DIRECT_ALIGN`` bytes, for :func:`read_tail`) or ``None`` — or
    ``None`` when the range cannot be read directly (an unaligned file offset, address, or
    length before the last view)."""
    if not _O_DIRECT or file_offset % DIRECT_ALIGN:
        return None
    body: list[np.ndarray] = []
    for i, view in enumerate(views):
        if view.ctypes.data % DIRECT_ALIGN:
            return None
        rest = view.nbytes % DIRECT_ALIGN
        if rest and i != len(views) - 1:
            return None
        if view.nbytes - rest:
            body.append(view[: view.nbytes - rest])
        if rest:
            return body, view[view.nbytes - rest :]
    return body, None


def read_tail(fd: int, tail: np.ndarray, file_offset: int) -> None:
    """Read ``tail`` (under one block, at an aligned ``file_offset``) of a file opened for
    direct reads, through an aligned one-block buffer."""
    block = aligned_empty(DIRECT_ALIGN)
    n = os.preadv(fd, [memoryview(block)], file_offset)
    if n < tail.nbytes:
        raise ObjectFormatError("object ends early (truncated while reading)")
    tail[:] = block[: tail.nbytes]


def open_read(path: str, direct: bool) -> int:
    """A read-only descriptor of ``path``, for direct reads if ``direct``."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))


def stop_direct(fd: int) -> None:
    """Read ``fd`` (opened by :func:`open_read` for direct reads) through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def probe_direct(directory: str) -> str | None:
    """``None`` when files in ``directory`` can be read with ``O_DIRECT`` (a probe file is
    written, read back directly and removed), else why not."""
    if not _O_DIRECT:
        return "this platform has no O_DIRECT"
    fd, path = tempfile.mkstemp(prefix=".direct-probe-", suffix=".tmp", dir=directory)
    try:
        try:
            pwritev_all(fd, [memoryview(bytes(range(256)) * (2 * DIRECT_ALIGN // 256))], 0)
        finally:
            os.close(fd)
        block = aligned_empty(2 * DIRECT_ALIGN)
        try:
            fd = open_read(path, True)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return f"the filesystem refuses O_DIRECT ({e.strerror})"
            raise
        try:
            n = os.preadv(fd, [memoryview(block)], 0)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return f"4 KiB-aligned direct reads fail ({e.strerror})"
            raise
        finally:
            os.close(fd)
        if n != block.nbytes or block[:256].tolist() != list(range(256)):
            return "a direct read of the probe file returned other bytes"
        return None
    finally:
        os.unlink(path)


def subdirs(path: str) -> list[str]:
    """The directories in ``path`` (none when it does not exist)."""
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def stat_sizes(stop: threading.Event, names: list[str]) -> list[int | None]:
    """Each file's size, ``None`` where it does not exist; stops when ``stop`` is set."""
    sizes: list[int | None] = []
    for name in names:
        check_stop(stop)
        try:
            sizes.append(os.stat(name).st_size)
        except (FileNotFoundError, NotADirectoryError):
            sizes.append(None)
    return sizes


def unlink_all(stop: threading.Event, names: list[str]) -> None:
    """Remove the files (one already gone is fine); stops when ``stop`` is set."""
    for name in names:
        check_stop(stop)
        try:
            os.unlink(name)
        except FileNotFoundError:
            continue  # already gone: the state we want
