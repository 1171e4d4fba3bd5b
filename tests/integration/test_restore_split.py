"""Restoring from storage only the part of a prefix that pays (cost model of the storage tier)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from serving import store_only

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError
from asynccache.policy import EveryPageAdmission
from asynccache.read_landing import note_landed
from asynccache.restore_cost import SplitTiming, plan_restore
from asynccache.spec import HybridSpec
from asynccache.tiering import ReadTimeCorrection, RestoreCost, StorageTier

PAGE = 4
NUM_PAGES = 32
TOKENS = [(9 * t + 2) % 250 + 1 for t in range(NUM_PAGES * PAGE)]
GRID = 8  # a stored state every 8 pages


async def stored_prefix_cache(spec: HybridSpec, **config: object) -> HybridCache:
    cfg = HybridCacheConfig(
        device_kv_pages=128,
        device_state_slots=16,
        host_kv_bytes=128 * spec.kv_page_bytes,
        host_state_bytes=16 * spec.state_bytes,
        storage_uri="memory://split_test",
        **config,  # type: ignore[arg-type]
    )
    cache = HybridCache(spec, cfg, admission=EveryPageAdmission())
    await cache.__aenter__()
    await store_only(cache, TOKENS, grid=GRID)
    return cache


@pytest.mark.parametrize(
    ("read_bytes_per_s", "expected_pages"),
    [
        (1e15, NUM_PAGES),  # reading is free: restore everything stored
        (1e-3, 0),  # reading is hopeless: recompute (never slower than cold)
    ],
)
async def test_split_point_follows_the_cost_model(read_bytes_per_s: float, expected_pages: int) -> None:
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    cache = await stored_prefix_cache(spec)
    try:
        tier = cache.controller.tiering
        assert tier is not None
        tier.cost = RestoreCost(read_bytes_per_s=read_bytes_per_s, prefill_tokens_per_s=1000.0)
        match = cache.tree.match_prefix(TOKENS)
        res = await tier.prefetch(TOKENS, match)
        assert res.num_pages_fetched == expected_pages
        assert cache.tree.match_prefix(TOKENS).num_tokens == expected_pages * PAGE
        cache.tree.check_integrity()
    finally:
        await cache.aclose()


async def test_the_state_read_is_part_of_the_cost() -> None:
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    cache = await stored_prefix_cache(spec)
    try:
        tier = cache.controller.tiering
        assert tier is not None
        read_page_s = spec.kv_page_bytes / 1e6
        state_pages = spec.state_bytes / spec.kv_page_bytes  # the state costs this many page reads
        assert 2 < state_pages < 0.3 * NUM_PAGES
        # Computing a page costs 1.5 page reads: restoring all 32 pages + the state pays.
        tier.cost = RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=PAGE / (1.5 * read_page_s))
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS))
        assert res.num_pages_fetched == NUM_PAGES
        # Computing a page costs 1.05 page reads: the extra state read makes restoring lose.
        cache.flush_device()
        cache.flush_host()
        tier.cost = RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=PAGE / (1.05 * read_page_s))
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS))
        assert res.num_pages_fetched == 0
        assert tier.counts["prefetch_split"] >= 1
    finally:
        await cache.aclose()


def balanced_cost(spec: HybridSpec, compute_over_read: float) -> RestoreCost:
    """Computing a page costs ``compute_over_read`` page reads (read bandwidth 1 MB/s)."""
    read_page_s = spec.kv_page_bytes / 1e6
    return RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=PAGE / (compute_over_read * read_page_s))


@contextlib.asynccontextmanager
async def balanced_tier(
    compute_over_read: float = 3.0, **config: object
) -> AsyncIterator[tuple[HybridCache, StorageTier]]:
    """A cache whose prefix is only in storage, its tier's cost model set to ``balanced_cost``."""
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    cache = await stored_prefix_cache(spec, **config)
    try:
        tier = cache.controller.tiering
        assert tier is not None
        tier.cost = balanced_cost(spec, compute_over_read)
        yield cache, tier
    finally:
        await cache.aclose()


