"""Invalid objects a read or a probe removes, run against every backend (memory, local disk,
S3 on SeaweedFS): a put of the same object that lands while the read looks is kept."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
from storage_harness import Harness, kv_transfer, make_keys, slot
from test_conformance import get, hit_pages, opened, put

from asynccache.storage import PoolName
from storage_backends.base import ObjectBackend


def hold_after(backend: ObjectBackend, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the first call of ``backend.name`` (a coroutine method) after it returns, until
    the returned gate is set; the other event is set once it is held."""
    real: Callable[..., Awaitable[object]] = getattr(backend, name)
    gate, held = asyncio.Event(), asyncio.Event()

    async def late(*args: object, **kwargs: object) -> object:
        result = await real(*args, **kwargs)
        if not held.is_set():
            held.set()
            await gate.wait()
        return result

    setattr(backend, name, late)
    return gate, held


@pytest.mark.parametrize("via", ["get", "exists"])
async def test_a_put_that_lands_while_a_read_finds_the_old_object_invalid_is_kept(
    harness: Harness, via: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asynccache.storage")  # the invalid object's warning
    keys = make_keys(1, seed=f"torn-{via}")
    backend, kv, _ = await opened(harness)
    name = backend.object_name(PoolName.KV, keys[0])
    await harness.raw_put(backend, name, b"torn")  # a short object: invalid
    gate, held = hold_after(backend, "_read_many" if via == "get" else "_object_sizes")
    if via == "get":
        reader: asyncio.Task[object] = asyncio.create_task(get(backend, kv_transfer(keys, [1])))
    else:
        reader = asyncio.create_task(hit_pages(backend, keys, kv_transfer([])))
    await held.wait()  # the read has looked: the object it found is invalid
    assert await put(backend, kv_transfer(keys, [0])) == [[True]]
    gate.set()
    assert await reader in ([[False]], 0)
    # the put's object is stored, and served
    assert await harness.raw_get(backend, name) not in (None, b"torn")
    assert await get(backend, kv_transfer(keys, [2])) == [[True]]
    assert slot(kv, 2) == slot(kv, 0)
    assert backend.statistics().num_corrupt == 1
    # with no put beside it, a read removes the invalid object
    await harness.raw_put(backend, name, b"torn")
    assert await get(backend, kv_transfer(keys, [3])) == [[False]]
    assert await harness.raw_get(backend, name) is None
    assert not backend._put_at and not backend._checks  # nothing kept once no read is in flight
    assert await put(backend, kv_transfer(make_keys(1, seed=f"later-{via}"), [1])) == [[True]]
    assert not backend._put_at  # a put with no read in flight records nothing
    await backend.aclose()
