"""The reference scheduler when a host hit's load fails after the forward passed its layer waits:
the copy of the boundary state into the node's own slot (``load(state_to=)``), issued after
every layer of the step is marked, raises. The forward read only copies that were issued, so
the requests' outputs stand; the load's pages and slot leave the tree but stay out of the pools
while the requests that compute on them (the owner, a reader) run, and their inserts, refused
(``StaleMatchError``), leave the loop running. The CPU copy path, each test twice: every
layer issued on the loop thread (the copy into the node's slot after the last layer's event),
and every layer after the first issued by the worker thread (that copy before the last layer's
event, which the worker records and marks all the same)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from serving import (
    arith_prompt,
    config_with,
    free_counts,
    held_nodes,
    tiny_model,
    tiny_spec,
)

import asynccache.copy_issue
from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.ops import CacheOperation
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.storage import PoolName
from asynccache.tree import Tier

SPEC = tiny_spec()
MODEL = tiny_model(SPEC, "cpu", seed=0)
PREFIX = arith_prompt(24, 7, 3)


def config(**overrides: Any) -> HybridCacheConfig:
    return config_with(SPEC, **overrides)


async def cold_output(tokens: list[int], n: int) -> list[int]:
    async with HybridCache(SPEC, config()) as cache, Scheduler(
        MODEL, cache, SchedulerConfig(use_cache=False)
    ) as sched:
        return (await sched.generate(tokens, n)).output_ids


def assert_nothing_held(cache: HybridCache, before: tuple[int, ...]) -> None:
    cache.tree.check_integrity()
    assert not cache.tree._pending.retired
    cache.flush_device()
    cache.flush_host()
    cache.tree.check_integrity()
    assert free_counts(cache) == before
    assert not held_nodes(cache)


async def prefix_on_host(cache: HybridCache) -> None:
    """``PREFIX`` cached with its state, then on the host only (KV and state)."""
    async with Scheduler(MODEL, cache) as sched:
        await sched.generate(PREFIX, 2)
    await cache.controller.wait_idle()
    cache.flush_device()
    match = cache.tree.match_prefix(PREFIX)
    assert match.num_tokens == len(PREFIX) and match.num_device_tokens == 0 and match.state_tier is Tier.HOST


#: ``LOAD_ENQUEUE_BUDGET_S`` of each copy path: every layer on the loop thread, or every layer
#: after the first on the worker thread.
BUDGETS = {"loop": 3600.0, "worker": 0.0}


@pytest.fixture(params=sorted(BUDGETS))
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def fail_the_node_slot_copy(cache: HybridCache, monkeypatch: pytest.MonkeyPatch, path: str = "loop") -> list[int]:
    """A step's layers are issued on the loop thread alone, or from the second on by the worker
    thread (``path``; either way the copy into the node's slot follows the step's last layer),
    and the first such copy raises; returns a list of the failures injected, then for each
    whether it was raised on the loop thread."""
    monkeypatch.setattr(asynccache.copy_issue, "LOAD_ENQUEUE_BUDGET_S", BUDGETS[path])
    ctrl = cache.controller
    real_load, real_copier = ctrl.load, ctrl.layer_copier
    node_slots: list[torch.Tensor] = []
    failed = [0]

    def load(match: Any, **kwargs: Any) -> CacheOperation | None:
        op = real_load(match, **kwargs)
        if op is not None and PoolName.MAMBA in op.deferred:
            node_slots.append(op.deferred[PoolName.MAMBA].device_indices)
        return op

    def layer_copier(pair: Any, host: torch.Tensor, dev: torch.Tensor) -> Any:
        copy = real_copier(pair, host, dev)
        if pair.dst is cache.device_mamba and not failed[0] and any(torch.equal(dev, s) for s in node_slots):
            failed[0] += 1

            def raising(*args: Any) -> int:
                failed.append(threading.current_thread() is threading.main_thread())
                raise RuntimeError("injected failure of the copy into the node's slot")

            return raising
        return copy

    monkeypatch.setattr(ctrl, "load", load)
    monkeypatch.setattr(ctrl, "layer_copier", layer_copier)
    return failed


async def test_a_request_whose_load_fails_after_its_last_layer_keeps_its_prefix_pages(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The owner alone: its load's pages are not given to a request admitted while it decodes
    on them (before, they went back to the pool at once: the later request overwrote them,
    the owner's output changed, and its insert made the tree own them twice). Both outputs
    are a cold run's; everything returns to the pools once both are done."""
    first, other = PREFIX + [9, 9, 9, 9], arith_prompt(40, 5, 1)
    want_first, want_other = await cold_output(first, 12), await cold_output(other, 2)
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        await prefix_on_host(cache)
        failed = fail_the_node_slot_copy(cache, monkeypatch, path)
        async with Scheduler(MODEL, cache) as sched:
            fut = sched.submit(first, 12)
            async with asyncio.timeout(30):
                while not cache.controller.statistics().counts.get("load_failed"):
                    await asyncio.sleep(0)
            assert failed == [1, path == "loop"] and not fut.done()
            (req,) = sched._running
            (retired,) = cache.tree._pending.retired  # held for the owner, which decodes on them
            assert req.kv_pages is not None
            assert torch.equal(retired.kv_indices, req.kv_pages[: len(PREFIX) // SPEC.page_size])
            assert list(retired.readers) == [req.lock_token]
            late = sched.submit(other, 2)  # takes free pages while the owner decodes
            async with asyncio.timeout(30):
                result, late_result = await fut, await late
            assert result.output_ids == want_first and late_result.output_ids == want_other
            assert not cache.tree._pending.retired  # the owner's unlock freed them
        await cache.controller.wait_idle()
        assert_nothing_held(cache, before)


async def test_requests_that_read_a_failed_load_finish_without_stopping_the_loop(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Two requests of one step share the host prefix: the first loads it, the second reads
    that load (a reader). The copy into the node's slot fails; both inserts pass back the
    failed load's pages and are refused. Each request still gets its cold run's output, the
    loop goes on serving, and the pages return once both are done."""
    first, second = PREFIX + [9, 9, 9, 9], PREFIX + [8, 8]
    want_first, want_second = await cold_output(first, 6), await cold_output(second, 4)
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        await prefix_on_host(cache)
        failed = fail_the_node_slot_copy(cache, monkeypatch, path)
        async with Scheduler(MODEL, cache) as sched:
            futs = [sched.submit(first, 6), sched.submit(second, 4)]
            async with asyncio.timeout(30):
                results = await asyncio.gather(*futs)
            assert failed == [1, path == "loop"]
            assert [r.output_ids for r in results] == [want_first, want_second]
            assert not cache.tree._pending.retired
            again = await sched.generate(second, 4)  # loaded afresh, then served from the tree
            assert again.output_ids == want_second and again.cached_by_tier["host"] == len(PREFIX)
        await cache.controller.wait_idle()
        assert_nothing_held(cache, before)
