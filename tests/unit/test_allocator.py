"""IndexAllocator: all-or-nothing alloc, strict free, and a model-based property test."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.errors import AllocationError, CapacityError, ConfigError
from asynccache.pools.allocator import IndexAllocator


def make_allocator(size: int = 8) -> IndexAllocator:
    return IndexAllocator(size, name="test_pool")


def test_alloc_returns_distinct_int64_cpu_indices() -> None:
    alloc = make_allocator(8)
    got = alloc.alloc(5)
    assert got is not None
    assert got.dtype == torch.int64
    assert got.device.type == "cpu"
    assert len(set(got.tolist())) == 5
    assert all(0 <= i < 8 for i in got.tolist())
    assert alloc.num_free == 3
    assert alloc.num_used == 5
    assert all(alloc.is_allocated(i) for i in got.tolist())


def test_fresh_allocator_hands_out_lowest_indices_first() -> None:
    alloc = make_allocator(6)
    first = alloc.alloc(3)
    assert first is not None
    assert first.tolist() == [0, 1, 2]


def test_alloc_free_round_trip_restores_counts_and_indices() -> None:
    alloc = make_allocator(4)
    got = alloc.alloc(4)
    assert got is not None
    assert alloc.num_free == 0
    alloc.free(got)
    assert alloc.num_free == 4
    assert alloc.allocated_indices().tolist() == []
    again = alloc.alloc(4)
    assert again is not None
    assert sorted(again.tolist()) == [0, 1, 2, 3]


def test_exhaustion_returns_none_and_takes_nothing() -> None:
    alloc = make_allocator(5)
    held = alloc.alloc(3)
    assert held is not None
    assert alloc.alloc(3) is None
    assert alloc.num_free == 2
    assert sorted(alloc.allocated_indices().tolist()) == sorted(held.tolist())
    rest = alloc.alloc(2)
    assert rest is not None
    assert alloc.alloc(1) is None
    assert alloc.num_free == 0


def test_alloc_zero_returns_empty_tensor_and_changes_nothing() -> None:
    alloc = make_allocator(3)
    got = alloc.alloc(0)
    assert got is not None
    assert got.numel() == 0
    assert got.dtype == torch.int64
    assert alloc.num_free == 3


def test_alloc_zero_on_an_empty_pool_is_not_none() -> None:
    alloc = make_allocator(0)
    got = alloc.alloc(0)
    assert got is not None and got.numel() == 0
    assert alloc.alloc(1) is None


def test_negative_alloc_raises() -> None:
    alloc = make_allocator(3)
    with pytest.raises(ValueError, match="-1"):
        alloc.alloc(-1)
    assert alloc.num_free == 3


def test_negative_size_raises() -> None:
    with pytest.raises(ValueError, match="size"):
        IndexAllocator(-1)


@pytest.mark.parametrize("bad", [True, 2.0, 2.5, "2"])
def test_a_count_that_is_not_an_integer_is_refused(bad: object) -> None:
    """``alloc(True)`` would hand out one index, ``alloc(2.0)`` fail deep in slicing."""
    alloc = make_allocator(4)
    with pytest.raises(ConfigError, match=f"cannot allocate {bad!r} indices"):
        alloc.alloc(bad)  # type: ignore[arg-type]
    assert alloc.num_free == 4
    with pytest.raises(ConfigError, match="allocator size"):
        IndexAllocator(bad)  # type: ignore[arg-type]


def test_numpy_integer_counts_are_taken_as_ints() -> None:
    import numpy as np

    alloc = IndexAllocator(np.int64(4))
    assert type(alloc.size) is int and alloc.size == 4
    held = alloc.alloc(np.int32(2))
    assert held is not None and held.tolist() == [0, 1]


@pytest.mark.parametrize("scalar", [1, "numpy", "tensor"])
def test_a_scalar_given_to_free_is_refused_by_name(scalar: object) -> None:
    import numpy as np

    alloc = make_allocator(4)
    assert alloc.alloc(2) is not None
    given = {"numpy": np.int64(1), "tensor": torch.tensor(1)}.get(scalar, scalar)  # type: ignore[call-overload]
    with pytest.raises(AllocationError, match="a tensor or a sequence of indices"):
        alloc.free(given)  # type: ignore[arg-type]
    assert alloc.num_free == 2


def test_double_free_raises_and_frees_nothing_of_that_call() -> None:
    alloc = make_allocator(6)
    a = alloc.alloc(2)
    b = alloc.alloc(2)
    assert a is not None and b is not None
    alloc.free(a)
    free_before = alloc.num_free
    # b is valid, a[0] was already freed: the whole call must be rejected.
    mixed = torch.cat([b, a[:1]])
    with pytest.raises(AllocationError, match="double free"):
        alloc.free(mixed)
    assert alloc.num_free == free_before
    assert all(alloc.is_allocated(i) for i in b.tolist())
    alloc.free(b)
    assert alloc.num_free == 6


def test_free_of_never_allocated_index_raises() -> None:
    alloc = make_allocator(4)
    with pytest.raises(AllocationError, match="double free"):
        alloc.free([2])
    assert alloc.num_free == 4


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_index_raises_and_frees_nothing(bad: int) -> None:
    alloc = make_allocator(4)
    held = alloc.alloc(2)
    assert held is not None
    with pytest.raises(AllocationError, match="outside"):
        alloc.free(held.tolist() + [bad])
    assert alloc.num_free == 2
    assert all(alloc.is_allocated(i) for i in held.tolist())


def test_duplicates_in_one_free_call_raise_and_free_nothing() -> None:
    alloc = make_allocator(4)
    held = alloc.alloc(2)
    assert held is not None
    with pytest.raises(AllocationError, match="duplicate"):
        alloc.free(torch.tensor([held[0].item(), held[0].item()]))
    assert alloc.num_free == 2
    assert alloc.is_allocated(int(held[0]))


def test_float_index_tensor_is_rejected() -> None:
    alloc = make_allocator(4)
    held = alloc.alloc(2)
    assert held is not None
    with pytest.raises(AllocationError, match="integer"):
        alloc.free(held.to(torch.float32))
    assert alloc.num_free == 2


@pytest.mark.parametrize("bad", [[0.9], [True], [1, True], "numpy-float"])
def test_float_or_bool_index_lists_are_rejected_and_free_nothing(bad: object) -> None:
    """As for tensors: 0.9 would be truncated to index 0, which the caller did not name."""
    import numpy as np

    alloc = make_allocator(4)
    held = alloc.alloc(2)
    assert held is not None
    indices = np.array([1.7]) if bad == "numpy-float" else bad
    with pytest.raises(AllocationError, match="integer"):
        alloc.free(indices)  # type: ignore[arg-type]
    assert alloc.num_free == 2 and alloc.is_allocated(0) and alloc.is_allocated(1)
    alloc.free(np.array([0, 1]))  # integer numpy arrays are fine
    assert alloc.num_free == 4


@pytest.mark.parametrize("bad", [-1, 4, True, 1.0])
def test_is_allocated_of_a_foreign_index_raises(bad: object) -> None:
    alloc = make_allocator(4)
    with pytest.raises(AllocationError, match="outside"):
        alloc.is_allocated(bad)  # type: ignore[arg-type]


def test_free_accepts_lists_and_empty_input() -> None:
    alloc = make_allocator(4)
    held = alloc.alloc(3)
    assert held is not None
    alloc.free([])
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.num_free == 1
    alloc.free(held.tolist())
    assert alloc.num_free == 4


# ---- property test -----------------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=0, max_value=12)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=2**16)),
        st.tuples(st.just("double_free"), st.integers(min_value=0, max_value=2**16)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(size=st.integers(min_value=0, max_value=16), ops=_ops)
def test_random_alloc_free_sequences_match_a_model_set(size: int, ops: list[tuple[str, int]]) -> None:
    alloc = make_allocator(size)
    held: list[list[int]] = []  # batches currently allocated, in allocation order
    model: set[int] = set()
    for op, arg in ops:
        if op == "alloc":
            got = alloc.alloc(arg)
            if arg > size - len(model):
                assert got is None
            else:
                assert got is not None
                batch = got.tolist()
                assert len(batch) == arg
                assert len(set(batch)) == arg
                assert all(0 <= i < size for i in batch)
                assert not (set(batch) & model), "an index was handed out twice"
                model |= set(batch)
                if batch:
                    held.append(batch)
        elif op == "free" and held:
            batch = held.pop(arg % len(held))
            alloc.free(torch.tensor(batch, dtype=torch.int64))
            model -= set(batch)
        elif op == "double_free" and size > 0:
            free_index = [i for i in range(size) if i not in model]
            if free_index:
                victim = free_index[arg % len(free_index)]
                with pytest.raises(AllocationError):
                    alloc.free([victim])
        assert alloc.num_used == len(model)
        assert alloc.num_free == size - len(model)
        assert set(alloc.allocated_indices().tolist()) == model


def test_an_allocation_comes_back_ascending_whatever_the_free_order() -> None:
    """Runs of consecutive indices stay runs: a copy into them is one call per run."""
    a = IndexAllocator(16)
    first, second = a.alloc(6), a.alloc(6)
    assert first is not None and second is not None
    a.free(second[3:])  # freed in pieces, newest first
    a.free(first)
    a.free(second[:3])
    got = a.alloc(12)
    assert got is not None
    assert got.tolist() == sorted(got.tolist()) == list(range(12))


def test_alloc_hands_out_sorted_distinct_free_indices_whether_the_run_is_contiguous_or_not() -> None:
    """Against a set model, over random allocs and frees (frees in random order, so the free
    list holds contiguous runs and scattered indices): every allocation is ascending, distinct,
    was free, and is marked allocated; nothing else changes."""
    rng = random.Random(3)
    alloc = make_allocator(64)
    free = set(range(64))
    held: list[int] = []
    contiguous = scattered = 0
    for _ in range(400):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            back, held = held[:k], held[k:]
            alloc.free(torch.tensor(back))
            free.update(back)
            continue
        n = rng.randint(1, 12)
        got = alloc.alloc(n)
        if n > len(free):
            assert got is None
            continue
        assert got is not None and got.dtype == torch.int64
        values = got.tolist()
        assert values == sorted(set(values)) and len(values) == n and set(values) <= free
        assert all(alloc.is_allocated(v) for v in values)
        contiguous += values[-1] - values[0] == n - 1
        scattered += values[-1] - values[0] != n - 1
        free.difference_update(values)
        held.extend(values)
        assert alloc.num_free == len(free)
    assert contiguous and scattered  # both paths ran
    assert set(alloc.allocated_indices().tolist()) == set(range(64)) - free


# ---- the duplicate check of free() in every order ----------------------------------------


@pytest.mark.parametrize("form", ["tensor", "numpy", "list"])
@pytest.mark.parametrize(
    "order",
    [
        [0, 1, 1, 2],  # ascending but for the repeat
        [3, 1, 2, 3],  # unsorted, the repeat at both ends
        [2, 2, 1, 0],  # descending with a repeat
        [1, 3, 0, 3, 2],
    ],
)
def test_a_repeat_in_any_order_is_refused_and_frees_nothing(form: str, order: list[int]) -> None:
    import numpy as np

    alloc = make_allocator(4)
    held = alloc.alloc(4)
    assert held is not None
    indices: object = {"tensor": torch.tensor(order), "numpy": np.array(order), "list": order}[form]
    with pytest.raises(AllocationError, match="test_pool: free\\(\\) got duplicate indices"):
        alloc.free(indices)  # type: ignore[arg-type]
    assert alloc.num_free == 0
    assert all(alloc.is_allocated(i) for i in range(4))


@pytest.mark.parametrize("order", [[3, 2, 1, 0], [2, 0, 3, 1], [0, 1, 2, 3], [5, 0, 7, 2]])
def test_distinct_indices_are_freed_whatever_their_order(order: list[int]) -> None:
    import numpy as np

    alloc = make_allocator(8)
    assert alloc.alloc(8) is not None
    alloc.free(torch.tensor(order))
    assert alloc.num_free == len(order)
    assert sorted(set(range(8)) - set(alloc.allocated_indices().tolist())) == sorted(order)
    rest = sorted(set(range(8)) - set(order))
    alloc.free(np.array(rest[::-1]))
    assert alloc.num_free == 8


def test_a_single_index_is_freed_and_a_second_free_of_it_is_a_double_free() -> None:
    alloc = make_allocator(4)
    held = alloc.alloc(4)
    assert held is not None
    alloc.free(held[2:3])
    assert alloc.num_free == 1 and not alloc.is_allocated(2)
    with pytest.raises(AllocationError, match="double free of indices \\[2\\]"):
        alloc.free([2])


def test_the_checks_of_free_keep_their_order() -> None:
    """Out of range is reported before a repeat, a repeat before a double free."""
    alloc = make_allocator(4)
    assert alloc.alloc(2) is not None  # 0 and 1 held, 2 and 3 free
    with pytest.raises(AllocationError, match="outside 0..3"):
        alloc.free([1, 1, 9])
    with pytest.raises(AllocationError, match="duplicate"):
        alloc.free([3, 3])  # free twice over: the repeat is what is reported
    with pytest.raises(AllocationError, match="double free"):
        alloc.free([3, 1])
    assert alloc.num_free == 2 and alloc.is_allocated(0) and alloc.is_allocated(1)


@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_a_long_free_with_one_repeat_is_refused(order: str) -> None:
    """Past any short-list special case: 4,096 indices, one of them given twice, far apart."""
    import numpy as np

    n = 4096
    alloc = make_allocator(n)
    held = alloc.alloc(n)
    assert held is not None
    values = held.numpy().copy()
    if order == "descending":
        values = values[::-1].copy()
    elif order == "shuffled":
        values = np.random.default_rng(1).permutation(values)
    dup = values.copy()
    dup[-1] = dup[0]
    with pytest.raises(AllocationError, match="duplicate"):
        alloc.free(torch.from_numpy(dup))
    assert alloc.num_free == 0
    alloc.free(torch.from_numpy(values))
    assert alloc.num_free == n


def test_an_allocator_whose_bookkeeping_cannot_fit_in_host_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools in accounting mode have no buffers to check: a size far beyond memory is a
    CapacityError up front, not a MemoryError while the free list is built."""
    from asynccache.pools import allocator

    monkeypatch.setattr(allocator, "available_host_bytes", lambda: 10 << 20)
    with pytest.raises(CapacityError, match="bookkeeping"):
        IndexAllocator(1 << 20, name="device_kv")  # ~48 MiB of bookkeeping > 10 MiB
    assert IndexAllocator((1 << 20) - 1).num_free == (1 << 20) - 1  # small ones are not checked
    monkeypatch.setattr(allocator, "available_host_bytes", lambda: None)  # unknown: not refused
    assert IndexAllocator(1 << 20).size == 1 << 20