async def test_tail_restore_balances_head_compute_against_the_read() -> None:
    async with balanced_tier() as (cache, tier):
        spec = cache.spec
        assert cache.host_kv is not None and cache.host_mamba is not None
        free_kv, free_st = cache.host_kv.num_free, cache.host_mamba.num_free
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        tail = res.tail
        assert tail is not None and res.num_tokens == 0
        b, n = tail.begin_tokens // PAGE, tail.end_tokens // PAGE
        assert n == NUM_PAGES and 0 < b < n
        # Balanced: computing the head takes as long as reading the tail and the state, ± a page.
        state_pages = spec.state_bytes / spec.kv_page_bytes
        assert abs(3.0 * b - (n - b + state_pages)) <= 3.0 + 1.0
        assert await tail.fetch
        assert tail.ok
        assert cache.host_kv.num_free == free_kv - (n - b) and cache.host_mamba.num_free == free_st - 1
        # The slots are private: nothing was inserted into the tree.
        assert cache.tree.match_prefix(TOKENS).num_tokens == 0
        tail.release()
        tail.release()  # idempotent
        assert cache.host_kv.num_free == free_kv and cache.host_mamba.num_free == free_st
        cache.tree.check_integrity()


async def test_tail_restore_released_early_frees_after_the_read() -> None:
    async with balanced_tier() as (cache, tier):
        assert cache.host_kv is not None
        free_kv = cache.host_kv.num_free
        tail = (await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)).tail
        assert tail is not None and not tail.fetch.done()
        tail.release()  # the read may still be landing in the slots: they stay allocated
        assert cache.host_kv.num_free < free_kv
        await tail.fetch
        assert cache.host_kv.num_free == free_kv


async def test_tail_restore_only_when_the_caller_takes_it() -> None:
    async with balanced_tier() as (cache, tier):
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS))
        assert res.tail is None and res.num_pages_fetched == NUM_PAGES  # restoring all beats recomputing


async def test_a_tail_arriving_after_the_deadline_is_released() -> None:
    async with balanced_tier(prefetch_policy="best_effort") as (cache, tier):
        ctrl = cache.controller
        assert cache.host_kv is not None
        free_kv = cache.host_kv.num_free
        gate = asyncio.Event()
        real = tier.prefetch

        async def late(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await real(*args, **kwargs)

        tier.prefetch = late
        task = ctrl.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        assert task is not None
        assert await ctrl.wait_prefetch(task, len(TOKENS)) is None  # best effort: no waiting
        gate.set()
        res = await task
        assert res.tail is not None and res.tail.released  # nobody took it: released on arrival
        assert not res.tail.ok  # its slots are no longer the caller's
        # Asked again (a scheduler that computed meanwhile): the result, without the tail.
        again = await ctrl.wait_prefetch(task, len(TOKENS))
        assert again is not None and again.tail is None and again.num_tokens == res.num_tokens
        await res.tail.fetch
        assert cache.host_kv.num_free == free_kv


async def test_a_context_cost_lengthens_the_head() -> None:
    """Attention makes a token dearer the deeper it sits, so the head of a prefix (computed from
    position 0) is cheaper than a flat rate says: with the same time for the whole prefix, a
    model with a context term computes a longer head and reads less — and still balances the
    head's computation against the tail's read to within a page."""
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    flat = balanced_cost(spec, 3.0)
    whole = flat.compute_s(0, NUM_PAGES * PAGE)
    # Half of the whole prefix's time from the context term, the same total.
    c = whole / ((NUM_PAGES * PAGE) ** 2 / 2) / 2
    rate = NUM_PAGES * PAGE / (whole / 2)
    deep = RestoreCost(read_bytes_per_s=1e6, prefill_tokens_per_s=rate, prefill_s_per_context_token=c)
    assert deep.compute_s(0, NUM_PAGES * PAGE) == pytest.approx(whole)
    heads = {}
    for name, cost in (("flat", flat), ("deep", deep)):
        async with balanced_tier() as (cache, tier):
            tier.cost = cost
            tail = (await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)).tail
            assert tail is not None
            b, n = tail.begin_tokens // PAGE, tail.end_tokens // PAGE
            assert await tail.fetch
            tail.release()

            def read_s(head: int, n: int = n, bw: float = cost.read_bytes_per_s) -> float:
                return ((n - head) * spec.kv_page_bytes + spec.state_bytes) / bw

            # b is where computing the head catches up with reading the tail (± one page).
            assert cost.compute_s(0, (b - 1) * PAGE) <= read_s(b - 1)
            assert cost.compute_s(0, (b + 1) * PAGE) >= read_s(b + 1)
            heads[name] = b
    assert heads["deep"] > heads["flat"]


