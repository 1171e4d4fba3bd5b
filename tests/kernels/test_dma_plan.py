"""The DMA path's host side: segment planning (merging), the per-call method choice, the runtime binding.

No GPU: segments are applied to CPU buffers byte range by byte range and compared with the
torch-indexing reference; the runtime binding is checked where a CUDA runtime library loads.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.errors import TransferError
from asynccache.pools.base import ItemPool, PoolLayout
from kernels import copy_items, dma_plan
from kernels.api import COPY_METHODS, select_method
from kernels.dma_copy import launch_dma
from kernels.dma_plan import (
    STRIDED_MIN_GAIN,
    CopySegments,
    _plan_small,
    _runs_may_pay,
    plan_segments,
    plan_strided_runs,
    progression_rows,
)
from kernels.plan import DMA_MIN_RUN_BYTES, dma_run_bytes
from kernels.testing import (
    LAYOUT_PAIRS,
    CopyCase,
    assert_copied,
    index_pairs,
    make_item_pool,
    snapshot,
)


def _segments(src: ItemPool, dst: ItemPool, si: torch.Tensor, di: torch.Tensor, lb: int, le: int):
    return plan_segments(
        item_bytes=src.item_bytes,
        src_layer_stride_bytes=src.layer_stride_bytes,
        src_item_stride_bytes=src.item_stride_bytes,
        dst_layer_stride_bytes=dst.layer_stride_bytes,
        dst_item_stride_bytes=dst.item_stride_bytes,
        src_indices=si,
        dst_indices=di,
        layer_begin=lb,
        layer_end=le,
    )


def _apply(src: ItemPool, dst: ItemPool, si: torch.Tensor, di: torch.Tensor, lb: int, le: int) -> int:
    """Copy through the planned segments on CPU buffers; returns the number of segments."""
    seg = _segments(src, dst, si, di, lb, le)
    assert src.buffer is not None and dst.buffer is not None
    s, d = src.buffer.view(-1), dst.buffer.view(-1)
    for so, do, n in zip(seg.src_offsets.tolist(), seg.dst_offsets.tolist(), seg.sizes.tolist(), strict=True):
        d[do : do + n] = s[so : so + n]
    assert seg.num_bytes == si.numel() * (le - lb) * src.item_bytes
    return seg.num_copies


def _apply_runs(src: ItemPool, dst: ItemPool, si: torch.Tensor, di: torch.Tensor, lb: int, le: int) -> int:
    """Copy through the strided runs of the planned segments, row by row; returns the run count."""
    runs = plan_strided_runs(_segments(src, dst, si, di, lb, le))
    assert src.buffer is not None and dst.buffer is not None
    s, d = src.buffer.view(-1), dst.buffer.view(-1)
    cols = (runs.src_offsets, runs.dst_offsets, runs.widths, runs.heights, runs.src_pitches, runs.dst_pitches)
    for so, do, w, h, sp, dp in zip(*(c.tolist() for c in cols), strict=True):
        assert h >= 1 and sp >= w and dp >= w  # rows of a run never overlap
        for r in range(h):
            d[do + r * dp : do + r * dp + w] = s[so + r * sp : so + r * sp + w]
    assert int((runs.widths * runs.heights).sum()) == si.numel() * (le - lb) * src.item_bytes
    return runs.num_runs


@pytest.mark.parametrize("apply", ["segments", "strided runs"])
@settings(max_examples=60, deadline=None)
@given(
    layouts=st.sampled_from(LAYOUT_PAIRS),
    item_bytes=st.sampled_from([1, 3, 16, 48, 4097]),
    num_layers=st.integers(1, 4),
    data=st.data(),
)
def test_segments_and_runs_copy_exactly_the_mapped_items(
    apply: str, layouts: tuple[PoolLayout, PoolLayout], item_bytes: int, num_layers: int, data: st.DataObject
) -> None:
    case = CopyCase(item_bytes, torch.uint8)
    src = make_item_pool(num_layers=num_layers, num_items=9, case=case, layout=layouts[0], seed=1)
    dst = make_item_pool(num_layers=num_layers, num_items=11, case=case, layout=layouts[1], seed=2)
    count = data.draw(st.integers(0, 9))
    if data.draw(st.booleans()):  # consecutive indices on both sides: the runs a load produces
        s0, d0 = data.draw(st.integers(0, 9 - count)), data.draw(st.integers(0, 11 - count))
        si, di = torch.arange(s0, s0 + count), torch.arange(d0, d0 + count)
    else:
        si = torch.tensor(data.draw(st.permutations(range(9)))[:count], dtype=torch.int64)
        di = torch.tensor(data.draw(st.permutations(range(11)))[:count], dtype=torch.int64)
    lb = data.draw(st.integers(0, num_layers))
    le = data.draw(st.integers(lb, num_layers))
    src_before, dst_before = snapshot(src), snapshot(dst)
    (_apply if apply == "segments" else _apply_runs)(src, dst, si, di, lb, le)
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=lb, layer_end=le,
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    layouts=st.sampled_from(LAYOUT_PAIRS),
    item_bytes=st.sampled_from([1, 3, 16, 48]),
    num_layers=st.integers(1, 5),
    data=st.data(),
)
def test_progression_rows_copy_exactly_the_mapped_items(
    layouts: tuple[PoolLayout, PoolLayout], item_bytes: int, num_layers: int, data: st.DataObject
) -> None:
    """Index lists made of pieces consecutive on both sides (a load) are planned without the
    vector planner: the rows, applied on CPU buffers, copy exactly the mapped items; lists of
    too many pieces are left to the planner."""
    case = CopyCase(item_bytes, torch.uint8)
    src = make_item_pool(num_layers=num_layers, num_items=24, case=case, layout=layouts[0], seed=1)
    dst = make_item_pool(num_layers=num_layers, num_items=24, case=case, layout=layouts[1], seed=2)
    # Pieces: split a permutation of runs of consecutive indices on each side.
    count = data.draw(st.integers(1, 24))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, count - 1)), max_size=4)))) if count > 1 else []
    bounds = [0, *[c for c in cuts if c < count], count]
    pieces = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    order = data.draw(st.permutations(range(len(pieces))))
    si = torch.cat([torch.arange(*pieces[i]) for i in order])  # each piece consecutive
    di = torch.arange(24 - count, 24) if data.draw(st.booleans()) else torch.arange(count)
    lb = data.draw(st.integers(0, num_layers - 1))
    le = data.draw(st.integers(lb + 1, num_layers))
    planned = progression_rows(src, dst, si, di, lb, le)
    if planned is None:  # too many pieces, or both pools page_first over several layers
        return
    engine, rows, _ = planned
    assert engine in ("loop", "strided") and len(rows) <= max(STRIDED_MIN_GAIN, count * (le - lb) // STRIDED_MIN_GAIN)
    assert src.buffer is not None and dst.buffer is not None
    src_before, dst_before = snapshot(src), snapshot(dst)
    s, d = src.buffer.view(-1), dst.buffer.view(-1)
    for so, do, w, h, sp, dp in rows:
        assert sp >= w and dp >= w  # rows never overlap
        for r in range(h):
            d[do + r * dp : do + r * dp + w] = s[so + r * sp : so + r * sp + w]
    assert sum(w * h for _, _, w, h, _, _ in rows) == count * (le - lb) * item_bytes
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=lb, layer_end=le,
    )  # fmt: skip


def test_scattered_indices_are_left_to_the_planner() -> None:
    case = CopyCase(16, torch.uint8)
    host = make_item_pool(num_layers=2, num_items=32, case=case, layout=PoolLayout.PAGE_FIRST, seed=1)
    dev = make_item_pool(num_layers=2, num_items=32, case=case, layout=PoolLayout.LAYER_FIRST, seed=2)
    si = torch.tensor([5, 3, 9, 1, 30, 12, 7, 20])
    assert progression_rows(host, dev, si, torch.arange(8), 0, 1) is None


def test_a_load_after_a_flush_is_planned_as_one_call_per_layer_range() -> None:
    """The copies of a long-prefix load: a layer of 512 consecutive KV pages from a page_first
    host pool is one 2D copy (two when the device pages come in two pieces); the states of
    three consecutive layers of one slot are one 2D copy too."""
    case = CopyCase(64, torch.uint8)
    host = make_item_pool(num_layers=8, num_items=600, case=case, layout=PoolLayout.PAGE_FIRST, seed=1)
    dev = make_item_pool(num_layers=8, num_items=700, case=case, layout=PoolLayout.LAYER_FIRST, seed=2)
    pages = progression_rows(host, dev, torch.arange(20, 532), torch.arange(100, 612), 3, 4)
    assert pages == ("strided", ((3 * 64 + 20 * 8 * 64, 3 * 700 * 64 + 100 * 64, 64, 512, 8 * 64, 64),), 512)
    two = progression_rows(host, dev, torch.arange(20, 532), torch.cat((torch.arange(300, 312), torch.arange(500))), 0, 1)
    assert two == ("strided", ((20 * 8 * 64, 300 * 64, 64, 12, 8 * 64, 64), (32 * 8 * 64, 0, 64, 500, 8 * 64, 64)), 512)
    states = progression_rows(host, dev, torch.tensor([5]), torch.tensor([9]), 0, 3)
    assert states == ("strided", ((5 * 8 * 64, 9 * 64, 64, 3, 64, 700 * 64),), 3)


@pytest.mark.parametrize(
    ("layouts", "layer_range", "want"),
    [
        ((PoolLayout.LAYER_FIRST, PoolLayout.LAYER_FIRST), (0, 3), 3 * 3),  # 3 runs per layer
        ((PoolLayout.LAYER_FIRST, PoolLayout.LAYER_FIRST), (1, 2), 3),
        ((PoolLayout.PAGE_FIRST, PoolLayout.PAGE_FIRST), (0, 3), 3),  # runs cover all layers
        ((PoolLayout.PAGE_FIRST, PoolLayout.PAGE_FIRST), (0, 2), 7),  # one item's layers, no more
        ((PoolLayout.PAGE_FIRST, PoolLayout.LAYER_FIRST), (0, 3), 21),  # nothing is adjacent on both sides
        ((PoolLayout.LAYER_FIRST, PoolLayout.PAGE_FIRST), (0, 3), 21),
    ],
)
def test_adjacent_items_merge(layouts: tuple[PoolLayout, PoolLayout], layer_range: tuple[int, int], want: int) -> None:
    case = CopyCase(48, torch.float32)
    src = make_item_pool(num_layers=3, num_items=16, case=case, layout=layouts[0], seed=1)
    dst = make_item_pool(num_layers=3, num_items=16, case=case, layout=layouts[1], seed=2)
    si, di = torch.tensor([3, 4, 5, 6, 11, 0, 1]), torch.tensor([8, 9, 10, 11, 2, 14, 15])
    src_before, dst_before = snapshot(src), snapshot(dst)
    assert _apply(src, dst, si, di, *layer_range) == want
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=layer_range[0], layer_end=layer_range[1],
    )  # fmt: skip


def test_whole_pool_in_order_is_one_segment() -> None:
    case = CopyCase(16, torch.uint8)
    src = make_item_pool(num_layers=2, num_items=5, case=case, layout=PoolLayout.LAYER_FIRST)
    dst = make_item_pool(num_layers=2, num_items=5, case=case, layout=PoolLayout.LAYER_FIRST)
    seg = _segments(src, dst, torch.arange(5), torch.arange(5), 0, 2)
    assert seg.num_copies == 1 and seg.sizes.tolist() == [2 * 5 * 16]


def test_offsets_are_int64_past_4_gib() -> None:
    seg = plan_segments(
        item_bytes=1 << 20, src_layer_stride_bytes=4608 << 20, src_item_stride_bytes=1 << 20,
        dst_layer_stride_bytes=1 << 20, dst_item_stride_bytes=2 << 20,
        src_indices=torch.tensor([4607]), dst_indices=torch.tensor([1]), layer_begin=1, layer_end=2,
    )  # fmt: skip
    assert seg.src_offsets.dtype == torch.int64
    assert seg.src_offsets.tolist() == [(4608 + 4607) << 20]
    assert seg.dst_offsets.tolist() == [(1 + 2) << 20]


def test_one_layer_of_consecutive_pages_is_one_strided_run() -> None:
    """A per-layer load, page_first host → layer_first device, consecutive indices on both sides:
    every page is its own segment, and all of them are one run (rows = pages)."""
    case = CopyCase(4096, torch.uint8)
    host = make_item_pool(num_layers=4, num_items=40, case=case, layout=PoolLayout.PAGE_FIRST, seed=1)
    dev = make_item_pool(num_layers=4, num_items=40, case=case, layout=PoolLayout.LAYER_FIRST, seed=2)
    si, di = torch.arange(5, 37), torch.arange(2, 34)
    seg = _segments(host, dev, si, di, 2, 3)
    runs = plan_strided_runs(seg)
    assert seg.num_copies == 32 and runs.num_runs == 1
    assert runs.heights.tolist() == [32] and runs.widths.tolist() == [4096]
    assert runs.src_pitches.tolist() == [host.item_stride_bytes] and runs.dst_pitches.tolist() == [4096]
    # A gap on one side starts a new run; a lone segment is a run of one row.
    si2 = torch.cat((torch.arange(0, 10), torch.tensor([20]), torch.arange(30, 40)))
    runs = plan_strided_runs(_segments(host, dev, si2, torch.arange(21), 0, 1))
    assert runs.heights.tolist() == [10, 1, 10]
    none = torch.empty(0, dtype=torch.int64)
    assert plan_strided_runs(_segments(host, dev, none, none, 0, 1)).num_runs == 0


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_quick_bound_never_rejects_runs_that_pay(data: st.DataObject) -> None:
    """``auto`` skips planning runs when the vectorized bound says they cannot pay: it must never
    say so where the planner would have found them."""
    case = CopyCase(4096, torch.uint8)
    host = make_item_pool(num_layers=2, num_items=64, case=case, layout=PoolLayout.PAGE_FIRST, seed=1)
    dev = make_item_pool(num_layers=2, num_items=64, case=case, layout=PoolLayout.LAYER_FIRST, seed=2)
    count = data.draw(st.integers(1, 32))
    scattered = torch.tensor(data.draw(st.permutations(range(64)))[:count])
    si = scattered if data.draw(st.booleans()) else torch.arange(count)
    di = torch.tensor(sorted(data.draw(st.permutations(range(64)))[:count]))
    seg = _segments(host, dev, si, di, 0, data.draw(st.integers(1, 2)))
    if plan_strided_runs(seg).num_runs * STRIDED_MIN_GAIN <= seg.num_copies:
        assert _runs_may_pay(seg)
    assert _runs_may_pay(_segments(host, dev, torch.arange(32), torch.arange(32), 0, 1))


def _greedy_runs(src: list[int], dst: list[int], size: list[int], max_pitch: int) -> list[tuple[int, ...]]:
    """The run grouping written as the plain per-segment loop of its definition
    (``plan_strided_runs``' docstring): the reference the vectorized planner must equal."""

    def fits(k: int, w: int) -> bool:
        return all(w <= p <= max_pitch for p in (src[k + 1] - src[k], dst[k + 1] - dst[k]))

    runs, k, n = [], 0, len(size)
    while k < n:
        w, h, sp, dp = size[k], 1, size[k], size[k]
        if k + 1 < n and size[k + 1] == w and fits(k, w):
            sp, dp = src[k + 1] - src[k], dst[k + 1] - dst[k]
            h = 2
            while k + h < n and size[k + h] == w and (src[k + h] - src[k + h - 1], dst[k + h] - dst[k + h - 1]) == (sp, dp):
                h += 1
            if h == 2 and k + 2 < n and size[k + 2] == w and fits(k + 1, w):
                h, sp, dp = 1, w, w
        runs.append((src[k], dst[k], w, h, sp, dp))
        k += h
    return runs


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_strided_runs_equal_the_greedy_definition(data: st.DataObject) -> None:
    """The vectorized planner groups exactly as the per-segment greedy loop does: segments built
    from short strided pieces with random widths, strides and gaps (ties, pairs, lone segments,
    pitches at and past the limit)."""
    src, dst, size = [], [], []
    s = d = 0
    for _ in range(data.draw(st.integers(0, 8))):
        w = data.draw(st.sampled_from([8, 16, 24]))
        sp, dp = data.draw(st.sampled_from([8, 16, 24, 40])), data.draw(st.sampled_from([8, 16, 24, 40]))
        for _ in range(data.draw(st.integers(1, 5))):
            src.append(s), dst.append(d), size.append(w)
            s, d = s + sp, d + dp
        s += data.draw(st.sampled_from([0, 8, 64]))
        d += data.draw(st.sampled_from([0, 8, 64]))
    max_pitch = data.draw(st.sampled_from([16, 24, 1 << 20]))
    seg = CopySegments(
        src_offsets=torch.tensor(src, dtype=torch.int64),
        dst_offsets=torch.tensor(dst, dtype=torch.int64),
        sizes=torch.tensor(size, dtype=torch.int64),
    )
    runs = plan_strided_runs(seg, max_pitch=max_pitch)
    cols = (runs.src_offsets, runs.dst_offsets, runs.widths, runs.heights, runs.src_pitches, runs.dst_pitches)
    assert list(zip(*(c.tolist() for c in cols), strict=True)) == _greedy_runs(src, dst, size, max_pitch)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_small_copies_are_planned_as_the_vector_planner_plans_them(data: st.DataObject) -> None:
    """Copies of a few items take a plain-Python planner: the same segments, in the same order,
    as the vectorized one, for both item orders (an item's layers adjacent or not)."""
    item = data.draw(st.sampled_from([16, 48]))
    items = 12
    adjacent = data.draw(st.booleans())
    layers = 3
    src_ls, src_is = (item, layers * item) if adjacent else (items * item, item)
    dst_ls, dst_is = (item, layers * item) if adjacent or data.draw(st.booleans()) else (items * item, item)
    n = data.draw(st.integers(0, 4))
    si = torch.tensor(data.draw(st.permutations(range(items)))[:n], dtype=torch.int64)
    di = torch.tensor(data.draw(st.permutations(range(items)))[:n], dtype=torch.int64)
    lb = data.draw(st.integers(0, layers - 1))
    le = data.draw(st.integers(lb, layers))
    strides = (item, src_ls, src_is, dst_ls, dst_is)
    small = _plan_small(*strides, si.tolist(), di.tolist(), range(lb, le))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dma_plan, "_SMALL_PLAN", -1)  # every copy through the vector ops
        vector = plan_segments(
            item_bytes=item, src_layer_stride_bytes=src_ls, src_item_stride_bytes=src_is,
            dst_layer_stride_bytes=dst_ls, dst_item_stride_bytes=dst_is,
            src_indices=si, dst_indices=di, layer_begin=lb, layer_end=le,
        )  # fmt: skip
    for a, b in ((small.src_offsets, vector.src_offsets), (small.dst_offsets, vector.dst_offsets), (small.sizes, vector.sizes)):
        assert a.dtype == b.dtype == torch.int64 and a.tolist() == b.tolist()


