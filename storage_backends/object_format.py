"""The storage object format and object names, shared by every built-in backend.

Primitives:

- :func:`validate_key` / :func:`validate_pool_name` — strict checks of what may become part of an
  object name (lowercase hex keys, ``[a-z0-9_]`` pool names): nothing a caller passes can climb
  out of the backend's directory or prefix.
- :func:`namespace_digest` / :func:`object_relpath` — the key space
  ``{namespace-digest}/{pool}/{key[:2]}/{key}``: one space per namespace (model, page size,
  dtypes, TP shard) and per pool; a Mamba state lives under the hash of the last page it covers
  in the ``mamba`` space, a KV page under its own hash in the ``kv`` space.
- :class:`ObjectGeometry` — what one object of a pool holds (pool, dtype, layers × item bytes).
- :class:`ObjectCodec` — header encoding and verification for one namespace, whole-object
  encode / decode-into-slot for backends that move objects as one buffer, and the object as
  header + slot views (``encode_parts``) for backends that can send a list of buffers.
- :func:`slot_buffers` — the contiguous runs of one host slot in payload order.

An object is a header followed by the payload (little-endian)::

    0       4     6     8            16           24      28                  44     46   48
    ┌───────┬─────┬─────┬────────────┬────────────┬───────┬───────────────────┬──────┬────┐
    │"ACSO" │ ver │ hlen│ payload len│ payload sum│ h.crc │ namespace digest  │ dlen │pad │
    └───────┴─────┴─────┴────────────┴────────────┴───────┴───────────────────┴──────┴────┘
    48: descriptor "pool;page_first;dtype;LxB;key" (ASCII, dlen bytes), zeros up to hlen
    hlen (a multiple of 64; 4096 on the local disk): payload in page_first order — layer 0's
    item, layer 1's item, …

A compressed object (``ObjectCodec(compression="zstd")``, see ``storage_backends.compression``)
appends ``;zstd:F`` to the descriptor (F: the frame size), follows the descriptor with the frame
table (one uint32 per frame, covered by the header CRC) and stores the frames instead of the
payload; ``payload len`` and ``payload sum`` still describe the decoded payload, so the checksum
covers the bytes a reader gets.

``payload sum`` is the :class:`PayloadChecksum` of the payload, ``h.crc`` the CRC-32 of the
header with that field zeroed. Given the namespace, pool and key every header byte except the
payload sum is known in advance,
so a reader knows the exact object size before it reads, and any difference — truncation, a
flipped byte, another model's or another key's object, another format version — is an
:class:`~asynccache.errors.ObjectFormatError`, which backends turn into a miss.
"""

from __future__ import annotations

import hashlib
import re
import struct
import threading
import time
import zlib
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from asynccache.errors import BackendError, ConfigError, ObjectFormatError
from storage_backends.compression import FrameTable, check_compression, element_bytes

if TYPE_CHECKING:  # not at run time: a reader process imports this module without torch
    from asynccache.pools.base import ItemPool

T = TypeVar("T")

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PAYLOAD_LAYOUT",
    "IO_CHUNK_BYTES",
    "validate_key",
    "validate_pool_name",
    "namespace_digest",
    "object_relpath",
    "ObjectGeometry",
    "ObjectHeader",
    "ObjectCodec",
    "slot_buffers",
    "iter_chunks",
    "StopRequested",
    "check_stop",
    "PayloadChecksum",
    "payload_checksum",
    "add_checksums",
    "payload_range",
    "CHECKSUM_BLOCK_BYTES",
    "run_steps",
]

MAGIC = b"ACSO"
FORMAT_VERSION = 1
#: The payload is always in page_first order (layer-major within one index), whatever the
#: layout of the host pool it came from, so objects are layout independent.
PAYLOAD_LAYOUT = "page_first"
#: Copies, checksums and file I/O work on pieces of at most this size: a piece is checksummed
#: right after (or before) it is read (written), while it is still in the core's L2 cache —
#: checksumming a whole 1.5 MiB page after reading it costs a second trip to DRAM and halved
#: page-cache read speed on the development machines. Also the granularity at which a
#: cancelled worker stops touching host memory.
IO_CHUNK_BYTES = 256 << 10

