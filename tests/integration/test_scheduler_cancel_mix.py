"""Requests that share prefixes, under device pressure, host hits, slow storage lookups and split
restores, each cancelled at a random moment of its life or left to finish. Whatever the timing:
the scheduler leaves the tree consistent, every pool whole and no node locked, and every request
that finished produced what a cold run of it produces."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from serving import (
    arith_prompt,
    config_with,
    held_nodes,
    settled,
    slow_backend,
    split_cost,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.policy import EveryPageAdmission
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
MODEL = tiny_model(SPEC, "cpu", seed=0)
ROUNDS = 4
REQUESTS_PER_ROUND = 6


def _config(rng: random.Random, storage_uri: str | None) -> HybridCacheConfig:
    return config_with(
        SPEC,
        device_kv_pages=rng.choice([24, 40, 128]),
        device_state_slots=12,
        host_kv_bytes=48 * SPEC.kv_page_bytes,
        host_state_bytes=8 * SPEC.state_bytes,
        storage_uri=storage_uri,
        prefetch_policy=rng.choice(["wait_complete", "timeout"]),
        prefetch_timeout_base_s=0.02,
        prefetch_timeout_per_1k_tokens_s=0.0,
    )


async def _cancel_later(rng: random.Random, fut: asyncio.Future[Any]) -> None:
    await asyncio.sleep(rng.random() * 0.05)
    for _ in range(rng.randrange(30)):
        await asyncio.sleep(0)  # a few loop turns more: lands between a step's parts
    fut.cancel()


async def _serve_mix(seed: int, tmp_path: Path) -> list[tuple[list[int], int, list[int]]]:
    """Serve the seed's rounds; returns (prompt, max new tokens, output) of the finished ones."""
    rng = random.Random(seed)
    storage = rng.random() < 0.7
    cfg = _config(rng, f"file://{tmp_path}/store" if storage else None)
    bases = [arith_prompt(rng.choice([16, 24, 40]), a, 1) for a in (3, 5, 7)]
    finished: list[tuple[list[int], int, list[int]]] = []
    admission = EveryPageAdmission() if rng.random() < 0.5 else None
    async with HybridCache(SPEC, cfg, admission=admission) as cache:
        tier = cache.controller.tiering
        if tier is not None:
            if rng.random() < 0.5:
                tier.cost = split_cost(SPEC)
            slow_backend(cache, "batch_exists_v2", rng.choice([0.0, 0.005, 0.03]))
        sched_cfg = SchedulerConfig(max_running=rng.choice([1, 2, 4]), chunk_size=rng.choice([4, 8, 64]))
        async with Scheduler(MODEL, cache, sched_cfg) as sched:
            for rnd in range(ROUNDS):
                asked = []
                for _ in range(REQUESTS_PER_ROUND):
                    base = rng.choice(bases)
                    tokens = base[: rng.randrange(4, len(base) + 1)]
                    tokens += [rng.randrange(1, 250) for _ in range(rng.randrange(1, 9))]
                    asked.append((tokens, rng.randrange(1, 8)))
                futs = [sched.submit(tokens, n) for tokens, n in asked]
                cancels = [asyncio.ensure_future(_cancel_later(rng, f)) for f in futs if rng.random() < 0.6]
                results = await asyncio.gather(*futs, return_exceptions=True)
                for c in cancels:
                    c.cancel()
                for (tokens, n), r in zip(asked, results, strict=True):
                    if isinstance(r, asyncio.CancelledError):
                        continue
                    assert not isinstance(r, BaseException), f"seed {seed}: {r!r}"
                    finished.append((tokens, n, r.output_ids))
                if rnd == 1:
                    await cache.controller.wait_idle()
                    cache.flush_device()
                if rnd == 2 and tier is not None:
                    await cache.controller.wait_idle()
                    await tier.drain()
                    cache.flush_device()
                    cache.flush_host()
        full = (cfg.device_kv_pages, cfg.device_state_slots, 48, 8)
        assert await settled(cache) == full, f"seed {seed}: a pool lost indices"
        locked = held_nodes(cache)
        assert not locked, f"seed {seed}: nodes still locked: {locked}"
    return finished


@pytest.mark.parametrize("seed", [1, 5, 11, 17, 23, 31, 219])
async def test_requests_cancelled_at_random_moments_leave_nothing_held_and_the_rest_exact(
    seed: int, tmp_path: Path
) -> None:
    finished = await _serve_mix(seed, tmp_path)
    assert finished, "every request was cancelled: the seed tests nothing of the outputs"
    cold = config_with(SPEC, device_kv_pages=512, device_state_slots=64)
    async with (
        HybridCache(SPEC, cold) as cache,
        Scheduler(MODEL, cache, SchedulerConfig(use_cache=False, chunk_size=4096)) as sched,
    ):
        for tokens, n, output in finished:
            assert (await sched.generate(tokens, n)).output_ids == output, f"seed {seed}: {len(tokens)} tokens"
