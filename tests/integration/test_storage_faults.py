"""Faults around storage reads as the scheduler sees them: a request cancelled while its split
restore's tail is read leaves nothing held, and does not hold up the other requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from serving import (
    PAGE,
    arith_prompt,
    free_counts,
    serving_config,
    settled,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.tiering import RestoreCost

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
            read_page_s = SPEC.kv_page_bytes / 1e6
            tier.cost = RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=PAGE / (3.0 * read_page_s))
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
