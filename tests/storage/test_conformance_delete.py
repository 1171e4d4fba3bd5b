"""Requested deletes (``batch_delete_v2``), run against every backend (memory, local disk,
S3 on SeaweedFS): what a key names in each pool, absent objects, failures, order with puts of
the same objects, capacity, malformed calls and a closed backend."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import pytest
from storage_harness import (
    Harness,
    kv_transfer,
    make_keys,
    make_pools,
    mamba_transfer,
    slot,
)
from test_conformance import DEADLINE_S, get, hit_pages, opened, put

from asynccache.errors import BackendError, ConfigError
from asynccache.storage import DeletingBackend, PoolName
from storage_backends.base import ObjectBackend
from storage_backends.object_format import ObjectGeometry


async def delete(backend: ObjectBackend, keys: Sequence[str], *pools: PoolName) -> list[bool]:
    async with asyncio.timeout(DEADLINE_S):
        return await backend.batch_delete_v2(list(keys), list(pools))


async def stored(h: Harness, backend: ObjectBackend, pool: PoolName, keys: Sequence[str]) -> list[bool]:
    """Whether each key's object of ``pool`` is in the store (read raw, not through a backend)."""
    return [await h.raw_get(backend, backend.object_name(pool, k)) is not None for k in keys]


def gate_method(backend: ObjectBackend, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the first call of ``backend.name`` (a coroutine method) until the returned gate is
    set; the other event is set once it is held."""
    real: Callable[..., Awaitable[object]] = getattr(backend, name)
    gate, entered = asyncio.Event(), asyncio.Event()

    async def held(*args: object, **kwargs: object) -> object:
        if not entered.is_set():
            entered.set()
            await gate.wait()
        return await real(*args, **kwargs)

    setattr(backend, name, held)
    return gate, entered


async def test_a_delete_removes_each_keys_object_in_the_named_pools_only(harness: Harness) -> None:
    keys = make_keys(4, seed="del")
    backend, _, _ = await opened(harness)
    assert isinstance(backend, DeletingBackend)
    assert await put(backend, kv_transfer(keys, [0, 1, 2, 3]), mamba_transfer(keys, [0, 1, 2, 3])) == [[True] * 4] * 2
    # a key names one object per pool: the KV page of keys[0] goes, its state stays
    assert await delete(backend, keys[:1], PoolName.KV) == [True]
    assert await stored(harness, backend, PoolName.KV, keys) == [False, True, True, True]
    assert await stored(harness, backend, PoolName.MAMBA, keys) == [True] * 4
    # both pools, a key given twice, and a key never stored: each is gone
    absent = make_keys(1, seed="never")[0]
    assert await delete(backend, [keys[1], keys[1], absent], PoolName.KV, PoolName.MAMBA) == [True] * 3
    assert await stored(harness, backend, PoolName.KV, keys) == [False, False, True, True]
    assert await stored(harness, backend, PoolName.MAMBA, keys) == [True, False, True, True]
    assert await delete(backend, [], PoolName.KV) == []
    # another backend over the same store sees it: a miss, and the prefix search stops there
    reader, _, _ = await opened(harness, seed=None)
    assert await get(reader, kv_transfer(keys[:2], [0, 1]), mamba_transfer(keys[2:3], [2])) == [[False, False], [True]]
    assert await hit_pages(reader, keys[2:], kv_transfer([]), mamba_transfer([])) == 2
    stats = backend.statistics()
    assert (stats.num_deletes, stats.num_failures) == (1 + 4, 0)  # objects named, each once a call


async def test_a_deleted_key_is_written_anew(harness: Harness) -> None:
    keys = make_keys(1, seed="rewrite")
    backend, kv, _ = await opened(harness)
    assert await put(backend, kv_transfer(keys, [0])) == [[True]]
    assert await delete(backend, keys, PoolName.KV) == [True]
    assert await put(backend, kv_transfer(keys, [1])) == [[True]]
    assert await get(backend, kv_transfer(keys, [2])) == [[True]]
    assert slot(kv, 2) == slot(kv, 1) != slot(kv, 0)
    stats = backend.statistics()
    assert (stats.num_writes, stats.num_write_skips) == (2, 0)


async def test_a_delete_waits_for_a_put_of_its_object_in_flight(harness: Harness) -> None:
    """A put called before the delete lands after it otherwise (its object would survive the
    delete): the delete removes it only once that put has ended."""
    keys = make_keys(1, seed="put-then-delete")
    backend, _, _ = await opened(harness)
    await backend.batch_exists_v2([], [])  # first use done: the put goes straight to its write
    gate, entered = gate_method(backend, "_write_many")
    writing = asyncio.create_task(put(backend, kv_transfer(keys, [0])))
    async with asyncio.timeout(DEADLINE_S):
        await entered.wait()
    order: list[str] = []
    real_delete = backend._delete_objects

    async def recorded(names: list[str], *args: object, **kwargs: object) -> None:
        order.append("delete" if gate.is_set() else "delete before the put ended")
        await real_delete(names, *args, **kwargs)

    backend._delete_objects = recorded  # type: ignore[method-assign]
    deleting = asyncio.create_task(delete(backend, keys, PoolName.KV))
    for _ in range(20):  # the delete gets every chance to go first
        await asyncio.sleep(0)
    gate.set()
    assert await writing == [[True]] and await deleting == [True]
    assert order == ["delete"]
    assert await stored(harness, backend, PoolName.KV, keys) == [False]


async def test_a_put_called_while_a_delete_waits_waits_for_it(harness: Harness) -> None:
    """put A (held), delete D, put B of one key: D waits for A; B, called after D, waits for D
    and stores its own bytes — it would otherwise find A's object or store before D and lose it
    to D, reporting success for an object that is gone."""
    keys = make_keys(1, seed="put-delete-put")
    backend, kv_ab, _ = await opened(harness, seed=1)
    await backend.batch_exists_v2([], [])
    gate, entered = gate_method(backend, "_write_many")  # A's write is held, B's is not
    put_a = asyncio.create_task(put(backend, kv_transfer(keys, [0])))
    async with asyncio.timeout(DEADLINE_S):
        await entered.wait()
    deleted = asyncio.create_task(delete(backend, keys, PoolName.KV))
    await asyncio.sleep(0)
    put_b = asyncio.create_task(put(backend, kv_transfer(keys, [1])))
    for _ in range(20):  # B gets every chance to go first
        await asyncio.sleep(0)
    gate.set()
    assert await put_a == [[True]] and await deleted == [True] and await put_b == [[True]]
    reader, kv, _ = await opened(harness, seed=None)
    assert await get(reader, kv_transfer(keys, [3])) == [[True]]
    assert slot(kv, 3) == slot(kv_ab, 1) != slot(kv_ab, 0)  # B's bytes


async def test_a_failed_delete_is_false_counted_reported_and_leaves_the_object(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(2, seed="fail-delete")
    backend, _, _ = await opened(harness)
    assert await put(backend, kv_transfer(keys, [0, 1])) == [[True, True]]

    async def failing(names: list[str], *args: object, **kwargs: object) -> None:
        raise OSError("disk on fire")

    real = backend._delete_objects
    backend._delete_objects = failing  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await delete(backend, keys, PoolName.KV) == [False, False]
    assert "batch_delete_v2" in caplog.text and "disk on fire" in caplog.text
    stats = backend.statistics()
    assert (stats.num_failures, stats.num_deletes) == (1, 0)
    assert await stored(harness, backend, PoolName.KV, keys) == [True, True]
    backend._delete_objects = real  # type: ignore[method-assign]
    assert await delete(backend, keys, PoolName.KV) == [True, True]


async def test_a_delete_gives_its_room_back_to_the_capacity(harness: Harness) -> None:
    keys = make_keys(3, seed="del-cap")
    probe = harness.open()
    size = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), keys[0])
    backend, _, _ = await opened(harness, capacity_bytes=2 * size)
    assert await put(backend, kv_transfer(keys[:2], [0, 1])) == [[True, True]]
    assert await delete(backend, keys[:1], PoolName.KV) == [True]
    assert backend.statistics().used_bytes == size
    assert await put(backend, kv_transfer(keys[2:], [2])) == [[True]]
    stats = backend.statistics()
    assert (stats.num_evictions, stats.used_bytes) == (0, 2 * size)
    assert await stored(harness, backend, PoolName.KV, keys) == [False, True, True]


async def test_malformed_deletes_raise_before_any_io_and_a_closed_backend_raises(harness: Harness) -> None:
    keys = make_keys(1, seed="bad-delete")
    backend = harness.open()
    kv, _ = make_pools()
    await backend.register_host_pool_v2(PoolName.KV, kv)
    assert await put(backend, kv_transfer(keys, [0])) == [[True]]
    for bad_keys, pools, match in (
        (["../../etc"], [PoolName.KV], "invalid storage key"),
        ([keys[0].upper()], [PoolName.KV], "invalid storage key"),
        (keys, [PoolName.MAMBA], "not registered"),
        (keys, ["kv/.."], "not registered"),
        (keys, [], "names no pool"),
        (keys[0], [PoolName.KV], "must be a sequence"),
        (keys, PoolName.KV, "must be a sequence"),
    ):
        with pytest.raises(ConfigError, match=match):
            await backend.batch_delete_v2(bad_keys, pools)  # type: ignore[arg-type]
    assert await stored(harness, backend, PoolName.KV, keys) == [True]
    await backend.aclose()
    for call_keys in (keys, []):
        with pytest.raises(BackendError, match="closed"):
            await backend.batch_delete_v2(call_keys, [PoolName.KV])
    assert await stored(harness, backend, PoolName.KV, keys) == [True]


async def close_then_open(backend: ObjectBackend, gate: asyncio.Event) -> None:
    """Let the call just started register, start closing the backend, then open ``gate`` and
    wait for the close."""
    await asyncio.sleep(0)
    closing = asyncio.create_task(backend.aclose())
    await asyncio.sleep(0)
    gate.set()
    async with asyncio.timeout(DEADLINE_S):
        await closing


async def test_a_delete_waiting_for_a_put_when_the_backend_closes_raises(harness: Harness) -> None:
    keys = make_keys(1, seed="close-delete")
    backend, _, _ = await opened(harness)
    await backend.batch_exists_v2([], [])
    gate, entered = gate_method(backend, "_write_many")
    writing = asyncio.create_task(put(backend, kv_transfer(keys, [0])))
    async with asyncio.timeout(DEADLINE_S):
        await entered.wait()
    deleting = asyncio.create_task(delete(backend, keys, PoolName.KV))
    await close_then_open(backend, gate)
    assert writing.done() and deleting.done()
    with pytest.raises(BackendError, match="closed"):
        deleting.result()


async def test_a_put_waiting_for_a_delete_when_the_backend_closes_is_skipped_writes(harness: Harness) -> None:
    """A call in flight at the close starts no more items: its writes are skipped (``False``),
    as ``aclose`` says, not a ``BackendError``."""
    keys = make_keys(2, seed="close-put")
    backend, _, _ = await opened(harness)
    assert await put(backend, kv_transfer(keys, [0, 1])) == [[True, True]]
    gate, entered = gate_method(backend, "_delete_objects")
    deleting = asyncio.create_task(delete(backend, keys, PoolName.KV))
    async with asyncio.timeout(DEADLINE_S):
        await entered.wait()
    writing = asyncio.create_task(put(backend, kv_transfer(keys, [2, 3])))  # waits for the delete
    await close_then_open(backend, gate)
    assert deleting.result() == [True, True]
    assert writing.result() == [[False, False]]
    assert backend.statistics().num_failures == 2
