"""What was computed on a load that failed, once it reached the host and storage. A prefix's
boundary state is loaded from the host alone; while that load is in flight a branch is computed
on it (here: made up, so that serving it would change an output), inserted, backed up to the
host and archived to a ``file://`` storage tier. The copy fails. Before, only the branch's device
copy went: its host copy stayed in the tree and its objects in storage, and a later request of
that prefix was served them. Now the undo drops the host copy and the tier deletes those objects
(``asynccache.stale_purge``): such a request computes the branch afresh (its output is a cold
run's), and once its own correct copy is archived, storage serves that (a cold run's output
again); the pools are whole. The CPU copy path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from serving import free_counts
from test_pending_loads import fail_copies
from test_scheduler_failed_load import (
    MODEL,
    PREFIX,
    SPEC,
    assert_nothing_held,
    cold_output,
    config,
)

from asynccache.cache import HybridCache
from asynccache.errors import TransferError
from asynccache.reference.scheduler import Scheduler
from asynccache.tree import Tier

#: the branch computed on the pending state: two pages past ``PREFIX``
BRANCH = PREFIX + [17, 3, 5, 7, 11, 13, 2, 19]


async def state_on_host_only(cache: HybridCache) -> None:
    """``PREFIX`` served once (cached, backed up, archived), then its state on the host only,
    its KV still on the device."""
    async with Scheduler(MODEL, cache) as sched:
        await sched.generate(PREFIX, 2)
    await settle(cache)
    cache.flush_device()
    match = cache.tree.match_prefix(PREFIX)
    assert match.needs_load and match.state_tier is Tier.HOST
    # Its KV back on the device: only the state is loaded from the host.
    node = match.last_node
    load = cache.controller.load(match)
    assert load is not None
    cache.controller.start_loading()
    await load
    assert cache.tree.evict_device(num_states=1).num_states == 1
    match = cache.tree.match_prefix(PREFIX)
    assert match.last_node is node and match.state_tier is Tier.HOST and match.num_host_tokens == 0


async def settle(cache: HybridCache) -> None:
    await cache.controller.wait_idle()
    assert cache.controller.tiering is not None
    await cache.controller.tiering.drain()


def noise(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4


async def branch_archived_on_a_pending_state(cache: HybridCache) -> tuple[Any, Any, int]:
    """The owner's load of ``PREFIX``'s state queued; ``BRANCH`` inserted meanwhile with made-up
    pages and state, backed up and archived. Returns the load, the owner's match and token."""
    ctrl, tree = cache.controller, cache.tree
    match = tree.match_prefix(PREFIX)
    token = tree.lock(match.last_node)
    op = ctrl.load(match)
    assert op is not None and tree.match_prefix(BRANCH).num_tokens == len(PREFIX)
    alloc = tree.alloc_device(2, 1)
    assert alloc is not None
    for lid in SPEC.attention_layer_ids:
        items = cache.device_kv.layer_items(lid)
        items[alloc.kv_indices] = noise(items[alloc.kv_indices].shape, lid).to(items.dtype)
    for lid in SPEC.mamba_layer_ids:
        items = cache.device_mamba.layer_items(lid)
        items[alloc.state_slots] = noise(items[alloc.state_slots].shape, 100 + lid).to(items.dtype)
    res = tree.insert(
        BRANCH, torch.cat([match.device_kv_indices, alloc.kv_indices]), states={len(BRANCH): int(alloc.state_slots[0])}
    )
    backup = ctrl.write([res.last_node])
    assert backup is not None
    ctrl.start_writing()
    await backup
    await settle(cache)
    assert res.last_node.archived  # in storage now
    return op, match, token


async def fail_the_branch_s_load(cache: HybridCache) -> None:
    """``BRANCH`` computed on ``PREFIX``'s pending state (made-up bytes), backed up and archived;
    then the load fails and everything settles."""
    ctrl, tree = cache.controller, cache.tree
    await state_on_host_only(cache)
    op, match, token = await branch_archived_on_a_pending_state(cache)
    real = fail_copies(cache)
    ctrl.start_loading()
    with pytest.raises(TransferError):
        async with asyncio.timeout(5):
            await op
    await settle(cache)
    tree.unlock(match.last_node, token)
    ctrl.layer_copier = real  # type: ignore[method-assign]


async def test_a_failed_state_load_leaves_no_host_copy_or_stored_object_of_what_was_computed_on_it(
    tmp_path: Path,
) -> None:
    """Served after the failure, then again from storage alone: the prefix's cached part is
    used (the device's), the branch is computed, and the output is a cold run's; then storage
    serves the branch's correct copy, archived by that request, and the output is a cold run's
    again. Without the host copy's undo the first request loads the branch from the host;
    without the purge it restores the wrong objects from storage
    (``tests/integration/test_stale_purge.py``)."""
    prompt = BRANCH + [23]
    want = await cold_output(prompt, 4)
    cache = HybridCache(SPEC, config(storage_uri=f"file://{tmp_path}/store"))
    before = free_counts(cache)
    async with cache:
        tree = cache.tree
        await fail_the_branch_s_load(cache)
        again = tree.match_prefix(BRANCH)
        assert again.num_tokens == len(PREFIX) and again.num_matched_tokens == len(PREFIX)  # not on the host
        async with Scheduler(MODEL, cache) as sched:
            first = await sched.generate(prompt, 4)
            assert first.output_ids == want and first.cached_tokens == len(PREFIX)
            await settle(cache)
            cache.flush_device()
            cache.flush_host()  # the branch's correct copy is gone from the tree: storage alone
            second = await sched.generate(prompt, 4)  # the branch's correct copy, from storage
            assert second.output_ids == want and second.cached_by_tier["storage"] == second.cached_tokens == len(BRANCH)
        await settle(cache)
        assert_nothing_held(cache, before)
