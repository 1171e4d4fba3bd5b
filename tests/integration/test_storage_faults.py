"""Faults around storage reads as the scheduler sees them: a request cancelled while its split
restore's tail is read leaves nothing held, and does not hold up the other requests; a lookup,
a whole restore or a tail read that raises, or a stored prefix larger than the host tier, is a
miss — the request is computed, to the same logits as cold, nothing is held after it, and the
stored prefix serves the next request that can take it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from serving import (
    PAGE,
    arith_prompt,
    free_counts,
    serving_config,
    settled,
    split_cost,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.errors import BackendError
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
P1 = arith_prompt(48, 7, 3)
SEGMENTATION = SchedulerConfig(chunk_size=PAGE, max_batch_tokens=4096)


def _awaiting(task: object) -> list[str]:
    """The names of the coroutines ``task`` is suspended in, outermost first."""
    names, coro = [], task.get_coro()  # type: ignore[attr-defined]
    while coro is not None and hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_name)
        coro = coro.cr_await
    return names


async def test_a_request_cancelled_while_its_tail_is_read_frees_the_loop_for_others(tmp_path: Path) -> None:
    """The only running request waits for its tail's read; cancelled meanwhile, it is dropped at
    once — another request runs to its end while the read is still held — and once the read
    lands everything it held is free."""
    model = tiny_model(SPEC, "cpu", seed=5)
    async with HybridCache(SPEC, serving_config(SPEC, tmp_path.as_uri())) as cache:
        full = free_counts(cache)
        tier = cache.controller.tiering
        assert tier is not None
        async with Scheduler(model, cache, SEGMENTATION) as sched:
            r1 = await sched.generate(P1, 4)
            prompt = P1 + r1.output_ids + arith_prompt(9, 11, 5)
            assert await settled(cache) == full
            tier.cost = split_cost(SPEC)
            real, entered, gate = tier.backend.batch_get_v2, asyncio.Event(), asyncio.Event()

            async def held_read(*args: object, **kwargs: object) -> object:
                entered.set()
                await gate.wait()
                return await real(*args, **kwargs)  # type: ignore[arg-type]

            tier.backend.batch_get_v2 = held_read  # type: ignore[method-assign]
            doomed = sched.submit(prompt, 4)
            async with asyncio.timeout(10):
                await entered.wait()
                while "_resume_tails" not in _awaiting(sched._task):  # blocked on the tail's read
                    await asyncio.sleep(0.001)
            assert tier.counts["prefetch_tail"] == 1
            doomed.cancel()
            other = sched.submit(arith_prompt(20, 3, 9), 2)
            try:
                async with asyncio.timeout(5):
                    result = await other
                assert not gate.is_set()
            finally:
                gate.set()
            assert len(result.output_ids) == 2
            assert not sched._running and not sched._waiting
        assert await settled(cache) == full


@pytest.mark.parametrize(
    ("method", "split"),
    [("batch_exists_v2", False), ("batch_get_v2", False), ("batch_get_v2", True)],
    ids=["lookup", "whole-restore", "split-tail"],
)
async def test_a_storage_failure_is_a_miss_computed_as_cold(tmp_path: Path, method: str, split: bool) -> None:
    """The prefix is only in storage, and the backend raises at the lookup, at a whole
    restore's read or at a split restore's tail read: the request is computed from its first
    token, to the logits and output of the same request computed cold with the same chunks,
    and nothing is held after it. Once storage answers again, the stored prefix is a hit."""
    model = tiny_model(SPEC, "cpu", seed=5)
    async with HybridCache(SPEC, serving_config(SPEC)) as first_cache, Scheduler(model, first_cache, SEGMENTATION) as first:
        r1 = await first.generate(P1, 4)
    prompt = P1 + r1.output_ids + arith_prompt(9, 11, 5)
    async with HybridCache(SPEC, serving_config(SPEC)) as cold_cache, Scheduler(model, cold_cache, SEGMENTATION) as cold:
        reference = await cold.generate(prompt, 4)
    assert reference.cached_tokens == 0
    async with HybridCache(SPEC, serving_config(SPEC, tmp_path.as_uri())) as cache:
        full = free_counts(cache)
        tier = cache.controller.tiering
        assert tier is not None
        async with Scheduler(model, cache, SEGMENTATION) as sched:
            assert (await sched.generate(P1, 4)).output_ids == r1.output_ids
            assert await settled(cache) == full  # P1 and its answer's pages: in storage only
            if split:
                tier.cost = split_cost(SPEC)
            real = getattr(tier.backend, method)

            async def failing(*args: object, **kwargs: object) -> object:
                raise BackendError("storage unreachable")

            setattr(tier.backend, method, failing)
            try:
                result = await sched.generate(prompt, 4)
            finally:
                setattr(tier.backend, method, real)
            assert tier.counts["prefetch_failed"] == 1
            assert tier.counts["prefetch_tail"] == int(split)
            assert result.cached_tokens == 0
            assert result.output_ids == reference.output_ids
            assert torch.equal(result.first_logits, reference.first_logits)
            assert await settled(cache) == full

            again = await sched.generate(prompt, 4)
            assert again.cached_by_tier["storage"] > 0
            assert again.output_ids == reference.output_ids
        assert await settled(cache) == full


@pytest.mark.parametrize("split", [False, True], ids=["whole-restore", "split-tail"])
async def test_a_stored_prefix_larger_than_the_host_tier_is_computed_as_cold(tmp_path: Path, split: bool) -> None:
    """Storage holds a prefix (written by a cache with a large host tier) that a cache whose
    host tier has room for 4 pages cannot land: the restore finds no room, and the request is
    computed as cold, nothing held after it."""
    model = tiny_model(SPEC, "cpu", seed=5)
    async with HybridCache(SPEC, serving_config(SPEC, tmp_path.as_uri())) as big, Scheduler(model, big, SEGMENTATION) as sched:
        r1 = await sched.generate(P1, 4)
        prompt = P1 + r1.output_ids + arith_prompt(9, 11, 5)
        await sched.generate(prompt, 4)
        await settled(big)
    async with HybridCache(SPEC, serving_config(SPEC)) as cold_cache, Scheduler(model, cold_cache, SEGMENTATION) as cold:
        reference = await cold.generate(prompt, 4)
    small = dataclasses.replace(serving_config(SPEC, tmp_path.as_uri()), host_kv_bytes=4 * SPEC.kv_page_bytes)
    async with HybridCache(SPEC, small) as cache:
        full = free_counts(cache)
        tier = cache.controller.tiering
        assert tier is not None
        if split:
            tier.cost = split_cost(SPEC)
        async with Scheduler(model, cache, SEGMENTATION) as sched:
            result = await sched.generate(prompt, 4)
            assert tier.counts["prefetch_no_room"] == 1 and tier.counts["prefetch_hit"] == 0
            assert result.cached_tokens == 0
            assert result.output_ids == reference.output_ids
            assert torch.equal(result.first_logits, reference.first_logits)
        assert await settled(cache) == full
