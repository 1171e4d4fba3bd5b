"""Controller on a GPU: what a layer reads after ``await counter.wait(i)`` is the loaded data,
and loading layer i+1 overlaps computing layer i (CUDA-event timeline)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.spec import HybridSpec
from kernels.cudart import elapsed_ms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PAGE = 64


def make_cache(num_pages: int) -> tuple[HybridSpec, HybridCache]:
    spec = HybridSpec.preset("qwen3-next-80b", page_size=PAGE)
    cfg = HybridCacheConfig(
        device_kv_pages=num_pages + 4,
        device_state_slots=4,
        host_kv_bytes=(num_pages + 4) * spec.kv_page_bytes,
        host_state_bytes=4 * spec.state_bytes,
    )
    return spec, HybridCache(spec, cfg, device="cuda")


async def populate_and_demote(cache: HybridCache, tokens: list[int]) -> torch.Tensor:
    """Insert a prefix with random bytes, back it up, demote it; return its device bytes."""
    n = len(tokens) // PAGE
    alloc = cache.tree.alloc_device(n, 1)
    assert alloc is not None
    for pool in (cache.device_kv, cache.device_mamba):
        assert pool.buffer is not None
        pool.buffer.random_(0, 256)
    res = cache.tree.insert(tokens, alloc.kv_indices, states={len(tokens): alloc.state_slot})
    expected = torch.stack(
        [cache.device_kv.layer_items(lid)[alloc.kv_indices.cuda()] for lid in cache.spec.attention_layer_ids]
    ).clone()
    op = cache.controller.write(res.backup_nodes or [res.last_node])
    assert op is not None
    cache.controller.start_writing()
    await op
    cache.flush_device()
    # Poison the device memory the load will land in.
    for pool in (cache.device_kv, cache.device_mamba):
        assert pool.buffer is not None
        pool.buffer.fill_(0xA5)
    return expected


async def read_after_load(cache: HybridCache, tokens: list[int], *, wait: bool) -> torch.Tensor:
    m = cache.tree.match_prefix(tokens)
    assert m.needs_load
    op = cache.controller.load(m)
    assert op is not None
    # Hold the load stream back so a read that does not wait sees the poisoned bytes.
    load_stream = cache.controller._load_stream
    assert load_stream is not None
    with torch.cuda.stream(load_stream):
        torch.cuda._sleep(200_000_000)
    counter = cache.controller.start_loading()
    out = []
    pages = None
    for lid in cache.spec.cached_layer_ids:
        if wait:
            await counter.wait(lid)
        else:
            # Let the controller enqueue the copy, but do not make the stream wait for it.
            while not counter.is_enqueued(lid):
                await _yield()
        if lid in cache.spec.attention_layer_ids:
            if pages is None:
                pages = cache.tree.match_prefix(tokens).device_kv_indices.cuda()
            out.append(cache.device_kv.layer_items(lid)[pages].clone())
    result = torch.stack(out)
    await op
    return result


async def _yield() -> None:
    import asyncio

    await asyncio.sleep(0)


async def test_values_read_after_wait_are_the_loaded_values() -> None:
    _spec, cache = make_cache(64)
    tokens = list(range(1, 64 * PAGE + 1))
    async with cache:
        expected = await populate_and_demote(cache, tokens)
        got = await read_after_load(cache, tokens, wait=True)
        torch.cuda.synchronize()
        assert torch.equal(got, expected)
        # Control: the same read without the wait races the delayed copy and sees the poison,
        # so the assertion above would fail if the wait were removed.
        cache.flush_device()
        for pool in (cache.device_kv, cache.device_mamba):
            assert pool.buffer is not None
            pool.buffer.fill_(0xA5)
        raced = await read_after_load(cache, tokens, wait=False)
        torch.cuda.synchronize()
        assert not torch.equal(raced, expected)
        cache.tree.check_integrity()


async def test_loading_layer_i_plus_1_overlaps_computing_layer_i() -> None:
    spec, cache = make_cache(256)  # 16k tokens: ~32 MiB of KV per attention layer
    tokens = list(range(1, 256 * PAGE + 1))
    async with cache:
        await populate_and_demote(cache, tokens)
        m = cache.tree.match_prefix(tokens)
        op = cache.controller.load(m)
        assert op is not None
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):  # warm up the GEMM (first calls pick and load kernels)
            (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        counter = cache.controller.start_loading()
        compute_start: dict[int, torch.cuda.Event] = {}
        compute_end: dict[int, torch.cuda.Event] = {}
        for lid in spec.cached_layer_ids:
            await counter.wait(lid)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            compute_start[lid] = ev
            for _ in range(32):  # ≈1 ms: longer than a layer's load (32 MiB of KV ≈ 0.6 ms)
                a = (a @ a).clamp_(-1, 1)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            compute_end[lid] = ev
        await op
        torch.cuda.synchronize()
        ids = list(spec.cached_layer_ids)
        load_end = {lid: counter.cuda_event(lid) for lid in ids}
        rows = []
        hidden = 0
        for i, lid in enumerate(ids[:-1]):
            nxt = ids[i + 1]
            c0 = start.elapsed_time(compute_start[lid])
            c1 = start.elapsed_time(compute_end[lid])
            l1 = elapsed_ms(start, load_end[nxt])
            rows.append((lid, c0, c1, l1))
            # Layer i+1 finished loading before layer i finished computing: the load ran
            # concurrently with (or ahead of) the compute instead of after it.
            if l1 <= c1:
                hidden += 1
        print("\nlayer  compute_start  compute_end  next_layer_load_end (ms)")
        for lid, c0, c1, l1 in rows:
            print(f"{lid:5d}  {c0:13.3f}  {c1:11.3f}  {l1:19.3f}")
        assert hidden >= len(rows) // 2, f"only {hidden} of {len(rows)} layer loads overlapped compute"


def _state_of(cache: HybridCache, slot: int) -> torch.Tensor:
    return torch.cat([cache.device_mamba.layer_items(lid)[slot].reshape(-1) for lid in cache.spec.mamba_layer_ids])


async def _load_into_working_slot(cache: HybridCache, tokens: list[int]) -> tuple[Any, ...]:
    """Load ``tokens`` with ``state_to=`` a fresh slot, wait for every layer, read the working
    slot after each recurrent layer's wait, then, after the next ``start_loading``, read the
    node's slot on the same stream, before the operation completes."""
    m = cache.tree.match_prefix(tokens)
    mine = cache.device_mamba.alloc(1)
    assert m.needs_load and mine is not None
    op = cache.controller.load(m, state_to=[int(mine[0])])
    assert op is not None
    counter = cache.controller.start_loading()
    working = []
    for lid in cache.spec.cached_layer_ids:
        await counter.wait(lid)
        if lid in cache.spec.mamba_layer_ids:
            working.append(cache.device_mamba.layer_items(lid)[int(mine[0])].reshape(-1).clone())
    assert cache.controller.start_loading().layer_ids == ()
    node = _state_of(cache, m.last_node.device_state).clone()
    await op
    cache.device_mamba.free(mine)
    return torch.cat(working), node


