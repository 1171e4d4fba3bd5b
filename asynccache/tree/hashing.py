"""Token keys and chained page hashes.

Tokens are keyed as int64 little-endian bytes, one page = ``page_size × 8`` bytes, so comparing a
node's pages with a prompt is one ``memcmp`` (``bytes.startswith``) and a child is found by the
bytes of its first page. Page hashes are storage keys::

    seed = blake2b("asynccache/tree/v1" ‖ 0 ‖ namespace ‖ 0 ‖ salt)        (16 bytes)
    h_0  = blake2b(seed ‖ tokens of page 0),  h_i = blake2b(h_{i-1} ‖ tokens of page i)

Two tenants with different salts therefore never share a key, in the tree or in storage.
Hashing costs about 1 µs per page, so it is lazy: nodes cache theirs on first use and
:class:`PageHashes` computes a prompt's hashes only as far as they are read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import torch

from asynccache.errors import ConfigError

__all__ = ["TOKEN_BYTES", "PageHashes", "TokenIds", "chain_hashes", "encode_tokens", "seed_hash"]

TOKEN_BYTES = 8
_TOKEN_DTYPE = np.dtype("<i8")
_DIGEST_BYTES = 16

#: What the tree accepts as token ids. Arrays and tensors are converted without a Python loop;
#: a list of 128k ints costs ~2.5 ms to convert, an array ~35 µs.
TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def encode_tokens(tokens: TokenIds, page_size: int) -> tuple[bytes, int]:
    """The full pages of ``tokens`` as int64 little-endian bytes, and the number of pages."""
    if isinstance(tokens, torch.Tensor):
        arr = tokens.detach().to("cpu").numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (bytes, bytearray, memoryview, str)):
        raise ConfigError(f"token ids must be integers, got {type(tokens).__name__}")
    else:
        # The type is inferred, then checked: asked for int64, NumPy truncated floats (1.7 → 1)
        # and a list of floats matched, and was cached as, the prompt of their integer parts.
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"token ids must be a 1-D sequence of integers ({e})") from None
    if arr.ndim != 1:
        raise ConfigError(f"token ids must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu" and arr.size:
        raise ConfigError(f"token ids must be integers, got dtype {arr.dtype}")
    num_pages = arr.shape[0] // page_size
    return arr[: num_pages * page_size].astype(_TOKEN_DTYPE, copy=False).tobytes(), num_pages


def seed_hash(namespace: str, salt: str) -> bytes:
    """The chain's origin for one namespace (model, page size, dtypes, shard) and tenant salt."""
    if not isinstance(salt, str):
        raise ConfigError(f"salt must be a str, got {type(salt).__name__}")
    data = b"asynccache/tree/v1\0" + namespace.encode() + b"\0" + salt.encode()
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def chain_hashes(prev: bytes, key: bytes | memoryview, page_size: int, num_pages: int | None = None) -> list[bytes]:
    """Digests of the pages of ``key`` (whole pages), chained from ``prev``."""
    page_bytes = page_size * TOKEN_BYTES
    n = len(key) // page_bytes if num_pages is None else num_pages
    view = memoryview(key)
    out: list[bytes] = []
    blake2b = hashlib.blake2b
    for i in range(n):
        h = blake2b(prev, digest_size=_DIGEST_BYTES)
        h.update(view[i * page_bytes : (i + 1) * page_bytes])
        prev = h.digest()
        out.append(prev)
    return out


class PageHashes(Sequence[str]):
    """Hex hashes of every full page of a prompt, computed lazily up to the index read."""

    __slots__ = ("_buf", "_num_pages", "_page_size", "_raw", "_seed")

    def __init__(self, buf: bytes, num_pages: int, page_size: int, seed: bytes) -> None:
        self._buf = buf
        self._num_pages = num_pages
        self._page_size = page_size
        self._seed = seed
        self._raw: list[bytes] = []

    def __len__(self) -> int:
        return self._num_pages

    def _extend_to(self, n: int) -> None:
        have = len(self._raw)
        if n <= have:
            return
        page_bytes = self._page_size * TOKEN_BYTES
        prev = self._raw[-1] if have else self._seed
        view = memoryview(self._buf)[have * page_bytes : n * page_bytes]
        self._raw.extend(chain_hashes(prev, view, self._page_size, n - have))

    def raw(self, index: int) -> bytes:
        """The 16-byte digest of page ``index``."""
        if not -self._num_pages <= index < self._num_pages:
            raise IndexError(index)
        index %= self._num_pages
        self._extend_to(index + 1)
        return self._raw[index]

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            rng = range(*index.indices(self._num_pages))
            if len(rng):
                self._extend_to(max(rng) + 1)
            return [self._raw[i].hex() for i in rng]
        return self.raw(index).hex()

    def __iter__(self) -> Iterator[str]:
        self._extend_to(self._num_pages)
        return (h.hex() for h in self._raw)

    def __repr__(self) -> str:
        return f"PageHashes(num_pages={self._num_pages}, computed={len(self._raw)})"
