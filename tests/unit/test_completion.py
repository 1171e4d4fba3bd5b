"""CompletionQueue with stand-in CUDA events (``query`` / ``synchronize``) on CPU: order, a
failed synchronize, a raising callback, operations without an event, a stopped ``run()``."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from asynccache.completion import CompletionQueue

DEADLINE_S = 5.0


class StandInEvent:
    """A recorded event: ``query()`` is False until ``fire()``; ``synchronize()`` waits for it
    (bounded, so a broken test cannot leave a thread behind) and then raises ``error`` if set."""

    def __init__(self, error: BaseException | None = None, *, fired: bool = False) -> None:
        self.error = error
        self.fired = threading.Event()
        self.waiting = threading.Event()  # a thread is inside synchronize()
        if fired:
            self.fired.set()

    def fire(self) -> None:
        self.fired.set()

    def query(self) -> bool:
        return self.fired.is_set() and self.error is None

    def synchronize(self) -> None:
        self.waiting.set()
        self.fired.wait(DEADLINE_S)
        if self.error is not None:
            raise self.error


class Recorder:
    """Callbacks that record (name, error) in completion order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, BaseException | None]] = []

    def callback(self, name: str, *, raises: BaseException | None = None):  # type: ignore[no-untyped-def]
        def done(error: BaseException | None = None) -> None:
            self.calls.append((name, error))
            if raises is not None:
                raise raises

        return done

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


async def drained(queue: CompletionQueue) -> None:
    async with asyncio.timeout(DEADLINE_S):
        await queue.drain()


async def test_operations_complete_in_order_once_their_events_fire() -> None:
    queue, rec = CompletionQueue("load"), Recorder()
    first, second = StandInEvent(), StandInEvent(fired=True)
    queue.submit(first, rec.callback("op1"))
    queue.submit(second, rec.callback("op2"))
    assert queue.depth == 2
    runner = asyncio.get_running_loop().create_task(queue.run())
    try:
        first.fire()
        await drained(queue)
        assert rec.calls == [("op1", None), ("op2", None)]
        assert queue.depth == 0 and queue.num_completed == 2
    finally:
        runner.cancel()


async def test_a_failed_synchronize_fails_that_operation_and_those_queued_behind_it() -> None:
    """A CUDA error on one end event: that op and the ops queued behind it hear of it (their
    callbacks get the error, so the controller undoes them) and drain returns."""
    queue, rec = CompletionQueue("load"), Recorder()
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    queue.submit(StandInEvent(fault, fired=True), rec.callback("op1"))
    queue.submit(StandInEvent(fired=True), rec.callback("op2"))
    queue.submit(None, rec.callback("op3"))
    runner = asyncio.get_running_loop().create_task(queue.run())
    try:
        await drained(queue)
        assert rec.calls == [("op1", fault), ("op2", fault), ("op3", fault)]
        assert queue.depth == 0 and not runner.done()
        # The queue goes on: an op submitted after the failure waits on its own event.
        queue.submit(StandInEvent(fired=True), rec.callback("op4"))
        await drained(queue)
        assert rec.calls[-1] == ("op4", None)
    finally:
        runner.cancel()


async def test_a_raising_callback_is_logged_and_the_queue_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    queue, rec = CompletionQueue("write"), Recorder()
    queue.submit(StandInEvent(fired=True), rec.callback("op1", raises=RuntimeError("finish_backup failed")))
    queue.submit(StandInEvent(fired=True), rec.callback("op2"))
    runner = asyncio.get_running_loop().create_task(queue.run())
    try:
        with caplog.at_level(logging.ERROR, logger="asynccache.controller"):
            await drained(queue)
        assert rec.calls == [("op1", None), ("op2", None)]
        assert queue.depth == 0 and not runner.done()
        assert "finish_backup failed" in caplog.text
    finally:
        runner.cancel()


async def test_an_operation_without_an_event_completes_after_earlier_pending_ones() -> None:
    queue, rec = CompletionQueue("load"), Recorder()
    pending = StandInEvent()
    queue.submit(pending, rec.callback("op1"))
    queue.submit(None, rec.callback("op2"))
    assert rec.calls == [] and queue.depth == 2
    runner = asyncio.get_running_loop().create_task(queue.run())
    try:
        pending.fire()
        await drained(queue)
        assert rec.names == ["op1", "op2"]
    finally:
        runner.cancel()


async def test_an_operation_without_an_event_and_nothing_pending_completes_at_once() -> None:
    queue, rec = CompletionQueue("load"), Recorder()
    queue.submit(None, rec.callback("op1"))
    assert rec.calls == [("op1", None)] and queue.depth == 0
    assert not await queue.wait_idle()


async def test_drain_completes_what_a_stopped_run_left() -> None:
    """``run()`` cancelled while it waits on an event (its task group shutting down): the op stays
    pending, and ``drain()`` completes it and those behind it instead of waiting for ever."""
    queue, rec = CompletionQueue("load"), Recorder()
    first = StandInEvent()
    queue.submit(first, rec.callback("op1"))
    queue.submit(StandInEvent(fired=True), rec.callback("op2"))
    runner = asyncio.get_running_loop().create_task(queue.run())
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.to_thread(first.waiting.wait, DEADLINE_S)  # run() waits in synchronize()
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert rec.calls == [] and queue.depth == 2
    first.fire()
    await drained(queue)
    assert rec.calls == [("op1", None), ("op2", None)] and queue.depth == 0
