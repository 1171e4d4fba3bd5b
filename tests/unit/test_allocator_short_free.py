"""IndexAllocator.free of a short int64 tensor (checked as a Python list) against the array path
(the same indices as a list): the same free stack afterwards, and the same errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asynccache.pools.allocator as allocator_module
from asynccache.errors import AllocationError
from asynccache.pools.allocator import IndexAllocator


def _free(alloc: IndexAllocator, indices: object) -> str | None:
    try:
        alloc.free(indices)  # type: ignore[arg-type]
    except AllocationError as e:
        return str(e)
    return None


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 24),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(0, 6)),
            # Some of the allocated indices, in an order of their own (a valid free)…
            st.tuples(st.just("held"), st.randoms(use_true_random=False)),
            # …or anything (out of range, repeated, never allocated).
            st.tuples(st.just("free"), st.lists(st.integers(-2, 26), min_size=0, max_size=20)),
        ),
        max_size=40,
    ),
)
def test_short_frees_match_the_array_path(size: int, ops: list[tuple[str, object]]) -> None:
    short, model = IndexAllocator(size, name="p"), IndexAllocator(size, name="p")
    for op, arg in ops:
        if op == "alloc":
            a, b = short.alloc(arg), model.alloc(arg)  # type: ignore[arg-type]
            assert (a is None and b is None) or a.tolist() == b.tolist()  # type: ignore[union-attr]
            continue
        if op == "held":
            held = model.allocated_indices().tolist()
            arg.shuffle(held)  # type: ignore[attr-defined]
            values = held[: arg.randint(0, len(held))]  # type: ignore[attr-defined]
        else:
            values = list(arg)  # type: ignore[call-overload]
        got = _free(short, torch.tensor(values, dtype=torch.int64))
        want = _free(model, values)
        assert got == want
        assert short._free == model._free
        assert (short._allocated == model._allocated).all()


def test_the_short_path_is_taken_for_short_cpu_int64_vectors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[int]] = []
    alloc = IndexAllocator(64, name="p")
    real = alloc._free_short
    monkeypatch.setattr(alloc, "_free_short", lambda v: (calls.append(v), real(v)))
    got = alloc.alloc(40)
    assert got is not None
    alloc.free(got[:3])
    alloc.free(got[3:3 + allocator_module._SHORT + 1])  # too long: the array path
    alloc.free(got[30:32].to(torch.int32))  # another dtype: the array path
    alloc.free(got[32:36].reshape(2, 2))  # not a vector: the array path
    assert calls == [got[:3].tolist()]
    assert alloc.num_used == 40 - 3 - (allocator_module._SHORT + 1) - 2 - 4
