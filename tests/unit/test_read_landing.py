"""A read's landing time as its backends report it (``asynccache.read_landing``)."""

from __future__ import annotations

import asyncio

from asynccache.read_landing import ReadLanding, note_landed


def test_a_report_outside_a_read_is_dropped() -> None:
    note_landed(1.0)  # no read observed: nothing to do, nothing raised
    landing = ReadLanding()
    assert landing.at is None and landing.at_or(5.0) == 5.0


def test_the_latest_report_counts_and_never_after_the_callers_clock() -> None:
    landing = ReadLanding()
    with landing.observing():
        note_landed(2.0)
        note_landed(3.0)
        note_landed(1.0)  # an earlier chunk's report, taken later
    note_landed(9.0)  # after the block: not this read's
    assert landing.at == 3.0
    assert landing.at_or(4.0) == 3.0 and landing.at_or(2.5) == 2.5


def test_observing_nests_and_restores_the_outer_read() -> None:
    outer, inner = ReadLanding(), ReadLanding()
    with outer.observing():
        with inner.observing():
            note_landed(1.0)
        note_landed(2.0)
    assert inner.at == 1.0 and outer.at == 2.0


async def test_tasks_a_backend_starts_inside_the_read_report_to_it() -> None:
    """The reports of a backend's own tasks (one per reader, say) reach the caller's landing;
    concurrent reads keep theirs apart."""

    async def backend_read(t: float) -> None:
        async with asyncio.TaskGroup() as tg:
            for k in range(3):
                tg.create_task(report_later(t + k))

    async def report_later(t: float) -> None:
        await asyncio.sleep(0)
        note_landed(t)

    async def caller(t: float) -> float | None:
        landing = ReadLanding()
        with landing.observing():
            await backend_read(t)
        return landing.at

    assert await asyncio.gather(caller(10.0), caller(20.0)) == [12.0, 22.0]
