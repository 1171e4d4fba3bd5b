"""HybridCacheController on CPU pools: merged launches, concurrency, cancellation, failures."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import TransferError
from asynccache.ops import CacheOperation, OpState
from asynccache.spec import HybridSpec
from asynccache.storage import PoolName, PoolTransfer

PAGE = 4


def make_spec() -> HybridSpec:
    return HybridSpec.preset("tiny", page_size=PAGE)


def make_cache(**overrides: Any) -> HybridCache:
    spec = make_spec()
    cfg = {
        "device_kv_pages": 256,
        "device_state_slots": 32,
        "host_kv_bytes": 512 * spec.kv_page_bytes,
        "host_state_bytes": 64 * spec.state_bytes,
    }
    cfg.update(overrides)
    return HybridCache(spec, HybridCacheConfig(**cfg))


def fill_random(cache: HybridCache, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for pool in (cache.device_kv, cache.device_mamba):
        assert pool.buffer is not None
        pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=g, dtype=torch.uint8))


def free_counts(cache: HybridCache) -> tuple[int, ...]:
    pools = [cache.device_kv, cache.device_mamba, cache.host_kv, cache.host_mamba]
    return tuple(p.num_free for p in pools if p is not None)


def prompt(i: int, n: int = 6 * PAGE) -> list[int]:
    return [1000 * (i + 1) + t for t in range(n)]


def insert_request(cache: HybridCache, tokens: list[int]) -> Any:
    """Insert a computed prefix with a state at its end, as a finished request would."""
    alloc = cache.tree.alloc_device(len(tokens) // PAGE, 1)
    assert alloc is not None
    return cache.tree.insert(tokens, alloc.kv_indices, states={len(tokens): alloc.state_slot})


async def back_up_and_demote(cache: HybridCache, tokens: list[int]) -> bytes:
    """Insert ``tokens``, back them up to host, drop the device copy; return the device bytes."""
    res = insert_request(cache, tokens)
    ctrl = cache.controller
    op = ctrl.write(res.backup_nodes or [res.last_node])
    assert op is not None
    ctrl.start_writing()
    await op
    m = cache.tree.match_prefix(tokens)
    saved = snapshot_bytes(cache, m)
    return saved


def snapshot_bytes(cache: HybridCache, match: Any) -> bytes:
    """The device bytes of a fully device-resident match (KV pages of every layer + state)."""
    pages = match.device_kv_indices
    kv = torch.stack([cache.device_kv.layer_items(lid)[pages] for lid in cache.spec.attention_layer_ids])
    slot = match.last_node.device_state
    st = torch.stack([cache.device_mamba.layer_items(lid)[slot] for lid in cache.spec.mamba_layer_ids])
    return kv.numpy().tobytes() + st.numpy().tobytes()


def stats_launches(ctrl: Any) -> tuple[int, int]:
    counts = ctrl.statistics().counts
    return counts.get("h2d_launches_kv", 0), counts.get("h2d_launches_mamba", 0)


class CountingCopier:
    """Wraps ``ctrl.layer_copier``: records ``(pool, first layer, layers, items, thread)`` for
    every call of a layer-by-layer copy."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int, int, int, int]] = []

    def __call__(self, pair: Any, si: torch.Tensor, di: torch.Tensor) -> Callable[..., int]:
        copy = self.inner(pair, si, di)

        def counted(layer: int, count: int = 1) -> int:
            self.calls.append((pair.dst.name, layer, count, si.numel(), threading.get_ident()))
            return copy(layer, count)

        return counted

    def layers(self, pool: str) -> list[int]:
        """The local layers copied into ``pool``, in call order."""
        return [la for name, first, n, _, _ in self.calls if name == pool for la in range(first, first + n)]


class CountingCopy:
    def __init__(self, inner: Callable[..., int]) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int, int]] = []  # (layer_begin, layer_end, items)

    def __call__(self, src: Any, dst: Any, si: torch.Tensor, di: torch.Tensor, **kw: Any) -> int:
        lb, le = kw.get("layer_begin", 0), kw.get("layer_end") or src.num_layers
        self.calls.append((lb, le, si.numel()))
        return self.inner(src, dst, si, di, **kw)


