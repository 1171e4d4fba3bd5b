"""The Triton copy kernel itself, run on CPU tensors by Triton's interpreter (tiny grids).

The interpreter costs ~0.5 ms per program instance plus numpy work per op, so pools are a few
items, tiles are a few hundred bytes (many loop iterations per CTA: the persistent loop and the
two-tile pipeline are exercised) and grids are at most a handful of programs.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

import kernels.plan
from asynccache.errors import TransferError
from asynccache.pools.base import PoolLayout
from kernels.plan import CopyTuning
from kernels.testing import (
    COPY_CASES,
    LAYOUT_PAIRS,
    CopyCase,
    assert_copied,
    index_pairs,
    make_item_pool,
    snapshot,
)

SMALL_TILE = CopyTuning(num_warps=4, tile_bytes=512, pipeline=True)
CASES = [c for c in COPY_CASES if c.item_bytes in (1, 6, 4100, 8200, 48, 4112)]


def _copy_and_check(
    mod: ModuleType,
    case: CopyCase,
    layouts: tuple[PoolLayout, PoolLayout],
    *,
    kind: str = "scattered",
    layer_range: tuple[int, int] = (1, 3),
    max_ctas: int = 2,
    tuning: CopyTuning = SMALL_TILE,
    src_items: int = 5,
    dst_items: int = 6,
) -> object:
    src = make_item_pool(num_layers=3, num_items=src_items, case=case, layout=layouts[0], seed=11)
    dst = make_item_pool(num_layers=3, num_items=dst_items, case=case, layout=layouts[1], seed=12)
    si, di = index_pairs(kind, src_items=src_items, dst_items=dst_items, seed=13)
    src_before, dst_before = snapshot(src), snapshot(dst)
    launch = mod.launch_copy(src, dst, si, di, *layer_range, max_ctas=max_ctas, tuning=tuning)
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=layer_range[0], layer_end=layer_range[1],
    )  # fmt: skip
    return launch


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference(interpreted_copy: ModuleType, case: CopyCase, layouts: tuple[PoolLayout, PoolLayout]) -> None:
    launch = _copy_and_check(interpreted_copy, case, layouts)
    assert launch is not None
    assert launch.plan.grid <= 2


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("max_ctas", [1, 3, 1000])
def test_persistent_loop_any_cap(interpreted_copy: ModuleType, pipeline: bool, max_ctas: int) -> None:
    """Every CTA count covers every tile once: 1 CTA loops over all, 1000 means one CTA per tile."""
    tuning = CopyTuning(num_warps=4, tile_bytes=128, pipeline=pipeline)
    launch = _copy_and_check(
        interpreted_copy, CopyCase(48, torch.float32), (PoolLayout.PAGE_FIRST, PoolLayout.LAYER_FIRST),
        max_ctas=max_ctas, tuning=tuning, layer_range=(0, 3),
    )  # fmt: skip
    assert launch is not None
    assert launch.plan.grid == min(max_ctas, launch.plan.num_iters)


def test_multi_chunk_items_and_many_items_per_tile(interpreted_copy: ModuleType) -> None:
    big = _copy_and_check(interpreted_copy, CopyCase(4112, torch.float32), LAYOUT_PAIRS[1])
    assert big is not None and big.plan.num_chunks > 1 and not big.plan.even
    small = _copy_and_check(interpreted_copy, CopyCase(48, torch.float32), LAYOUT_PAIRS[2])
    assert small is not None and small.plan.rows * small.plan.chunk_words > small.plan.item_words


@pytest.mark.parametrize("kind", ["single", "all"])
def test_single_item_and_whole_pool(interpreted_copy: ModuleType, kind: str) -> None:
    _copy_and_check(interpreted_copy, CopyCase(20, torch.float32), LAYOUT_PAIRS[3], kind=kind, layer_range=(0, 3))


def test_empty_index_list_launches_nothing(interpreted_copy: ModuleType) -> None:
    case = CopyCase(20, torch.float32)
    src = make_item_pool(num_layers=2, num_items=3, case=case, layout=PoolLayout.LAYER_FIRST)
    dst = make_item_pool(num_layers=2, num_items=3, case=case, layout=PoolLayout.LAYER_FIRST, seed=1)
    before = snapshot(dst)
    si, di = index_pairs("empty", src_items=3, dst_items=3)
    assert interpreted_copy.launch_copy(src, dst, si, di) is None
    assert torch.equal(snapshot(dst), before)


def test_wide_task_numbers_path(interpreted_copy: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The int64 task decomposition (taken past 2**31 tasks) gives the same copy."""
    monkeypatch.setattr(kernels.plan, "INT32_TASK_LIMIT", 0)
    launch = _copy_and_check(interpreted_copy, CopyCase(4100, torch.bfloat16), LAYOUT_PAIRS[1])
    assert launch is not None and launch.plan.wide


def test_copy_within_one_pool(interpreted_copy: ModuleType) -> None:
    case = CopyCase(48, torch.float32)
    pool = make_item_pool(num_layers=2, num_items=6, case=case, layout=PoolLayout.PAGE_FIRST, seed=5)
    before = snapshot(pool)
    si, di = torch.tensor([0, 5]), torch.tensor([3, 1])
    interpreted_copy.launch_copy(pool, pool, si, di, max_ctas=2, tuning=SMALL_TILE)
    after = snapshot(pool)
    want = before.clone()
    want[:, di] = before[:, si]
    assert torch.equal(after, want)
    with pytest.raises(TransferError, match="overlap"):
        interpreted_copy.launch_copy(pool, pool, torch.tensor([0, 1]), torch.tensor([1, 2]))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_cta_cap_raises(interpreted_copy: ModuleType, bad: object) -> None:
    case = CopyCase(16, torch.uint8)
    src = make_item_pool(num_layers=1, num_items=2, case=case, layout=PoolLayout.LAYER_FIRST)
    dst = make_item_pool(num_layers=1, num_items=2, case=case, layout=PoolLayout.LAYER_FIRST)
    with pytest.raises(TransferError, match="max_ctas"):
        interpreted_copy.launch_copy(src, dst, torch.tensor([0]), torch.tensor([1]), max_ctas=bad)
