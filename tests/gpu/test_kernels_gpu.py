"""The copy paths on a CUDA GPU — the Triton kernels and the DMA engines — pinned host ↔ device,
every layout pair, dtype, odd size.

Marked ``gpu``: skipped where no CUDA device is present (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from asynccache.errors import TransferError
from asynccache.pools.base import ItemPool, PoolLayout
from asynccache.pools.device import DeviceKVPool, DeviceMambaPool
from asynccache.pools.host import HostKVPool, MambaPoolHost
from asynccache.spec import HybridSpec
from kernels import copy_items
from kernels.dma_copy import DMA_ENGINES, batch_check, launch_dma
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

pytestmark = pytest.mark.gpu

ENDS = {"h2d": ("host", "device"), "d2h": ("device", "host"), "d2d": ("device", "device")}


def _pool(case: CopyCase, layout: PoolLayout, where: str, num_items: int, seed: int, num_layers: int = 3) -> ItemPool:
    if where == "host":
        return make_item_pool(num_layers=num_layers, num_items=num_items, case=case, layout=layout, pin=True, seed=seed)
    return make_item_pool(num_layers=num_layers, num_items=num_items, case=case, layout=layout, device="cuda", seed=seed)


def _check_copy(
    case: CopyCase,
    layouts: tuple[PoolLayout, PoolLayout],
    direction: str,
    *,
    kind: str = "scattered",
    layer_range: tuple[int, int] = (1, 3),
    max_ctas: int | None = None,
    tuning: CopyTuning | None = None,
    method: str | None = None,
    engine: str | None = None,
) -> None:
    src_where, dst_where = ENDS[direction]
    src = _pool(case, layouts[0], src_where, 37, seed=1)
    dst = _pool(case, layouts[1], dst_where, 41, seed=2)
    si, di = index_pairs(kind, src_items=37, dst_items=41, seed=3)
    src_before, dst_before = snapshot(src), snapshot(dst)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if engine is not None:
        launch = launch_dma(src, dst, si, di, *layer_range, stream=stream, engine=engine)
        assert launch is not None and launch.num_bytes == si.numel() * (layer_range[1] - layer_range[0]) * case.item_bytes
        assert engine == "auto" or launch.engine == engine
    elif tuning is None:
        nbytes = copy_items(src, dst, si, di, layer_begin=layer_range[0], layer_end=layer_range[1],
                            max_ctas=max_ctas, stream=stream, method=method)  # fmt: skip
        assert nbytes == si.numel() * (layer_range[1] - layer_range[0]) * case.item_bytes
    else:
        from kernels.triton_copy import launch_copy

        launch_copy(src, dst, si, di, *layer_range, max_ctas=max_ctas, stream=stream, tuning=tuning)
    stream.synchronize()
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=layer_range[0], layer_end=layer_range[1],
    )  # fmt: skip


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: c.id)
def test_copy_matches_reference(case: CopyCase, layouts: tuple[PoolLayout, PoolLayout], direction: str) -> None:
    _check_copy(case, layouts, direction)


@pytest.mark.parametrize("case", [COPY_CASES[4], COPY_CASES[9]], ids=lambda c: c.id)
def test_device_to_device(case: CopyCase) -> None:
    _check_copy(case, LAYOUT_PAIRS[0], "d2d", layer_range=(0, 3))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kind", ["single", "all"])
def test_single_item_and_whole_pool(direction: str, kind: str) -> None:
    _check_copy(CopyCase(4112, torch.float32), LAYOUT_PAIRS[1], direction, kind=kind, layer_range=(0, 3))


@pytest.mark.parametrize("max_ctas", [1, 3, 2**31 - 1])
@pytest.mark.parametrize("pipeline", [True, False])
def test_any_cta_cap_and_pipeline(max_ctas: int, pipeline: bool) -> None:
    tuning = CopyTuning(num_warps=8, tile_bytes=8192, pipeline=pipeline)
    _check_copy(CopyCase(4096, torch.uint8), LAYOUT_PAIRS[2], "h2d", max_ctas=max_ctas, tuning=tuning)


def test_empty_index_list_is_a_no_op() -> None:
    case = CopyCase(4096, torch.uint8)
    src = _pool(case, PoolLayout.PAGE_FIRST, "host", 4, seed=1)
    dst = _pool(case, PoolLayout.LAYER_FIRST, "device", 4, seed=2)
    before = snapshot(dst)
    si, di = index_pairs("empty", src_items=4, dst_items=4)
    assert copy_items(src, dst, si, di) == 0
    torch.cuda.synchronize()
    assert torch.equal(snapshot(dst), before)


def test_offsets_past_int32_words() -> None:
    """Items more than 2**31 int32 words (8 GiB) into a pool: address math must be int64."""
    case = CopyCase(1 << 20, torch.uint8)
    big = ItemPool(name="big", layer_ids=(0, 1), num_items=4608, item_bytes=case.item_bytes, device="cuda")  # 9 GiB
    host = _pool(case, PoolLayout.PAGE_FIRST, "host", 2, seed=5, num_layers=2)
    back = _pool(case, PoolLayout.PAGE_FIRST, "host", 2, seed=6, num_layers=2)
    copy_items(host, big, torch.tensor([0, 1]), torch.tensor([4607, 4606]), method="triton")
    copy_items(big, back, torch.tensor([4607, 4606]), torch.tensor([0, 1]), method="triton")
    torch.cuda.synchronize()
    assert big.buffer is not None and host.buffer is not None and back.buffer is not None
    assert (1 * big.layer_stride_bytes + 4607 * big.item_stride_bytes) // 4 > 2**31
    assert torch.equal(back.buffer, host.buffer)
    assert torch.equal(big.buffer[1, 4607].cpu(), host.buffer[0, 1])


def test_host_writes_between_launches_are_seen() -> None:
    """A second load of the same host item after the CPU rewrote it brings the new bytes."""
    case = CopyCase(4096, torch.uint8)
    host = _pool(case, PoolLayout.PAGE_FIRST, "host", 4, seed=1, num_layers=1)
    dev = _pool(case, PoolLayout.LAYER_FIRST, "device", 4, seed=2, num_layers=1)
    assert host.buffer is not None and dev.buffer is not None
    for value in (7, 9):
        host.buffer[2].fill_(value)
        copy_items(host, dev, torch.tensor([2]), torch.tensor([1]))
        torch.cuda.synchronize()
        assert bool((dev.buffer[0, 1] == value).all())


def test_indices_may_change_right_after_the_call() -> None:
    """Indices are staged at call time: reusing the CPU tensors at once cannot change the copy."""
    case = CopyCase(48, torch.float32)
    src = _pool(case, PoolLayout.PAGE_FIRST, "host", 64, seed=1)
    dst = _pool(case, PoolLayout.LAYER_FIRST, "device", 64, seed=2)
    si, di = index_pairs("scattered", src_items=64, dst_items=64, seed=4)
    src_before, dst_before = snapshot(src), snapshot(dst)
    want_si, want_di = si.clone(), di.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # keep the stream busy so the copy is still queued
    copy_items(src, dst, si, di, stream=side)
    si.zero_()
    di.zero_()
    side.synchronize()
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=want_si, dst_indices=want_di, layer_begin=0, layer_end=3,
    )  # fmt: skip


# ---- validation on CUDA ---------------------------------------------------------------------------


def test_pageable_host_memory_is_rejected() -> None:
    case = CopyCase(4096, torch.uint8)
    pageable = make_item_pool(num_layers=1, num_items=2, case=case, layout=PoolLayout.PAGE_FIRST, pin=False)
    dev = _pool(case, PoolLayout.LAYER_FIRST, "device", 2, seed=2, num_layers=1)
    with pytest.raises(TransferError, match="pageable"):
        copy_items(pageable, dev, torch.tensor([0]), torch.tensor([1]))


def test_cuda_index_tensors_are_rejected() -> None:
    case = CopyCase(4096, torch.uint8)
    host = _pool(case, PoolLayout.PAGE_FIRST, "host", 2, seed=1, num_layers=1)
    dev = _pool(case, PoolLayout.LAYER_FIRST, "device", 2, seed=2, num_layers=1)
    with pytest.raises(TransferError, match="CPU tensor"):
        copy_items(host, dev, torch.tensor([0], device="cuda"), torch.tensor([1]))


def test_overlapping_copy_inside_one_device_pool_is_rejected() -> None:
    case = CopyCase(4096, torch.uint8)
    dev = _pool(case, PoolLayout.LAYER_FIRST, "device", 4, seed=2, num_layers=1)
    with pytest.raises(TransferError, match="overlap"):
        copy_items(dev, dev, torch.tensor([0, 1]), torch.tensor([1, 2]))


# ---- the DMA path (copy engines) -----------------------------------------------------------------


def test_batch_memcpy_passes_its_self_check() -> None:
    """CUDA ≥ 12.8 has cudaMemcpyBatchAsync; the DMA path's preferred engine must work here."""
    assert batch_check(torch.cuda.current_device()) == "ok"


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: c.id)
def test_dma_copy_matches_reference(case: CopyCase, layouts: tuple[PoolLayout, PoolLayout], direction: str) -> None:
    _check_copy(case, layouts, direction, method="dma")


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
@pytest.mark.parametrize("engine", DMA_ENGINES)
def test_every_dma_engine(engine: str, layouts: tuple[PoolLayout, PoolLayout], direction: str) -> None:
    for layer_range in ((1, 3), (0, 3), (2, 3)):
        _check_copy(CopyCase(4100, torch.bfloat16), layouts, direction, layer_range=layer_range, engine=engine)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kind", ["single", "all"])
