"""The infinite-cache bound of a trace: the token hit rate no policy or budget can beat.

For request ``i`` with input length ``L`` let ``m`` be the number of its leading tokens that an
earlier request (inputs only: traces give no ids for outputs) has seen: its leading blocks whose
ids appeared before, each counting the tokens of it seen before — a whole block, unless every
earlier occurrence of the id was the partial last block of a prompt (then the match ends inside
it). With an infinite cache that keeps a KV page and a state at every page boundary, the request
reuses

    hit_i = floor(min(m, L, L − 1) / page_size) · page_size

tokens: the matched tokens, cut to whole pages (only full pages are cached) and to ``L − 1``
(one token is always computed). For traces whose ids hash a block's content (Mooncake), a
reused id is always as long as before, and ``m`` is ``k · block_size`` for ``k`` leading
blocks seen before. The bound is ``Σ hit_i / Σ L``. With ``page_size == block_size``
(512 for the Mooncake traces) this is the block-granular bound; it is what every policy's
"fraction of bound" divides by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asynccache.errors import ConfigError
from asynccache.trace.loader import Trace

__all__ = ["BoundResult", "infinite_cache_bound", "matched_blocks", "matched_tokens"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundResult:
    hit_tokens: int
    prompt_tokens: int
    page_size: int
    per_request: np.ndarray  # int64 hit tokens per request

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def matched_blocks(trace: Trace) -> np.ndarray:
    """Per request, how many leading blocks appeared in an earlier request (int64)."""
    seen: set[int] = set()
    out = np.zeros(len(trace), dtype=np.int64)
    offsets, ids = trace.offsets, trace.hash_ids.tolist()
    for i in range(len(trace)):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        k = 0
        while lo + k < hi and ids[lo + k] in seen:
            k += 1
        out[i] = k
        seen.update(ids[lo + k : hi])
    return out


def matched_tokens(trace: Trace) -> np.ndarray:
    """Per request, how many leading tokens an earlier request saw (int64; see the module)."""
    bs = trace.block_size
    seen: dict[int, int] = {}  # id → most tokens of its block seen so far
    out = np.zeros(len(trace), dtype=np.int64)
    offsets, ids, lengths = trace.offsets, trace.hash_ids.tolist(), trace.input_lengths.tolist()
    for i in range(len(trace)):
        lo, hi, length = int(offsets[i]), int(offsets[i + 1]), lengths[i]
        m = 0
        for j in range(hi - lo):
            have = seen.get(ids[lo + j], 0)
            need = min(bs, length - j * bs)
            m += min(have, need)
            if have < need:
                break
        out[i] = m
        for j in range(hi - lo):
            size = min(bs, length - j * bs)
            if seen.get(ids[lo + j], 0) < size:
                seen[ids[lo + j]] = size
    return out


def infinite_cache_bound(trace: Trace, *, page_size: int) -> BoundResult:
    """The infinite-cache token hit rate of ``trace`` at ``page_size`` granularity (see module)."""
    if page_size <= 0 or trace.block_size % page_size:
        raise ConfigError(f"page_size {page_size} must divide the trace's block size {trace.block_size}")
    lengths = trace.input_lengths
    matched = np.minimum(np.minimum(matched_tokens(trace), lengths), lengths - 1)
    hit = (matched // page_size) * page_size
    return BoundResult(
        hit_tokens=int(hit.sum()), prompt_tokens=int(lengths.sum()), page_size=page_size, per_request=hit
    )
