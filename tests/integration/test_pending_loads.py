"""A second request whose match reaches a load in flight (``pending_load``): it waits for that
load's operation (``wait_loaded``), its lock keeps a cancel from undoing the load and a failed
copy's pages out of the pools, and a failed load of a state alone takes along what was computed
on the state meanwhile. The CPU copy path; no timing."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch
from serving import free_counts, serving_config

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import StaleMatchError, TransferError
from asynccache.ops import OpState
from asynccache.spec import HybridSpec
from asynccache.tree import Tier

PAGE = 4
SPEC = HybridSpec.preset("tiny", page_size=PAGE)
TOKENS = list(range(1, 4 * PAGE + 1))
LONGER = TOKENS + list(range(700, 700 + 2 * PAGE))


def config(**overrides: Any) -> HybridCacheConfig:
    return dataclasses.replace(serving_config(SPEC), **overrides)


def fill_random(cache: HybridCache) -> None:
    g = torch.Generator().manual_seed(7)
    for pool in (cache.device_kv, cache.device_mamba):
        assert pool.buffer is not None
        pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=g, dtype=torch.uint8))


def insert(cache: HybridCache, tokens: list[int]) -> Any:
    alloc = cache.tree.alloc_device(len(tokens) // PAGE, 1)
    assert alloc is not None
    return cache.tree.insert(tokens, alloc.kv_indices, states={len(tokens): int(alloc.state_slots[0])})


def device_bytes(cache: HybridCache, pages: torch.Tensor, slot: int) -> bytes:
    kv = torch.stack([cache.device_kv.layer_items(lid)[pages] for lid in SPEC.attention_layer_ids])
    st = torch.stack([cache.device_mamba.layer_items(lid)[slot] for lid in SPEC.mamba_layer_ids])
    return kv.numpy().tobytes() + st.numpy().tobytes()


async def on_host_only(cache: HybridCache, tokens: list[int], *, keep_kv: bool = False) -> bytes:
    """``tokens`` inserted (random bytes), backed up and gone from the device (its state only,
    with ``keep_kv``); returns the bytes the device held."""
    fill_random(cache)
    res = insert(cache, tokens)
    op = cache.controller.write(res.backup_nodes)
    assert op is not None
    cache.controller.start_writing()
    await op
    m = cache.tree.match_prefix(tokens)
    assert m.last_node.device_state is not None
    saved = device_bytes(cache, m.device_kv_indices, m.last_node.device_state)
    if keep_kv:
        assert cache.tree.evict_device(num_states=1).num_states == 1
    else:
        cache.flush_device()
    return saved


def holds(cache: HybridCache, match: Any, saved: bytes) -> bool:
    """Whether the device pages and state slot ``match`` reports hold ``saved``."""
    slot = match.last_node.device_state
    return slot is not None and device_bytes(cache, match.device_kv_indices, slot) == saved


def settle(cache: HybridCache) -> None:
    """The tree consistent; then everything it holds dropped (the pools' counts checked after)."""
    cache.tree.check_integrity()
    cache.flush_device()
    cache.flush_host()


def locked_match(cache: HybridCache) -> tuple[Any, int]:
    """A request's match of ``TOKENS``, locked, and its lock token."""
    match = cache.tree.match_prefix(TOKENS)
    return match, cache.tree.lock(match.last_node)


def queued_load(cache: HybridCache) -> tuple[tuple[Any, int], Any]:
    """The first request: its match of ``TOKENS`` locked (with its lock token), then its load
    queued."""
    first, token = locked_match(cache)
    op = cache.controller.load(first)
    assert op is not None
    return (first, token), op


def fail_copies(cache: HybridCache) -> Any:
    """Every copy of the controller fails from now on; returns the real copier."""
    real = cache.controller.layer_copier

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise TransferError("injected copy failure")

    cache.controller.layer_copier = failing  # type: ignore[method-assign]
    return real


async def reader_of_a_queued_load(
    cache: HybridCache,
) -> tuple[bytes, tuple[Any, int], Any, tuple[Any, int]]:
    """``TOKENS`` on the host only; the first request's locked match and its queued load; then
    a second request's locked match of the same prefix. Returns the saved bytes and the three
    (each match with its lock token)."""
    saved = await on_host_only(cache, TOKENS)
    first, op = queued_load(cache)
    return saved, first, op, locked_match(cache)


async def yield_a_few() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_second_request_waits_for_the_load_another_one_queued() -> None:
    """The first request queues the load; the second matches the same prefix while it is
    queued: its match is pending (nothing to load itself), and its wait ends once a step has
    issued that load and the bytes are on the device."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        saved, (first, first_token), op, (second, second_token) = await reader_of_a_queued_load(cache)
        assert second.pending_load and not second.needs_load
        assert ctrl.pending_ops(second) == [op]
        waiter = asyncio.create_task(ctrl.wait_loaded(second))
        await yield_a_few()
        assert not waiter.done()  # queued: nothing lands until a step issues it
        ctrl.start_loading()
        async with asyncio.timeout(5):
            await waiter
        assert op.state is OpState.DONE and ctrl.pending_ops(second) == []
        assert holds(cache, second, saved)
        await ctrl.wait_loaded(second)  # nothing pending: at once
        tree.unlock(second.last_node, second_token)
        tree.unlock(first.last_node, first_token)
        settle(cache)
    assert free_counts(cache) == before


async def test_cancelling_a_load_another_request_holds_lets_it_complete() -> None:
    """The first request gives up while its load is queued; the second, which matched the
    pages meanwhile and locked them, still needs them: the cancel is refused, the next step
    issues the load and the second request's wait ends with the bytes on the device."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        saved, (first, first_token), op, (second, second_token) = await reader_of_a_queued_load(cache)
        waiter = asyncio.create_task(ctrl.wait_loaded(second))
        assert ctrl.cancel(op) is False
        assert op.state is OpState.QUEUED and tree.match_is_current(second)
        tree.unlock(first.last_node, first_token)  # the first request leaves
        ctrl.start_loading()
        async with asyncio.timeout(5):
            await waiter
        assert holds(cache, second, saved)
        tree.unlock(second.last_node, second_token)
        settle(cache)
    assert free_counts(cache) == before


async def test_a_load_cancelled_before_anyone_held_it_leaves_its_waiter_a_stale_match() -> None:
    """A waiter that took no lock does not hold the load up: the cancel goes through and the
    wait reports a stale match instead of returning over pages that never arrived."""
    cache = HybridCache(SPEC, config())
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        await on_host_only(cache, TOKENS)
        first = tree.match_prefix(TOKENS)
        op = ctrl.load(first)
        assert op is not None
        second = tree.match_prefix(TOKENS)
        waiter = asyncio.create_task(ctrl.wait_loaded(second))
        await yield_a_few()
        assert ctrl.cancel(op) is True
        with pytest.raises(StaleMatchError):
            async with asyncio.timeout(5):
                await waiter
        assert tree.match_prefix(TOKENS).needs_load
        tree.check_integrity()


async def test_a_failed_load_another_request_holds_is_reported_and_its_pages_held_until_unlock() -> None:
    """The copy fails: the second request's wait raises ``StaleMatchError``; the failed copy
    leaves the tree at once (a new match loads it afresh) but its pages stay out of the pools
    until the second request unlocks; loaded again, the bytes are right."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        saved = await on_host_only(cache, TOKENS)
        real = fail_copies(cache)
        (first, first_token), op = queued_load(cache)
        second, second_token = locked_match(cache)
        waiter = asyncio.create_task(ctrl.wait_loaded(second))
        await yield_a_few()
        loading = free_counts(cache)
        ctrl.start_loading()
        async with asyncio.timeout(5):
            with pytest.raises(StaleMatchError) as caught:
                await waiter
            with pytest.raises(TransferError):
                await op
        assert isinstance(caught.value.__cause__, TransferError)
        with pytest.raises(StaleMatchError):  # a wait that starts after the failure hears of it too
            await ctrl.wait_loaded(second)
        again = tree.match_prefix(TOKENS)
        assert again.needs_load and not again.pending_load and again.num_device_tokens == 0
        tree.unlock(first.last_node, first_token)
        assert free_counts(cache) == loading  # the second request may still read them
        tree.unlock(second.last_node, second_token)
        assert free_counts(cache)[:2] == (loading[0] + 4, loading[1] + 1)
        tree.check_integrity()
        ctrl.layer_copier = real  # type: ignore[method-assign]
        retry = tree.match_prefix(TOKENS)
        retry_token = tree.lock(retry.last_node)
        op2 = ctrl.load(retry)
        assert op2 is not None
        ctrl.start_loading()
        await ctrl.wait_loaded(tree.match_prefix(TOKENS))
        now = tree.match_prefix(TOKENS)
        assert holds(cache, now, saved)
        tree.unlock(retry.last_node, retry_token)
        settle(cache)
    assert free_counts(cache) == before


async def test_a_failed_load_of_a_state_alone_takes_what_was_computed_on_it_along() -> None:
    """The KV is on the device, the state on the host only; while its load is in flight a
    request resumes from it and inserts what it computed. The copy fails: that data would be
    served after a state that never arrived, so it leaves with the load."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        await on_host_only(cache, TOKENS, keep_kv=True)
        fail_copies(cache)
        match = tree.match_prefix(TOKENS)
        assert match.state_tier is Tier.HOST and match.num_host_tokens == 0
        op = ctrl.load(match)
        assert op is not None
        assert tree.match_prefix(LONGER).pending_load
        insert(cache, LONGER)  # computed on the pending state
        assert ctrl.cancel(op) is False  # that data rests on it: a cancel would leave it in place
        ctrl.start_loading()
        with pytest.raises(TransferError):
            async with asyncio.timeout(5):
                await op
        await ctrl.wait_idle()
        assert tree.stats().num_active_plans == 0
        again = tree.match_prefix(LONGER)
        assert again.num_tokens == len(TOKENS) and again.state_tier is Tier.HOST
        settle(cache)
    assert free_counts(cache) == before


async def failed_under_computed_data(cache: HybridCache) -> tuple[tuple[Any, int], tuple[Any, int]]:
    """The first request's load of ``TOKENS`` fails; meanwhile a second one read the pending
    pages and inserted what it computed on them, which a third one holds: the failed load's
    undo waits for that lock. Returns the first and the third request's matches, locked (each
    with its lock token)."""
    ctrl, tree = cache.controller, cache.tree
    await on_host_only(cache, TOKENS)
    fail_copies(cache)
    first, op = queued_load(cache)
    second, second_token = locked_match(cache)
    insert(cache, LONGER)  # computed on the pending pages
    tree.unlock(second.last_node, second_token)
    third = tree.match_prefix(LONGER)
    third_token = tree.lock(third.last_node)
    ctrl.start_loading()
    with pytest.raises(TransferError):
        async with asyncio.timeout(5):
            await op
    await ctrl.wait_idle()
    assert ctrl.pending_ops(tree.match_prefix(TOKENS)) == [op]  # its undo waits
    return first, (third, third_token)


async def test_a_failed_load_whose_undo_a_lock_blocked_is_undone_once_that_lock_goes() -> None:
    """The lock that kept a failed load from being undone is released: the undo runs on the
    loop's next turn, without waiting for another operation to complete, and a new match
    loads the prefix afresh."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        tree = cache.tree
        (first, first_token), (third, third_token) = await failed_under_computed_data(cache)
        tree.unlock(third.last_node, third_token)
        await yield_a_few()
        assert tree.stats().num_active_plans == 0
        again = tree.match_prefix(TOKENS)
        assert again.needs_load and not again.pending_load and again.num_device_tokens == 0
        tree.unlock(first.last_node, first_token)
        settle(cache)
    assert free_counts(cache) == before


async def test_asking_for_a_matchs_loads_undoes_a_failed_load_no_lock_blocks_any_more() -> None:
    """Everyone has left, and a request matches again before the loop has turned: its match
    still reaches the failed load, but asking for the loads it waits for undoes that load
    first. The wait reports the match stale, and the next match loads the prefix afresh."""
    cache = HybridCache(SPEC, config())
    before = free_counts(cache)
    async with cache:
        ctrl, tree = cache.controller, cache.tree
        (first, first_token), (third, third_token) = await failed_under_computed_data(cache)
        tree.unlock(third.last_node, third_token)
        tree.unlock(first.last_node, first_token)
        again, again_token = locked_match(cache)
        assert again.pending_load
        assert ctrl.pending_ops(again) == []
        with pytest.raises(StaleMatchError):
            await ctrl.wait_loaded(again)
        tree.unlock(again.last_node, again_token)
        fresh = tree.match_prefix(TOKENS)
        assert fresh.needs_load and not fresh.pending_load and fresh.num_device_tokens == 0
        settle(cache)
    assert free_counts(cache) == before