@pytest.mark.parametrize("case", [CopyCase(13, torch.uint8), CopyCase(4112, torch.float32)], ids=lambda c: c.id)
def test_dma_single_item_and_whole_pool(case: CopyCase, direction: str, kind: str) -> None:
    _check_copy(case, LAYOUT_PAIRS[1], direction, kind=kind, layer_range=(0, 3), method="dma")


@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda p: f"{p[0].value}->{p[1].value}")
def test_dma_merges_adjacent_items(layouts: tuple[PoolLayout, PoolLayout]) -> None:
    """Runs of consecutive indices on both sides become single memcpys and still land exactly."""
    case = CopyCase(4097, torch.uint8)
    src = _pool(case, layouts[0], "host", 16, seed=1)
    dst = _pool(case, layouts[1], "device", 16, seed=2)
    si, di = torch.tensor([3, 4, 5, 6, 11, 0, 1]), torch.tensor([8, 9, 10, 11, 2, 14, 15])
    src_before, dst_before = snapshot(src), snapshot(dst)
    launch = launch_dma(src, dst, si, di)
    torch.cuda.synchronize()
    assert launch is not None
    both_page_first = layouts == (PoolLayout.PAGE_FIRST, PoolLayout.PAGE_FIRST)
    both_layer_first = layouts == (PoolLayout.LAYER_FIRST, PoolLayout.LAYER_FIRST)
    # layer_first: 3 runs per layer; page_first over all layers: 3 runs; mixed: every item alone.
    assert launch.num_copies == (3 if both_page_first else 9 if both_layer_first else 21)
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=si, dst_indices=di, layer_begin=0, layer_end=3,
    )  # fmt: skip


