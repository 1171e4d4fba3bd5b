"""LayerTransferCounter: per-layer events, global sparse ids, pipeline stages, failure."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asynccache.errors import ConfigError, TransferError
from asynccache.layer_counter import LayerTransferCounter


async def test_wait_blocks_until_the_layer_is_enqueued() -> None:
    counter = LayerTransferCounter([0, 3, 7])  # sparse global ids (MLP-only layers skipped)
    waiter = asyncio.ensure_future(counter.wait(3))
    await asyncio.sleep(0)
    assert not waiter.done()
    counter.mark_enqueued(0)
    await asyncio.sleep(0)
    assert not waiter.done()
    counter.mark_enqueued(3)
    await asyncio.wait_for(waiter, timeout=1)


async def test_untracked_layers_and_completed_counter_return_at_once() -> None:
    counter = LayerTransferCounter([2])
    await asyncio.wait_for(counter.wait(5), timeout=1)  # another stage's layer / nothing to load
    done = LayerTransferCounter.completed()
    for lid in range(10):
        await asyncio.wait_for(done.wait(lid), timeout=1)


async def test_pipeline_stage_waits_only_for_its_own_layers() -> None:
    counter = LayerTransferCounter(range(8))
    stage1 = counter.for_layers(range(4, 8))
    assert stage1.layer_ids == (4, 5, 6, 7)
    # Stage 1 never waits on stage 0's layers, even when they are not loaded yet.
    await asyncio.wait_for(stage1.wait(1), timeout=1)
    waiter = asyncio.ensure_future(stage1.wait(4))
    await asyncio.sleep(0)
    assert not waiter.done()
    counter.mark_enqueued(4)  # marked through the full counter, seen by the stage view
    await asyncio.wait_for(waiter, timeout=1)


async def test_fail_releases_waiters_with_transfer_error() -> None:
    counter = LayerTransferCounter([0, 1])
    waiter = asyncio.ensure_future(counter.wait(1))
    await asyncio.sleep(0)
    counter.fail(RuntimeError("boom"))
    with pytest.raises(TransferError):
        await waiter


def test_marking_an_unknown_layer_raises() -> None:
    counter = LayerTransferCounter([0])
    with pytest.raises(KeyError):
        counter.mark_enqueued(9)


async def test_a_stage_view_sees_a_failure_of_the_full_counter() -> None:
    counter = LayerTransferCounter(range(4))
    stage = counter.for_layers([2, 3])
    waiter = asyncio.ensure_future(stage.wait(3))
    await asyncio.sleep(0)
    counter.fail(RuntimeError("boom"))
    with pytest.raises(TransferError):
        await waiter
    with pytest.raises(TransferError):  # also a layer nobody waited for before the failure
        await stage.wait(2)


async def test_marked_layers_need_no_waiter_and_keep_their_event() -> None:
    counter = LayerTransferCounter([1, 2])
    counter.mark_enqueued(1)
    assert counter.is_enqueued(1) and not counter.is_enqueued(2) and counter.is_enqueued(9)
    assert counter.cuda_event(1) is None and counter.cuda_event(2) is None
    await asyncio.wait_for(counter.wait(1), timeout=1)  # already marked: returns at once


def test_a_failed_counter_reports_every_layer_as_done_for_pollers() -> None:
    counter = LayerTransferCounter([0, 1])
    counter.fail(RuntimeError("boom"))
    assert counter.is_enqueued(0) and counter.is_enqueued(1)


async def test_an_integer_layer_id_of_another_type_waits_for_that_layer() -> None:
    """A model may pass a 0-d tensor or a NumPy integer: it names the same layer (the forward
    must not read KV that is still being loaded)."""
    counter = LayerTransferCounter([4])
    waiters = [asyncio.ensure_future(counter.wait(lid)) for lid in (torch.tensor(4), np.int64(4))]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    assert not counter.is_enqueued(torch.tensor(4))
    counter.mark_enqueued(4)
    async with asyncio.timeout(1):
        await asyncio.gather(*waiters)
    assert counter.is_enqueued(torch.tensor(4))


@pytest.mark.parametrize("bad", ["4", 4.0, True, torch.tensor([4, 5])])
async def test_a_layer_id_that_is_not_an_integer_is_refused(bad: object) -> None:
    counter = LayerTransferCounter([4])
    with pytest.raises(ConfigError, match="layer id"):
        async with asyncio.timeout(1):
            await counter.wait(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="layer id"):
        counter.is_enqueued(bad)  # type: ignore[arg-type]