def test_strided_runs_respect_the_pitch_limit() -> None:
    seg = plan_segments(
        item_bytes=16, src_layer_stride_bytes=16, src_item_stride_bytes=1 << 20,
        dst_layer_stride_bytes=16, dst_item_stride_bytes=16,
        src_indices=torch.arange(4), dst_indices=torch.arange(4), layer_begin=0, layer_end=1,
    )  # fmt: skip
    assert plan_strided_runs(seg).num_runs == 1
    assert plan_strided_runs(seg, max_pitch=(1 << 20) - 1).heights.tolist() == [1, 1, 1, 1]


# ---- the method choice ----------------------------------------------------------------------------


def _pair(item_bytes: int, layouts: tuple[PoolLayout, PoolLayout], num_layers: int = 4) -> tuple[ItemPool, ItemPool]:
    def make(layout: PoolLayout) -> ItemPool:
        return ItemPool(name="p", layer_ids=tuple(range(num_layers)), num_items=2, item_bytes=item_bytes,
                        layout=layout, materialize=False)  # fmt: skip

    return make(layouts[0]), make(layouts[1])


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
def test_auto_sends_large_items_to_the_copy_engines(layouts: tuple[PoolLayout, PoolLayout]) -> None:
    big, small = DMA_MIN_RUN_BYTES, DMA_MIN_RUN_BYTES - 16
    assert select_method(*_pair(big, layouts)) == "dma"
    assert select_method(*_pair(big, layouts), method="auto", layer_begin=2, layer_end=3) == "dma"
    assert select_method(*_pair(small, layouts), layer_begin=1, layer_end=2) == "triton"
    for method in ("triton", "dma"):  # an explicit choice is taken as given
        assert select_method(*_pair(small, layouts), method=method) == method
        assert select_method(*_pair(big, layouts), method=method) == method