async def test_a_state_loaded_for_a_working_slot_reaches_the_node_slot_by_the_next_step() -> None:
    """``load(state_to=)``: the working slot holds the state once each layer is waited for; the
    node's slot, filled after the last layer (no layer waits for it), is ready for any work the
    next step's ``start_loading`` precedes. (Read before that ``start_loading`` the node's slot
    may or may not hold the state yet — 77 MB land ~1.5 ms after the last layer, and on some
    H200 machines that is before the read — so only the ordered read is asserted.)"""
    _, cache = make_cache(16)
    tokens = list(range(1, 16 * PAGE + 1))
    async with cache:
        alloc = cache.tree.alloc_device(16, 1)
        assert alloc is not None
        for pool in (cache.device_kv, cache.device_mamba):
            assert pool.buffer is not None
            pool.buffer.random_(0, 256)
        res = cache.tree.insert(tokens, alloc.kv_indices, states={len(tokens): alloc.state_slot})
        expected = _state_of(cache, alloc.state_slot).clone()
        op = cache.controller.write(res.backup_nodes or [res.last_node])
        assert op is not None
        cache.controller.start_writing()
        await op
        for _ in range(2):
            cache.flush_device()
            for pool in (cache.device_kv, cache.device_mamba):
                assert pool.buffer is not None
                pool.buffer.fill_(0xA5)
            working, node = await _load_into_working_slot(cache, tokens)
            torch.cuda.synchronize()
            assert torch.equal(working, expected)
            assert torch.equal(node, expected)
        cache.tree.check_integrity()


async def test_a_load_failing_inside_a_step_completes_after_the_step_s_enqueued_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy that fails after another copy of its step was enqueued: the load fails only once
    the enqueued copy has run (its pages are freed then), not while it may still write them.
    400 pages: each step after the first is a KV layer with a group of states riding along."""
    from asynccache import copy_issue
    from asynccache.errors import TransferError

    _, cache = make_cache(400)
    tokens = list(range(1, 400 * PAGE + 1))
    since_event, injected = [0], [False]
    record = copy_issue.record_on

    def recording(handle: Any) -> Any:
        since_event[0] = 0
        return record(handle)

    monkeypatch.setattr(copy_issue, "record_on", recording)
    async with cache:
        await populate_and_demote(cache, tokens)
        ctrl = cache.controller
        load_stream = ctrl._load_stream
        assert load_stream is not None
        real = ctrl.layer_copier

        def failing(pair: Any, src: Any, dst: Any) -> Any:
            copy = real(pair, src, dst)

            def layer(index: int, count: int = 1) -> int:
                if since_event[0] == 0:  # a step's first copy, held back on the load stream
                    with torch.cuda.stream(load_stream):
                        torch.cuda._sleep(300_000_000)
                elif not injected[0]:  # the first step's second copy fails
                    injected[0] = True
                    raise TransferError("copy failed")
                since_event[0] += 1
                return copy(index, count)

            return layer

        ctrl.layer_copier = failing  # type: ignore[method-assign]
        op = ctrl.load(cache.tree.match_prefix(tokens))
        assert op is not None
        ctrl.start_loading()
        with pytest.raises(TransferError):
            await op
        assert injected[0]
        assert load_stream.query(), "the load failed while a copy of its step was still queued"
        cache.tree.check_integrity()