def test_a_plan_counts_the_pages_the_cache_holds() -> None:
    """Storage is read only past the pages the cache holds (``first_page``): a whole restore
    costs only those reads, and a tail begins there or later."""
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    num_tokens = NUM_PAGES * PAGE + 1
    # Computing a page costs 1.05 page reads: reading all 32 pages and the state loses...
    cheap = balanced_cost(spec, 1.05)

    def plan(cost: RestoreCost, start: int, first: int, *, allow_tail: bool, **factors: float) -> tuple[int, int, bool]:
        return plan_restore(
            cost, spec, start_page=start, first_page=first, end_page=NUM_PAGES, num_tokens=num_tokens,
            allow_tail=allow_tail, **factors,
        )  # fmt: skip

    assert plan(cheap, 0, 0, allow_tail=False) == (0, 0, False)
    # ...reading the 8 past the 24 the cache holds (and the state) wins.
    assert plan(cheap, 0, 24, allow_tail=False) == (0, NUM_PAGES, False)
    # Whole restores observed 10x slower than estimated: a balanced split of a cold prefix
    # begins early; with 24 pages held (storage need not hold those) it begins at page 24.
    cost = balanced_cost(spec, 3.0)
    begin, end, split = plan(cost, 0, 0, allow_tail=True, read_factor=10.0)
    assert split and 0 < begin < 24 and end == NUM_PAGES
    assert plan(cost, 0, 24, allow_tail=True, read_factor=10.0) == (24, NUM_PAGES, True)
    # No tail when storage adds a state alone (every page held).
    assert not plan(cost, 8, NUM_PAGES, allow_tail=True)[2]


def test_restore_cost_compute_time_adds_up_and_grows_with_the_context() -> None:
    cost = RestoreCost(read_bytes_per_s=1e9, prefill_tokens_per_s=1000.0, prefill_s_per_context_token=1e-6)
    assert cost.compute_s(0, 100) + cost.compute_s(100, 300) == pytest.approx(cost.compute_s(0, 300))
    assert cost.compute_s(1000, 1100) > cost.compute_s(0, 100)
    assert cost.compute_s(0, 100) == pytest.approx(0.1 + 1e-6 * 100**2 / 2)
    flat = RestoreCost(read_bytes_per_s=1e9, prefill_tokens_per_s=1000.0)
    assert flat.compute_s(1000, 1100) == pytest.approx(flat.compute_s(0, 100)) == pytest.approx(0.1)


def test_restore_cost_fit_from_cold_prefills() -> None:
    def cold(n: int, rate: float = 20_000.0, c: float = 3e-9) -> float:
        return n / rate + c * n * n / 2

    fit = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(8192, cold(8192)), (32768, cold(32768))])
    assert fit.prefill_tokens_per_s == pytest.approx(20_000.0, rel=1e-6)
    assert fit.prefill_s_per_context_token == pytest.approx(3e-9, rel=1e-6)
    assert fit.read_bytes_per_s == 1e9
    # Three lengths, least squares: the same model back.
    three = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(n, cold(n)) for n in (4096, 16384, 32768)])
    assert three.prefill_s_per_context_token == pytest.approx(3e-9, rel=1e-6)
    # One length: a flat rate through it.
    one = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(32768, 2.0)])
    assert one.prefill_s_per_context_token == 0 and one.prefill_tokens_per_s == pytest.approx(16384.0)
    # Longer prompts faster per token than short ones (noise): no negative context cost.
    odd = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(8192, 0.5), (32768, 1.0)])
    assert odd.prefill_s_per_context_token == 0 and odd.prefill_tokens_per_s > 0
    assert odd.prefill_tokens_per_s == pytest.approx((8192**2 + 32768**2) / (8192 * 0.5 + 32768 * 1.0))


def test_a_pass_costs_its_fixed_time_once() -> None:
    cost = RestoreCost(read_bytes_per_s=1e9, prefill_tokens_per_s=1000.0, prefill_s_per_pass=0.01)
    assert cost.compute_s(0, 100) == pytest.approx(0.11) and cost.compute_s(5, 5) == 0.0
    # Two passes where one would do: the fixed time twice.
    assert cost.compute_s(0, 100) + cost.compute_s(100, 300) == pytest.approx(cost.compute_s(0, 300) + 0.01)


