"""The reference scheduler and the admission policy: where it snapshots states (branch points
from the request's match) and what it does when the device has fewer state slots than the
policy asks for."""

from __future__ import annotations

import pytest
from serving import arith_prompt, config_with, tiny_model, tiny_spec

from asynccache.cache import HybridCache
from asynccache.policy import EveryPageAdmission
from asynccache.policy.branch import BranchAdmission
from asynccache.reference.scheduler import Scheduler, SchedulerConfig

SPEC = tiny_spec()
MODEL = tiny_model(SPEC, "cpu", seed=0)
PAGE = SPEC.page_size


async def test_branch_admission_serves_the_third_occurrence_of_a_shared_prefix() -> None:
    """Marconi-style admission: the second prompt through a shared prefix leaves a state where
    it branches off the first, so the third resumes there."""
    shared = arith_prompt(8 * PAGE, 7, 3)
    cache = HybridCache(SPEC, config_with(SPEC), admission=BranchAdmission())
    async with cache, Scheduler(MODEL, cache) as sched:
        cached = []
        for tail in ([9, 8, 7, 6, 5, 4], [19, 18, 17, 16, 15, 14], [29, 28, 27, 26, 25, 24]):
            cached.append((await sched.generate(shared + tail, 2)).cached_tokens)
    assert cached == [0, 0, 8 * PAGE]


@pytest.mark.parametrize("use_cache", [True, False])
async def test_snapshots_beyond_the_free_state_slots_are_dropped_not_the_request(use_cache: bool) -> None:
    """Every-page admission asks for a state at each of a 40-token prompt's pages, more than the
    device's 8 slots; the request needs only its working slot. It runs, with the output of a
    cold run, and (with the cache) keeps the deepest states that fitted, its prompt's end first."""
    prompt = arith_prompt(10 * PAGE, 7, 3)
    cache = HybridCache(SPEC, config_with(SPEC))
    async with cache, Scheduler(MODEL, cache, SchedulerConfig(use_cache=False)) as sched:
        cold = (await sched.generate(prompt, 2)).output_ids
    config = config_with(SPEC, device_kv_pages=128, device_state_slots=8)
    async with HybridCache(SPEC, config, admission=EveryPageAdmission()) as cache:
        async with Scheduler(MODEL, cache, SchedulerConfig(use_cache=use_cache)) as sched:
            result = await sched.generate(prompt, 2)
        assert result.output_ids == cold
        match = cache.tree.match_prefix(prompt[:-1])
        assert match.num_tokens == (9 * PAGE if use_cache else 0)  # the last full page of the prompt
        cache.tree.check_integrity()
