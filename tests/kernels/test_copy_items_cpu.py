"""copy_items on CPU pools (the torch-indexing path): every layout pair, dtype, awkward size."""

from __future__ import annotations

import pytest
import torch

from asynccache.errors import TransferError
from asynccache.pools.base import ItemPool, PoolLayout
from kernels import PoolPair, copy_items, layer_copier
from kernels.api import check_overlap, shares_buffer
from kernels.testing import (
    COPY_CASES,
    LAYOUT_PAIRS,
    CopyCase,
    assert_copied,
    index_pairs,
    make_item_pool,
    snapshot,
)

NUM_LAYERS = 3


def _run_case(case: CopyCase, layouts: tuple[PoolLayout, PoolLayout], kind: str, layer_range: tuple[int, int]) -> None:
    src = make_item_pool(num_layers=NUM_LAYERS, num_items=7, case=case, layout=layouts[0], seed=1)
    dst = make_item_pool(num_layers=NUM_LAYERS, num_items=9, case=case, layout=layouts[1], seed=2)
    si, di = index_pairs(kind, src_items=7, dst_items=9, seed=3)
    src_before, dst_before = snapshot(src), snapshot(dst)
    lb, le = layer_range
    nbytes = copy_items(src, dst, si, di, layer_begin=lb, layer_end=le)
    assert nbytes == si.numel() * (le - lb) * case.item_bytes
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=lb, layer_end=le,
    )  # fmt: skip


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("kind", ["scattered", "single", "all"])
def test_copy_matches_reference(case: CopyCase, layouts: tuple[PoolLayout, PoolLayout], kind: str) -> None:
    _run_case(case, layouts, kind, (0, NUM_LAYERS))


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
@pytest.mark.parametrize("layer_range", [(1, 2), (0, 1), (2, 3)])
def test_layer_subrange_leaves_other_layers(layouts: tuple[PoolLayout, PoolLayout], layer_range: tuple[int, int]) -> None:
    _run_case(CopyCase(48, torch.float32), layouts, "scattered", layer_range)


def test_empty_index_list_copies_nothing() -> None:
    case = CopyCase(20, torch.float32)
    src = make_item_pool(num_layers=2, num_items=4, case=case, layout=PoolLayout.LAYER_FIRST, seed=1)
    dst = make_item_pool(num_layers=2, num_items=4, case=case, layout=PoolLayout.PAGE_FIRST, seed=2)
    before = snapshot(dst)
    si, di = index_pairs("empty", src_items=4, dst_items=4)
    assert copy_items(src, dst, si, di) == 0
    assert torch.equal(snapshot(dst), before)


def test_typed_values_survive_a_round_trip() -> None:
    """bf16 values written through a typed view come back identical after h→d→h."""
    case = CopyCase(64, torch.bfloat16)
    host = make_item_pool(num_layers=2, num_items=5, case=case, layout=PoolLayout.PAGE_FIRST, seed=4)
    dev = make_item_pool(num_layers=2, num_items=5, case=case, layout=PoolLayout.LAYER_FIRST, seed=5)
    back = make_item_pool(num_layers=2, num_items=5, case=case, layout=PoolLayout.PAGE_FIRST, seed=6)
    idx = torch.tensor([4, 0, 2])
    copy_items(host, dev, idx, torch.tensor([1, 3, 0]))
    copy_items(dev, back, torch.tensor([1, 3, 0]), idx)
    assert host.buffer is not None and back.buffer is not None
    want = host.buffer[idx].view(torch.bfloat16)
    got = back.buffer[idx].view(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_accounting_mode_counts_bytes_and_copies_nothing() -> None:
    a = ItemPool(name="a", layer_ids=(0, 1), num_items=4, item_bytes=100, materialize=False)
    b = ItemPool(name="b", layer_ids=(0, 1), num_items=4, item_bytes=100, materialize=False)
    assert copy_items(a, b, torch.tensor([0, 3]), torch.tensor([1, 2])) == 2 * 2 * 100


# ---- validation: every misuse is a TransferError before anything is touched -------------------


def _pools(item_bytes: int = 16, **dst_kwargs: object) -> tuple[ItemPool, ItemPool]:
    src = ItemPool(name="s", layer_ids=(0, 1), num_items=4, item_bytes=item_bytes)
    kwargs: dict[str, object] = {"name": "d", "layer_ids": (0, 1), "num_items": 4, "item_bytes": item_bytes}
    kwargs.update(dst_kwargs)
    return src, ItemPool(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("src_idx", "dst_idx", "message"),
    [
        (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]), "int64"),
        (torch.tensor([0, 4]), torch.tensor([0, 1]), "out of range"),
        (torch.tensor([-1]), torch.tensor([0]), "out of range"),
        (torch.tensor([0, 1]), torch.tensor([0]), "count mismatch"),
        (torch.tensor([[0, 1]]), torch.tensor([[0, 1]]), "1-D"),
        ([0, 1], torch.tensor([0, 1]), "must be a tensor"),
        (torch.tensor([0, 1]), torch.tensor([2, 2]), "twice"),
    ],
)
def test_bad_indices_raise(src_idx: object, dst_idx: torch.Tensor, message: str) -> None:
    src, dst = _pools()
    before = snapshot(dst)
    with pytest.raises(TransferError, match=message):
        copy_items(src, dst, src_idx, dst_idx)  # type: ignore[arg-type]
    assert torch.equal(snapshot(dst), before)


