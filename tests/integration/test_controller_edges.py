"""The controller and storage tier driven directly at their edges: archives racing host backups,
storage that evicts, stale node lists, failed loads with data inserted below, tail loads whose
lists do not fit, calls after close."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import torch
from serving import free_counts, serving_config

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import (
    BackendError,
    ClosedError,
    ConfigError,
    TransferError,
    TreeError,
)
from asynccache.ops import OpState
from asynccache.policy import EveryPageAdmission
from asynccache.spec import HybridSpec
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer

PAGE = 4
SPEC = HybridSpec.preset("tiny", page_size=PAGE)


def config(**overrides: Any) -> HybridCacheConfig:
    return dataclasses.replace(serving_config(SPEC), **overrides)


def insert(cache: HybridCache, tokens: list[int], states: list[int] | None = None) -> Any:
    positions = [len(tokens)] if states is None else states
    alloc = cache.tree.alloc_device(len(tokens) // PAGE, len(positions))
    assert alloc is not None
    slots = {p: int(s) for p, s in zip(positions, alloc.state_slots, strict=True)}
    return cache.tree.insert(tokens, alloc.kv_indices, states=slots)


async def stored(backend: Any, keys: list[str]) -> Any:
    return await backend.batch_exists_v2(
        keys,
        [
            PoolTransfer(pool_name=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ],
    )


async def backed_up(cache: HybridCache, nodes: Any) -> None:
    op = cache.controller.write(nodes)
    assert op is not None
    cache.controller.start_writing()
    await op


async def on_host_only(cache: HybridCache, tokens: list[int]) -> None:
    """``tokens`` inserted, backed up and demoted: a match of them loads from the host."""
    await backed_up(cache, insert(cache, tokens).backup_nodes)
    cache.flush_device()


async def test_a_state_that_reaches_the_host_during_an_archive_is_archived_too() -> None:
    """An archive of a deeper node is awaiting storage when its ancestor gets a host state: the
    ancestor is not marked archived by it (its state was not written) but archived itself."""
    tokens = list(range(1, 8 * PAGE + 1))
    sibling = tokens[:16] + [900 + i for i in range(16)]
    cache = HybridCache(SPEC, config(storage_uri="memory://archive_race", max_backups_in_flight=1))
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        assert ctrl.tiering is not None
        backend = ctrl.tiering.backend
        gate = asyncio.Event()
        real_set = backend.batch_set_v2

        async def gated_set(transfers: Any) -> Any:
            await gate.wait()
            return await real_set(transfers)

        backend.batch_set_v2 = gated_set  # type: ignore[method-assign]
        insert(cache, tokens)
        insert(cache, sibling)  # splits the first node at 16: M = [0, 4), D = [4, 8)
        d = tree.match_prefix(tokens).last_node
        m = d.parent
        await backed_up(cache, [m, d])
        await asyncio.sleep(0.01)  # D's archive (M's KV, D's KV and state) waits for storage
        alloc = tree.alloc_device(4, 1)
        assert alloc is not None
        res = tree.insert(tokens[:16], alloc.kv_indices, states={16: int(alloc.state_slots[0])})
        assert res.last_node is m
        await backed_up(cache, res.backup_nodes)  # M's state reaches the host
        gate.set()
        await ctrl.wait_idle()
        await ctrl.tiering.drain()
        found = await stored(backend, list(tree.match_prefix(tokens[:16]).page_hashes))
        assert m.archived and found.exists[PoolName.MAMBA][-1], "M is marked archived, so its state is stored"


async def test_storage_that_evicts_keeps_every_stored_state_restorable() -> None:
    """With a capacity the backend drops old objects: nothing is marked archived, and a backup
    writes its whole path, so a stored state always has its KV."""
    prefix = list(range(1, 4 * PAGE + 1))
    longer = prefix + list(range(500, 500 + 4 * PAGE))
    room = 12 * (SPEC.kv_page_bytes + 64) + 3 * (SPEC.state_bytes + 64) + 256
    cfg = config(storage_uri="memory://evicting", storage_options={"capacity_bytes": room},
                 host_kv_bytes=64 * SPEC.kv_page_bytes, host_state_bytes=16 * SPEC.state_bytes)  # fmt: skip
    async with HybridCache(SPEC, cfg) as cache:
        ctrl, tree = cache.controller, cache.tree
        assert ctrl.tiering is not None

        async def serve(tokens: list[int]) -> Any:
            res = insert(cache, tokens)
            await backed_up(cache, res.backup_nodes)
            await ctrl.tiering.drain()  # type: ignore[union-attr]
            return res.last_node

        node = await serve(prefix)
        assert not node.archived
        for k in range(3):  # other traffic: the backend evicts the prefix's objects
            await serve([10_000 * (k + 1) + i for i in range(4 * PAGE)])
        await serve(longer)
        keys = list(tree.match_prefix(longer).page_hashes)
        assert (await stored(ctrl.tiering.backend, keys)).num_hit_pages == len(keys)
        cache.flush_device()
        tree.evict_host(num_kv_pages=64, num_states=16, archived_only=True)
        assert tree.match_prefix(longer).num_tokens == len(longer)  # nothing trusted a stale flag


async def test_a_backup_of_a_node_deleted_meanwhile_leaves_nothing_locked() -> None:
    cache = HybridCache(SPEC, config(), admission=EveryPageAdmission())
    before = free_counts(cache)
    async with cache:
        tokens = list(range(1, 4 * PAGE + 1))
        nodes = insert(cache, tokens, states=[2 * PAGE, 4 * PAGE]).backup_nodes
        cache.tree.release_states([nodes[-1]])  # the deeper node goes
        with pytest.raises(TreeError, match="deleted"):
            cache.controller.write(nodes)
        assert nodes[0].device_lock == 0 and nodes[0].host_lock == 0
        cache.flush_device()
        cache.flush_host()
        cache.tree.check_integrity()
    assert free_counts(cache) == before


async def test_a_failed_load_with_data_inserted_below_is_undone() -> None:
    """Pages another request inserted below the loading nodes would be served after pages the
    failed copy never filled: they leave the device too, and the plan ends."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        tokens = list(range(1, 4 * PAGE + 1))
        await on_host_only(cache, tokens)
        real = ctrl.layer_copier

        def failing(pair: Any, src: Any, dst: Any) -> Any:
            copy = real(pair, src, dst)

            def layer(index: int, count: int = 1) -> int:
                time.sleep(0.003)
                if index >= 1:
                    raise TransferError("copy failed")
                return copy(index, count)

            return layer

        ctrl.layer_copier = failing  # type: ignore[method-assign]
        match = tree.match_prefix(tokens)
        op = ctrl.load(match)
        assert op is not None
        ctrl.start_loading()  # the first layers on the loop, the rest on the worker thread
        longer = tokens + list(range(700, 700 + 2 * PAGE))
        alloc = tree.alloc_device(6, 1)
        assert alloc is not None
        tree.insert(longer, alloc.kv_indices, states={len(longer): int(alloc.state_slots[0])})
        with pytest.raises(TransferError):
            await op
        await ctrl.wait_idle()
        assert tree.stats().num_active_plans == 0 and match.last_node.loading == 0
        again = tree.match_prefix(longer)
        assert not again.pending_load and again.num_device_tokens == 0
        cache.flush_device()
        cache.flush_host()
        tree.check_integrity()
    assert free_counts(cache) == before