async def test_load_restores_exact_bytes_and_merges_to_one_launch_per_layer() -> None:
    async with make_cache() as cache:
        fill_random(cache)
        saved = [await back_up_and_demote(cache, prompt(i)) for i in range(5)]
        cache.flush_device()
        # Scribble over the freed device memory: a load must bring back the host bytes.
        fill_random(cache, seed=99)
        ctrl = cache.controller
        counting = CountingCopier(ctrl.layer_copier)
        ctrl.layer_copier = counting
        matches = [cache.tree.match_prefix(prompt(i)) for i in range(5)]
        assert all(m.needs_load and m.num_tokens == 6 * PAGE for m in matches)
        ops = [ctrl.load(m) for m in matches]
        assert all(op is not None for op in ops)
        counter = ctrl.start_loading()
        for lid in cache.spec.cached_layer_ids:
            await counter.wait(lid)
        await asyncio.gather(*ops)
        spec = cache.spec
        # One launch per layer per pool for all five operations together (consecutive small
        # layers of one pool grouped): every layer once, in order.
        assert counting.layers("device_kv") == list(range(spec.num_attention_layers))
        assert counting.layers("device_mamba") == list(range(spec.num_mamba_layers))
        assert {items for name, *_, items, _ in counting.calls if name == "device_kv"} == {5 * 6}
        assert sum(stats_launches(ctrl)) == len(counting.calls) <= spec.num_attention_layers + spec.num_mamba_layers
        for i in range(5):
            m = cache.tree.match_prefix(prompt(i))
            assert not m.needs_load
            assert snapshot_bytes(cache, m) == saved[i]
        cache.tree.check_integrity()
        stats = ctrl.statistics()
        assert stats.counts["load_ops"] == 5
        assert stats.bytes_total("h2d") == 5 * (6 * spec.kv_page_bytes + spec.state_bytes)


