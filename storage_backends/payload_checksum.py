"""The payload checksum of storage objects (``blocksum64``).

Primitives:

- :class:`PayloadChecksum` — the checksum of a payload (128 bits) fed piece by piece, from the payload's
  start or from any block boundary (``first_block``).
- :func:`payload_checksum` — the checksum of a whole payload given as its buffers.
- :func:`add_checksums` — the checksum of a payload from the partial checksums of block-aligned
  ranges that cover it (the checksum's two halves are linear), for objects read as several
  ranges.
- :data:`CHECKSUM_BLOCK_BYTES` — the block size (4 KiB): ranges whose partial checksums add up
  start on a block.

An object's header records the checksum of its decoded payload (see
:mod:`storage_backends.object_header`); readers feed each piece as it lands, while it is still
in the core's cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["CHECKSUM_BLOCK_BYTES", "PayloadChecksum", "add_checksums", "payload_checksum"]

_BLOCK_BYTES = 4096
#: 32-bit words per block
_BLOCK_WORDS = _BLOCK_BYTES // 4
_WORD = np.dtype("<u4")
_MASK64 = (1 << 64) - 1
#: Block weights 2b+1 for the first 256 MiB of a payload (longer payloads compute the rest).
_WEIGHTS = np.arange(1, 2 * 65536, 2, dtype=np.uint64)
_WEIGHTS.flags.writeable = False
#: Block weights 2048b+1 of ``B`` (the coefficient of block b's sum), for the same blocks.
_WEIGHTS_B = _WEIGHTS * np.uint64(_BLOCK_WORDS) - np.uint64(_BLOCK_WORDS - 1)
_WEIGHTS_B.flags.writeable = False
#: Columns 1 and i: a block of words times this is its sum and its moment Σ i·w_i.
_SUM_AND_MOMENT = np.stack([np.ones(_BLOCK_WORDS), np.arange(_BLOCK_WORDS, dtype=np.float64)], axis=1)
_SUM_AND_MOMENT.flags.writeable = False
#: Blocks per float64 product (256 KiB of words: the product's 512 KiB stays in cache).
_CHUNK_BLOCKS = 64

CHECKSUM_BLOCK_BYTES = _BLOCK_BYTES


class PayloadChecksum:
    """``blocksum128`` of a payload, fed piece by piece (``update``) in payload order.

    The payload is cut into 4 KiB blocks (the last one zero-padded) of 1024 little-endian 32-bit
    words ``w``; word ``n`` of the payload is word ``i`` of block ``b`` (``n = 1024·b + i``).
    The checksum is a pair of 64-bit sums, returned as one 128-bit integer ``A | B << 64``::

        A = Σ (2b+1)·S_b  mod 2⁶⁴      S_b = Σ_i w_{b,i}   (exact: below 2⁴²)
        B = Σ (2n+1)·w_n  mod 2⁶⁴          = Σ ((2048·b+1)·S_b + 2·T_b),  T_b = Σ_i i·w_{b,i}

    Both are linear, so the checksums of block-aligned ranges add up (each half mod 2⁶⁴) to the
    whole's. A flip of bit ``j`` (``j`` ≤ 31) of word ``n`` changes ``A`` by ±(2b+1)·2ʲ and ``B``
    by ±(2n+1)·2ʲ, never 0 mod 2⁶⁴. In payloads below 8 GiB (2³¹ words) the pair catches:

    - any single-bit flip and any two bit flips, wherever they are: two flips of different bit
      positions change ``B`` by 2^min(j, l) times an odd number; two of the same position ``j``
      by ±2ʲ·2·(n − m) or ±2ʲ·2·(n + m + 1), both nonzero and below 2⁶⁴ in magnitude;
    - two 32-bit words swapped, wherever they are (``B`` changes by 2·(n − m)·(w_m − w_n)), so
      sectors swapped inside a block unless their sums are equal;
    - any burst of up to 32 consecutive bits, across a block boundary too (``A``);
    - zeroed or foreign ranges and moved blocks, unless both sums happen to agree.

    It misses changes that keep both sums (three or more flipped bits that cancel in both,
    blocks of equal sums swapped): it is a cheap linear guard against storage faults, not a CRC
    or a hash. Format version 2 kept ``A`` alone, which cannot see data reordered inside a block
    (two 512-byte sectors or two words swapped) nor two opposite flips of one bit position in
    one block; version 1 summed 64-bit words mod 2⁶⁴, whose top bits cancelled in pairs.
    Sums and moments are one float64 product per 256 KiB (exact, see :func:`_block_terms`):
    ~7.5–8.5 GB/s on one core of the 2-core development machine, in pieces of 256 KiB or
    64 MiB (version 2's sums alone: ~13–14), vs 3–3.5 GB/s for zlib's CRC-32."""

    __slots__ = ("_num_blocks", "_num_pending", "_pending", "_value", "_value_b")

    def __init__(self, *, first_block: int = 0) -> None:
        """``first_block``: the block index of the first byte fed (a range of the payload that
        starts on a block boundary). The checksum is linear: the digests of consecutive ranges
        add up (mod 2⁶⁴) to the digest of the whole."""
        self._value = 0  # A
        self._value_b = 0  # B
        self._num_blocks = first_block
        self._pending = np.zeros(_BLOCK_BYTES, dtype=np.uint8)
        self._num_pending = 0

    def update(self, piece: np.ndarray | memoryview | bytes | bytearray) -> None:
        data = piece if isinstance(piece, np.ndarray) else np.frombuffer(piece, dtype=np.uint8)
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            # the bytes as they lie in memory, in order (a typed or strided view otherwise
            # would be cut by elements, or refuse the 32-bit view)
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
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
        words = data.view(_WORD).reshape(n, _BLOCK_WORDS)
        for first in range(0, n, _CHUNK_BLOCKS):
            a, b = _block_terms(words[first : first + _CHUNK_BLOCKS], self._num_blocks + first)
            self._value = (self._value + a) & _MASK64
            self._value_b = (self._value_b + b) & _MASK64
        self._num_blocks += n

    def digest(self) -> int:
        """The checksum of everything fed so far, ``A | B << 64`` (feeding may go on)."""
        a, b = self._value, self._value_b
        if self._num_pending:
            last = self._pending.copy()
            last[self._num_pending :] = 0
            da, db = _block_terms(last.view(_WORD).reshape(1, _BLOCK_WORDS), self._num_blocks)
            a, b = (a + da) & _MASK64, (b + db) & _MASK64
        return a | b << 64


def _block_terms(words: np.ndarray, first_block: int) -> tuple[int, int]:
    """The terms of ``A`` and ``B`` of the blocks ``words`` (rows of 1024 32-bit words; at most
    :data:`_CHUNK_BLOCKS`) that start at block ``first_block``.

    Each block's sum ``S_b`` (below 2⁴²) and moment ``T_b = Σ i·w_i`` (below 2⁵²) come from
    one float64 product: every product and partial sum is an integer below 2⁵³, so exact in
    any order of summation. The weighted sums then wrap mod 2⁶⁴ (uint64 arithmetic)."""
    n = len(words)
    moments = (words.astype(np.float64) @ _SUM_AND_MOMENT).astype(np.uint64)  # columns S_b, T_b
    if first_block + n <= len(_WEIGHTS):
        weights = _WEIGHTS[first_block : first_block + n]
        weights_b = _WEIGHTS_B[first_block : first_block + n]
    else:
        weights = np.arange(2 * first_block + 1, 2 * (first_block + n), 2, dtype=np.uint64)
        weights_b = weights * np.uint64(_BLOCK_WORDS) - np.uint64(_BLOCK_WORDS - 1)
    sums = moments[:, 0]
    a = int(np.dot(sums, weights))
    b = int(np.dot(sums, weights_b)) + 2 * int(np.sum(moments[:, 1], dtype=np.uint64))
    return a & _MASK64, b & _MASK64


def add_checksums(partials: Iterable[int]) -> int:
    """The payload's checksum from the partial checksums of block-aligned ranges that cover it
    once each (``PayloadChecksum(first_block=…)``; both halves are linear, each added mod
    2⁶⁴)."""
    a = b = 0
    for p in partials:
        a += p & _MASK64
        b += p >> 64
    return (a & _MASK64) | (b & _MASK64) << 64


def payload_checksum(buffers: Sequence[np.ndarray | memoryview | bytes | bytearray]) -> int:
    check = PayloadChecksum()
    for buf in buffers:
        check.update(buf)
    return check.digest()