def test_dma_on_the_legacy_default_stream() -> None:
    """With no stream given on the default stream, the copy is ordered after earlier work on it
    and later work on it sees the copied bytes (the batch call is bridged through a side stream)."""
    case = CopyCase(65536, torch.uint8)
    host = _pool(case, PoolLayout.PAGE_FIRST, "host", 8, seed=1, num_layers=1)
    dev = _pool(case, PoolLayout.LAYER_FIRST, "device", 8, seed=2, num_layers=1)
    assert host.buffer is not None and dev.buffer is not None
    assert torch.cuda.current_stream().cuda_stream == 0
    dev.buffer.fill_(0)
    torch.cuda._sleep(10_000_000)  # earlier work on the default stream, still running
    dev.buffer[0, 5].fill_(3)  # … ordered after the sleep; the copy below must come after it
    copy_items(host, dev, torch.tensor([1, 2]), torch.tensor([5, 6]), method="dma")
    total = dev.buffer[0, 5:7].sum(dtype=torch.int64)  # later work on the default stream
    want = host.buffer[1:3].sum(dtype=torch.int64)
    assert int(total) == int(want)


def test_dma_indices_may_change_right_after_the_call() -> None:
    case = CopyCase(4096, torch.uint8)
    src = _pool(case, PoolLayout.PAGE_FIRST, "host", 64, seed=1)
    dst = _pool(case, PoolLayout.LAYER_FIRST, "device", 64, seed=2)
    si, di = index_pairs("scattered", src_items=64, dst_items=64, seed=4)
    src_before, dst_before = snapshot(src), snapshot(dst)
    want_si, want_di = si.clone(), di.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # keep the stream busy so the copy is still queued
    copy_items(src, dst, si, di, stream=side, method="dma")
    si.zero_()
    di.zero_()
    side.synchronize()
    assert_copied(
        src=src, dst=dst, src_before=src_before, dst_before=dst_before,
        src_indices=want_si, dst_indices=want_di, layer_begin=0, layer_end=3,
    )  # fmt: skip


def test_dma_host_writes_between_copies_are_seen() -> None:
    case = CopyCase(131072, torch.uint8)
    host = _pool(case, PoolLayout.PAGE_FIRST, "host", 4, seed=1, num_layers=1)
    dev = _pool(case, PoolLayout.LAYER_FIRST, "device", 4, seed=2, num_layers=1)
    assert host.buffer is not None and dev.buffer is not None
    for value in (7, 9):
        host.buffer[2].fill_(value)
        copy_items(host, dev, torch.tensor([2]), torch.tensor([1]), method="dma")
        torch.cuda.synchronize()
        assert bool((dev.buffer[0, 1] == value).all())