def test_restore_cost_fit_takes_a_pass_cost_from_three_lengths() -> None:
    def cold(n: int, f: float = 0.016, rate: float = 26_000.0, c: float = 0.0) -> float:
        return f + n / rate + c * n * n / 2

    flat_and_fixed = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(n, cold(n)) for n in (516, 2064, 8256)])
    assert flat_and_fixed.prefill_s_per_pass == pytest.approx(0.016, rel=1e-6)
    assert flat_and_fixed.prefill_tokens_per_s == pytest.approx(26_000.0, rel=1e-6)
    assert flat_and_fixed.prefill_s_per_context_token == pytest.approx(0.0, abs=1e-15)
    every = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(n, cold(n, c=3e-9)) for n in (2052, 8208, 16384, 32832)])
    assert every.prefill_s_per_pass == pytest.approx(0.016, rel=1e-6)
    assert every.prefill_s_per_context_token == pytest.approx(3e-9, rel=1e-6)
    # Two lengths cannot tell a pass's cost from attention's: the context term takes it, as before.
    two = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(n, cold(n)) for n in (2064, 8256)])
    assert two.prefill_s_per_pass == 0.0
    # Short prompts faster per token than long ones' trend says: no negative pass cost.
    fast_short = RestoreCost.fit(read_bytes_per_s=1e9, prefills=[(500, 0.01), (2000, 0.08), (8000, 0.32)])
    assert fast_short.prefill_s_per_pass == 0.0 and fast_short.prefill_s_per_context_token >= 0


