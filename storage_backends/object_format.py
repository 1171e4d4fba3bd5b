"""The storage object format, shared by every built-in backend: the codec of one namespace.

Primitives:

- :class:`ObjectCodec` — header encoding and verification for one namespace, whole-object
  encode / decode-into-slot for backends that move objects as one buffer, and the object as
  header + slot views (``encode_parts``) for backends that can send a list of buffers.

The parts of the format live in their own modules and are re-exported here:

- :mod:`storage_backends.object_names` — key and pool-name validation, the key space
  ``{namespace-digest}/{pool}/{key[:2]}/{key}`` (:func:`object_relpath`), :class:`ObjectGeometry`.
- :mod:`storage_backends.object_header` — the header's byte layout, :class:`ObjectHeader`.
- :mod:`storage_backends.payload_checksum` — :class:`PayloadChecksum` (``blocksum128``).
- :mod:`storage_backends.payload_pieces` — :func:`slot_buffers`, :func:`payload_range`,
  :func:`iter_chunks`, :func:`check_stop` and :func:`run_steps` (piecewise work that stops).

An object is a header followed by the payload in page_first order (layer 0's item, layer 1's
item, …). A compressed object (``ObjectCodec(compression="zstd")``, see
``storage_backends.compression``) appends ``;zstd:F`` to the descriptor (F: the frame size),
follows the descriptor with the frame table (one uint32 per frame, covered by the header CRC)
and stores the frames instead of the payload; ``payload len`` and ``payload sum`` still
describe the decoded payload, so the checksum covers the bytes a reader gets.

Given the namespace, pool and key every header byte except the payload sum is known in advance,
so a reader knows the exact object size before it reads, and any difference — truncation, a
flipped byte, another model's or another key's object, another format version — is an
:class:`~asynccache.errors.ObjectFormatError`, which backends turn into a miss.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Generator, Sequence

import numpy as np

from asynccache.errors import ConfigError, ObjectFormatError
from storage_backends.compression import FrameTable, check_compression, element_bytes
from storage_backends.object_header import (
    FIXED_HEADER,
    FORMAT_VERSION,
    HEADER_ALIGN,
    HEADER_CRC_OFFSET,
    MAGIC,
    PAYLOAD_LAYOUT,
    ObjectHeader,
)
from storage_backends.object_names import (
    ObjectGeometry,
    namespace_digest,
    object_relpath,
    short_repr,
    validate_key,
    validate_pool_name,
)
from storage_backends.payload_checksum import (
    CHECKSUM_BLOCK_BYTES,
    PayloadChecksum,
    add_checksums,
    payload_checksum,
)
from storage_backends.payload_pieces import (
    IO_CHUNK_BYTES,
    StopRequested,
    check_stop,
    iter_chunks,
    payload_range,
    run_steps,
    slot_buffers,
)

__all__ = [
    "CHECKSUM_BLOCK_BYTES",
    "FORMAT_VERSION",
    "IO_CHUNK_BYTES",
    "MAGIC",
    "PAYLOAD_LAYOUT",
    "ObjectCodec",
    "ObjectGeometry",
    "ObjectHeader",
    "PayloadChecksum",
    "StopRequested",
    "add_checksums",
    "check_stop",
    "iter_chunks",
    "namespace_digest",
    "object_relpath",
    "payload_checksum",
    "payload_range",
    "run_steps",
    "slot_buffers",
    "validate_key",
    "validate_pool_name",
]

#: where the header's payload sum starts (16 bytes, little-endian: the two 64-bit halves, up to
#: the header CRC), and the first byte after the header CRC
_SUM = 16
_AFTER_CRC = HEADER_CRC_OFFSET + 4


def _header_bytes(descriptor_bytes: int, align: int = HEADER_ALIGN) -> int:
    return -(-(FIXED_HEADER.size + descriptor_bytes) // align) * align


class ObjectCodec:
    """Headers of one namespace. Thread-safe (immutable after construction).

    ``header_align``: the header is padded to a multiple of this (64 by default; a multiple of
    64). The local disk uses 4 KiB so that payloads can be read with ``O_DIRECT``; the length
    is in the header, so readers of the format need no option, but a backend expects its own
    alignment and takes an object of another size for a foreign one (a miss)."""

    def __init__(
        self,
        namespace: str,
        *,
        header_align: int = HEADER_ALIGN,
        compression: str = "none",
        frame_bytes: int = 4 << 20,
    ) -> None:
        if not isinstance(header_align, int) or header_align <= 0 or header_align % HEADER_ALIGN:
            raise ConfigError(f"header_align must be a positive multiple of {HEADER_ALIGN}, got {header_align!r}")
        if not isinstance(frame_bytes, int) or frame_bytes <= 0 or frame_bytes % CHECKSUM_BLOCK_BYTES:
            raise ConfigError(f"frame_bytes must be a positive multiple of {CHECKSUM_BLOCK_BYTES}, got {frame_bytes!r}")
        self.digest = namespace_digest(namespace)
        self.digest_hex = self.digest.hex()
        self.header_align = header_align
        #: ``"none"`` or ``"zstd"`` (objects stored as frames, see ``storage_backends.compression``)
        self.compression = check_compression(compression)
        #: payload bytes per frame of a compressed object (a multiple of the checksum block, so
        #: a frame's partial checksum starts on a block)
        self.frame_bytes = frame_bytes
        self._tables: dict[ObjectGeometry, FrameTable] = {}  # a backend's pools: a few geometries

    def frame_table(self, geometry: ObjectGeometry) -> FrameTable | None:
        """How ``geometry``'s payload is framed when this codec compresses (else ``None``)."""
        if self.compression == "none":
            return None
        table = self._tables.get(geometry)
        if table is None:  # (two threads may both build it: the same table)
            element = element_bytes(geometry.dtype, geometry.item_bytes)
            table = self._tables[geometry] = FrameTable(geometry.payload_bytes, self.frame_bytes, element)
        return table

    def relpath(self, pool_name: str, key: str) -> str:
        return object_relpath(self.digest_hex, pool_name, key)

    def _descriptor(self, geometry: ObjectGeometry, key: str) -> bytes:
        framed = "" if self.compression == "none" else f";{self.compression}:{self.frame_bytes}"
        return (
            f"{geometry.pool_name};{PAYLOAD_LAYOUT};{geometry.dtype};"
            f"{geometry.num_layers}x{geometry.item_bytes};{key}{framed}"
        ).encode("ascii")

    def header_bytes(self, geometry: ObjectGeometry, key: str) -> int:
        """Size of the header of ``key``'s object (known before reading; a compressed object's
        includes its frame table)."""
        return self._header_bytes(len(self._descriptor(geometry, key)), self.frame_table(geometry))

    def _header_bytes(self, descriptor_bytes: int, table: FrameTable | None) -> int:
        return _header_bytes(descriptor_bytes + (0 if table is None else table.table_bytes), self.header_align)

    def object_bytes(self, geometry: ObjectGeometry, key: str) -> int:
        """Size of a valid object of ``key``: exact, or for a compressed object the largest
        (every frame stored as it is)."""
        return self.header_bytes(geometry, key) + geometry.payload_bytes

    def valid_size(self, geometry: ObjectGeometry, key: str, size: int) -> bool:
        """Whether ``size`` bytes can be a valid object of ``key`` (a size check before reading)."""
        table = self.frame_table(geometry)
        if table is None:
            return size == self.object_bytes(geometry, key)
        return self.header_bytes(geometry, key) + table.min_stored_bytes() <= size <= self.object_bytes(geometry, key)

    def encode_header(
        self, geometry: ObjectGeometry, key: str, payload_sum: int, top_lengths: Sequence[int] = ()
    ) -> bytearray:
        """The header of ``key``'s object; ``top_lengths``: a compressed object's frame table
        (zeros when empty: the expected header that :meth:`verify_frames` compares against)."""
        desc = self._descriptor(geometry, key)
        table = self.frame_table(geometry)
        hlen = self._header_bytes(len(desc), table)
        out = bytearray(hlen)
        FIXED_HEADER.pack_into(
            out, 0, MAGIC, FORMAT_VERSION, hlen, geometry.payload_bytes, payload_sum.to_bytes(16, "little"), 0,
            self.digest, len(desc),
        )  # fmt: skip
        out[FIXED_HEADER.size : FIXED_HEADER.size + len(desc)] = desc
        if table is not None and top_lengths:
            start = FIXED_HEADER.size + len(desc)
            out[start : start + table.table_bytes] = table.encode(top_lengths)
        struct.pack_into("<I", out, HEADER_CRC_OFFSET, zlib.crc32(out))
        return out

    def verify_frames(
        self, buf: bytes | bytearray | memoryview, geometry: ObjectGeometry, key: str, object_size: int
    ) -> tuple[int, list[int]]:
        """Check that ``buf`` starts with the header of ``key``'s compressed object of
        ``object_size`` bytes; return the payload checksum and the frames' top-plane lengths."""
        table = self.frame_table(geometry)
        if table is None:
            raise ConfigError("verify_frames is for a codec that compresses")
        view = memoryview(buf)
        expected = self.encode_header(geometry, key, 0)
        hlen = len(expected)
        start = FIXED_HEADER.size + len(self._descriptor(geometry, key))
        if not (
            len(view) >= hlen
            and view[:_SUM] == expected[:_SUM]
            and view[_AFTER_CRC:start] == expected[_AFTER_CRC:start]
            and view[start + table.table_bytes : hlen] == expected[start + table.table_bytes :]
        ):
            self._verify_header(view, expected, geometry, key)  # names the difference
            raise ObjectFormatError("not a compressed object of this backend's frame size")
        ObjectHeader.decode(view)  # the header CRC covers the frame table
        lengths = table.decode(view[start : start + table.table_bytes], object_size - hlen)
        return int.from_bytes(view[_SUM:HEADER_CRC_OFFSET], "little"), lengths

    def verify_header(self, buf: bytes | bytearray | memoryview, geometry: ObjectGeometry, key: str) -> int:
        """Check that ``buf`` starts with the header of ``key``'s object in this namespace;
        return the payload checksum it records. Raises :class:`ObjectFormatError` naming the problem."""
        return self._verify_header(memoryview(buf), self.encode_header(geometry, key, 0), geometry, key)

    def _verify_header(self, view: memoryview, expected: bytearray, geometry: ObjectGeometry, key: str) -> int:
        """:meth:`verify_header` given ``expected``, the header of ``key`` with a zero payload sum."""
        hlen = len(expected)
        if len(view) >= hlen and view[:_SUM] == expected[:_SUM] and view[_AFTER_CRC:hlen] == expected[_AFTER_CRC:]:
            # every byte but the payload sum and the header CRC is as expected: a corrupted
            # payload sum is caught by the payload check, a corrupted header CRC is harmless
            return int.from_bytes(view[_SUM:HEADER_CRC_OFFSET], "little")
        header = ObjectHeader.decode(view)  # the slow path names the problem
        if header.namespace_digest != self.digest:
            raise ObjectFormatError("object of a foreign namespace (another model, dtype or TP shard)")
        if header.key != key:
            raise ObjectFormatError(f"object of key {short_repr(header.key)} stored under {short_repr(key)}")
        got = (header.pool_name, header.layout, header.dtype, header.num_layers, header.item_bytes)
        want = (geometry.pool_name, PAYLOAD_LAYOUT, geometry.dtype, geometry.num_layers, geometry.item_bytes)
        if got != want or header.payload_bytes != geometry.payload_bytes:
            raise ObjectFormatError(f"object geometry {got} does not match the pool's {want}")
        mine = "none" if self.compression == "none" else f"{self.compression}:{self.frame_bytes}"
        if header.compression != mine:
            raise ObjectFormatError(f"object stored with compression {header.compression!r}, this backend's is {mine!r}")
        return header.payload_sum

    def _whole_objects_only(self) -> None:
        if self.compression != "none":
            raise ConfigError("whole-object encoding is for uncompressed objects (the local disk compresses frames)")

    # ---- whole-object encode / decode (memory and object-store backends) -----------------
    def encode(
        self, geometry: ObjectGeometry, key: str, buffers: Sequence[np.ndarray], stop: threading.Event | None = None
    ) -> bytearray:
        """The whole object of ``key`` (header + payload gathered from ``buffers``)."""
        self._whole_objects_only()
        hlen = self.header_bytes(geometry, key)
        out = bytearray(hlen + geometry.payload_bytes)
        dst = np.frombuffer(out, dtype=np.uint8)
        check, off = PayloadChecksum(), hlen
        for piece in iter_chunks(buffers):
            check_stop(stop)
            if off + piece.nbytes > len(out):  # refused before numpy's broadcast error
                raise ConfigError(f"slot holds more than the geometry's {geometry.payload_bytes} bytes")
            dst[off : off + piece.nbytes] = piece
            check.update(piece)
            off += piece.nbytes
        if off != len(out):
            raise ConfigError(f"slot holds {off - hlen} bytes, geometry says {geometry.payload_bytes}")
        out[:hlen] = self.encode_header(geometry, key, check.digest())
        return out

    def encode_parts(
        self,
        geometry: ObjectGeometry,
        key: str,
        buffers: Sequence[np.ndarray],
        stop: threading.Event | None = None,
        *,
        piece_bytes: int | None = None,
    ) -> list[bytes | np.ndarray]:
        """The object of ``key`` as parts to send in order, without copying the payload: its
        header, then ``buffers`` themselves (their concatenation is :meth:`encode`'s output).
        The header records the checksum of the buffers as they are now: bytes that change
        before they are sent make an object that fails its payload check. ``piece_bytes``: the
        work between two ``stop`` checks (default ``IO_CHUNK_BYTES``)."""
        return run_steps(self.encode_parts_steps(geometry, key, buffers, piece_bytes=piece_bytes), stop)

    def encode_parts_steps(
        self, geometry: ObjectGeometry, key: str, buffers: Sequence[np.ndarray], *, piece_bytes: int | None = None
    ) -> Generator[None, None, list[bytes | np.ndarray]]:
        """:meth:`encode_parts` in steps of one piece (see :func:`run_steps`)."""
        self._whole_objects_only()
        check, size = PayloadChecksum(), 0
        for piece in iter_chunks(buffers, piece_bytes):
            if size:
                yield
            check.update(piece)
            size += piece.nbytes
        if size != geometry.payload_bytes:
            raise ConfigError(f"slot holds {size} bytes, geometry says {geometry.payload_bytes}")
        return [bytes(self.encode_header(geometry, key, check.digest())), *buffers]

    def decode_into(
        self,
        data: bytes | bytearray | memoryview,
        geometry: ObjectGeometry,
        key: str,
        buffers: Sequence[np.ndarray],
        stop: threading.Event | None = None,
        *,
        piece_bytes: int | None = None,
    ) -> None:
        """Verify the object ``data`` of ``key`` and copy its payload into ``buffers``.

        Each piece is copied first and then checksummed where it landed, while it is still in
        the core's cache: the source is read from memory once, as by a plain copy, and the
        check covers the bytes the caller gets. On an :class:`ObjectFormatError` the
        destination holds unspecified bytes (callers treat the slot as a miss). ``piece_bytes``:
        the work between two ``stop`` checks (default ``IO_CHUNK_BYTES``: small pieces stay in
        a core's L2; on a worker thread larger ones mean fewer trips through the GIL)."""
        run_steps(self.decode_steps(data, geometry, key, buffers, piece_bytes=piece_bytes), stop)

    def decode_range_into(
        self,
        data: bytes | bytearray | memoryview,
        payload_offset: int,
        payload_end: int,
        buffers: Sequence[np.ndarray],
        stop: threading.Event | None = None,
        *,
        piece_bytes: int | None = None,
    ) -> int:
        """Copy ``data``, the payload bytes ``[payload_offset, payload_end)`` (the offset a
        multiple of ``CHECKSUM_BLOCK_BYTES``), into their place in ``buffers``; return the
        range's partial checksum (the partial checksums of a payload's ranges add up to its
        checksum, mod 2⁶⁴). Each piece is checksummed where it landed, as in
        :meth:`decode_into`. ``data`` of another length than the range asked for is an
        :class:`ObjectFormatError`: a short body would leave the rest of the range's bytes as
        they were, and a stretch of zero bytes adds nothing to the checksum."""
        self._whole_objects_only()
        if payload_offset % CHECKSUM_BLOCK_BYTES:
            raise ValueError(f"a payload range starts on a {CHECKSUM_BLOCK_BYTES}-byte block, not at {payload_offset}")
        src = np.frombuffer(memoryview(data), dtype=np.uint8)
        if src.nbytes != payload_end - payload_offset:
            raise ObjectFormatError(
                f"range [{payload_offset}, {payload_end}) of the payload came back as {src.nbytes} bytes"
            )
        dest = payload_range(buffers, payload_offset, payload_end)
        if sum(d.nbytes for d in dest) != src.nbytes:
            raise ObjectFormatError("object longer than its payload")
        check = PayloadChecksum(first_block=payload_offset // CHECKSUM_BLOCK_BYTES)
        run_steps(_copy_checked_steps(src, dest, check, piece_bytes), stop)
        return check.digest()

    def decode_steps(
        self,
        data: bytes | bytearray | memoryview,
        geometry: ObjectGeometry,
        key: str,
        buffers: Sequence[np.ndarray],
        *,
        piece_bytes: int | None = None,
    ) -> Generator[None, None, None]:
        """:meth:`decode_into` in steps of one piece (see :func:`run_steps`)."""
        self._whole_objects_only()
        view = memoryview(data)
        expected = self.encode_header(geometry, key, 0)
        size = len(expected) + geometry.payload_bytes
        if len(view) != size:
            raise ObjectFormatError(f"object of {len(view)} bytes, expected {size} (truncated or foreign)")
        want = self._verify_header(view, expected, geometry, key)
        src = np.frombuffer(view, dtype=np.uint8)[len(expected) :]
        check = PayloadChecksum()
        yield from _copy_checked_steps(src, buffers, check, piece_bytes)
        if check.digest() != want:
            raise ObjectFormatError("payload checksum mismatch")


def _copy_checked_steps(
    src: np.ndarray, dest: Sequence[np.ndarray], check: PayloadChecksum, piece_bytes: int | None
) -> Generator[None, None, None]:
    """Copy ``src`` into ``dest`` piece by piece, feeding each piece to ``check`` where it
    landed (still in cache); one step per piece."""
    off = 0
    for piece in iter_chunks(dest, piece_bytes):
        if off:
            yield
        piece[...] = src[off : off + piece.nbytes]
        check.update(piece)
        off += piece.nbytes