class _Tail:
    def __init__(self, host_kv: torch.Tensor, host_slot: torch.Tensor, *, ok: bool = True) -> None:
        self.host_kv, self.host_slot = host_kv, host_slot
        self.landed, self.released = ok, False

    @property
    def ok(self) -> bool:  # as TailRestore.ok: landed intact and not released
        return self.landed and not self.released

    def release(self) -> None:
        self.released = True


async def test_a_tail_load_whose_lists_do_not_fit_is_refused_before_queueing() -> None:
    """Lists of the wrong length or out of the device pools' range, and tails that did not
    land intact or are released, are refused before queueing: a bad list would fail the whole
    step's merged copy, the loads of other requests with it."""
    async with HybridCache(SPEC, config()) as cache:
        host = cache.tree.alloc_host(2, 1)
        device = cache.tree.alloc_device(3, 1)
        assert host is not None and device is not None
        tail = _Tail(host.kv_indices, host.state_slots)
        with pytest.raises(ConfigError, match="device_pages holds 3"):
            cache.controller.load_tail(tail, device.kv_indices, device.state_slots)
        with pytest.raises(ConfigError, match="state_slots"):
            cache.controller.load_tail(tail, device.kv_indices[:2], torch.empty(0, dtype=torch.int64))
        far = torch.tensor([0, cache.device_kv.num_items], dtype=torch.int64)
        with pytest.raises(ConfigError, match=r"device_pages must lie in \[0, "):
            cache.controller.load_tail(tail, far, device.state_slots)
        with pytest.raises(ConfigError, match=r"state_slots must lie in \[0, "):
            cache.controller.load_tail(tail, device.kv_indices[:2], torch.tensor([-1], dtype=torch.int64))
        with pytest.raises(ConfigError, match="not landed intact"):
            cache.controller.load_tail(_Tail(host.kv_indices, host.state_slots, ok=False), device.kv_indices[:2], device.state_slots)
        tail.release()
        with pytest.raises(ConfigError, match="released"):
            cache.controller.load_tail(tail, device.kv_indices[:2], device.state_slots)
        assert cache.controller.statistics().load_queue == 0