@pytest.fixture(params=[0.0, 10.0])
def budget_s(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """``LOAD_ENQUEUE_BUDGET_S``: none (a worker thread takes every layer after the first) or
    generous (the loop thread enqueues them all)."""
    import asynccache.copy_issue as copy_issue_module

    monkeypatch.setattr(copy_issue_module, "LOAD_ENQUEUE_BUDGET_S", request.param)
    return float(request.param)


async def demoted_and_counted(cache: HybridCache, seed: int) -> tuple[bytes, CountingCopier]:
    """``prompt(0)`` backed up and dropped from the device, whose memory is then scribbled over
    (``seed``); returns the saved bytes and the controller's copier, now counted."""
    fill_random(cache)
    saved = await back_up_and_demote(cache, prompt(0))
    cache.flush_device()
    fill_random(cache, seed=seed)
    counting = CountingCopier(cache.controller.layer_copier)
    cache.controller.layer_copier = counting
    return saved, counting


async def test_load_enqueue_budget_splits_layers_between_loop_and_worker(budget_s: float) -> None:
    """``start_loading`` enqueues layers on the loop while its host-time budget lasts — all of
    them with a generous budget, only the first with none (a worker thread takes the rest) —
    and either way every layer lands, in order, with the saved bytes."""
    async with make_cache() as cache:
        saved, counting = await demoted_and_counted(cache, seed=7)
        ctrl = cache.controller
        loop_thread = threading.get_ident()
        op = ctrl.load(cache.tree.match_prefix(prompt(0)))
        assert op is not None
        counter = ctrl.start_loading()
        layer_ids = cache.spec.cached_layer_ids
        threads = [t for *_, t in counting.calls]
        on_loop = sum(t == loop_thread for t in threads)
        if budget_s:
            assert all(counter.is_enqueued(lid) for lid in layer_ids)
            assert on_loop == len(threads)
            assert counting.layers("device_kv") == list(range(cache.spec.num_attention_layers))
            assert counting.layers("device_mamba") == list(range(cache.spec.num_mamba_layers))
        else:
            assert counter.is_enqueued(layer_ids[0]) and on_loop == 1
        for lid in layer_ids:
            await counter.wait(lid)
        await op
        threads = [t for *_, t in counting.calls]
        if not budget_s:
            assert sum(t != loop_thread for t in threads) == len(threads) - 1
        m = cache.tree.match_prefix(prompt(0))
        assert not m.needs_load and snapshot_bytes(cache, m) == saved
        cache.tree.check_integrity()


async def test_writes_merge_into_one_launch_for_all_layers() -> None:
    async with make_cache() as cache:
        fill_random(cache)
        ctrl = cache.controller
        counting = CountingCopy(ctrl.copy)
        ctrl.copy = counting
        ops = []
        for i in range(7):
            res = insert_request(cache, prompt(i))
            op = ctrl.write(res.backup_nodes or [res.last_node])
            assert op is not None
            ops.append(op)
        assert ctrl.start_writing() == 7
        await asyncio.gather(*ops)
        # One launch per pool, covering every layer.
        assert len(counting.calls) == 2
        assert {(lb, le) for lb, le, _ in counting.calls} == {
            (0, cache.spec.num_attention_layers),
            (0, cache.spec.num_mamba_layers),
        }
        assert all(op.state is OpState.DONE for op in ops)
        cache.tree.check_integrity()


def test_merge_ops_concatenates_per_pool_in_order() -> None:
    loop = asyncio.new_event_loop()
    try:
        a = CacheOperation(
            "load",  # type: ignore[arg-type]
            [
                PoolTransfer(pool_name=PoolName.KV, host_indices=torch.tensor([1, 2]), device_indices=torch.tensor([5, 6])),
                PoolTransfer(pool_name=PoolName.MAMBA, host_indices=torch.tensor([0]), device_indices=torch.tensor([3])),
            ],
            plan=None,
            loop=loop,
        )
        b = CacheOperation(
            "load",  # type: ignore[arg-type]
            [PoolTransfer(pool_name=PoolName.KV, host_indices=torch.tensor([9]), device_indices=torch.tensor([7]))],
            plan=None,
            loop=loop,
        )
        merged = CacheOperation.merge_ops([a, b])
        assert merged[PoolName.KV].host_indices.tolist() == [1, 2, 9]
        assert merged[PoolName.KV].device_indices.tolist() == [5, 6, 7]
        assert merged[PoolName.MAMBA].device_indices.tolist() == [3]
    finally:
        loop.close()


async def test_many_concurrent_requests_write_and_load() -> None:
    async with make_cache(device_kv_pages=160, device_state_slots=24) as cache:
        fill_random(cache)
        ctrl = cache.controller
        expected: dict[int, bytes] = {}

        async def client(i: int) -> None:
            expected[i] = await back_up_and_demote(cache, prompt(i))

        await asyncio.gather(*(client(i) for i in range(20)))
        cache.flush_device()

        async def loader(i: int) -> None:
            for _ in range(50):
                m = cache.tree.match_prefix(prompt(i))
                if not m.needs_load:
                    return
                token = cache.tree.lock(m.last_node)
                op = ctrl.load(m)
                if op is None:
                    cache.tree.unlock(m.last_node, token)
                    await asyncio.sleep(0)
                    continue
                counter = ctrl.start_loading()
                for lid in cache.spec.cached_layer_ids:
                    await counter.wait(lid)
                await op
                m2 = cache.tree.match_prefix(prompt(i))
                assert snapshot_bytes(cache, m2) == expected[i]
                cache.tree.unlock(m.last_node, token)
                return
            pytest.fail(f"request {i} never got room to load")

        # The device holds ~6 prefixes at once: loaders evict each other's unlocked data.
        for batch in (range(5), range(5, 10), range(10, 15), range(15, 20)):
            await asyncio.gather(*(loader(i) for i in batch))
            cache.tree.check_integrity()


async def test_cancellation_storm_leaks_nothing() -> None:
    rng = random.Random(7)
    async with make_cache(device_kv_pages=256, device_state_slots=64) as cache:
        fill_random(cache)
        for i in range(24):
            await back_up_and_demote(cache, prompt(i))
        cache.flush_device()
        await cache.controller.wait_idle()
        start = free_counts(cache)
        ctrl = cache.controller
        cancelled = issued = 0
        for _ in range(1000):
            i = rng.randrange(24)
            kind = rng.random()
            if kind < 0.6:
                m = cache.tree.match_prefix(prompt(i))
                op = ctrl.load(m) if m.needs_load else None
            else:
                m = cache.tree.match_prefix(prompt(i))
                op = ctrl.write([m.last_node]) if m.last_node.parent is not None else None
            if op is None:
                continue
            point = rng.random()
            if point < 0.5:
                assert ctrl.cancel(op)
                cancelled += 1
                with pytest.raises(asyncio.CancelledError):
                    await op
            else:
                # Issue, then cancel the waiter mid-flight: the copy completes regardless.
                if op.kind.value == "load":
                    ctrl.start_loading()
                else:
                    ctrl.start_writing()
                issued += 1
                waiter = asyncio.ensure_future(_await(op))
                await asyncio.sleep(0)
                if waiter.cancel():
                    with pytest.raises(asyncio.CancelledError):
                        await waiter
                assert not ctrl.cancel(op)
                await op
                if rng.random() < 0.3:
                    cache.flush_device()
            cache.tree.check_integrity()
        assert cancelled > 100 and issued > 100
        await ctrl.wait_idle()
        cache.flush_device()
        cache.tree.check_integrity()
        # Everything the operations took came back: only tree-owned data remains allocated.
        assert free_counts(cache)[:2] == start[:2]
        assert cache.tree.stats().num_active_plans == 0


async def _await(op: CacheOperation) -> None:
    await op


async def test_failed_copy_rolls_back_and_frees_everything() -> None:
    async with make_cache() as cache:
        fill_random(cache)
        for i in range(3):
            await back_up_and_demote(cache, prompt(i))
        cache.flush_device()
        before = free_counts(cache)
        ctrl = cache.controller
        real = ctrl.layer_copier
        calls = 0

        def failing(*args: Any, **kwargs: Any) -> Callable[..., int]:
            copy = real(*args, **kwargs)

            def layer(li: int, count: int = 1) -> int:
                nonlocal calls
                calls += 1
                if calls == 2:  # fail in the middle of the per-layer loop
                    raise TransferError("injected copy failure")
                return copy(li, count)

            return layer

        ctrl.layer_copier = failing
        ops = [ctrl.load(cache.tree.match_prefix(prompt(i))) for i in range(3)]
        counter = ctrl.start_loading()
        with pytest.raises(TransferError):
            for lid in cache.spec.cached_layer_ids:
                await counter.wait(lid)
        for op in ops:
            assert op is not None
            with pytest.raises(TransferError):
                await op
            assert op.state is OpState.FAILED
        assert free_counts(cache) == before
        cache.tree.check_integrity()
        # The data is still on host and loads fine once copies work again.
        ctrl.layer_copier = real
        m = cache.tree.match_prefix(prompt(0))
        assert m.needs_load
        op = ctrl.load(m)
        assert op is not None
        ctrl.start_loading()
        await op
        assert not cache.tree.match_prefix(prompt(0)).needs_load


async def test_failed_write_copy_frees_host_slots() -> None:
    async with make_cache() as cache:
        fill_random(cache)
        res = insert_request(cache, prompt(0))
        before = free_counts(cache)
        ctrl = cache.controller

        def failing(*args: Any, **kwargs: Any) -> int:
            raise TransferError("injected")

        ctrl.copy = failing
        op = ctrl.write(res.backup_nodes or [res.last_node])
        assert op is not None
        ctrl.start_writing()
        with pytest.raises(TransferError):
            await op
        assert free_counts(cache) == before
        cache.tree.check_integrity()
        assert cache.tree.match_prefix(prompt(0)).last_node.host_kv is None


async def test_allocation_failure_returns_none_and_takes_nothing() -> None:
    async with make_cache(host_kv_bytes=4 * make_spec().kv_page_bytes) as cache:
        fill_random(cache)
        res = insert_request(cache, prompt(0))  # 6 pages, host holds only 4
        before = free_counts(cache)
        assert cache.controller.write(res.backup_nodes or [res.last_node]) is None
        assert free_counts(cache) == before
        cache.tree.check_integrity()
        assert cache.controller.statistics().counts["write_no_room"] == 1


async def test_a_load_without_device_room_returns_none_and_takes_nothing() -> None:
    """The device holds 8 pages, 6 of them a prefix in use (locked): loading another 6-page
    prefix from the host finds no room — ``None``, nothing allocated, locked or evicted — and
    succeeds, with the saved bytes, once the prefix in use is released."""
    async with make_cache(device_kv_pages=8) as cache:
        fill_random(cache)
        tree, ctrl = cache.tree, cache.controller
        saved = await back_up_and_demote(cache, prompt(0))
        cache.flush_device()
        held = insert_request(cache, prompt(1)).last_node
        token = tree.lock(held)
        before = free_counts(cache)
        m = tree.match_prefix(prompt(0))
        assert ctrl.load(m) is None
        assert ctrl.statistics().counts["load_no_room"] == 1
        assert free_counts(cache) == before
        assert tree.match_prefix(prompt(1)).num_device_tokens == 6 * PAGE
        tree.check_integrity()
        tree.unlock(held, token)
        op = ctrl.load(tree.match_prefix(prompt(0)))
        assert op is not None
        counter = ctrl.start_loading()
        await op
        await counter.wait(cache.spec.cached_layer_ids[-1])
        assert snapshot_bytes(cache, tree.match_prefix(prompt(0))) == saved
        tree.check_integrity()


async def test_injected_tree_failure_in_begin_load_frees_allocation() -> None:
    async with make_cache() as cache:
        fill_random(cache)
        await back_up_and_demote(cache, prompt(0))
        cache.flush_device()
        before = free_counts(cache)
        m = cache.tree.match_prefix(prompt(0))

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected tree failure")

        cache.tree.begin_load = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            cache.controller.load(m)
        assert free_counts(cache) == before
        del cache.tree.begin_load  # type: ignore[attr-defined]
        cache.tree.check_integrity()


async def test_nothing_to_load_is_a_completed_operation() -> None:
    async with make_cache() as cache:
        fill_random(cache)
        insert_request(cache, prompt(0))
        m = cache.tree.match_prefix(prompt(0))
        assert not m.needs_load
        op = cache.controller.load(m)
        assert op is not None and op.done
        await op
        counter = cache.controller.start_loading()
        await asyncio.wait_for(counter.wait(cache.spec.cached_layer_ids[0]), timeout=1)


async def test_start_loading_requires_the_async_context() -> None:
    cache = make_cache()
    with pytest.raises(RuntimeError, match="async with"):
        cache.controller.start_loading()


class _Tail:
    """The part of a TailRestore that ``load_tail`` uses: host pages, a host state slot, release."""

    def __init__(self, cache: HybridCache, num_pages: int) -> None:
        assert cache.host_kv is not None and cache.host_mamba is not None
        kv, slot = cache.host_kv.alloc(num_pages), cache.host_mamba.alloc(1)
        assert kv is not None and slot is not None
        self.host_kv, self.host_slot = kv, slot
        self.released = 0

    @property
    def ok(self) -> bool:
        return not self.released

    def release(self) -> None:
        self.released += 1


async def test_load_tail_lands_layer_by_layer_and_releases_the_tail_once() -> None:
    async with make_cache() as cache:
        assert cache.host_kv is not None and cache.host_mamba is not None
        g = torch.Generator().manual_seed(5)
        for pool in (cache.host_kv, cache.host_mamba):
            assert pool.buffer is not None
            pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=g, dtype=torch.uint8))
        ctrl = cache.controller
        tail = _Tail(cache, 3)
        pages, slots = cache.device_kv.alloc(3), cache.device_mamba.alloc(2)
        assert pages is not None and slots is not None
        op = ctrl.load_tail(tail, pages, slots)
        counter = ctrl.start_loading()
        for lid in cache.spec.cached_layer_ids:
            await counter.wait(lid)
        await op
        await asyncio.sleep(0)  # done callbacks run on the next loop iteration
        assert tail.released == 1 and op.state is OpState.DONE
        for lid in cache.spec.attention_layer_ids:
            assert torch.equal(cache.device_kv.layer_items(lid)[pages], cache.host_kv.layer_items(lid)[tail.host_kv])
        for lid in cache.spec.mamba_layer_ids:
            want = cache.host_mamba.layer_items(lid)[tail.host_slot]
            assert torch.equal(cache.device_mamba.layer_items(lid)[slots], want.expand(2, -1))
        # The device pages and slots stay the caller's; the tree never saw them.
        assert cache.device_kv.allocator.is_allocated(int(pages[0]))
        # A queued tail load that is cancelled never copies, and still releases its tail.
        tail2 = _Tail(cache, 2)
        op2 = ctrl.load_tail(tail2, cache.device_kv.alloc(2), cache.device_mamba.alloc(1))
        assert ctrl.cancel(op2)
        await asyncio.sleep(0)
        assert tail2.released == 1 and op2.state is OpState.CANCELLED
        assert ctrl.start_loading().layer_ids == ()


