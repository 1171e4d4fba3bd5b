"""The payload checksum of storage objects (``blocksum64``).

Primitives:

- :class:`PayloadChecksum` — the checksum of a payload fed piece by piece, from the payload's
  start or from any block boundary (``first_block``).
- :func:`payload_checksum` — the checksum of a whole payload given as its buffers.
- :func:`add_checksums` — the checksum of a payload from the partial checksums of block-aligned
  ranges that cover it (the checksum is linear), for objects read as several ranges.
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
_MASK64 = (1 << 64) - 1
#: Block weights 2b+1 for the first 256 MiB of a payload (longer payloads compute the rest).
_WEIGHTS = np.arange(1, 2 * 65536, 2, dtype=np.uint64)
_WEIGHTS.flags.writeable = False

CHECKSUM_BLOCK_BYTES = _BLOCK_BYTES


class PayloadChecksum:
    """``blocksum64`` of a payload, fed piece by piece (``update``) in payload order.

    The payload is cut into 4 KiB blocks (the last one zero-padded); ``S_b`` is the sum of block
    ``b``'s little-endian 64-bit words and the checksum is ``Σ (2b+1)·S_b``, all mod 2⁶⁴. It
    catches any single-bit flip (the weights are odd), truncation, zeroed or foreign ranges and
    misplaced blocks; being linear it misses changes that cancel exactly inside one block (two
    opposite flips of one bit position), which storage faults do not produce in practice. It
    runs at memory speed in numpy (~30–40 GB/s per core, vs ~4.5 GB/s for zlib's CRC-32 on the
    development machines), which keeps page-cache reads within reach of the raw path."""

    __slots__ = ("_num_blocks", "_num_pending", "_pending", "_value")

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