@pytest.mark.parametrize("method", ["triton", "auto", "dma"])
def test_real_spec_round_trip_by_method(method: str) -> None:
    """Qwen3-Next geometry (128 KiB KV pages, 2 MiB states): backup all layers in one call, load
    back one call per layer, by each method."""
    spec = HybridSpec.preset("qwen3-next-80b")
    dev_kv, dev_kv2 = DeviceKVPool(spec, 6, device="cuda"), DeviceKVPool(spec, 6, device="cuda")
    host_kv = HostKVPool(spec, num_pages=5, pin=True)
    dev_st, dev_st2 = DeviceMambaPool(spec, 2, device="cuda"), DeviceMambaPool(spec, 2, device="cuda")
    host_st = MambaPoolHost(spec, num_slots=3, pin=True)
    for pool in (dev_kv, dev_st):
        assert pool.buffer is not None
        pool.buffer.view(-1).random_(0, 256)
    pages, host_pages = torch.tensor([5, 0, 3]), torch.tensor([4, 1, 2])
    copy_items(dev_kv, host_kv, pages, host_pages, method=method)
    copy_items(dev_st, host_st, torch.tensor([1]), torch.tensor([2]), method=method)
    for layer_id in range(spec.num_layers):
        if layer_id in spec.attention_layer_ids:
            li = host_kv.layer_index(layer_id)
            copy_items(host_kv, dev_kv2, host_pages, pages, layer_begin=li, layer_end=li + 1, method=method)
        else:
            li = host_st.layer_index(layer_id)
            copy_items(host_st, dev_st2, torch.tensor([2]), torch.tensor([0]), layer_begin=li, layer_end=li + 1,
                       method=method)  # fmt: skip
    torch.cuda.synchronize()
    assert dev_kv.buffer is not None and dev_kv2.buffer is not None
    assert torch.equal(dev_kv.buffer[:, pages], dev_kv2.buffer[:, pages])
    assert dev_st.buffer is not None and dev_st2.buffer is not None
    assert torch.equal(dev_st.buffer[:, 1], dev_st2.buffer[:, 0])


def test_dma_validation() -> None:
    case = CopyCase(4096, torch.uint8)
    host = _pool(case, PoolLayout.PAGE_FIRST, "host", 4, seed=1, num_layers=1)
    dev = _pool(case, PoolLayout.LAYER_FIRST, "device", 4, seed=2, num_layers=1)
    pageable = make_item_pool(num_layers=1, num_items=4, case=case, layout=PoolLayout.PAGE_FIRST, pin=False)
    one, two = torch.tensor([0]), torch.tensor([1])
    with pytest.raises(TransferError, match="pageable"):
        copy_items(pageable, dev, one, two, method="dma")
    with pytest.raises(TransferError, match="engine"):
        launch_dma(host, dev, one, two, engine="fast")
    with pytest.raises(TransferError, match="stream"):
        launch_dma(host, dev, one, two, stream=object())  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="overlap"):
        copy_items(dev, dev, torch.tensor([0, 1]), torch.tensor([1, 2]), method="dma")
    with pytest.raises(TransferError, match="method"):
        copy_items(host, dev, one, two, method="copy-engine")
    with pytest.raises(TransferError, match="max_ctas"):
        copy_items(host, dev, one, two, method="dma", max_ctas=0)
    assert launch_dma(host, dev, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) is None


def test_dma_offsets_past_4_gib() -> None:
    """Byte offsets past 2**32 (a 9 GiB device pool) reach the right item."""
    case = CopyCase(1 << 20, torch.uint8)
    big = ItemPool(name="big", layer_ids=(0, 1), num_items=4608, item_bytes=case.item_bytes, device="cuda")
    host = _pool(case, PoolLayout.PAGE_FIRST, "host", 2, seed=5, num_layers=2)
    back = _pool(case, PoolLayout.PAGE_FIRST, "host", 2, seed=6, num_layers=2)
    copy_items(host, big, torch.tensor([0, 1]), torch.tensor([4607, 4606]), method="dma")
    copy_items(big, back, torch.tensor([4607, 4606]), torch.tensor([0, 1]), method="dma")
    torch.cuda.synchronize()
    assert big.buffer is not None and host.buffer is not None and back.buffer is not None
    assert torch.equal(back.buffer, host.buffer)
    assert torch.equal(big.buffer[1, 4607].cpu(), host.buffer[0, 1])
