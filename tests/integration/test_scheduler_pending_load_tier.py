"""The tier a hit counts on when another request's host → device load, queued earlier in the
same step, brings its prefix: the match finds the prefix's pages on the device (the load
attached them) while they are still being filled, and that hit needed a host load — it counts
on the host tier, like the hit of the request whose load it is."""

from __future__ import annotations

import asyncio

import pytest
import serving
from serving import arith_prompt, config_with, tiny_model, tiny_spec

from asynccache.cache import HybridCache
from asynccache.reference.scheduler import Scheduler

SPEC = tiny_spec()
PAGE = SPEC.page_size
MODEL = tiny_model(SPEC, "cpu", seed=0)
PREFIX = arith_prompt(15 * PAGE, 3, 1)


async def cold_output(tokens: list[int], n: int) -> list[int]:
    return await serving.cold_output(MODEL, tokens, n)


@pytest.mark.parametrize("on_host", ["pages", "state"])
async def test_requests_served_by_one_load_of_the_same_step_both_count_on_the_host(on_host: str) -> None:
    """``pages``: the prefix's pages and states on the host only (the load brings both);
    ``state``: its pages on the device, its states on the host only (the load brings the
    boundary state alone)."""
    a_prompt, b_prompt = [*PREFIX, 7, 8, 9], [*PREFIX, 7, 8, 10]
    async with HybridCache(SPEC, config_with(SPEC)) as cache, Scheduler(MODEL, cache) as sched:
        await sched.generate(PREFIX, 2)
        await cache.controller.wait_idle()
        if on_host == "pages":
            cache.flush_device()
        else:
            tree = cache.tree
            assert tree.evict_device(num_states=tree.stats().device_states).num_lost_states == 0
            assert tree.stats().device_kv_pages == len(PREFIX) // PAGE
        loads, steps = load_ops(cache), sched.num_steps
        a, b = sched.submit(a_prompt, 4), sched.submit(b_prompt, 4)
        ra, rb = await asyncio.wait_for(a, 30), await asyncio.wait_for(b, 30)
        assert load_ops(cache) - loads == 1  # one load served both
        assert sched.num_steps - steps == 4  # admitted together: a prefill and three decodes
        await cache.controller.wait_idle()
        cache.tree.check_integrity()
    for r in (ra, rb):
        assert r.cached_tokens == len(PREFIX)
        assert r.cached_by_tier == {"device": 0, "host": len(PREFIX), "storage": 0}
    assert ra.output_ids == await cold_output(a_prompt, 4)
    assert rb.output_ids == await cold_output(b_prompt, 4)


def load_ops(cache: HybridCache) -> int:
    return cache.controller.statistics().counts.get("load_ops", 0)
