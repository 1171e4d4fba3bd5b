"""The header of a storage object: its byte layout, constants and decoder.

Primitives:

- :data:`MAGIC`, :data:`FORMAT_VERSION`, :data:`PAYLOAD_LAYOUT` — what every header records.
- :data:`FIXED_HEADER`, :data:`HEADER_ALIGN`, :data:`HEADER_CRC_OFFSET` — the fixed part's
  struct, the alignment every header length is a multiple of, where the header CRC sits.
- :class:`ObjectHeader` — a decoded header; ``ObjectHeader.decode`` checks its structure.

Encoding and checking a header against the object it should be is the codec's
(:class:`~storage_backends.object_format.ObjectCodec`). An object is a header followed by the
payload (little-endian)::

    0       4     6     8            16                         32      36                  52     54   56
    ┌───────┬─────┬─────┬────────────┬──────────────────────────┬───────┬───────────────────┬──────┬────┐
    │"ACSO" │ ver │ hlen│ payload len│ payload sum (A, then B)  │ h.crc │ namespace digest  │ dlen │pad │
    └───────┴─────┴─────┴────────────┴──────────────────────────┴───────┴───────────────────┴──────┴────┘
    56: descriptor "pool;page_first;dtype;LxB;key" (ASCII, dlen bytes), zeros up to hlen
    hlen (a multiple of 64; 4096 on the local disk): payload in page_first order — layer 0's
    item, layer 1's item, …

``payload sum`` is the :class:`~storage_backends.payload_checksum.PayloadChecksum` of the
payload (two 64-bit halves), ``h.crc`` the CRC-32 of the header with that field zeroed. A compressed object appends
``;zstd:F`` to the descriptor and follows it with its frame table (covered by the header CRC;
see :mod:`storage_backends.object_format`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from asynccache.errors import ObjectFormatError

__all__ = [
    "FIXED_HEADER",
    "FORMAT_VERSION",
    "HEADER_ALIGN",
    "HEADER_CRC_OFFSET",
    "MAGIC",
    "PAYLOAD_LAYOUT",
    "ObjectHeader",
]

MAGIC = b"ACSO"
#: 3: the payload sum adds a second half weighted by word position (2 kept block sums alone,
#: blind to data reordered inside a block; 1 added 64-bit words, whose top bits cancelled in
#: pairs); an object of another version is a miss.
FORMAT_VERSION = 3
#: The payload is always in page_first order (layer-major within one index), whatever the
#: layout of the host pool it came from, so objects are layout independent.
PAYLOAD_LAYOUT = "page_first"
#: The fixed part of every header (up to the descriptor).
FIXED_HEADER = struct.Struct("<4sHHQ16sI16sH2x")
HEADER_ALIGN = 64
HEADER_CRC_OFFSET = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectHeader:
    """A decoded header (see the module docstring for the byte layout)."""

    version: int
    header_bytes: int
    payload_bytes: int
    payload_sum: int
    namespace_digest: bytes
    pool_name: str
    layout: str
    dtype: str
    num_layers: int
    item_bytes: int
    key: str
    #: ``"none"``, or ``"zstd:F"`` for an object stored as frames of F payload bytes
    compression: str = "none"

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> ObjectHeader:
        """Parse and check a header's structure (magic, version, header CRC); raises
        :class:`ObjectFormatError`. ``buf`` holds at least the whole header."""
        view = memoryview(buf)
        if len(view) < FIXED_HEADER.size:
            raise ObjectFormatError(f"truncated header: {len(view)} bytes")
        magic, version, hlen, plen, psum, hcrc, digest, dlen = FIXED_HEADER.unpack_from(view)
        if magic != MAGIC:
            raise ObjectFormatError("not an asynccache storage object (bad magic)")
        if version != FORMAT_VERSION:
            raise ObjectFormatError(f"object format version {version}, this reader knows {FORMAT_VERSION}")
        if hlen < FIXED_HEADER.size + dlen or hlen % HEADER_ALIGN:
            raise ObjectFormatError(f"inconsistent header length {hlen}")
        if len(view) < hlen:
            raise ObjectFormatError(f"header of {hlen} bytes, only {len(view)} available")
        check = zlib.crc32(view[:HEADER_CRC_OFFSET])
        check = zlib.crc32(b"\0\0\0\0", check)
        check = zlib.crc32(view[HEADER_CRC_OFFSET + 4 : hlen], check)
        if check != hcrc:
            raise ObjectFormatError("header checksum mismatch")
        try:
            fields = bytes(view[FIXED_HEADER.size : FIXED_HEADER.size + dlen]).decode("ascii").split(";")
            pool, layout, dtype, shape, key = fields[:5]
            compression = fields[5] if len(fields) == 6 else "none"
            if len(fields) > 6:
                raise ValueError(f"{len(fields)} fields")
            layers, item = (int(x) for x in shape.split("x"))
        except ValueError as e:
            raise ObjectFormatError(f"undecodable header descriptor: {e}") from e
        return cls(
            version=version,
            header_bytes=hlen,
            payload_bytes=plen,
            payload_sum=int.from_bytes(psum, "little"),
            namespace_digest=digest,
            pool_name=pool,
            layout=layout,
            dtype=dtype,
            num_layers=layers,
            item_bytes=item,
            key=key,
            compression=compression,
        )