def test_auto_counts_an_items_adjacent_layers_as_one_run() -> None:
    """page_first on both sides: an item's layers are one contiguous run of the copy."""
    item = DMA_MIN_RUN_BYTES // 4
    both_page_first = (PoolLayout.PAGE_FIRST, PoolLayout.PAGE_FIRST)
    assert select_method(*_pair(item, both_page_first, num_layers=4)) == "dma"
    assert select_method(*_pair(item, both_page_first, num_layers=4), layer_begin=0, layer_end=3) == "triton"
    assert select_method(*_pair(item, (PoolLayout.PAGE_FIRST, PoolLayout.LAYER_FIRST), num_layers=4)) == "triton"
    assert dma_run_bytes(item_bytes=8, src_layer_stride_bytes=8, dst_layer_stride_bytes=8, num_layers=5) == 40
    assert dma_run_bytes(item_bytes=8, src_layer_stride_bytes=8, dst_layer_stride_bytes=16, num_layers=5) == 8
    assert dma_run_bytes(item_bytes=8, src_layer_stride_bytes=8, dst_layer_stride_bytes=8, num_layers=1) == 8


def test_unknown_method_is_rejected_on_every_path() -> None:
    assert COPY_METHODS == ("auto", "triton", "dma")
    src, dst = _pair(16, LAYOUT_PAIRS[0])
    with pytest.raises(TransferError, match="unknown copy method"):
        select_method(src, dst, method="cuda")
    with pytest.raises(TransferError, match="unknown copy method"):
        copy_items(src, dst, torch.tensor([0]), torch.tensor([1]), method="fast")


