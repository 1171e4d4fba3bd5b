"""Foreground work (reads, probes) before background work (write-back, deletes): the limiter
and the worker pool of ``storage_backends.workers``."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from asynccache.errors import BackendError
from storage_backends.workers import YIELD, JobControl, PriorityLimiter, WorkerPool


async def test_limiter_serves_foreground_waiters_first_each_kind_in_order() -> None:
    limiter = PriorityLimiter(1)
    order: list[str] = []
    release = asyncio.Event()

    async def hold() -> None:
        async with limiter():
            await release.wait()

    async def take(name: str, background: bool) -> None:
        async with limiter(background=background):
            order.append(name)
            await asyncio.sleep(0)

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(take(n, bg)) for n, bg in (("b1", True), ("f1", False), ("b2", True), ("f2", False))]
    await asyncio.sleep(0)
    assert limiter.num_waiting == 4
    release.set()
    await asyncio.gather(holder, *waiters)
    assert order == ["f1", "f2", "b1", "b2"]
    assert limiter.num_waiting == 0


async def test_limiter_never_exceeds_its_slots_and_survives_cancelled_waiters() -> None:
    limiter = PriorityLimiter(2)
    inside = peak = 0

    async def work(background: bool) -> None:
        nonlocal inside, peak
        async with limiter(background=background):
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.001)
            inside -= 1

    tasks = [asyncio.create_task(work(i % 3 == 0)) for i in range(30)]
    await asyncio.sleep(0)
    for t in tasks[5:25:4]:
        t.cancel()  # waiting ones leave the queue; none takes a slot with it
    await asyncio.gather(*tasks, return_exceptions=True)
    assert peak == 2 and inside == 0
    async with asyncio.timeout(1):  # both slots came back
        async with limiter(), limiter(background=True):
            pass


async def test_limiter_passes_on_a_slot_handed_to_a_waiter_being_cancelled() -> None:
    limiter = PriorityLimiter(1)
    async with limiter():
        first = asyncio.create_task(limiter(background=True).__aenter__())
        second_done = asyncio.Event()

        async def second() -> None:
            async with limiter(background=True):
                second_done.set()

        other = asyncio.create_task(second())
        await asyncio.sleep(0)
    # the slot was handed to ``first``; cancelling it before it runs must pass the slot on
    first.cancel()
    async with asyncio.timeout(1):
        await second_done.wait()
    await other
    with pytest.raises(asyncio.CancelledError):
        await first


def _units_job(log: list[str], name: str, n: int, *, background: bool, unit_s: float = 0.02):
    """A job that works through ``n`` units from a shared counter, yielding between units when
    it is background work and foreground work waits (what the local disk's batch jobs do)."""
    left = iter(range(n))

    def job(stop: JobControl) -> object:
        while not stop.is_set():
            if background and stop.foreground_waiting():
                return YIELD
            i = next(left, None)
            if i is None:
                return name
            time.sleep(unit_s)
            log.append(f"{name}{i}")
        return None

    return job


async def test_a_background_job_gives_its_thread_to_foreground_work_between_units() -> None:
    pool = WorkerPool(1, name="test-prio")
    log: list[str] = []
    writes = asyncio.create_task(pool.run(_units_job(log, "w", 20, background=True), background=True))
    while not log:
        await asyncio.sleep(0.005)
    read = await pool.run(_units_job(log, "r", 2, background=False))
    assert read == "r"
    assert not writes.done()
    # the read's units came right after the write unit that was running, not after all twenty
    assert log.index("r0") <= 2 and log.index("r1") == log.index("r0") + 1
    assert await writes == "w"
    assert [x for x in log if x.startswith("w")] == [f"w{i}" for i in range(20)]  # resumed where it stopped
    await pool.aclose()


async def held_pool() -> tuple[WorkerPool, threading.Event, asyncio.Task[None]]:
    """A one-thread pool whose thread is held by a job until the returned event is set."""
    pool = WorkerPool(1, name="test-prio")
    gate = threading.Event()
    first = asyncio.create_task(pool.run(lambda stop: gate.wait(5) and None))
    await asyncio.sleep(0.02)
    return pool, gate, first


async def test_foreground_jobs_start_before_queued_background_jobs() -> None:
    pool, gate, first = await held_pool()
    order: list[str] = []

    def record(stop: JobControl, name: str) -> str:
        order.append(name)
        return name

    jobs = [asyncio.create_task(pool.run(record, n, background=n.startswith("b"))) for n in ("b1", "f1", "b2", "f2")]
    await asyncio.sleep(0.02)
    gate.set()
    assert await asyncio.gather(first, *jobs) == [None, "b1", "f1", "b2", "f2"]
    assert order == ["f1", "f2", "b1", "b2"]
    await pool.aclose()


async def test_a_job_cancelled_before_it_started_never_runs() -> None:
    pool, gate, first = await held_pool()
    ran: list[str] = []
    queued = asyncio.create_task(pool.run(lambda stop: ran.append("queued")))
    await asyncio.sleep(0.02)
    queued.cancel()
    async with asyncio.timeout(1):  # returns at once: nothing of it is running
        with pytest.raises(asyncio.CancelledError):
            await queued
    gate.set()
    await first
    await pool.aclose()
    assert ran == []


async def test_a_cancelled_running_job_is_waited_for_and_errors_reach_the_caller() -> None:
    pool = WorkerPool(2, name="test-prio")
    started, finished = threading.Event(), threading.Event()

    def job(stop: JobControl) -> None:
        started.set()
        while not stop.wait(0.01):
            pass
        time.sleep(0.05)  # the job's last touch of shared memory
        finished.set()

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await pool.run(job)
    assert started.is_set() and finished.is_set()

    def fails(stop: JobControl) -> None:
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        await pool.run(fails)
    await pool.aclose()


async def test_a_detached_job_holds_neither_its_cancelled_caller_nor_the_close() -> None:
    """A ``detach`` job that never looks at ``stop`` (stuck in a system call): its cancelled
    caller returns at once, ``aclose`` returns while it runs, and its thread exits after it."""
    pool = WorkerPool(2, name="test-prio")
    started, release = threading.Event(), threading.Event()

    def stuck(stop: JobControl) -> int:
        started.set()
        release.wait(30)
        return 1

    task = asyncio.create_task(pool.run(stuck, detach=True))
    async with asyncio.timeout(10):
        while not started.is_set():
            await asyncio.sleep(0.01)
    threads = list(pool._state.threads)
    try:
        task.cancel()
        async with asyncio.timeout(2):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await pool.run(lambda stop: 7) == 7  # the other thread still serves jobs
        async with asyncio.timeout(2):
            await pool.aclose()
        assert any(t.is_alive() for t in threads)
    finally:
        release.set()
    async with asyncio.timeout(10):
        while any(t.is_alive() for t in threads):
            await asyncio.sleep(0.01)


async def test_a_closed_pool_finishes_queued_jobs_and_refuses_new_ones() -> None:
    pool = WorkerPool(1, name="test-prio")
    done: list[int] = []

    def job(stop: JobControl, i: int) -> int:
        time.sleep(0.01)
        done.append(i)
        return i

    tasks = [asyncio.create_task(pool.run(job, i, background=bool(i % 2))) for i in range(4)]
    await asyncio.sleep(0)
    await pool.aclose()
    assert sorted(await asyncio.gather(*tasks)) == [0, 1, 2, 3]
    with pytest.raises(BackendError, match="closed"):
        await pool.run(job, 9)


async def test_threads_start_as_work_arrives_up_to_the_bound() -> None:
    pool = WorkerPool(3, name="test-prio")
    gate = threading.Event()
    names: set[str] = set()

    def job(stop: JobControl) -> None:
        names.add(threading.current_thread().name)
        gate.wait(5)

    tasks = [asyncio.create_task(pool.run(job)) for _ in range(5)]
    await asyncio.sleep(0.05)
    assert len(names) == 3  # three run at once, two wait
    gate.set()
    await asyncio.gather(*tasks)
    assert all(n.startswith("test-prio_") for n in names)
    await pool.aclose()


async def test_jobs_submitted_together_run_together_whatever_threads_are_idle() -> None:
    """Eight jobs submitted at once run on eight threads, also when fewer threads exist and are
    idle (one, left by an earlier single job): each job wakes its own thread or starts one."""
    pool = WorkerPool(8, name="test-prio")
    assert await pool.run(lambda stop: 1) == 1  # one thread, now idle
    barrier = threading.Barrier(8, timeout=5)

    def job(stop: JobControl) -> int:
        return barrier.wait()  # raises BrokenBarrierError unless all eight run at once

    async with asyncio.timeout(10):
        assert sorted(await asyncio.gather(*(pool.run(job) for _ in range(8)))) == list(range(8))
    await pool.aclose()


async def test_a_waiter_cancelled_as_the_slot_is_released_raises_cancelled_and_keeps_the_count() -> None:
    limiter = PriorityLimiter(1)
    release = asyncio.Event()

    async def holder() -> None:
        async with limiter():
            await release.wait()

    async def waiter() -> None:
        async with limiter():
            pass

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    w = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    release.set()  # the holder releases in the same iteration as the waiter's cancellation
    w.cancel()
    await h
    with pytest.raises(asyncio.CancelledError):
        await w
    assert limiter.num_waiting == 0
    async with asyncio.timeout(1), limiter():  # the one slot is free
        pass


async def test_a_background_job_yielding_as_its_caller_is_cancelled_is_not_queued_again() -> None:
    """The cancelled caller waits for its running job; a job that yields then must be settled,
    not put back behind the foreground work (which would hold the caller as long)."""
    pool = WorkerPool(1, name="test-prio")
    loop = asyncio.get_running_loop()
    deciding = asyncio.Event()
    runs: list[float] = []

    def background(stop: JobControl) -> object:
        runs.append(time.monotonic())
        if stop.is_set():
            return None
        while not stop.foreground_waiting():
            time.sleep(0.001)
        loop.call_soon_threadsafe(deciding.set)
        stop.wait(5)  # the caller is cancelled while this job is about to yield
        return YIELD

    def foreground(stop: JobControl) -> str:
        time.sleep(1.0)
        return "fg"

    b = asyncio.create_task(pool.run(background, background=True))
    await asyncio.sleep(0.05)
    f = asyncio.create_task(pool.run(foreground))
    await deciding.wait()
    t0 = time.monotonic()
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    assert time.monotonic() - t0 < 0.5 and len(runs) == 1
    assert await f == "fg"
    await pool.aclose()


async def test_a_pool_dropped_without_closing_lets_its_threads_exit() -> None:
    pool = WorkerPool(3, name="test-dropped")
    assert sorted(await asyncio.gather(*(pool.run(lambda stop, i=i: i) for i in range(3)))) == [0, 1, 2]
    threads = list(pool._state.threads)
    assert threads and all(t.is_alive() for t in threads)
    del pool
    gc.collect()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
