"""A load whose copies fail at issue, on the CPU copy path. The copies enqueued before the
failure run until the step's event, which completion waits for before it frees anything (here a
held event the test releases stands in for one that has not fired yet). Meanwhile:

- a failing copy into the node's own slot (``load(state_to=)``), issued after the step's layers
  by the loop thread or with the last of them by the worker thread, leaves every layer of the
  step ready for the forward: the operation fails, the counter does not;
- the failed load's nodes stop offering what never arrived at once: a match made before the
  completion runs loads the prefix afresh (and a request the scheduler admits then is served
  right), while the failed load's pages and slot, and the host copies its copies read, stay
  held until the event, whoever unlocks first."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from serving import free_counts
from test_pending_loads import (
    PAGE,
    SPEC,
    TOKENS,
    config,
    fail_copies,
    holds,
    locked_match,
    on_host_only,
    queued_load,
    settle,
    yield_a_few,
)
from test_scheduler_failed_load import (
    BUDGETS,
    MODEL,
    PREFIX,
    assert_nothing_held,
    cold_output,
    fail_the_node_slot_copy,
    prefix_on_host,
)
from test_scheduler_failed_load import config as model_config

import asynccache.copy_issue
from asynccache.cache import HybridCache
from asynccache.errors import StaleMatchError, TransferError
from asynccache.ops import OpState
from asynccache.reference.scheduler import Scheduler
from asynccache.storage import PoolName
from asynccache.tree import Tier


class HeldEvent:
    """A CUDA event stand-in that has not fired until :meth:`fire`."""

    def __init__(self) -> None:
        self._fired = threading.Event()

    def query(self) -> bool:
        return self._fired.is_set()

    def synchronize(self) -> None:
        if not self._fired.wait(10):
            raise RuntimeError("the held event was never fired")

    def fire(self) -> None:
        self._fired.set()


def hold_failed_completion(cache: HybridCache, monkeypatch: pytest.MonkeyPatch) -> list[HeldEvent]:
    """The first load step that fails is handed to completion with a :class:`HeldEvent` (what
    the CPU path, whose copies are synchronous, hands as None): it completes once the test
    fires it. Returns the list that receives that event."""
    issuer = cache.controller._loads
    real = issuer._finish
    held: list[HeldEvent] = []

    def finish(ops: Any, merged: Any, event: Any, *, error: BaseException | None) -> None:
        if error is not None and not held:
            held.append(HeldEvent())
            event = held[0]
        real(ops, merged, event, error=error)

    monkeypatch.setattr(issuer, "_finish", finish)
    return held


def allocated(pool: Any, indices: torch.Tensor) -> torch.Tensor:
    """Which of ``indices`` ``pool`` has handed out (not free)."""
    return torch.isin(indices, torch.from_numpy(pool.allocator.allocated_indices()))


@pytest.fixture(params=sorted(BUDGETS))
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The copy path: every layer issued by the loop thread, or all after the first by the
    worker thread."""
    monkeypatch.setattr(asynccache.copy_issue, "LOAD_ENQUEUE_BUDGET_S", BUDGETS[str(request.param)])
    return str(request.param)