_FIXED = struct.Struct("<4sHHQQI16sH2x")
_HEADER_ALIGN = 64
_HCRC_OFFSET = 24
_BLOCK_BYTES = 4096
_MASK64 = (1 << 64) - 1
#: Block weights 2b+1 for the first 256 MiB of a payload (longer payloads compute the rest).
_WEIGHTS = np.arange(1, 2 * 65536, 2, dtype=np.uint64)
_WEIGHTS.flags.writeable = False
_KEY_RE = re.compile(r"[0-9a-f]{8,128}")
_POOL_RE = re.compile(r"[a-z0-9_]{1,32}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_key(key: object) -> str:
    """A storage key: 8–128 lowercase hex characters (a chained page hash). Anything else —
    separators, dots, upper case, NUL — is misuse and raises :class:`ConfigError`."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ConfigError(f"invalid storage key {_short(key)}: expected 8-128 lowercase hex characters")
    return key


def validate_pool_name(name: object) -> str:
    value = getattr(name, "value", name)
    if not isinstance(value, str) or _POOL_RE.fullmatch(value) is None:
        raise ConfigError(f"invalid pool name {_short(name)}: expected 1-32 characters of [a-z0-9_]")
    return value


def namespace_digest(namespace: str) -> bytes:
    """16-byte digest of a namespace string (``HybridSpec.namespace_id``)."""
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError("a storage backend needs a non-empty namespace (the spec's namespace_id)")
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def object_relpath(ns_digest_hex: str, pool_name: str, key: str) -> str:
    """``{namespace-digest}/{pool}/{key[:2]}/{key}`` — validated, '/'-separated."""
    pool = validate_pool_name(pool_name)
    k = validate_key(key)
    return f"{ns_digest_hex}/{pool}/{k[:2]}/{k}"


def _pool_dtype(pool: ItemPool) -> str:
    from asynccache.pools.views import KVViews, StateViews

    spec = getattr(pool, "spec", None)
    if spec is not None and isinstance(pool, KVViews):
        return str(spec.kv_dtype).removeprefix("torch.")
    if spec is not None and isinstance(pool, StateViews):
        return "+".join(f"{c.name}:{str(c.dtype).removeprefix('torch.')}" for c in spec.state_components)
    return "uint8"


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectGeometry:
    """What one object of a pool holds: ``num_layers`` items of ``item_bytes`` bytes."""

    pool_name: str
    dtype: str
    num_layers: int
    item_bytes: int

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.item_bytes

    @classmethod
    def of_pool(cls, pool_name: object, pool: ItemPool) -> ObjectGeometry:
        from asynccache.pools import base as pools

        name = validate_pool_name(pool_name)
        if not isinstance(pool, pools.ItemPool):
            raise ConfigError(f"pool {name}: expected an ItemPool, got {type(pool).__name__}")
        if not pool.materialized:
            raise ConfigError(f"pool {name}: {pool.name} is in accounting mode; storage needs its bytes")
        if pool.device.type != "cpu":
            raise ConfigError(f"pool {name}: storage reads and writes host pools, {pool.name} is on {pool.device}")
        return cls(pool_name=name, dtype=_pool_dtype(pool), num_layers=pool.num_layers, item_bytes=pool.item_bytes)


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
        if len(view) < _FIXED.size:
            raise ObjectFormatError(f"truncated header: {len(view)} bytes")
        magic, version, hlen, plen, psum, hcrc, digest, dlen = _FIXED.unpack_from(view)
        if magic != MAGIC:
            raise ObjectFormatError("not an asynccache storage object (bad magic)")
        if version != FORMAT_VERSION:
            raise ObjectFormatError(f"object format version {version}, this reader knows {FORMAT_VERSION}")
        if hlen < _FIXED.size + dlen or hlen % _HEADER_ALIGN:
            raise ObjectFormatError(f"inconsistent header length {hlen}")
        if len(view) < hlen:
            raise ObjectFormatError(f"header of {hlen} bytes, only {len(view)} available")
        check = zlib.crc32(view[:_HCRC_OFFSET])
        check = zlib.crc32(b"\0\0\0\0", check)
        check = zlib.crc32(view[_HCRC_OFFSET + 4 : hlen], check)
        if check != hcrc:
            raise ObjectFormatError("header checksum mismatch")
        try:
            fields = bytes(view[_FIXED.size : _FIXED.size + dlen]).decode("ascii").split(";")
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
            payload_sum=psum,
            namespace_digest=digest,
            pool_name=pool,
            layout=layout,
            dtype=dtype,
            num_layers=layers,
            item_bytes=item,
            key=key,
            compression=compression,
        )


class PayloadChecksum:
    """``blocksum64`` of a payload, fed piece by piece (``update``) in payload order.

    The payload is cut into 4 KiB blocks (the last one zero-padded); ``S_b`` is the sum of block
    ``b``'s little-endian 64-bit words and the checksum is ``Σ (2b+1)·S_b``, all mod 2⁶⁴. It
    catches any single-bit flip (the weights are odd), truncation, zeroed or foreign ranges and
    misplaced blocks; being linear it misses changes that cancel exactly inside one block (two
    opposite flips of one bit position), which storage faults do not produce in practice. It
    runs at memory speed in numpy (~30–40 GB/s per core, vs ~4.5 GB/s for zlib's CRC-32 on the
    development machines), which keeps page-cache reads within reach of the raw path."""

    __slots__ = ("_value", "_num_blocks", "_pending", "_num_pending")

    def __init__(self, *, first_block: int = 0) -> None:
        """``first_block``: the block index of the first byte fed (a range of the payload that
        starts on a block boundary). The checksum is linear: the digests of consecutive ranges
        add up (mod 2⁶⁴) to the digest of the whole."""
        self._value = 0
        self._num_blocks = first_block
        self._pending = np.zeros(_BLOCK_BYTES, dtype=np.uint8)
        self._num_pending = 0

    def update(self, piece: np.ndarray | memoryview | bytes | bytearray) -> None:
        data = piece if isinstance(piece, np.ndarray) else np.frombuffer(piece, dtype=np.uint8)
        if not self._num_pending and not data.nbytes % _BLOCK_BYTES:
            if data.nbytes:
                self._add_blocks(data)
            return
        if self._num_pending:
            take = min(_BLOCK_BYTES - self._num_pending, data.nbytes)
            self._pending[self._num_pending : self._num_pending + take] = data[:take]
            self._num_pending += take
            data = data[take:]
            if self._num_pending < _BLOCK_BYTES:
                return
            self._add_blocks(self._pending)
            self._num_pending = 0
        full = data.nbytes // _BLOCK_BYTES * _BLOCK_BYTES
        if full:
            self._add_blocks(data[:full])
        if full < data.nbytes:
            self._num_pending = data.nbytes - full
            self._pending[: self._num_pending] = data[full:]

    def _add_blocks(self, data: np.ndarray) -> None:
        n = data.nbytes // _BLOCK_BYTES
        sums = np.add.reduce(data.view(np.uint64).reshape(n, _BLOCK_BYTES // 8), axis=1)
        b0 = self._num_blocks
        if b0 + n <= len(_WEIGHTS):
            weights = _WEIGHTS[b0 : b0 + n]
        else:
            weights = np.arange(2 * b0 + 1, 2 * (b0 + n), 2, dtype=np.uint64)
        self._value = (self._value + int(np.dot(sums, weights))) & _MASK64
        self._num_blocks += n

    def digest(self) -> int:
        """The checksum of everything fed so far (feeding may go on)."""
        if not self._num_pending:
            return self._value
        last = self._pending.copy()
        last[self._num_pending :] = 0
        sums = int(last.view(np.uint64).sum(dtype=np.uint64))
        return (self._value + (2 * self._num_blocks + 1) * sums) & _MASK64


def add_checksums(partials: Iterable[int]) -> int:
    """The payload's checksum from the partial checksums of block-aligned ranges that cover it
    once each (``PayloadChecksum(first_block=…)``; the checksum is linear)."""
    return sum(partials) & _MASK64


def payload_checksum(buffers: Sequence[np.ndarray | memoryview | bytes | bytearray]) -> int:
    check = PayloadChecksum()
    for buf in buffers:
        check.update(buf)
    return check.digest()


class StopRequested(BackendError):
    """Raised inside a worker job whose caller was cancelled (never reaches callers)."""


CHECKSUM_BLOCK_BYTES = _BLOCK_BYTES


def payload_range(buffers: Sequence[np.ndarray], start: int, end: int) -> list[np.ndarray]:
    """Views of payload bytes ``[start, end)`` of ``buffers`` (their concatenation), in order."""
    out: list[np.ndarray] = []
    base = 0
    for buf in buffers:
        lo, hi = max(start, base), min(end, base + buf.nbytes)
        if lo < hi:
            out.append(buf[lo - base : hi - base])
        base += buf.nbytes
        if base >= end:
            break
    return out


def slot_buffers(pool: ItemPool, index: int) -> list[np.ndarray]:
    """The bytes of slot ``index`` as contiguous 1-D uint8 arrays in payload (page_first) order:
    one array for a page_first pool, one per layer for a layer_first pool. They alias the pool."""
    item = pool.index_bytes(index).numpy()  # [num_layers, item_bytes]
    if item.flags.c_contiguous:
        return [item.reshape(-1)]
    return list(item)


def iter_chunks(buffers: Sequence[np.ndarray], chunk_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Split buffers into pieces of at most ``chunk_bytes`` (default ``IO_CHUNK_BYTES``; views, in order)."""
    chunk_bytes = IO_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    for buf in buffers:
        for start in range(0, buf.nbytes, chunk_bytes):
            yield buf[start : start + chunk_bytes]


def _header_bytes(descriptor_bytes: int, align: int = _HEADER_ALIGN) -> int:
    return -(-(_FIXED.size + descriptor_bytes) // align) * align


def check_stop(stop: threading.Event | None, deadline: float | None = None) -> None:
    """Between pieces of a job: stop when its caller was cancelled (``stop`` set) or its
    deadline (``time.monotonic()``) passed."""
    if stop is not None and stop.is_set():
        raise StopRequested("stopped: the caller was cancelled")
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("timed out")


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
        header_align: int = _HEADER_ALIGN,
        compression: str = "none",
        frame_bytes: int = 4 << 20,
    ) -> None:
        if not isinstance(header_align, int) or header_align <= 0 or header_align % _HEADER_ALIGN:
            raise ConfigError(f"header_align must be a positive multiple of {_HEADER_ALIGN}, got {header_align!r}")
        if not isinstance(frame_bytes, int) or frame_bytes <= 0 or frame_bytes % _BLOCK_BYTES:
            raise ConfigError(f"frame_bytes must be a positive multiple of {_BLOCK_BYTES}, got {frame_bytes!r}")
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
        _FIXED.pack_into(
            out, 0, MAGIC, FORMAT_VERSION, hlen, geometry.payload_bytes, payload_sum, 0, self.digest, len(desc)
        )
        out[_FIXED.size : _FIXED.size + len(desc)] = desc
        if table is not None and top_lengths:
            start = _FIXED.size + len(desc)
            out[start : start + table.table_bytes] = table.encode(top_lengths)
        struct.pack_into("<I", out, _HCRC_OFFSET, zlib.crc32(out))
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
        start = _FIXED.size + len(self._descriptor(geometry, key))
        if not (
            len(view) >= hlen
            and view[:16] == expected[:16]
            and view[28:start] == expected[28:start]
            and view[start + table.table_bytes : hlen] == expected[start + table.table_bytes :]
        ):
            self._verify_header(view, expected, geometry, key)  # names the difference
            raise ObjectFormatError("not a compressed object of this backend's frame size")
        ObjectHeader.decode(view)  # the header CRC covers the frame table
        lengths = table.decode(view[start : start + table.table_bytes], object_size - hlen)
        return int.from_bytes(view[16:24], "little"), lengths

    def verify_header(self, buf: bytes | bytearray | memoryview, geometry: ObjectGeometry, key: str) -> int:
        """Check that ``buf`` starts with the header of ``key``'s object in this namespace;
        return the payload checksum it records. Raises :class:`ObjectFormatError` naming the problem."""
        return self._verify_header(memoryview(buf), self.encode_header(geometry, key, 0), geometry, key)

    def _verify_header(self, view: memoryview, expected: bytearray, geometry: ObjectGeometry, key: str) -> int:
        """:meth:`verify_header` given ``expected``, the header of ``key`` with a zero payload sum."""
        hlen = len(expected)
        if len(view) >= hlen and view[:16] == expected[:16] and view[28:hlen] == expected[28:]:
            # every byte but the payload sum and the header CRC is as expected: a corrupted
            # payload sum is caught by the payload check, a corrupted header CRC is harmless
            return int.from_bytes(view[16:24], "little")
        header = ObjectHeader.decode(view)  # the slow path names the problem
        if header.namespace_digest != self.digest:
            raise ObjectFormatError("object of a foreign namespace (another model, dtype or TP shard)")
        if header.key != key:
            raise ObjectFormatError(f"object of key {_short(header.key)} stored under {_short(key)}")
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
        buffers: Sequence[np.ndarray],
        stop: threading.Event | None = None,
        *,
        piece_bytes: int | None = None,
    ) -> int:
        """Copy ``data``, the payload bytes from ``payload_offset`` on (a multiple of
        ``CHECKSUM_BLOCK_BYTES``), into their place in ``buffers``; return the range's partial
        checksum (the partial checksums of a payload's ranges add up to its checksum, mod 2⁶⁴).
        Each piece is checksummed where it landed, as in :meth:`decode_into`."""
        self._whole_objects_only()
        if payload_offset % _BLOCK_BYTES:
            raise ValueError(f"a payload range starts on a {_BLOCK_BYTES}-byte block, not at {payload_offset}")
        src = np.frombuffer(memoryview(data), dtype=np.uint8)
        dest = payload_range(buffers, payload_offset, payload_offset + src.nbytes)
        if sum(d.nbytes for d in dest) != src.nbytes:
            raise ObjectFormatError("object longer than its payload")
        check = PayloadChecksum(first_block=payload_offset // _BLOCK_BYTES)
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


def run_steps(steps: Generator[None, None, T], stop: threading.Event | None = None) -> T:
    """Run a stepwise codec operation to its end and return its result, checking ``stop``
    before each step. A step handles one piece of at most ``IO_CHUNK_BYTES`` (~50 µs of copy
    and checksum): an event loop can run one step per callback instead, so that the work never
    holds the loop for longer than that (dropping the generator abandons the operation)."""
    while True:
        check_stop(stop)
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