@pytest.mark.parametrize("method", [None, "auto", "triton", "dma"])
def test_cpu_pools_copy_through_torch_whatever_the_method(method: str | None) -> None:
    case = CopyCase(DMA_MIN_RUN_BYTES, torch.uint8)
    src = make_item_pool(num_layers=2, num_items=3, case=case, layout=PoolLayout.PAGE_FIRST, seed=1)
    dst = make_item_pool(num_layers=2, num_items=4, case=case, layout=PoolLayout.LAYER_FIRST, seed=2)
    si, di = index_pairs("scattered", src_items=3, dst_items=4, seed=3)
    src_before, dst_before = snapshot(src), snapshot(dst)
    assert copy_items(src, dst, si, di, method=method) == si.numel() * 2 * case.item_bytes
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=0, layer_end=2,
    )  # fmt: skip


def test_launch_dma_rejects_host_only_copies_before_touching_the_runtime() -> None:
    case = CopyCase(16, torch.uint8)
    src = make_item_pool(num_layers=1, num_items=2, case=case, layout=PoolLayout.LAYER_FIRST)
    dst = make_item_pool(num_layers=1, num_items=2, case=case, layout=PoolLayout.LAYER_FIRST)
    with pytest.raises(TransferError, match="CUDA buffer"):
        launch_dma(src, dst, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(TransferError, match="index count"):
        launch_dma(src, dst, torch.tensor([0]), torch.tensor([1, 0]))


def test_one_state_loaded_into_several_slots_is_a_few_rows() -> None:
    """A tail's end state copied into two device slots (one host slot repeated): one 2D copy per
    slot over the layer range, not the vector planner's batch."""
    case = CopyCase(64, torch.uint8)
    host = make_item_pool(num_layers=8, num_items=4, case=case, layout=PoolLayout.PAGE_FIRST, seed=1)
    dev = make_item_pool(num_layers=8, num_items=6, case=case, layout=PoolLayout.LAYER_FIRST, seed=2)
    planned = progression_rows(host, dev, torch.tensor([3, 3]), torch.tensor([1, 4]), 2, 5)
    src = 2 * 64 + 3 * 8 * 64  # layer 2 of host slot 3
    rows = tuple((src, 2 * 6 * 64 + slot * 64, 64, 3, 64, 6 * 64) for slot in (1, 4))
    assert planned == ("strided", rows, 6)