def test_mismatched_geometry_raises() -> None:
    src, dst = _pools(item_bytes=16)
    _, other = _pools(item_bytes=32)
    with pytest.raises(TransferError, match="item size mismatch"):
        copy_items(src, other, torch.tensor([0]), torch.tensor([0]))
    three = ItemPool(name="t", layer_ids=(0, 1, 2), num_items=4, item_bytes=16)
    with pytest.raises(TransferError, match="layer count mismatch"):
        copy_items(src, three, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(TransferError, match="layer range"):
        copy_items(src, dst, torch.tensor([0]), torch.tensor([0]), layer_begin=1, layer_end=3)


def test_non_byte_or_non_contiguous_buffer_raises() -> None:
    src, dst = _pools()
    assert dst.buffer is not None
    dst.buffer = dst.buffer.view(torch.int32)
    with pytest.raises(TransferError, match="uint8"):
        copy_items(src, dst, torch.tensor([0]), torch.tensor([0]))
    src2, dst2 = _pools()
    assert dst2.buffer is not None
    dst2.buffer = torch.empty(2 * dst2.buffer.numel(), dtype=torch.uint8)[::2]
    with pytest.raises(TransferError, match="contiguous"):
        copy_items(src2, dst2, torch.tensor([0]), torch.tensor([0]))


def test_materialized_to_accounting_raises() -> None:
    src, _ = _pools()
    ghost = ItemPool(name="g", layer_ids=(0, 1), num_items=4, item_bytes=16, materialize=False)
    with pytest.raises(TransferError, match="accounting"):
        copy_items(src, ghost, torch.tensor([0]), torch.tensor([0]))


def test_launcher_rejects_cpu_buffers_without_the_interpreter() -> None:
    """The compiled launcher refuses CPU-only copies (they belong to copy_items' torch path)."""
    from kernels import triton_copy

    assert not triton_copy.interpreting()
    case = CopyCase(16, torch.uint8)
    src = make_item_pool(num_layers=1, num_items=2, case=case, layout=PoolLayout.LAYER_FIRST)
    dst = make_item_pool(num_layers=1, num_items=2, case=case, layout=PoolLayout.LAYER_FIRST)
    with pytest.raises(TransferError, match="CUDA buffer"):
        triton_copy.launch_copy(src, dst, torch.tensor([0]), torch.tensor([1]))


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
def test_layer_copier_copies_each_layer_like_copy_items(layouts: tuple[PoolLayout, PoolLayout]) -> None:
    """A layer-by-layer copier issues, per call, exactly ``copy_items`` of that one layer."""
    case = CopyCase(48, torch.float32)
    src = make_item_pool(num_layers=NUM_LAYERS, num_items=7, case=case, layout=layouts[0], seed=1)
    dst = make_item_pool(num_layers=NUM_LAYERS, num_items=9, case=case, layout=layouts[1], seed=2)
    si, di = index_pairs("scattered", src_items=7, dst_items=9, seed=3)
    src_before, dst_before = snapshot(src), snapshot(dst)
    copy = layer_copier(src, dst, si, di)
    assert copy(1) == si.numel() * case.item_bytes
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=1, layer_end=2,
    )  # fmt: skip
    for layer in (0, 2):
        copy(layer)
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=0, layer_end=NUM_LAYERS,
    )  # fmt: skip


