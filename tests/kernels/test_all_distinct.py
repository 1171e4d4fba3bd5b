"""kernels.copy_checks.all_distinct (re-exported by kernels.api): what counts as a repeat, in
every order, and the errors of the copy and tree checks built on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.errors import ConfigError, TransferError
from asynccache.pools.base import ItemPool
from asynccache.pools.device import DeviceKVPool, DeviceMambaPool
from asynccache.spec import HybridSpec
from asynccache.tree import HybridRadixTree
from kernels import copy_items, layer_copier
from kernels.api import all_distinct
from kernels.copy_checks import all_distinct as all_distinct_of_copy_checks


def test_kernels_api_re_exports_the_copy_checks_function() -> None:
    assert all_distinct is all_distinct_of_copy_checks


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], True),
        ([7], True),
        ([0, 1, 2, 3], True),  # ascending: what the allocators hand out
        ([0, 5, 9, 200], True),  # ascending with gaps
        ([3, 2, 1, 0], True),  # descending, distinct
        ([2, 0, 3, 1], True),  # another order, distinct
        ([4, 4], False),
        ([0, 1, 1, 2], False),  # ascending but for one repeat (not strictly ascending)
        ([3, 1, 2, 3], False),  # unsorted, the repeat far apart
        ([2, 2, 1, 0], False),  # descending with a repeat
        ([5, 5, 5, 5], False),
    ],
)
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_repeats_are_found_in_any_order(values: list[int], expected: bool, dtype: type) -> None:
    assert all_distinct(np.array(values, dtype=dtype)) is expected


@pytest.mark.parametrize("n", [2, 17, 1000, 65_536])
def test_long_lists_in_every_order(n: int) -> None:
    rng = np.random.default_rng(n)
    ascending = np.arange(n, dtype=np.int64) * 3
    shuffled = rng.permutation(ascending)
    assert all_distinct(ascending) and all_distinct(ascending[::-1]) and all_distinct(shuffled)
    for base in (ascending, ascending[::-1], shuffled):
        for i, j in ((0, n - 1), (n // 2, n // 2 - 1 if n > 2 else 0), (n - 1, 0)):
            if i == j:
                continue
            dup = base.copy()
            dup[i] = dup[j]
            assert not all_distinct(dup), (n, i, j)


def test_values_whose_differences_wrap_around_int64() -> None:
    """Neighbour differences of these values all wrap to positive int64s; 0 is still there twice."""
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    assert not all_distinct(np.array([0, 2**62, lo, -(2**62), 0], dtype=np.int64))
    assert all_distinct(np.array([hi, lo], dtype=np.int64))
    assert all_distinct(np.array([lo, 0, hi], dtype=np.int64))
    assert not all_distinct(np.array([hi, lo, hi], dtype=np.int64))


def test_a_non_contiguous_view_is_read_as_its_values() -> None:
    base = np.array([0, 9, 1, 9, 2, 9], dtype=np.int64)
    assert all_distinct(base[::2])
    assert not all_distinct(base[1::2])


def test_cpu_tensors_are_read_as_their_values() -> None:
    assert all_distinct(torch.tensor([2, 0, 1]))
    assert all_distinct(torch.empty(0, dtype=torch.int64))
    assert not all_distinct(torch.tensor([2, 0, 2]))


def test_floats_count_nans_as_one_value() -> None:
    """Only integer indices reach the copy and tree checks; other dtypes keep ``np.unique``'s rules."""
    assert all_distinct(np.array([1.5, 0.5, 2.5]))
    assert not all_distinct(np.array([1.0, 0.0, 1.0]))
    assert not all_distinct(np.array([np.nan, 1.0, np.nan]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=40))
def test_matches_a_set_model(values: list[int]) -> None:
    arr = np.array(values, dtype=np.int64)
    assert all_distinct(arr) is (len(set(values)) == len(values))


def test_a_copy_refuses_a_destination_given_twice_in_any_order() -> None:
    """Past the short-list path (more than 16 indices): unsorted and descending lists with a
    repeat are refused, unsorted and descending distinct ones taken."""
    src = ItemPool(name="s", layer_ids=(0,), num_items=64, item_bytes=8)
    dst = ItemPool(name="d", layer_ids=(0,), num_items=64, item_bytes=8)
    n = 40
    perm = torch.from_numpy(np.random.default_rng(0).permutation(n))
    for dst_idx in (perm, torch.arange(n).flip(0)):
        assert copy_items(src, dst, torch.arange(n), dst_idx) == n * 8
        layer_copier(src, dst, torch.arange(n), dst_idx)
        dup = dst_idx.clone()
        dup[n // 2] = dup[3]
        with pytest.raises(TransferError, match="dst_indices name one item twice"):
            copy_items(src, dst, torch.arange(n), dup)
        with pytest.raises(TransferError, match="dst_indices name one item twice"):
            layer_copier(src, dst, torch.arange(n), dup)


def test_tree_insert_refuses_a_page_given_twice_in_any_order() -> None:
    spec = HybridSpec.preset("qwen3-next-80b", page_size=1)
    n = 64
    tree = HybridRadixTree(
        spec,
        device_kv=DeviceKVPool(spec, 4 * n, materialize=False),
        device_mamba=DeviceMambaPool(spec, 4, materialize=False),
    )
    kv = tree.device_kv.alloc(n)
    assert kv is not None
    dup = kv.flip(0).clone()
    dup[n - 1] = dup[5]
    tokens = np.arange(n, dtype=np.int64)
    with pytest.raises(ConfigError, match="the same page index is given twice"):
        tree.insert(tokens, dup)
    assert tree.stats().device_kv_pages == 0
    result = tree.insert(tokens, kv.flip(0))  # descending, distinct: taken
    assert result.num_new_pages == n
