"""Lossless compression of stored payloads: the sign-and-exponent bytes of each element through
zstd, the other bytes as they are.

KV pages and Mamba states are floating point: in each element the byte that holds the sign and
the high exponent bits takes few values (activations keep a narrow range of magnitudes), while the
mantissa bytes are close to random. A payload is cut into frames of ``frame_bytes`` (the last one
shorter), and each frame into *byte planes* — plane ``j`` holds byte ``j`` of every element
(little-endian, ``element_bytes`` planes). The top plane (sign and exponent) is compressed with
zstd; the others are stored as they are, since compressing them costs time and saves nothing::

    raw frame      e0b0 e0b1 | e1b0 e1b1 | e2b0 e2b1 | …            (bf16: 2 planes)
    stored frame   zstd(e0b1 e1b1 e2b1 …) ++ e0b0 e1b0 e2b0 …

On the reference model (hybrid-3b shapes, random weights) a bf16 KV page took 0.68 of its bytes
and a Gated-DeltaNet state (fp32 recurrent state, bf16 conv state) 0.85 on the development
machine; a 32k-token prefix's objects took 0.72 on an H200 machine (docs/benchmarks.md,
Long-prefix TTFT). A top plane
that zstd does not shrink is stored as it is (its stored length then equals the plane's); so a
frame never grows.

Each frame decodes on its own, so a large payload's frames are read and decoded on several
threads at once; the object header records each frame's top-plane length (see
:class:`FrameTable`). Decoding checks every length it meets, and zstd checks its own content
checksum: a damaged compressed plane can decode, without that check, into several changed bytes
(two sign bits of one 64-bit lane, say) that cancel in the payload's linear checksum. A corrupted
frame is an :class:`~asynccache.errors.ObjectFormatError`; the payload checksum, taken over the
decoded bytes, catches a flip in the planes stored as they are.

zstd releases the GIL while it runs, and the plane shuffles are numpy loops that do too, so
frames decode in parallel on worker threads; but each step takes the lock back, and on an H200
machine 8 jobs decoded no faster than 2.3–2.4 GB/s (docs/benchmarks.md).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asynccache.errors import ConfigError, ObjectFormatError

__all__ = [
    "COMPRESSIONS",
    "ZSTD_LEVEL",
    "FrameTable",
    "check_compression",
    "decode_frame",
    "element_bytes",
    "encode_frame",
    "thread_buffer",
]

#: Accepted values of a backend's ``compression`` option.
COMPRESSIONS = ("none", "zstd")
#: zstd's fastest standard level: level 3 stored no fewer bytes of a KV page and compressed at
#: half the speed on the development machine.
ZSTD_LEVEL = 1

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1}
_LENGTH = struct.Struct("<I")
_local = threading.local()


def check_compression(value: object) -> str:
    """``value`` if it names a supported compression; zstd also needs the ``zstandard`` package."""
    if not isinstance(value, str) or value not in COMPRESSIONS:
        raise ConfigError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {value!r}")
    if value == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError as e:
            raise ConfigError("compression='zstd' needs the zstandard package (pip install zstandard)") from e
    return value


def element_bytes(dtype: str, item_bytes: int) -> int:
    """Bytes per element of an object of ``dtype`` (an ``ObjectGeometry.dtype``: one dtype, or
    ``name:dtype`` components joined by ``+``): the largest component size that divides
    ``item_bytes``. A bf16 component inside 4-byte elements puts its sign-and-exponent bytes in
    planes 1 and 3, of which only 3 is compressed: mixed states lose a little, nothing breaks."""
    sizes = [_DTYPE_BYTES.get(part.rpartition(":")[2], 1) for part in dtype.split("+")]
    size = max(sizes)
    while size > 1 and item_bytes % size:
        size //= 2
    return size


def _zstd() -> tuple[object, object]:
    """This thread's zstd compressor and decompressor (their objects are not thread-safe)."""
    pair = getattr(_local, "zstd", None)
    if pair is None:
        import zstandard

        # zstd's content checksum (4 bytes a frame): a damaged compressed plane can decode
        # without error into several changed bytes that cancel in the payload's linear checksum
        pair = (zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True), zstandard.ZstdDecompressor())
        _local.zstd = pair
    return pair


def thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """A reusable uint8 buffer of this thread, by name (allocating 4 MiB per frame costs page
    faults)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]


def encode_frame(raw: np.ndarray, element_size: int) -> tuple[int, list[bytes | np.ndarray]]:
    """Stored form of one frame (``raw``: contiguous uint8, a multiple of ``element_size``):
    ``(top plane's stored length, parts to write in order)``. The parts may alias thread
    scratch: write them before this thread encodes another frame."""
    if raw.nbytes % element_size:
        raise ValueError(f"frame of {raw.nbytes} bytes is not a whole number of {element_size}-byte elements")
    plane_bytes = raw.nbytes // element_size
    if element_size == 1:
        planes = [raw]
    elif element_size == 2:
        words = raw.view(np.uint16)
        low, top = thread_buffer("low", plane_bytes), thread_buffer("top", plane_bytes)
        np.copyto(low, words, casting="unsafe")
        np.right_shift(words, 8, out=_scratch16(plane_bytes), casting="unsafe")
        np.copyto(top, _scratch16(plane_bytes), casting="unsafe")
        planes = [low, top]
    else:
        shuffled = thread_buffer("shuffled", raw.nbytes).reshape(element_size, plane_bytes)
        np.copyto(shuffled, raw.reshape(plane_bytes, element_size).T)
        planes = list(shuffled)
    compressor, _ = _zstd()
    packed = compressor.compress(planes[-1])  # type: ignore[attr-defined]
    top: bytes | np.ndarray = packed if len(packed) < plane_bytes else planes[-1]
    return min(plane_bytes, len(packed)), [top, *planes[:-1]]


def _scratch16(plane_bytes: int) -> np.ndarray:
    return thread_buffer("wide", 2 * plane_bytes).view(np.uint16)


def decode_frame(stored: np.ndarray, top_bytes: int, element_size: int, out: np.ndarray) -> None:
    """Decode one stored frame into ``out`` (contiguous uint8, the frame's raw length).
    Raises :class:`ObjectFormatError` when ``stored`` is not a frame of that length.

    One call per plane, not per cache-sized step: the worker threads that decode hold the GIL
    between calls, and decoding in 256 KiB steps (to keep each step in a core's cache) read a
    prefix at 0.64 of the speed of whole frames with 8 jobs on an H200 machine's 16 cores."""
    plane_bytes = out.nbytes // element_size
    if out.nbytes % element_size or not 0 < top_bytes <= plane_bytes:
        raise ObjectFormatError(f"frame of {out.nbytes} bytes with a top plane of {top_bytes} bytes")
    if stored.nbytes != top_bytes + (element_size - 1) * plane_bytes:
        raise ObjectFormatError(f"stored frame of {stored.nbytes} bytes, its table says otherwise")
    top_stored = stored[:top_bytes]
    if top_bytes == plane_bytes:
        top = top_stored
    else:
        _, decompressor = _zstd()
        try:
            got = decompressor.decompress(top_stored, max_output_size=plane_bytes)  # type: ignore[attr-defined]
        except Exception as e:  # zstandard.ZstdError: a damaged frame
            raise ObjectFormatError(f"undecodable frame: {e}") from e
        if len(got) != plane_bytes:
            raise ObjectFormatError(f"frame's top plane decodes to {len(got)} bytes, expected {plane_bytes}")
        top = np.frombuffer(got, dtype=np.uint8)
    rest = stored[top_bytes:]
    if element_size == 1:
        out[...] = top
    elif element_size == 2:
        words = out.view(np.uint16)
        np.left_shift(top, 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, rest, out=words, casting="unsafe")
    else:
        elements = out.reshape(plane_bytes, element_size)
        for j in range(element_size - 1):
            elements[:, j] = rest[j * plane_bytes : (j + 1) * plane_bytes]
        elements[:, element_size - 1] = top


@dataclass(frozen=True, slots=True)
class FrameTable:
    """How a payload of ``payload_bytes`` is framed, and (encoded in the header, after the
    descriptor) each frame's stored top-plane length as a little-endian uint32."""

    payload_bytes: int
    frame_bytes: int
    element_size: int

    @property
    def num_frames(self) -> int:
        return -(-self.payload_bytes // self.frame_bytes)

    @property
    def table_bytes(self) -> int:
        return self.num_frames * _LENGTH.size

    def frame_range(self, k: int) -> tuple[int, int]:
        """Payload offset and raw length of frame ``k``."""
        start = k * self.frame_bytes
        return start, min(self.frame_bytes, self.payload_bytes - start)

    def stored_bytes(self, k: int, top_bytes: int) -> int:
        _, length = self.frame_range(k)
        return top_bytes + (self.element_size - 1) * (length // self.element_size)

    def min_stored_bytes(self) -> int:
        """Every frame's top plane one byte long (each frame is whole elements)."""
        return self.num_frames + (self.element_size - 1) * (self.payload_bytes // self.element_size)

    def encode(self, top_lengths: Sequence[int]) -> bytes:
        if len(top_lengths) != self.num_frames:
            raise ValueError(f"{len(top_lengths)} frame lengths for {self.num_frames} frames")
        return b"".join(_LENGTH.pack(n) for n in top_lengths)

    def decode(self, table: bytes | memoryview, stored_total: int) -> list[int]:
        """The frames' top-plane lengths; checks them against the frames' sizes and the stored
        payload's total (the file's size less its header)."""
        lengths = [n for (n,) in _LENGTH.iter_unpack(bytes(table[: self.table_bytes]))]
        for k, n in enumerate(lengths):
            if not 0 < n <= self.frame_range(k)[1] // self.element_size:
                raise ObjectFormatError(f"frame {k}: top plane of {n} bytes")
        total = sum(self.stored_bytes(k, n) for k, n in enumerate(lengths))
        if total != stored_total:
            raise ObjectFormatError(f"frames of {total} bytes stored in {stored_total} (truncated or foreign)")
        return lengths

    def stored_offset(self, lengths: Sequence[int], k: int) -> int:
        """Offset of frame ``k`` in the stored payload."""
        return sum(self.stored_bytes(j, lengths[j]) for j in range(k))
