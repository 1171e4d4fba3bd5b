"""The reference scheduler's edges: input it refuses before queueing, leaving it while a step is
inside the forward, and an admission whose allocation raises."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
import torch
from serving import (
    arith_prompt,
    config_with,
    free_counts,
    split_cost,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError, SchedulerError
from asynccache.reference import admit
from asynccache.reference.model import HybridModel
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from kernels import PoolPair

SPEC = tiny_spec()
MODEL = tiny_model(SPEC, "cpu", seed=0)


def config(**overrides: Any) -> HybridCacheConfig:
    return config_with(SPEC, **overrides)


prompt = arith_prompt


def locked_nodes(cache: HybridCache) -> list[Any]:
    return [n for n in cache.tree.iter_nodes() if n.device_lock or n.host_lock]


def assert_nothing_held(cache: HybridCache) -> None:
    cache.flush_device()
    cache.flush_host()
    cache.tree.check_integrity()
    for pool in (cache.device_kv, cache.device_mamba, cache.host_kv, cache.host_mamba):
        assert pool is not None and pool.num_free == pool.num_items
    assert not locked_nodes(cache)


async def test_bad_input_is_refused_before_it_is_queued() -> None:
    """Each of these passed submit: a bad max_new_tokens or salt then stopped the loop (every
    request failed with it), float token ids were truncated, a bool taken for 1."""
    bad: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        (([1, 2, 3], 2.0), {}, "max_new_tokens"),
        (([1, 2, 3], True), {}, "max_new_tokens"),
        (([1, 2, 3], 0), {}, "max_new_tokens"),
        (([1, 2, 3], 2), {"salt": None}, "salt must be a str"),
        (([1, 2, 3], 2), {"salt": 5}, "salt must be a str"),
        (([1.9, 2.9, 3.9], 2), {}, "must be integers, got 1.9"),
        (([1, True, 3], 2), {}, "must be integers, got True"),
        (([1, torch.tensor(True)], 2), {}, "must be integers"),
        ((np.array([1.0, 2.0]), 2), {}, "must be integers"),
        ((torch.tensor([1.0, 2.0]), 2), {}, "integer dtype"),
        ((torch.tensor([True, False]), 2), {}, "integer dtype"),
        ((torch.tensor([[1, 2]]), 2), {}, "1-D"),
        ((5, 2), {}, "sequence of token ids"),
        ((torch.tensor([1, SPEC.vocab_size]), 2), {}, "must lie in"),
        (([-1, 2], 2), {}, "must lie in"),
        (([1, 2**70], 2), {}, "must lie in"),
        ((np.array([1, 2**63], dtype=np.uint64), 2), {}, "must lie in"),
        ((np.array([[1, 2]]), 2), {}, "1-D"),
        ((np.array([1, True], dtype=object), 2), {}, "must be integers, got True"),
        ((np.array([], dtype=np.int64), 2), {}, "at least one prompt token"),
    ]
    async with HybridCache(SPEC, config()) as cache, Scheduler(MODEL, cache) as sched:
        good = sched.submit(prompt(12, 7, 3), 3)
        for args, kwargs, match in bad:
            with pytest.raises(ConfigError, match=match):
                sched.submit(*args, **kwargs)
        assert not sched._waiting[1:]  # nothing of them queued
        assert len((await asyncio.wait_for(good, 60)).output_ids) == 3
        # Integers of other types are the same prompt.
        tokens = prompt(8, 3, 2)
        want = (await sched.generate(tokens, 2, salt="a")).output_ids
        for same in (
            np.array(tokens),
            np.array(tokens, dtype=np.uint16),
            np.array(tokens, dtype=object),
            torch.tensor(tokens, dtype=torch.int32),
            [np.int64(t) for t in tokens],
        ):
            assert (await sched.generate(same, 2, salt="b")).output_ids == want  # type: ignore[arg-type]
        # The request keeps its own copy: a caller changing its prompt after submit changes
        # nothing the request computes or caches.
        for mine in (list(tokens), np.array(tokens), torch.tensor(tokens)):
            fut = sched.submit(mine, 2, salt="c")
            mine[:] = [0] * len(tokens) if isinstance(mine, list) else 0
            assert (await fut).output_ids == want
            assert cache.tree.match_prefix(tokens, salt="c").num_tokens > 0


class GatedModel:
    """The reference model, whose forward waits for ``release`` once entered; records what the
    pools and locks held when each forward ended (returned, raised or cancelled)."""

    def __init__(self, model: HybridModel, cache: HybridCache) -> None:
        self.model, self.cache, self.device, self.spec = model, cache, model.device, model.spec
        self.entered, self.release = asyncio.Event(), asyncio.Event()
        self.at_end: list[tuple[tuple[int, ...], int]] = []

    async def forward(self, *args: Any) -> torch.Tensor:
        self.entered.set()
        try:
            await self.release.wait()
            return await self.model.forward(*args)
        finally:
            self.at_end.append((free_counts(self.cache), len(locked_nodes(self.cache))))


@pytest.mark.parametrize("hit", ["device", "host"])
async def test_leaving_during_a_forward_frees_nothing_before_the_step_ends(hit: str) -> None:
    """Leaving freed the requests' pages and slots and unlocked their prefix before it stopped
    the loop: a step inside the forward kept using them (on CUDA, kernels already queued)."""
    p1 = prompt(24, 7, 3)
    async with HybridCache(SPEC, config()) as cache:
        gated = GatedModel(MODEL, cache)
        async with Scheduler(gated, cache) as sched:  # type: ignore[arg-type]
            gated.release.set()
            await sched.generate(p1, 2)
            await cache.controller.wait_idle()
            if hit == "host":
                cache.flush_device()
        idle = free_counts(cache)
        gated.release.clear()
        gated.entered.clear()
        sched = Scheduler(gated, cache)  # type: ignore[arg-type]
        await sched.__aenter__()
        fut = sched.submit(p1 + [9, 9, 9, 9], 4)
        await asyncio.wait_for(gated.entered.wait(), 30)
        during = (free_counts(cache), len(locked_nodes(cache)))
        assert during[0] != idle and during[1] > 0  # the request's pages, slots and prefix lock
        gated.at_end.clear()
        await sched.__aexit__(None, None, None)
        assert gated.at_end == [during]  # the forward ended with everything still held
        assert fut.cancelled()
        await cache.controller.wait_idle()
        assert_nothing_held(cache)


async def admission_fails(cache: HybridCache, tokens: list[int], message: str) -> None:
    """A request for ``tokens`` fails in admission with ``message``, which stops the scheduler's
    loop: leaving the scheduler raises it as a SchedulerError."""
    sched = Scheduler(MODEL, cache)
    await sched.__aenter__()
    with pytest.raises(RuntimeError, match=message):
        await asyncio.wait_for(sched.generate(tokens, 2), 30)
    with pytest.raises(SchedulerError, match=message):
        await sched.__aexit__(None, None, None)


@pytest.mark.parametrize("when", ["before", "after"])
async def test_an_allocation_that_raises_leaves_no_node_locked(when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission locks the match on the device and the host, then allocates; when the allocation
    raised, only the host lock was released."""
    p1 = prompt(24, 7, 3)
    async with HybridCache(SPEC, config()) as cache:
        async with Scheduler(MODEL, cache) as sched:
            await sched.generate(p1, 2)
        real = Scheduler._allocate

        def allocate(self: Scheduler, *args: Any) -> bool:
            if when == "after":  # the request took the lock, then something failed
                assert real(self, *args)
            raise RuntimeError("allocation failed")

        monkeypatch.setattr(Scheduler, "_allocate", allocate)
        await admission_fails(cache, p1 + [9, 9, 9, 9], "allocation failed")
        assert not locked_nodes(cache)
        if when == "before":
            assert_nothing_held(cache)