def test_layer_copier_validates_once_up_front_and_each_layer_position() -> None:
    src, dst = _pools()
    before = snapshot(dst)
    with pytest.raises(TransferError, match="out of range"):
        layer_copier(src, dst, torch.tensor([0, 4]), torch.tensor([1, 2]))
    with pytest.raises(TransferError, match="unknown copy method"):
        layer_copier(src, dst, torch.tensor([0]), torch.tensor([1]), method="fastest")
    copy = layer_copier(src, dst, torch.tensor([0]), torch.tensor([1]))
    for layer in (-1, src.num_layers):
        with pytest.raises(TransferError, match="outside"):
            copy(layer)
    assert torch.equal(snapshot(dst), before)  # nothing was copied by a rejected call


def test_layer_copier_in_accounting_mode_counts_bytes() -> None:
    a = ItemPool(name="a", layer_ids=(0, 1), num_items=4, item_bytes=24, materialize=False)
    b = ItemPool(name="b", layer_ids=(0, 1), num_items=4, item_bytes=24, materialize=False)
    assert layer_copier(a, b, torch.tensor([0, 3]), torch.tensor([1, 2]))(1) == 2 * 24


def test_a_pool_pair_checks_the_pools_once_and_each_copier_its_indices() -> None:
    """``PoolPair`` rejects mismatched pools and unknown methods when it is made; each
    ``layer_copier`` of it checks only its index lists, and copiers of one pair copy exactly."""
    case = CopyCase(48, torch.float32)
    src = make_item_pool(num_layers=NUM_LAYERS, num_items=7, case=case, layout=PoolLayout.PAGE_FIRST, seed=1)
    dst = make_item_pool(num_layers=NUM_LAYERS, num_items=9, case=case, layout=PoolLayout.LAYER_FIRST, seed=2)
    narrow = CopyCase(40, torch.float32)
    other = make_item_pool(num_layers=NUM_LAYERS, num_items=9, case=narrow, layout=PoolLayout.LAYER_FIRST)
    with pytest.raises(TransferError, match="item size mismatch"):
        PoolPair(src, other)
    with pytest.raises(TransferError, match="unknown copy method"):
        PoolPair(src, dst, method="fastest")
    pair = PoolPair(src, dst)
    with pytest.raises(TransferError, match="out of range"):
        pair.layer_copier(torch.tensor([0, 7]), torch.tensor([1, 2]))
    with pytest.raises(TransferError, match="int64"):
        pair.layer_copier(torch.tensor([0], dtype=torch.int32), torch.tensor([1]))
    src_before, dst_before = snapshot(src), snapshot(dst)
    first, second = (torch.tensor([0, 1, 2]), torch.tensor([4, 5, 6])), (torch.tensor([5, 3]), torch.tensor([0, 8]))
    for si, di in (first, second):
        assert pair.layer_copier(si, di)(0, NUM_LAYERS) == si.numel() * NUM_LAYERS * case.item_bytes
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=torch.cat([first[0], second[0]]), dst_indices=torch.cat([first[1], second[1]]),
        layer_begin=0, layer_end=NUM_LAYERS,
    )  # fmt: skip


def test_overlap_inside_one_pool_is_found_for_short_and_long_index_lists() -> None:
    case = CopyCase(16, torch.uint8)
    pool = make_item_pool(num_layers=2, num_items=200, case=case, layout=PoolLayout.LAYER_FIRST, seed=3)
    other = make_item_pool(num_layers=2, num_items=200, case=case, layout=PoolLayout.LAYER_FIRST, seed=4)
    assert shares_buffer(pool, pool) and not shares_buffer(pool, other)
    for n in (2, 100):  # Python sets below 64 items, torch.isin above
        src = torch.arange(n)
        check_overlap(pool, pool, src, src + n)
        check_overlap(pool, other, src, src)
        with pytest.raises(TransferError, match="overlap"):
            check_overlap(pool, pool, src, src + n - 1)
        with pytest.raises(TransferError, match="overlap"):
            check_overlap(pool, pool, src, src + n - 1, shared=True)
        check_overlap(pool, pool, src, src + n - 1, shared=False)  # the caller's word is taken


class _View:
    """A pool over bytes of a given tensor (the PoolBufferLike protocol): one layer of 16-byte items."""

    num_layers, item_bytes, layer_stride_bytes, item_stride_bytes = 1, 16, 16, 16

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.num_items = buffer, buffer.numel() // 16


