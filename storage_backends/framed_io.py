"""Compressed objects on the local disk: one frame read and decoded into its place in a slot, and
an object written as frames (the format: ``storage_backends.compression``).

A read unit of a compressed object is one frame (the local disk's frames are its read ranges,
``READ_RANGE_BYTES``): its job reads the header — with the frame table — and the frame's stored
bytes into buffers of its thread, decodes the frame into the slot and checksums the decoded bytes
there. An object of one frame (a KV page) is read in one ``preadv``, header and frame together;
the frames of a larger one (a Mamba state) are read by several jobs at once, each reading the
header first. Reads go through the page cache: stored frames are not block-aligned.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from asynccache.errors import ObjectFormatError
from storage_backends.base import BatchItem
from storage_backends.compression import decode_frame, encode_frame, thread_buffer
from storage_backends.file_io import preadv_all, pwritev_all
from storage_backends.object_format import (
    CHECKSUM_BLOCK_BYTES,
    ObjectCodec,
    PayloadChecksum,
    check_stop,
    payload_range,
)

__all__ = ["read_frame", "write_frames"]


def read_frame(
    path: str,
    codec: ObjectCodec,
    item: BatchItem,
    offset: int,
    length: int,
    stop: threading.Event,
    deadline: float,
) -> tuple[int | None, int, tuple[int, int]] | bool:
    """Payload bytes ``[offset, offset + length)`` of ``item`` — one frame — decoded into their
    place in its slot. Results as ``LocalDiskBackend._read_range``: ``False`` when the object is
    absent, else ``(want, partial, file)``."""
    geometry, key = item.geometry, item.key
    table = codec.frame_table(geometry)
    assert table is not None
    k = offset // table.frame_bytes
    if table.frame_range(k) != (offset, length):
        raise ValueError(f"range [{offset}, {offset + length}) is not a frame of {table.frame_bytes} bytes")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        st = os.fstat(fd)
        if not codec.valid_size(geometry, key, st.st_size):
            raise ObjectFormatError(f"object of {st.st_size} bytes (truncated or foreign)")
        hlen = codec.header_bytes(geometry, key)
        header = thread_buffer("header", hlen)
        check_stop(stop, deadline)
        if table.num_frames == 1:
            stored = thread_buffer("stored", st.st_size - hlen)
            preadv_all(fd, [memoryview(header), memoryview(stored)], 0)
            want, lengths = codec.verify_frames(header, geometry, key, st.st_size)
        else:
            preadv_all(fd, [memoryview(header)], 0)
            want, lengths = codec.verify_frames(header, geometry, key, st.st_size)
            stored = thread_buffer("stored", table.stored_bytes(k, lengths[k]))
            check_stop(stop, deadline)
            preadv_all(fd, [memoryview(stored)], hlen + table.stored_offset(lengths, k))
        views = payload_range(item.buffers(), offset, offset + length)
        out = views[0] if len(views) == 1 else thread_buffer("raw", length)
        decode_frame(stored, lengths[k], table.element_size, out)
        check = PayloadChecksum(first_block=offset // CHECKSUM_BLOCK_BYTES)
        at = 0
        for view in views:
            if len(views) > 1:
                view[...] = out[at : at + view.nbytes]
            check.update(view)
            at += view.nbytes
        return (want if offset == 0 else None), check.digest(), (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def write_frames(fd: int, codec: ObjectCodec, item: BatchItem, stop: threading.Event, deadline: float) -> int:
    """Write ``item``'s object to ``fd`` (a new file) as frames, then its header; return the
    object's size."""
    geometry, key = item.geometry, item.key
    table = codec.frame_table(geometry)
    assert table is not None
    buffers = item.buffers()
    check, lengths = PayloadChecksum(), []
    position = codec.header_bytes(geometry, key)
    for k in range(table.num_frames):
        check_stop(stop, deadline)
        start, length = table.frame_range(k)
        views = payload_range(buffers, start, start + length)
        for view in views:
            check.update(view)
        raw = views[0] if len(views) == 1 else np.concatenate(views)
        top_bytes, parts = encode_frame(raw, table.element_size)
        iov = [memoryview(part).cast("B") for part in parts]
        pwritev_all(fd, iov, position)
        position += sum(len(v) for v in iov)
        lengths.append(top_bytes)
    pwritev_all(fd, [memoryview(codec.encode_header(geometry, key, check.digest(), lengths))], 0)
    return position