async def test_loads_and_backups_after_close_are_refused_and_queue_nothing() -> None:
    cache = HybridCache(SPEC, config(write_policy="write_back"))
    async with cache:
        insert(cache, list(range(1, 4 * PAGE + 1)))
    with pytest.raises(ClosedError, match="closed"):
        cache.flush_device()  # its write-back would queue a backup nothing issues
    assert cache.tree.stats().num_active_plans == 0 and cache.controller.statistics().write_queue == 0


async def test_a_cache_is_entered_once() -> None:
    """A second ``async with`` (nested or after close) would orphan the first task group or
    run on a closed backend: it is refused, and the first stays usable until it exits."""
    cache = HybridCache(SPEC, config(storage_uri="memory://entered_once"))
    async with cache:
        with pytest.raises(ClosedError, match="entered already"):
            await cache.__aenter__()
        await backed_up(cache, insert(cache, list(range(1, 2 * PAGE + 1))).backup_nodes)
    with pytest.raises(ClosedError, match="closed"):
        await cache.__aenter__()


async def test_a_cache_never_entered_still_closes_its_backend() -> None:
    cache = HybridCache(SPEC, config(storage_uri="memory://never_entered"))
    backend = cache.controller.backend
    assert not backend._closed
    await cache.aclose()
    assert backend._closed
    await cache.aclose()  # idempotent


async def test_a_backend_that_fails_to_close_does_not_hang_later_closes() -> None:
    cache = HybridCache(SPEC, config(storage_uri="memory://close_fails"))
    backend = cache.controller.backend

    async def refuse() -> None:
        raise BackendError("close failed")

    backend.aclose = refuse  # type: ignore[method-assign]
    await cache.__aenter__()
    with pytest.raises(BackendError, match="close failed"):
        await cache.aclose()
    async with asyncio.timeout(5):
        await cache.aclose()  # returns: the first close ended, with an error


class _ShuttingDown:
    """A task group whose background work failed: it takes no new tasks."""

    def create_task(self, coro: Any, name: str | None = None) -> Any:
        raise RuntimeError("TaskGroup is shutting down")


async def test_a_prefetch_refused_while_shutting_down_leaves_its_node_unlocked() -> None:
    cache = HybridCache(SPEC, config(storage_uri="memory://shutting_down"))
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        tokens = list(range(1, 4 * PAGE + 1))
        insert(cache, tokens[: 2 * PAGE])
        match = tree.match_prefix(tokens)
        node = match.last_node
        locks = (node.device_lock, node.host_lock)
        real, ctrl._tg = ctrl._tg, _ShuttingDown()  # type: ignore[assignment]
        try:
            with pytest.raises(ClosedError, match="shutting down"):
                ctrl.prefetch(tokens, match)
        finally:
            ctrl._tg = real
        assert (node.device_lock, node.host_lock) == locks
        tree.check_integrity()