def test_views_of_one_buffer_from_different_bytes() -> None:
    """Item i of one view is not item i of the other: overlapping views are refused (an index
    check cannot tell a read from a write of the same bytes), disjoint ones copy normally."""
    storage = torch.arange(12 * 16, dtype=torch.uint8)
    a, shifted = _View(storage[0:128]), _View(storage[16:144])  # shifted[j] is a[j + 1]
    before = storage.clone()
    with pytest.raises(TransferError, match="overlapping views"):
        copy_items(a, shifted, torch.tensor([0, 4, 2]), torch.tensor([1, 5, 3]))
    assert torch.equal(storage, before)
    apart = _View(storage[128:192])  # items 8..11 of the storage
    assert not shares_buffer(a, apart)
    copy_items(a, apart, torch.tensor([0, 1]), torch.tensor([1, 0]))
    assert torch.equal(storage[144:160], before[0:16]) and torch.equal(storage[128:144], before[16:32])


@pytest.mark.parametrize("layers", [(0.5, 2), (0, 1.5), (True, 2), (None, 2), (0, "2")])
def test_a_layer_range_of_non_integers_is_refused(layers: tuple[object, object]) -> None:
    src, dst = _pools()
    before = snapshot(dst)
    with pytest.raises(TransferError, match="must be an int"):
        copy_items(src, dst, torch.tensor([0]), torch.tensor([1]), layer_begin=layers[0], layer_end=layers[1])  # type: ignore[arg-type]
    copy = layer_copier(src, dst, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(TransferError, match="must be ints"):
        copy(0.5)  # type: ignore[arg-type]
    assert torch.equal(snapshot(dst), before)


def test_numpy_integer_layers_reach_the_copies_as_python_ints() -> None:
    """The runtime's ctypes arguments and Triton's launch refuse NumPy integers: the checks
    hand back Python ints, and a copy named by them lands as one named by ints."""
    import numpy as np

    from kernels.copy_checks import check_layer_range, layer_int

    first, count = check_layer_range(np.int64(1), np.int32(1), 2)
    assert (first, count) == (1, 1) and type(first) is int and type(count) is int
    assert type(layer_int("layer_begin", np.int64(0))) is int
    src, dst = _pools()
    copy_items(src, dst, torch.tensor([0]), torch.tensor([1]), layer_begin=np.int64(1), layer_end=np.int64(2))
    copy_items(src, dst, torch.tensor([0]), torch.tensor([1]), layer_begin=0, layer_end=1)
    for layer in (0, 1):
        assert torch.equal(dst.layer_items(layer)[1], src.layer_items(layer)[0])


@pytest.mark.parametrize("method", [123, b"dma"])
def test_a_pool_pair_of_a_method_that_is_no_string_is_refused(method: object) -> None:
    from kernels.api import PoolPair

    src, dst = _pools()
    with pytest.raises(TransferError, match="unknown copy method"):
        PoolPair(src, dst, method=method)  # type: ignore[arg-type]


def test_a_destination_named_twice_is_refused_on_every_path() -> None:
    """Two writes of one item would race on a GPU (which one lands is unspecified), so no path
    takes them: short and long lists, sorted or not, through copy_items and a layer copier. The
    source may repeat (one item copied to several places)."""
    from kernels.api import layer_copier

    src = ItemPool(name="s", layer_ids=(0, 1), num_items=64, item_bytes=8)
    dst = ItemPool(name="d", layer_ids=(0, 1), num_items=64, item_bytes=8)
    for n in (3, 40):  # the short (Python) and the long (numpy) check
        dup = torch.arange(n)
        dup[-1] = dup[0]
        for dst_idx in (dup, dup.flip(0)):
            with pytest.raises(TransferError, match="twice"):
                copy_items(src, dst, torch.arange(n), dst_idx)
            with pytest.raises(TransferError, match="twice"):
                layer_copier(src, dst, torch.arange(n), dst_idx)
        assert copy_items(src, dst, torch.zeros(n, dtype=torch.int64), torch.arange(n)) == 2 * n * 8


def test_a_copy_inside_one_pool_follows_the_cuda_rule_on_cpu_too() -> None:
    from kernels.api import layer_copier

    pool = ItemPool(name="p", layer_ids=(0, 1), num_items=8, item_bytes=8)
    with pytest.raises(TransferError, match="overlap"):
        copy_items(pool, pool, torch.tensor([0, 1]), torch.tensor([1, 2]))
    with pytest.raises(TransferError, match="overlap"):
        layer_copier(pool, pool, torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert copy_items(pool, pool, torch.tensor([0, 1]), torch.tensor([2, 3])) == 2 * 2 * 8