@pytest.mark.parametrize("tier", ["device", "host"])
async def test_an_allocation_that_raises_midway_gives_back_what_it_took(tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error inside the allocation, once the request's slots and pages are taken (and, for a
    host hit, its load queued), leaves none of them taken: after the scheduler is left, every
    pool is whole and no node is locked."""
    p1 = prompt(24, 5, 2)
    async with HybridCache(SPEC, config()) as cache:
        async with Scheduler(MODEL, cache) as sched:
            await sched.generate(p1, 2)
        await cache.controller.wait_idle()
        if tier == "host":
            cache.flush_device()

        def broken(node: Any) -> torch.Tensor:
            raise RuntimeError("page lookup failed")

        monkeypatch.setattr(admit, "_path_device_pages", broken)
        await admission_fails(cache, p1 + [9, 9, 9, 9], "page lookup failed")
        await cache.controller.wait_idle()
        assert_nothing_held(cache)


async def test_leaving_during_a_tail_restores_load_frees_its_pages_once_the_copy_ends(tmp_path: Any) -> None:
    """A split restore's tail is loaded into the request's own pages during the step's forward.
    Leaving then must not free those pages while the copy still writes them (a request taking
    them next would be overwritten): they are freed once the copy has completed."""
    chunk = SPEC.page_size
    first = prompt(48, 7, 3)
    async with HybridCache(SPEC, config(storage_uri=f"file://{tmp_path}")) as cache:
        ctrl = cache.controller
        async with Scheduler(MODEL, cache, SchedulerConfig(chunk_size=chunk)) as sched:
            out = (await sched.generate(first, 4)).output_ids
        await ctrl.wait_idle()
        cache.flush_device()
        cache.flush_host()  # in storage only: the next request restores it, split
        assert ctrl.tiering is not None
        ctrl.tiering.cost = split_cost(SPEC)
        copier = PoolPair.layer_copier

        def slow(pair: Any, *args: Any) -> Any:
            copy = copier(pair, *args)

            def each(*a: Any, **k: Any) -> Any:
                time.sleep(0.05)  # the copies outlast the forward
                return copy(*a, **k)

            return each

        ctrl.layer_copier = slow
        tails: list[Any] = []
        load_tail = ctrl.load_tail
        gated = GatedModel(MODEL, cache)
        gated.release.set()

        def tracked(tail: Any, pages: torch.Tensor, slots: torch.Tensor) -> Any:
            op = load_tail(tail, pages, slots)
            tails.append((op, pages.clone()))
            gated.release.clear()  # this step's forward waits: the scheduler is left during it
            gated.entered.clear()
            return op

        ctrl.load_tail = tracked  # type: ignore[method-assign]
        sched = Scheduler(gated, cache, SchedulerConfig(chunk_size=chunk))  # type: ignore[arg-type]
        await sched.__aenter__()
        fut = sched.submit(first + out + [5, 6, 7, 8, 9], 4)
        async with asyncio.timeout(60):
            while not tails or not gated.entered.is_set():
                await asyncio.sleep(0.01)
        (op, pages), = tails
        await sched.__aexit__(None, None, None)
        assert fut.cancelled()
        assert not op.future.done()  # its copy is still running
        assert all(cache.device_kv.allocator.is_allocated(int(p)) for p in pages)
        await ctrl.wait_idle()
        assert op.future.done()
        assert_nothing_held(cache)
