"""The end of the reference scheduler's requests when something fails there: an error raised in
a request's finish once ``tree.insert`` has taken its pages (the backup it queues, the archive
of its storage-only snapshots) stops the loop like a failing forward — the request fails with
it, leaving raises ``SchedulerError`` — and the request's cancellation then frees only what it
still holds: no double free of the pages the tree owns, no slot leaked. A cancelled request
forgets the lock it released."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from serving import (
    arith_prompt,
    config_with,
    free_counts,
    held_nodes,
    tiny_model,
    tiny_spec,
)

from asynccache.cache import HybridCache
from asynccache.errors import SchedulerError
from asynccache.policy import EndsAdmission
from asynccache.reference.scheduler import Scheduler

SPEC = tiny_spec()
PAGE = SPEC.page_size
MODEL = tiny_model(SPEC, "cpu", seed=0)
PROMPT = arith_prompt(24, 7, 3)


class EndsPlusStorageGrid(EndsAdmission):
    """The tree keeps the ends; storage gets a state at every page of the prompt besides."""

    def storage_positions(self, prompt_len: int, *, page_size: int, match: Any = None) -> set[int]:
        return set(range(page_size, prompt_len + 1, page_size))


async def assert_nothing_held(cache: HybridCache, before: tuple[int, ...]) -> None:
    cache.controller.start_writing()  # a backup queued by a finish the loop did not issue
    await cache.controller.wait_idle()
    if cache.controller.tiering is not None:
        await cache.controller.tiering.drain()
    cache.tree.check_integrity()
    cache.flush_device()
    cache.flush_host()
    cache.tree.check_integrity()
    assert free_counts(cache) == before
    assert not held_nodes(cache)


@pytest.mark.parametrize("where", ["write", "archive_snapshots", "model"])
async def test_an_error_after_the_insert_stops_the_loop_and_frees_only_what_the_request_holds(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller's ``write`` (the request's backups) or ``archive_snapshots`` (its
    storage-only snapshots) raises after the insert took the request's pages and kept states:
    the request fails with the error, leaving raises ``SchedulerError`` from it, and the pools
    and the tree are whole — as when the model's forward raises (``model``). Before, leaving
    freed the inserted pages a second time (``AllocationError``) and leaked the slots."""
    config = config_with(SPEC, storage_uri=tmp_path.as_uri() if where == "archive_snapshots" else None)
    admission = EndsPlusStorageGrid() if where == "archive_snapshots" else None
    cache = HybridCache(SPEC, config, admission=admission)
    before = free_counts(cache)
    error = RuntimeError(f"injected failure of {where}")
    async with cache:
        sched = Scheduler(MODEL, cache)
        if where == "model":

            class Failing:
                device, spec = MODEL.device, MODEL.spec

                async def forward(self, *args: Any) -> Any:
                    raise error

            monkeypatch.setattr(sched, "model", Failing())
        else:

            def raising(*args: Any, **kwargs: Any) -> Any:
                raise error

            monkeypatch.setattr(cache.controller, where, raising)
        await sched.__aenter__()
        async with asyncio.timeout(30):
            with pytest.raises(RuntimeError) as failed:
                await sched.generate(PROMPT, 3)
        assert failed.value is error
        with pytest.raises(SchedulerError) as stopped:
            await sched.__aexit__(None, None, None)
        assert stopped.value.__cause__ is error
        if where != "model":
            assert cache.tree.match_prefix(PROMPT).num_tokens == len(PROMPT)  # the insert stands
        await assert_nothing_held(cache, before)


async def test_a_cancelled_request_forgets_the_lock_it_released() -> None:
    """A running request that holds its match's lock is cancelled: the lock is released once,
    and the request no longer names it (nor its pages and slots)."""
    cache = HybridCache(SPEC, config_with(SPEC))
    before = free_counts(cache)
    async with cache:
        async with Scheduler(MODEL, cache) as sched:
            await sched.generate(PROMPT, 2)
            fut = sched.submit(PROMPT + [9, 9, 9, 9], 50)
            async with asyncio.timeout(30):
                while not sched._running or sched._running[0].phase.value != "decode":
                    await asyncio.sleep(0)
            (req,) = sched._running
            assert req.locked_node is not None and req.lock_token is not None
            node = req.locked_node
            fut.cancel()
            async with asyncio.timeout(30):
                while sched._running:
                    await asyncio.sleep(0)
            assert req.locked_node is None and req.lock_token is None
            assert req.own_pages is None and not req.snapshots and req.state_slot == -1
            assert node.num_locks == 0
        await assert_nothing_held(cache, before)