async def test_a_load_copies_the_boundary_state_into_the_callers_slots_too(budget_s: float) -> None:
    """``load(match, state_to=...)``: the caller's slots receive the host state layer by layer
    with the step's copies; the node's own slot gets it after the last layer, all layers in one
    copy (on the loop thread or in the worker's last step); the caller's slots stay the
    caller's when the load is cancelled; a match whose state needs no load is refused."""
    async with make_cache() as cache:
        saved, counting = await demoted_and_counted(cache, seed=5)
        ctrl, spec = cache.controller, cache.spec
        mine = cache.device_mamba.alloc(2)
        assert mine is not None
        op = ctrl.load(cache.tree.match_prefix(prompt(0)), state_to=[int(s) for s in mine])
        assert op is not None
        counter = ctrl.start_loading()
        for lid in spec.cached_layer_ids:
            await counter.wait(lid)
        await op
        state_calls = [(first, n, items) for name, first, n, items, _ in counting.calls if name == "device_mamba"]
        # Per step: both caller slots; last: the node's slot, every layer in one call.
        assert state_calls[-1] == (0, spec.num_mamba_layers, 1)
        assert [la for first, n, _ in state_calls[:-1] for la in range(first, first + n)] == list(
            range(spec.num_mamba_layers)
        )
        assert {items for *_, items in state_calls[:-1]} == {2}
        assert counting.calls[-1][0] == "device_mamba"
        assert ctrl.statistics().bytes_total("h2d") == 6 * spec.kv_page_bytes + 3 * spec.state_bytes
        m = cache.tree.match_prefix(prompt(0))
        assert snapshot_bytes(cache, m) == saved

        def state(slot: int) -> torch.Tensor:
            return torch.stack([cache.device_mamba.layer_items(lid)[slot] for lid in spec.mamba_layer_ids])

        for slot in mine.tolist():
            assert torch.equal(state(slot), state(m.last_node.device_state))
        with pytest.raises(ValueError, match="state_to"):
            ctrl.load(m, state_to=[int(mine[0])])
        # Cancelled before it is issued: the node's slot is freed, the caller's are not.
        cache.flush_device()
        before = cache.device_mamba.num_free
        op = ctrl.load(cache.tree.match_prefix(prompt(0)), state_to=[int(mine[0])])
        assert op is not None and ctrl.cancel(op)
        assert cache.device_mamba.num_free == before
        cache.device_mamba.free(mine)  # still ours: no double free
        cache.tree.check_integrity()


async def test_waiting_for_idle_ends_while_finished_tasks_still_await_their_done_callbacks(tmp_path: Any) -> None:
    """A finished task stays in the controller's loader set (and the storage tier's backup set)
    until its done callback runs, a loop pass later; since Python 3.12 gathering only finished
    tasks does not yield to the loop. Waiting for idle must end anyway, not spin on them."""

    async def nothing() -> None:
        return None

    async with make_cache(storage_uri=tmp_path.as_uri()) as cache:
        ctrl = cache.controller
        done = asyncio.get_running_loop().create_task(nothing())
        await done
        for tasks, wait in ((ctrl._loaders, ctrl.wait_idle), (ctrl.tiering._in_flight, ctrl.tiering.drain)):
            tasks.add(done)  # as if its discard callback had not run yet
            waiter = asyncio.ensure_future(wait())
            ended, _ = await asyncio.wait({waiter}, timeout=5)
            tasks.clear()  # (a waiter that spins ends now)
            await waiter
            assert ended, f"{wait.__qualname__} did not end"
