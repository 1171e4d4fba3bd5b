from __future__ import annotations

import pytest
from trace_builders import BLOCK, make_trace

from asynccache.errors import ConfigError
from asynccache.trace.bound import infinite_cache_bound, matched_blocks


def test_bound_counts_previously_seen_full_pages_capped_at_length_minus_one() -> None:
    # Lengths: 3 blocks - 7 = 17 tokens each (partial=1 → last block holds 1 token).
    trace = make_trace([(0, [0, 1, 2]), (1, [0, 1, 3]), (2, [0, 4, 5]), (3, [0, 1, 2])])
    assert matched_blocks(trace).tolist() == [0, 2, 1, 3]
    b = infinite_cache_bound(trace, page_size=BLOCK)
    # Request 3 saw all 3 blocks but may reuse at most L-1 = 16 tokens = 2 pages.
    assert b.per_request.tolist() == [0, 16, 8, 16]
    assert b.prompt_tokens == 4 * 17
    assert b.hit_rate == pytest.approx(40 / 68)


def test_bound_at_a_finer_page_size_and_exact_lengths() -> None:
    trace = make_trace([(0, [0, 1]), (1, [0, 1])], partial=BLOCK)  # 16 tokens, all full
    # Second request: 2 blocks seen, capped at L-1 = 15 → 12 with pages of 4, 8 with pages of 8.
    assert infinite_cache_bound(trace, page_size=4).per_request.tolist() == [0, 12]
    assert infinite_cache_bound(trace, page_size=8).per_request.tolist() == [0, 8]
    with pytest.raises(ConfigError):
        infinite_cache_bound(trace, page_size=3)


def test_a_block_seen_only_as_a_partial_last_block_counts_its_seen_tokens() -> None:
    """An id first seen as the partial last block of a prompt (1 of 8 tokens) and reused later
    as a full block: the later request has seen 8 + 1 tokens, not 16 — the bound stays one an
    infinite every-page cache can reach."""
    from asynccache.trace.bound import matched_tokens
    from asynccache.trace.loader import Trace

    trace = Trace.from_requests([(0.0, 9, 1, [0, 1]), (1.0, 16, 1, [0, 1])], block_size=8)
    assert matched_tokens(trace).tolist() == [0, 9]
    assert infinite_cache_bound(trace, page_size=4).per_request.tolist() == [0, 8]
    # Seen whole later, the block counts whole from then on.
    trace = Trace.from_requests([(0.0, 9, 1, [0, 1]), (1.0, 16, 1, [0, 1]), (2.0, 16, 1, [0, 1])], block_size=8)
    assert matched_tokens(trace).tolist() == [0, 9, 16]