def test_a_pass_cost_keeps_a_short_head_from_splitting() -> None:
    """A split computes its head in a pass of its own: with the fixed cost of that pass counted,
    a prefix whose head would be short is restored whole instead."""
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    base = balanced_cost(spec, 3.0)

    def plan(cost: RestoreCost) -> tuple[int, int, bool]:
        return plan_restore(
            cost, spec, start_page=0, first_page=0, end_page=NUM_PAGES, num_tokens=NUM_PAGES * PAGE + 1,
            allow_tail=True, read_factor=1.3,
        )  # fmt: skip

    begin, end, split = plan(base)
    assert split and 0 < begin < end == NUM_PAGES
    read_all = (NUM_PAGES * spec.kv_page_bytes + spec.state_bytes) / base.read_bytes_per_s * 1.3
    fixed = dataclasses.replace(base, prefill_s_per_pass=read_all)  # a head costs at least a whole read
    assert plan(fixed) == (0, NUM_PAGES, True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"read_bytes_per_s": 0.0, "prefill_tokens_per_s": 1.0},
        {"read_bytes_per_s": 1.0, "prefill_tokens_per_s": -1.0},
        {"read_bytes_per_s": 1.0, "prefill_tokens_per_s": float("nan")},
        {"read_bytes_per_s": 1.0, "prefill_tokens_per_s": 1.0, "prefill_s_per_context_token": -1e-9},
        {"read_bytes_per_s": 1.0, "prefill_tokens_per_s": 1.0, "prefill_s_per_pass": -0.001},
        {"read_bytes_per_s": 1.0, "prefill_tokens_per_s": 1.0, "prefill_s_per_pass": float("inf")},
    ],
)
def test_restore_cost_refuses_rates_that_are_not_positive(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        RestoreCost(**kwargs)


@pytest.mark.parametrize("prefills", [[], [(0, 1.0)], [(100, 0.0)], [(100, -1.0), (200, 1.0)]])
def test_restore_cost_fit_refuses_empty_or_meaningless_prefills(prefills: list[tuple[int, float]]) -> None:
    with pytest.raises(ConfigError, match="prefills"):
        RestoreCost.fit(read_bytes_per_s=1e9, prefills=prefills)


def test_read_time_correction_is_a_moving_average_of_large_reads() -> None:
    c = ReadTimeCorrection(alpha=0.5, min_bytes=1000)
    assert c.factor == 1.0
    c.observe(999, 10.0, 100.0)  # too small to tell bandwidth from latency
    assert c.factor == 1.0 and c.samples == 0
    c.observe(1000, 20.0, 100.0)  # estimated 10 s, took 20
    assert c.factor == 2.0
    c.observe(1000, 10.0, 100.0)
    assert c.factor == 1.5 and c.samples == 2


async def test_observed_slow_tail_reads_turn_a_split_into_a_whole_restore() -> None:
    """A split restore whose tail reads slower than estimated (the head's computation shares the
    host CPU) stops paying: the model learns it from the reads it observes."""
    async with balanced_tier() as (cache, tier):
        tier.read_alone.min_bytes = tier.read_beside_compute.min_bytes = 0  # the tiny spec's reads count
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        assert res.tail is not None
        assert await res.tail.fetch
        res.tail.release()
        # The tail's read was observed: the correction is its observed / estimated time (how
        # fast the memory backend was depends on the machine's moment, a GC pause included).
        observed = tier.read_beside_compute
        assert observed.samples == 1 and list(observed.ratios) == [observed.factor] and observed.factor > 0
        tier.read_beside_compute.factor = 2.0  # as if tails read at half the estimate beside a head
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        assert res.tail is None and res.num_pages_fetched == NUM_PAGES
        assert tier.read_alone.samples == 1
        cache.tree.check_integrity()


async def test_reads_are_timed_when_the_backend_says_they_landed(monkeypatch) -> None:
    """A backend that reports when its bytes landed (stamped where it read) times the tail and
    the whole restore by that, not by when the loop resumed the read: a forward pass holding
    the loop meanwhile is not blamed on the read."""
    async with balanced_tier() as (cache, tier):
        tier.read_alone.min_bytes = tier.read_beside_compute.min_bytes = 0  # the tiny spec's reads count
        real, reported = tier.backend.batch_get_v2, []

        async def late_loop(transfers: Any) -> Any:
            got = await real(transfers)
            reported.append(time.perf_counter())
            note_landed(reported[-1])
            await asyncio.sleep(0.3)  # the loop takes the replies late
            return got

        monkeypatch.setattr(tier.backend, "batch_get_v2", late_loop)
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        assert res.tail is not None and res.tail.timing is not None
        assert await res.tail.fetch
        assert res.tail.timing.landed_at == reported[-1]
        res.tail.release()
        cache.flush_device()
        cache.flush_host()
        tier.read_beside_compute.factor = 1e6  # a whole restore now
        started = time.perf_counter()
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        assert res.tail is None and res.num_pages_fetched == NUM_PAGES
        (ratio,) = tier.read_alone.ratios
        spec = cache.spec
        whole_est_s = (NUM_PAGES * spec.kv_page_bytes + spec.state_bytes) / tier.cost.read_bytes_per_s
        assert ratio * whole_est_s <= reported[-1] - started < 0.3
        cache.tree.check_integrity()


def test_a_correction_relaxes_toward_a_reference_from_above_only() -> None:
    c = ReadTimeCorrection(alpha=0.5, min_bytes=0)
    c.factor = 3.0
    c.relax(1.0)
    assert c.factor == 2.0
    c.relax(1.0, keep=0.25)
    assert c.factor == 1.25
    c.factor = 0.8
    c.relax(1.0)  # faster than the reference: nothing to forget
    assert c.factor == 0.8
    c.observe(10, 2.0, 10.0)
    assert list(c.ratios) == [2.0]


async def test_splits_are_tried_again_after_slow_tails_stop_being_observed() -> None:
    """One slow tail must not rule splits out for good: while whole restores are chosen, the
    tail correction fades toward the whole-read one, a split is chosen again within a few
    restores — and every restore along the way is complete."""
    async with balanced_tier() as (cache, tier):
        tier.read_beside_compute.min_bytes = 0  # the tiny spec's tail reads count
        tier.read_alone.min_bytes = 1 << 60  # whole reads keep the estimate (factor 1)
        tier.read_beside_compute.factor = 4.0  # as if the last tail read 4× slower than estimated
        factors, tails = [], []
        for _ in range(6):
            cache.flush_device()
            cache.flush_host()
            res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
            factors.append(tier.read_beside_compute.factor)
            tails.append(res.tail is not None)
            if res.tail is not None:
                assert await res.tail.fetch
                res.tail.release()
                break
            assert res.num_pages_fetched == NUM_PAGES
        assert tails[0] is False and tails[-1] is True
        assert all(a > b for a, b in itertools.pairwise(factors[:-1]))  # fading while not observed
        assert tier.read_beside_compute.samples == 1  # the split was observed again
        cache.tree.check_integrity()


def split_timing(read: ReadTimeCorrection, compute: ReadTimeCorrection, **kwargs: float) -> SplitTiming:
    """A split estimated at 10 s of head and 10 s of tail, started at t = 0."""
    return SplitTiming(read=read, compute=compute, head_est_s=10.0, tail_est_s=10.0, tail_bytes=1 << 30, started=0.0)


@pytest.mark.parametrize(
    ("head_done", "landed", "compute_factor", "read_factor"),
    [
        # The tail landed while the head computed: the head was the slow side; the tail's time is
        # only a bound (its last reply waited for the loop), which here says nothing new.
        (17.0, 16.0, 1.7, 1.0),
        # The same, but the tail's bound is below what the model expects: it lowers the read's.
        (17.0, 6.0, 1.7, 0.6),
        # The engine waited for the tail: the tail was the slow side; the head's time is a bound.
        (8.0, 15.0, 0.8, 1.5),
        (12.0, 15.0, 1.0, 1.5),
    ],
)
def test_a_split_s_time_corrects_the_side_that_took_it(
    head_done: float, landed: float, compute_factor: float, read_factor: float
) -> None:
    read, compute = ReadTimeCorrection(min_bytes=0), ReadTimeCorrection(min_bytes=0)
    timing = split_timing(read, compute)
    timing.landed(landed)
    assert compute.samples == read.samples == 0  # nothing until both sides are in
    timing.head_done(head_done)
    timing.head_done(head_done + 5)  # the first report counts
    timing.settle_unreported()  # settled already: nothing more
    assert compute.factor == pytest.approx(compute_factor) and read.factor == pytest.approx(read_factor)
    assert compute.samples + read.samples == 1 + (compute_factor < 1.0 or read_factor < 1.0)


def test_a_head_is_timed_from_when_the_engine_starts_it() -> None:
    """A request that waited for admission after its lookup: the wait is not the head's."""
    read, compute = ReadTimeCorrection(min_bytes=0), ReadTimeCorrection(min_bytes=0)
    timing = split_timing(read, compute)
    timing.landed(16.0)
    timing.head_started(10.0)
    timing.head_started(12.0)  # the first report counts
    timing.head_done(17.0)  # 7 s of computing against 10 estimated; the tail landed first
    assert compute.factor == pytest.approx(0.7) and read.samples == 0


def test_an_unreported_head_leaves_the_tail_a_read_observation() -> None:
    """An owner that never reports its head (no scheduler): the tail's time, as it landed."""
    read, compute = ReadTimeCorrection(min_bytes=0), ReadTimeCorrection(min_bytes=0)
    timing = split_timing(read, compute)
    timing.settle_unreported()  # not landed (a failed read): nothing to learn
    assert read.samples == 0
    timing.landed(14.0)
    timing.settle_unreported()
    assert read.factor == pytest.approx(1.4) and compute.samples == 0
    small = ReadTimeCorrection()  # 64 MiB and up only: the tail of 1 GiB counts, not 1 KiB
    SplitTiming(read=small, compute=compute, head_est_s=1.0, tail_est_s=1.0, tail_bytes=1024, started=0.0).landed(2.0)
    assert small.samples == 0


async def test_a_slow_head_beside_the_reads_shortens_the_head() -> None:
    """The head's correction weighs in the plan: a head computed at a quarter of its estimated
    speed beside the reads makes the next split compute less of the prefix and read more."""
    async with balanced_tier() as (cache, tier):
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        assert res.tail is not None
        first_head = res.tail.begin_tokens
        assert await res.tail.fetch
        res.tail.head_computed()
        res.tail.release()
        assert tier.compute_beside_reads.samples == 1  # reported: the head's time was observed
        cache.flush_device()
        cache.flush_host()
        tier.read_beside_compute.factor = 1.0  # (the memory backend reads far faster than the model)
        tier.compute_beside_reads.factor = 4.0
        res = await tier.prefetch(TOKENS, cache.tree.match_prefix(TOKENS), allow_tail=True)
        assert res.tail is not None and 0 < res.tail.begin_tokens < first_head
        assert await res.tail.fetch
        res.tail.release()
        cache.tree.check_integrity()