async def test_a_failing_copy_into_the_node_slot_leaves_every_layer_ready(path: str) -> None:
    """The owner's load brings the KV and the state into its working slot layer by layer; the
    copy into the node's slot, after the last layer, fails. Every layer is marked, and waiting
    for it after the failure is known returns (before, the counter failed: a forward that
    waited after that point raised ``TransferError``, and on the worker path the last layers
    were never marked). The working slot holds the state; the pages, held for the owner, the
    KV; the operation fails and the owner's unlock returns its pages and slot."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        saved = await on_host_only(cache, TOKENS)
        match, token = locked_match(cache)
        working = cache.device_mamba.alloc(1)
        assert working is not None
        real = ctrl.layer_copier
        node_slot: list[torch.Tensor] = []
        threads: list[bool] = []

        def copier(pair: Any, host: torch.Tensor, dev: torch.Tensor) -> Any:
            copy = real(pair, host, dev)
            if pair.dst is cache.device_mamba and node_slot and torch.equal(dev, node_slot[0]):

                def raising(*args: Any) -> int:
                    threads.append(threading.current_thread() is threading.main_thread())
                    raise RuntimeError("injected failure of the copy into the node's slot")

                return raising
            return copy

        ctrl.layer_copier = copier  # type: ignore[method-assign]
        op = ctrl.load(match, state_to=[int(working[0])])
        assert op is not None
        node_slot.append(op.deferred[PoolName.MAMBA].device_indices)
        counter = ctrl.start_loading()
        with pytest.raises(TransferError):
            async with asyncio.timeout(5):
                await op
        assert threads == [path == "loop"]
        for lid in counter.layer_ids:
            assert counter.is_enqueued(lid)
            await counter.wait(lid)  # no TransferError: its copy was enqueued
        (retired,) = tree._pending.retired
        kv = torch.stack([cache.device_kv.layer_items(lid)[retired.kv_indices] for lid in cache.spec.attention_layer_ids])
        st = torch.stack([cache.device_mamba.layer_items(lid)[int(working[0])] for lid in cache.spec.mamba_layer_ids])
        assert kv.numpy().tobytes() + st.numpy().tobytes() == saved
        tree.unlock(match.last_node, token)
        assert not tree._pending.retired
        cache.device_mamba.free(working)
        ctrl.layer_copier = real  # type: ignore[method-assign]
        settle(cache)
    assert free_counts(cache) == before


async def test_a_load_failed_at_issue_leaves_the_tree_before_its_completion(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every copy fails at issue. Before the step's event has fired: the operation is still
    unresolved, but a new match no longer reaches the failed load (no device pages, not
    pending), and loads the prefix afresh into new pages that land right; the owner and a
    reader (waiting) unlock, yet nothing of the failed load returns to the pools, nor may its
    host copies go. Once the event fires the operation fails, the waiter hears the match is
    stale, and the failed load's pages and slot return."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        saved = await on_host_only(cache, TOKENS)
        held = hold_failed_completion(cache, monkeypatch)
        real = fail_copies(cache)
        (first, first_token), op = queued_load(cache)
        second, second_token = locked_match(cache)
        waiter = asyncio.create_task(ctrl.wait_loaded(second))
        await yield_a_few()
        loading = free_counts(cache)
        ctrl.start_loading()
        async with asyncio.timeout(5):
            while not held:
                await asyncio.sleep(0)
        await yield_a_few()
        assert op.state is OpState.ISSUED and not op.future.done() and not waiter.done()
        again = tree.match_prefix(TOKENS)
        assert again.needs_load and not again.pending_load and again.num_device_tokens == 0
        assert again.state_tier is Tier.HOST
        tree.unlock(first.last_node, first_token)
        tree.unlock(second.last_node, second_token)
        assert free_counts(cache) == loading  # held until the copies have run
        evicted = tree.evict_host(num_kv_pages=1000, num_states=1000)  # nor the copies' sources
        assert evicted.num_kv_pages == 0 and evicted.num_states == 0
        tree.check_integrity()
        ctrl.layer_copier = real  # type: ignore[method-assign]
        third, third_token = locked_match(cache)
        assert third.needs_load and not third.pending_load
        reload = ctrl.load(third)
        assert reload is not None
        ctrl.start_loading()  # completes behind the held event
        held[0].fire()
        async with asyncio.timeout(5):
            await ctrl.wait_idle()  # (on CPU nothing else runs the completion queue)
            with pytest.raises(StaleMatchError):
                await waiter
            with pytest.raises(TransferError):
                await op
            await reload
        assert holds(cache, tree.match_prefix(TOKENS), saved)
        assert not tree._pending.retired
        tree.unlock(third.last_node, third_token)
        settle(cache)
    assert free_counts(cache) == before


async def test_a_request_admitted_before_a_failed_load_completes_is_not_served_what_never_arrived(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's copy into the node's slot fails (its layers all landed); that step's
    completion waits for its event. A request admitted meanwhile matches the prefix: before,
    the tree still offered the node's slot, which never got the state, and the request seeded
    its working slot from it (its output changed); now it loads the prefix afresh. Both outputs
    are a cold run's, and the failed load's pages and slot return only after the event, once
    both requests are done."""
    first, second = PREFIX + [9, 9, 9, 9], PREFIX + [8, 8]
    want_first, want_second = await cold_output(first, 12), await cold_output(second, 4)
    cache = HybridCache(MODEL.spec, model_config())
    before = free_counts(cache)
    async with cache:
        await prefix_on_host(cache)
        pool = cache.device_mamba
        assert pool.buffer is not None and pool.num_free == pool.num_items
        noise = torch.Generator().manual_seed(3)  # what the node's slot holds if it never gets the state
        pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=noise, dtype=torch.uint8))
        failed = fail_the_node_slot_copy(cache, monkeypatch, path)
        held = hold_failed_completion(cache, monkeypatch)
        async with Scheduler(MODEL, cache) as sched:
            fut = sched.submit(first, 12)
            async with asyncio.timeout(30):
                while not held:
                    await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert failed == [1, path == "loop"] and not fut.done()
            late = sched.submit(second, 4)
            async with asyncio.timeout(30):
                result, late_result = await fut, await late
            assert result.output_ids == want_first and late_result.output_ids == want_second
            assert late_result.cached_by_tier["host"] == len(PREFIX)
            (retired,) = cache.tree._pending.retired  # both done: held for the copies alone
            assert not allocated(cache.device_kv, retired.kv_indices).logical_not().any()
            assert allocated(pool, retired.state_slots).all()
            held[0].fire()
            await cache.controller.wait_idle()
            assert not cache.tree._pending.retired
        await cache.controller.wait_idle()
        assert_nothing_held(cache, before)


