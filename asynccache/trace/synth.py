"""Deterministic token ids from a trace's block hash ids.

Traces carry block ids, not tokens; the tree keys on tokens. :class:`TokenSynthesizer` maps every
block id to a fixed block of ``block_size`` token ids, so

- the same id always gives the same tokens (in any request, in any process, on any machine);
- different ids give different blocks: the first ``num_id_tokens`` tokens spell the id in base
  ``vocab_size`` (so no two blocks are equal even by accident), the rest are a SplitMix64 hash of
  ``(id, position)`` folded into the vocabulary. A block's first page tells it apart only when it
  holds all of those tokens: :func:`make_synthesizer` refuses pages shorter than
  ``num_id_tokens`` (different blocks would share pages, and a replay would hit more than the
  infinite-cache bound allows).

A request's prompt is the concatenation of its blocks, cut at ``input_length`` (the last block may
be partial). Everything is vectorised numpy over the request's blocks: a 12k-token prompt costs
tens of microseconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from asynccache.errors import ConfigError

if TYPE_CHECKING:
    from asynccache.spec import HybridSpec
    from asynccache.trace.loader import Trace

__all__ = ["TokenSynthesizer", "make_synthesizer"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over a uint64 array (wrapping arithmetic, arrays only)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class TokenSynthesizer:
    """Token ids for block ids: ``tokens(hash_ids, input_length) -> int64 array``."""

    def __init__(self, *, vocab_size: int, block_size: int, max_block_id: int = 2**40) -> None:
        if vocab_size < 2:
            raise ConfigError(f"vocab_size must be >= 2, got {vocab_size}")
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        # Enough base-vocab digits to spell every id up to max_block_id.
        digits, span = 1, vocab_size
        while span <= max_block_id:
            digits += 1
            span *= vocab_size
        if digits > block_size:
            raise ConfigError(f"block_size {block_size} is too small to spell ids < {max_block_id} in base {vocab_size}")
        self.num_id_tokens = digits
        self.max_block_id = max_block_id
        pos = np.arange(block_size, dtype=np.uint64)
        self._pos = pos
        self._place = np.asarray([vocab_size**k for k in range(digits - 1, -1, -1)], dtype=np.int64)

    def blocks(self, hash_ids: np.ndarray) -> np.ndarray:
        """``[len(hash_ids), block_size]`` int64 token ids of whole blocks."""
        ids = np.asarray(hash_ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > self.max_block_id):
            raise ConfigError(f"block ids must lie in 0..{self.max_block_id}")
        seeds = ids.astype(np.uint64)[:, None] * np.uint64(self.block_size) + self._pos[None, :]
        out = (_splitmix64(seeds) % np.uint64(self.vocab_size)).astype(np.int64)
        out[:, : self.num_id_tokens] = (ids[:, None] // self._place[None, :]) % self.vocab_size
        return out

    def tokens(self, hash_ids: np.ndarray, input_length: int) -> np.ndarray:
        """The prompt of a request: its blocks concatenated, cut at ``input_length``."""
        n = len(hash_ids)
        if not (n - 1) * self.block_size < input_length <= n * self.block_size:
            raise ConfigError(
                f"input_length {input_length} does not match {n} blocks of {self.block_size} tokens"
            )
        return self.blocks(hash_ids).reshape(-1)[:input_length]


def make_synthesizer(trace: Trace, spec: HybridSpec) -> TokenSynthesizer:
    """The synthesiser a replay of ``trace`` under ``spec`` uses. ``ConfigError`` when the page
    size does not divide the trace's block size, or when a page is shorter than the tokens that
    spell a block id (the first pages of different blocks could then be equal)."""
    page = spec.page_size
    if trace.block_size % page:
        raise ConfigError(f"page_size {page} must divide the trace block size {trace.block_size}")
    vocab = spec.vocab_size or 2**31 - 1
    synth = TokenSynthesizer(
        vocab_size=vocab, block_size=trace.block_size, max_block_id=max(int(trace.hash_ids.max()), 1)
    )
    if page < synth.num_id_tokens:
        raise ConfigError(
            f"page_size {page} is shorter than the {synth.num_id_tokens} tokens that spell a block id "
            f"(ids up to {synth.max_block_id:,} in a vocabulary of {vocab:,}): pages of different blocks "
            f"would be equal; use a page of at least {synth.num_id_tokens} tokens"
        )
    return synth
