"""Launch planning: word width, chunking, tiles and grid (pure host-side arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asynccache.errors import TransferError
from kernels.plan import (
    DEFAULT_MAX_CTAS,
    DEFAULT_TUNING,
    CopyTuning,
    choose_chunk_words,
    plan_copy,
    word_bytes_for,
)


@pytest.mark.parametrize(
    ("values", "word"),
    [
        ((4096, 0, 4096, 4096 * 8), 16),
        ((2146304, 2146304 * 36, 2146304), 16),
        ((4100, 4100 * 3), 4),
        ((8200,), 8),
        ((6,), 2),
        ((13,), 1),
        ((4096, 4096, 1 << 40 | 8), 8),  # a base address aligned to 8 only
    ],
)
def test_word_is_widest_common_power_of_two(values: tuple[int, ...], word: int) -> None:
    assert word_bytes_for(*values) == word


@given(
    item_words=st.integers(1, 1 << 20),
    align_log=st.integers(0, 2),
    max_chunk_log=st.integers(0, 14),
)
def test_chunk_is_aligned_power_of_two_with_little_padding(item_words: int, align_log: int, max_chunk_log: int) -> None:
    align = 1 << align_log
    item_words *= align
    chunk = choose_chunk_words(item_words, align_words=align, max_chunk_words=1 << max_chunk_log)
    assert chunk & (chunk - 1) == 0
    assert chunk % align == 0
    assert chunk <= max(align, 1 << max_chunk_log)
    padded = math.ceil(item_words / chunk) * chunk
    assert chunk == align or (padded - item_words) * 8 <= padded


def _plan(item_bytes: int, num_pairs: int, layers: tuple[int, int] = (0, 4), max_ctas: int = 8, **tuning: object):
    return plan_copy(
        item_bytes=item_bytes,
        src_layer_stride_bytes=item_bytes,
        src_item_stride_bytes=item_bytes * 4,
        dst_layer_stride_bytes=item_bytes * 1000,
        dst_item_stride_bytes=item_bytes,
        src_address=1 << 20,
        dst_address=1 << 30,
        num_pairs=num_pairs,
        layer_begin=layers[0],
        layer_end=layers[1],
        max_ctas=max_ctas,
        tuning=CopyTuning(**tuning),  # type: ignore[arg-type]
    )


@given(
    item_bytes=st.integers(1, 3 << 20),
    num_pairs=st.integers(1, 5000),
    max_ctas=st.integers(1, 200),
    tile_log=st.integers(5, 17),
)
def test_plan_covers_every_task_once(item_bytes: int, num_pairs: int, max_ctas: int, tile_log: int) -> None:
    plan = _plan(item_bytes, num_pairs, max_ctas=max_ctas, tile_bytes=1 << tile_log)
    assert plan.num_tasks == 4 * num_pairs * plan.num_chunks
    assert plan.num_chunks * plan.chunk_words >= plan.item_words > (plan.num_chunks - 1) * plan.chunk_words
    assert plan.num_iters * plan.rows >= plan.num_tasks > (plan.num_iters - 1) * plan.rows
    assert 1 <= plan.grid <= max_ctas and plan.grid <= plan.num_iters
    assert plan.rows >= 2 and plan.rows & (plan.rows - 1) == 0
    assert plan.item_words * plan.word_dtype.itemsize == item_bytes
    assert plan.num_bytes == 4 * num_pairs * item_bytes
    assert plan.src_item_stride * plan.word_dtype.itemsize == item_bytes * 4


def test_four_kib_pages_put_several_items_in_one_tile() -> None:
    plan = _plan(4096, 1000, tile_bytes=32768)
    assert plan.word_bytes == 16 and plan.word_dtype == torch.int32 and plan.align_words == 4
    assert plan.chunk_words == 1024 and plan.rows == 8 and plan.even


def test_state_items_are_chunked_without_padding() -> None:
    plan = _plan(2146304, 64)
    assert plan.even and plan.num_chunks * plan.chunk_words == plan.item_words


def test_wide_only_past_int32() -> None:
    assert not _plan(4096, 1000).wide
    huge = _plan(1, 2**31, layers=(0, 2), tile_bytes=32)
    assert huge.wide


def test_bad_arguments_raise() -> None:
    with pytest.raises(TransferError, match="max_ctas"):
        _plan(4096, 10, max_ctas=0)
    with pytest.raises(TransferError, match="at least one"):
        _plan(4096, 0)
    with pytest.raises(TransferError, match="num_warps"):
        CopyTuning(num_warps=3)
    with pytest.raises(TransferError, match="tile_bytes"):
        CopyTuning(tile_bytes=1000)


def test_defaults_are_sane() -> None:
    assert 1 <= DEFAULT_MAX_CTAS <= 16
    assert set(DEFAULT_TUNING) == {"h2d", "d2h", "d2d"}