async def test_a_failed_load_whose_node_got_a_state_backed_up_meanwhile_leaves_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queued load of A + B; meanwhile a request that computed A itself inserts it with a state
    at its end (the loaded node splits; its upper part gets that state), and the write policy
    backs that state up. The load's copies fail at issue: before the step's event has fired,
    its undo has gone through (the load's own pin and the controller's hold on its sources are
    no one else's use of that host state) and a new match loads the prefix afresh; once it has
    fired every page and slot returns."""
    a, b = list(range(1, 2 * PAGE + 1)), list(range(500, 500 + 2 * PAGE))
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        await on_host_only(cache, a + b)
        owner = tree.match_prefix(a + b)
        token = tree.lock(owner.last_node)
        op = ctrl.load(owner)
        assert op is not None
        alloc = tree.alloc_device(2, 1)
        assert alloc is not None
        node = tree.insert(a, alloc.kv_indices, states={2 * PAGE: int(alloc.state_slots[0])}).last_node
        assert node.loading and node.device_state is not None
        write = ctrl.write([node])
        assert write is not None
        ctrl.start_writing()
        await write
        held = hold_failed_completion(cache, monkeypatch)
        real = fail_copies(cache)
        ctrl.start_loading()
        async with asyncio.timeout(5):
            while not held:
                await asyncio.sleep(0)
        assert not op.future.done() and tree.active_plans == ()  # undone before the event
        again = tree.match_prefix(a + b)
        assert again.num_device_tokens == 0 and again.needs_load and not again.pending_load
        assert node.host_state is None  # computed meanwhile: its host copy went too
        tree.check_integrity()
        ctrl.layer_copier = real  # type: ignore[method-assign]
        tree.unlock(owner.last_node, token)
        held[0].fire()
        async with asyncio.timeout(5):
            await ctrl.wait_idle()
            with pytest.raises(TransferError):
                await op
        assert ctrl._ops.num_blocked == 0
        tree.check_integrity()
        settle(cache)
    assert free_counts(cache) == before


def hold_the_loop_thread(done: Any) -> None:
    """Keep the loop thread busy (no callback runs) until ``done()``, and 0.2 s more."""
    deadline = time.monotonic() + 5
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)


async def test_on_the_worker_path_the_marks_of_a_failed_step_arrive_with_its_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker thread issues the step's last layers and the copy into the node's slot after
    them, which raises. The loop hears of the failure in the same turn as those layers' marks:
    whoever resumes on a mark (the forward; after it, the next step's admission) finds the
    failed load already gone from the tree, not offered until the worker's error came through
    later."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        await on_host_only(cache, TOKENS)
        failed = fail_the_node_slot_copy(cache, monkeypatch, path="worker")
        match, token = locked_match(cache)
        working = cache.device_mamba.alloc(1)
        assert working is not None
        op = ctrl.load(match, state_to=[int(working[0])])
        assert op is not None
        counter = ctrl.start_loading()
        hold_the_loop_thread(lambda: len(failed) == 2)  # the worker posts everything meanwhile
        assert failed == [1, False]
        await counter.wait(counter.layer_ids[-1])
        assert tree.active_plans == ()  # undone before anyone resumed on the marks
        again = tree.match_prefix(TOKENS)
        assert not again.pending_load and again.num_device_tokens == 0
        with pytest.raises(TransferError):
            async with asyncio.timeout(5):
                await op
        tree.unlock(match.last_node, token)
        cache.device_mamba.free(working)
        settle(cache)
    assert free_counts(cache) == before
