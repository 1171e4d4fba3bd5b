"""Reading one range of a plain object into slot views — what the local disk's worker threads
and its reader processes run — and the reader process's loop.

This module imports no torch (nor anything that does): a reader process (see
``storage_backends.reader_processes``) starts with it and numpy alone, in a fraction of a
second, and without a copy of the parent's CUDA libraries.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from asynccache.errors import BackendError, ObjectFormatError
from storage_backends.file_io import (
    aligned_empty,
    direct_views,
    groups,
    open_read,
    preadv_all,
    read_tail,
    stop_direct,
)
from storage_backends.object_format import (
    CHECKSUM_BLOCK_BYTES,
    ObjectCodec,
    ObjectGeometry,
    PayloadChecksum,
    check_stop,
)
from storage_backends.page_residency import in_page_cache

__all__ = ["RangeResult", "ReadUnit", "read_object_range", "reply_outcome", "serve_reader"]

#: What reading a range gives: the header's checksum (``None`` but for the range that read the
#: header), the range's partial checksum and the file's ``(device, inode)``; ``False`` when absent.
RangeResult = tuple[int | None, int, tuple[int, int]] | bool


def read_object_range(
    path: str,
    codec: ObjectCodec,
    geometry: ObjectGeometry,
    key: str,
    offset: int,
    views: list[np.ndarray],
    *,
    piece_bytes: int,
    stop: threading.Event | None,
    deadline: float,
    direct: bool = False,
) -> RangeResult:
    """Payload bytes ``[offset, offset + Σ views)`` of the plain object at ``path`` into
    ``views``, ``piece_bytes`` per ``preadv``, each piece checksummed as it lands. The first
    range also reads the header in its first ``preadv`` and checks it. ``direct``: read with
    ``O_DIRECT`` where the views allow it (see ``storage_backends.file_io``) and the range is
    not all in the page cache already (``storage_backends.page_residency``). Raises
    :class:`ObjectFormatError` for an object of the wrong size or header."""
    hlen = codec.header_bytes(geometry, key)
    tail: np.ndarray | None = None
    split = direct_views(views, hlen + offset) if direct else None
    try:
        fd = open_read(path, split is not None)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        st = os.fstat(fd)
        expected = hlen + geometry.payload_bytes
        if st.st_size != expected:
            raise ObjectFormatError(f"object of {st.st_size} bytes, expected {expected} (truncated or foreign)")
        if split is not None:
            start = 0 if offset == 0 else hlen + offset  # the first range reads the header too
            if in_page_cache(fd, start, hlen + offset + sum(v.nbytes for v in views) - start):
                stop_direct(fd)  # read at memory speed what a direct read would fetch again
            else:
                views, tail = split
        want: int | None = None
        check = PayloadChecksum(first_block=offset // CHECKSUM_BLOCK_BYTES)
        position = hlen + offset
        pieces = groups(views, piece_bytes)
        if offset == 0:
            header = aligned_empty(hlen)  # aligned for a direct read, harmless for the other
            first = pieces[0] if pieces else []
            check_stop(stop, deadline)
            preadv_all(fd, [memoryview(header), *first], 0)
            want = codec.verify_header(header, geometry, key)
            for view in first:
                check.update(view)
                position += len(view)
            pieces = pieces[1:]
        for group in pieces:
            check_stop(stop, deadline)
            preadv_all(fd, group, position)
            for view in group:
                check.update(view)
                position += len(view)
        if tail is not None:
            read_tail(fd, tail, position)
            check.update(tail)
        return want, check.digest(), (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class ReadUnit:
    """One range of one object and where it lands: ``pieces`` are ``(memory id, offset,
    bytes)`` in payload order, in shared memories the children have mapped; ``direct``: read
    with ``O_DIRECT`` where the pieces allow it (the backend's ``direct_io``)."""

    path: str
    geometry: ObjectGeometry
    key: str
    offset: int
    pieces: tuple[tuple[int, int, int], ...]
    direct: bool = False


# ---- the reader process ---------------------------------------------------------------------
def serve_reader(conn: Connection) -> None:
    """Serve one parent: an ``("init", namespace, header_align, piece_bytes, timeout_s)``
    message, then ``ping`` / ``map`` / ``unmap`` / ``read`` requests until ``exit`` or the
    parent's end closes. A ``read`` is answered with each unit's reply and the time the last
    was done, a ``ping`` with ``"ok"`` and the time it was answered (``time.perf_counter()``:
    the parent compares the clocks at the child's start)."""
    try:
        _, namespace, header_align, piece_bytes, timeout_s = conn.recv()
    except (EOFError, OSError):
        return
    codec = ObjectCodec(namespace, header_align=header_align)
    maps: dict[int, np.ndarray] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "map":
            _, mem_id, path, size = msg
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    maps[mem_id] = np.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED), dtype=np.uint8)
                finally:
                    os.close(fd)
                conn.send(("ok",))
            except OSError as e:
                conn.send(("error", f"cannot map {path}: {e}"))
        elif msg[0] == "read":
            replies = [_read_unit(codec, maps, unit, piece_bytes, timeout_s) for unit in msg[1]]
            conn.send((replies, time.perf_counter()))
        elif msg[0] == "unmap":
            maps.pop(msg[1], None)  # the mapping goes with its last view
            conn.send(("ok",))
        elif msg[0] == "ping":
            conn.send(("ok", time.perf_counter()))
        else:  # "exit"
            return


def _read_unit(
    codec: ObjectCodec, maps: dict[int, np.ndarray], unit: ReadUnit, piece_bytes: int, timeout_s: float
) -> tuple[Any, ...]:
    try:
        views = [maps[mem_id][off : off + n] for mem_id, off, n in unit.pieces]
        got = read_object_range(
            unit.path, codec, unit.geometry, unit.key, unit.offset, views,
            piece_bytes=piece_bytes, stop=None, deadline=time.monotonic() + timeout_s, direct=unit.direct,
        )
    except ObjectFormatError as e:
        return ("format", str(e))
    except TimeoutError:
        return ("timeout",)
    except OSError as e:
        return ("os", e.errno, e.strerror, e.filename)
    except Exception as e:  # noqa: BLE001 (reported to the parent as a backend failure)
        return ("backend", f"{type(e).__name__}: {e}")
    return ("absent",) if got is False else ("ok", got)


def reply_outcome(reply: tuple[Any, ...]) -> RangeResult | BaseException:
    """A reader process's reply for one unit as what :func:`read_object_range` returns, or the
    exception it raised."""
    kind = reply[0]
    if kind == "ok":
        return reply[1]  # type: ignore[no-any-return]
    if kind == "absent":
        return False
    if kind == "format":
        return ObjectFormatError(reply[1])
    if kind == "timeout":
        return TimeoutError("timed out")
    if kind == "os":
        return OSError(reply[1], reply[2], reply[3])
    return BackendError(reply[1])