async def test_a_load_issued_as_a_background_task_fails_still_completes_and_frees() -> None:
    """A background task fails just before ``start_loading``: its task group then cancels its
    tasks — a load task in it would be cancelled before its first step and never complete its
    ops. The load's ops are issued and its first layers enqueued, so they complete (their
    waiters resolved, their pages given back) and the close reports the failure."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    tokens = list(range(1, 4 * PAGE + 1))

    async def fails() -> None:
        raise ValueError("a background task failed")

    with pytest.raises(ExceptionGroup) as raised:
        async with cache:
            ctrl, tree = cache.controller, cache.tree
            await on_host_only(cache, tokens)
            op = ctrl.load(tree.match_prefix(tokens))
            assert op is not None
            ctrl._tg.create_task(fails())
            await asyncio.sleep(0)  # it fails; the group aborts at its done callback
            ctrl.start_loading()
            await asyncio.sleep(1)  # cancelled: the aborting group cancels this task too
    assert raised.group_contains(ValueError, match="background task failed")
    # The close waited for the load: done, its plan gone, the prefix on the device.
    assert op.future.done() and op.future.exception() is None
    tree = cache.tree
    assert tree.stats().num_active_plans == 0
    assert tree.match_prefix(tokens).num_device_tokens == len(tokens)
    tree.check_integrity()
    cache.flush_device()
    cache.flush_host()
    assert free_counts(cache) == before


async def test_a_failed_step_undoes_its_loads_newest_first_whatever_their_priority() -> None:
    """Two loads of one step, the later one below the earlier one in the tree and issued first
    (higher priority): when the step fails, the later one is undone first, so both are undone
    — no plan left active, every page and slot back, the prefix on the host alone again."""
    cache = HybridCache(SPEC, config())
    tokens = [(9 * t + 2) % 250 + 1 for t in range(8 * PAGE)]
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        for n in (4 * PAGE, 8 * PAGE):
            await backed_up(cache, insert(cache, tokens[:n]).backup_nodes)
        cache.flush_device()
        before = free_counts(cache)

        def fails(*args: Any, **kwargs: Any) -> Any:
            raise TransferError("injected")

        ctrl.layer_copier = fails
        ops = [ctrl.load(tree.match_prefix(tokens[:n]), priority=p) for n, p in ((4 * PAGE, 0), (8 * PAGE, 1))]
        assert all(op is not None for op in ops)
        counter = ctrl.start_loading()
        with pytest.raises(TransferError):
            await counter.wait(SPEC.cached_layer_ids[0])
        for op in ops:
            with pytest.raises(TransferError):
                await asyncio.wait_for(op, 5)
        assert tree.stats().num_active_plans == 0
        assert free_counts(cache) == before
        match = tree.match_prefix(tokens)
        assert (match.num_device_tokens, match.num_host_tokens, match.pending_load) == (0, len(tokens), False)
        tree.check_integrity()


async def test_a_backup_completing_while_shutting_down_leaves_its_host_copy() -> None:
    """The archive of a finished backup cannot start once the task group takes no new tasks:
    the completion goes on (the host copy stays, counted), nothing raises into it."""
    cache = HybridCache(SPEC, config(storage_uri="memory://backup_shutting_down"))
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        tiering = ctrl.tiering
        real, tiering._tg = tiering._tg, _ShuttingDown()
        try:
            await backed_up(cache, insert(cache, list(range(1, 2 * PAGE + 1))).backup_nodes)
        finally:
            tiering._tg = real
        assert tiering.counts["backup_skipped_closing"] == 1
        assert tree.stats().num_active_plans == 0
        cache.flush_device()
        assert tree.match_prefix(list(range(1, 2 * PAGE + 1))).num_host_tokens == 2 * PAGE
        tree.check_integrity()


async def test_a_close_retried_after_a_cancelled_one_waits_for_the_backend() -> None:
    """The first close is cancelled while the backend closes (its close goes on as a task of
    its own): the retry returns only once the backend is closed."""
    cache = HybridCache(SPEC, config(storage_uri="memory://retried_close"))
    backend = cache.controller.backend
    real, gate, closed = backend.aclose, asyncio.Event(), []
    closing: list[asyncio.Task[None]] = []

    async def slow_close() -> None:
        if not closing:

            async def run() -> None:
                await gate.wait()
                await real()
                closed.append(True)

            closing.append(asyncio.ensure_future(run()))
        await asyncio.shield(closing[0])

    backend.aclose = slow_close  # type: ignore[method-assign]
    await cache.__aenter__()
    first = asyncio.create_task(cache.aclose())
    async with asyncio.timeout(5):
        while not closing:
            await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    retry = asyncio.create_task(cache.aclose())
    await asyncio.sleep(0.05)
    assert not retry.done() and not closed
    gate.set()
    async with asyncio.timeout(5):
        await retry
    assert closed


class _FaultedEvent:
    """A stream's end event whose copies faulted: ``synchronize()`` raises (a CUDA error)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_a_copy_that_faults_on_its_stream_fails_its_ops_and_close_returns() -> None:
    """The completion tasks run as on CUDA, and the end events of a step's loads and of a backup
    report a fault when waited on: the ops fail and give their pages back, the queue goes on,
    and the cache closes instead of draining a queue nobody runs."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    ctrl, tree = cache.controller, cache.tree
    ctrl._cuda = True  # start the completion tasks, as on CUDA
    async with asyncio.timeout(10):
        async with cache:
            tokens = list(range(1, 4 * PAGE + 1))
            await on_host_only(cache, tokens)
            for issuer in (ctrl._loads, ctrl._writes):
                real = issuer._finish

                def faulted(ops: Any, merged: Any, event: Any, *, error: Any, real: Any = real) -> None:
                    real(ops, merged, _FaultedEvent(), error=error)

                issuer._finish = faulted
            match = tree.match_prefix(tokens)
            op = ctrl.load(match)
            assert op is not None
            ctrl.start_loading()
            with pytest.raises(TransferError, match="illegal memory access"):
                await op
            assert tree.stats().num_active_plans == 0 and match.last_node.loading == 0
            other = list(range(500, 500 + 2 * PAGE))
            backup = ctrl.write(insert(cache, other).backup_nodes)
            assert backup is not None
            ctrl.start_writing()
            with pytest.raises(TransferError, match="illegal memory access"):
                await backup
            assert tree.match_prefix(other).num_host_tokens == 0
            assert not any(t.done() for t in ctrl._tasks)  # the completion tasks go on
            cache.flush_device()
            cache.flush_host()
            tree.check_integrity()
    assert free_counts(cache) == before


async def test_the_backend_is_closed_once_however_often_the_cache_is() -> None:
    cache = HybridCache(SPEC, config(storage_uri="memory://closed_once"))
    backend = cache.controller.backend
    real, calls = backend.aclose, []

    async def counted() -> None:
        calls.append(1)
        await real()

    backend.aclose = counted  # type: ignore[method-assign]
    async with cache:
        pass
    await cache.aclose()
    await cache.aclose()
    assert len(calls) == 1


async def test_an_operation_whose_completion_raises_fails_and_the_others_of_its_step_complete() -> None:
    """Completing one backup of a step raises (the tree refuses its finish): that op fails, and
    the step's other ops complete — none is left pending with its nodes locked."""
    cache = HybridCache(SPEC, config())
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        first = insert(cache, list(range(1, 2 * PAGE + 1))).backup_nodes
        second = insert(cache, list(range(500, 500 + 2 * PAGE))).backup_nodes
        real, refused = tree.finish_backup, []

        def finish_backup(plan: Any) -> Any:
            if not refused:
                refused.append(plan)
                raise TreeError("injected: the tree refuses this finish")
            return real(plan)

        tree.finish_backup = finish_backup  # type: ignore[method-assign]
        ops = [ctrl.write(first), ctrl.write(second)]
        assert all(op is not None for op in ops)
        ctrl.start_writing()
        async with asyncio.timeout(5):
            outcomes = await asyncio.gather(*ops, return_exceptions=True)
        assert isinstance(outcomes[0], TransferError) and outcomes[1] is None
        tree.finish_backup = real  # type: ignore[method-assign]


async def test_a_close_cancelled_while_a_load_copies_still_completes_the_load() -> None:
    """The close is cancelled while it waits for a load still copying (a shutdown deadline):
    the load still completes — its waiter resolved, its plan finished — before the close ends."""
    cache = HybridCache(SPEC, config())
    tokens = list(range(1, 4 * PAGE + 1))
    await cache.__aenter__()
    ctrl, tree = cache.controller, cache.tree
    await on_host_only(cache, tokens)
    copier = ctrl.layer_copier

    def slow(*args: Any) -> Any:
        copy = copier(*args)

        def each(*a: Any, **k: Any) -> Any:
            time.sleep(0.05)
            return copy(*a, **k)

        return each

    ctrl.layer_copier = slow
    op = ctrl.load(tree.match_prefix(tokens))
    assert op is not None
    ctrl.start_loading()
    closing = asyncio.create_task(cache.__aexit__(None, None, None))
    await asyncio.sleep(0.02)  # the close waits for the load
    assert not op.future.done()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert op.future.done() and op.state is OpState.DONE
    assert tree.stats().num_active_plans == 0
    tree.check_integrity()
