"""One conformance suite, run against every backend (memory, local disk, S3 on SeaweedFS)."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import zlib
from collections.abc import Callable

import pytest
import torch
from storage_harness import (
    NAMESPACE,
    OTHER_NAMESPACE,
    SPEC,
    Harness,
    kv_transfer,
    make_keys,
    make_pools,
    mamba_transfer,
    slot,
)

from asynccache.errors import BackendError, ConfigError
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer, longest_hit
from storage_backends.base import ObjectBackend
from storage_backends.local_disk import LocalDiskBackend
from storage_backends.object_format import FORMAT_VERSION, ObjectGeometry

DEADLINE_S = 30


async def opened(h: Harness, *, layout: str = "page_first", seed: int | None = 0, **options: object):
    backend = h.open(**options)
    kv, mamba = make_pools(layout=layout, seed=seed, shared=h.shared_pools)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    return backend, kv, mamba


async def put(backend: ObjectBackend, *transfers: PoolTransfer) -> list[list[bool]]:
    async with asyncio.timeout(DEADLINE_S):
        return await backend.batch_set_v2(list(transfers))


async def get(backend: ObjectBackend, *transfers: PoolTransfer) -> list[list[bool]]:
    async with asyncio.timeout(DEADLINE_S):
        return await backend.batch_get_v2(list(transfers))


async def hit_pages(backend: ObjectBackend, keys: list[str], *transfers: PoolTransfer) -> int:
    async with asyncio.timeout(DEADLINE_S):
        return (await backend.batch_exists_v2(keys, list(transfers))).num_hit_pages


# ---- round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("src_layout,dst_layout", [("page_first", "page_first"), ("page_first", "layer_first"),
                                                   ("layer_first", "page_first"), ("layer_first", "layer_first")])
async def test_roundtrip_both_pools_any_layout(harness: Harness, src_layout: str, dst_layout: str) -> None:
    keys = make_keys(4)
    writer, kv, mamba = await opened(harness, layout=src_layout, seed=1)
    assert await put(writer, kv_transfer(keys, [0, 1, 2, 3]), mamba_transfer([keys[1], keys[3]], [5, 6])) == [
        [True] * 4, [True, True]]
    reader, kv2, mamba2 = await opened(harness, layout=dst_layout, seed=None)
    assert await get(reader, kv_transfer(keys, [7, 6, 5, 4]), mamba_transfer([keys[1], keys[3]], [0, 1])) == [
        [True] * 4, [True, True]]
    for src, dst in zip([0, 1, 2, 3], [7, 6, 5, 4]):
        assert slot(kv2, dst) == slot(kv, src)
    assert slot(mamba2, 0) == slot(mamba, 5) and slot(mamba2, 1) == slot(mamba, 6)
    assert slot(kv2, 0) == bytes([0xAB]) * SPEC.kv_page_bytes  # untouched
    stats = reader.statistics()
    assert stats.num_hits == 6 and stats.num_misses == 0
    assert stats.bytes_read == 4 * SPEC.kv_page_bytes + 2 * SPEC.state_bytes
    assert writer.statistics().bytes_written == stats.bytes_read
    assert writer.statistics().num_writes == 6


async def test_state_and_page_of_one_key_are_separate_objects(harness: Harness) -> None:
    keys = make_keys(1)
    backend, _kv, _mamba = await opened(harness)
    await put(backend, kv_transfer(keys, [0]))
    assert await get(backend, mamba_transfer(keys, [3])) == [[False]]
    assert await hit_pages(backend, keys, kv_transfer(keys), mamba_transfer(keys)) == 0
    assert backend.object_name(PoolName.KV, keys[0]) != backend.object_name(PoolName.MAMBA, keys[0])


async def test_missing_keys_are_misses_and_leave_slots_untouched(harness: Harness) -> None:
    keys = make_keys(3, seed="absent")
    backend, kv, mamba = await opened(harness, seed=None)
    assert await get(backend, kv_transfer(keys, [0, 1, 2]), mamba_transfer(keys[:1], [0])) == [[False] * 3, [False]]
    assert slot(kv, 0) == bytes([0xAB]) * SPEC.kv_page_bytes
    assert slot(mamba, 0) == bytes([0xAB]) * SPEC.state_bytes
    stats = backend.statistics()
    assert (stats.num_misses, stats.num_hits, stats.num_corrupt, stats.num_failures) == (4, 0, 0, 0)
    assert await hit_pages(backend, keys, kv_transfer(keys)) == 0
    assert await get(backend, kv_transfer([], [])) == [[]]


# ---- exists and hit policies -----------------------------------------------------------------
async def test_exists_honours_every_policy(harness: Harness) -> None:
    keys = make_keys(12, seed="prefix")
    backend, _kv, _mamba = await opened(harness)
    kv_present = [0, 1, 2, 3, 4, 5, 6, 7]  # key 8.. absent
    state_present = [1, 3, 4, 9]
    await put(backend, kv_transfer([keys[i] for i in kv_present], kv_present),
              mamba_transfer([keys[i] for i in state_present], [0, 1, 2, 3]))
    truth = {PoolName.KV: [i in kv_present for i in range(12)], PoolName.MAMBA: [i in state_present for i in range(12)]}

    def expect(*transfers: PoolTransfer) -> int:
        return longest_hit(len(keys), transfers, truth)

    cases = [
        (kv_transfer(keys),),
        (mamba_transfer(keys),),
        (kv_transfer(keys), mamba_transfer(keys)),
        (kv_transfer(keys), mamba_transfer(keys, num_trailing=2)),
        (kv_transfer(keys), mamba_transfer(keys, num_trailing=3)),
    ]
    answers = [8, 10, 5, 5, 0]
    for transfers, answer in zip(cases, answers, strict=True):
        assert expect(*transfers) == answer
        result = await backend.batch_exists_v2(keys, list(transfers))
        assert result.num_hit_pages == answer, transfers
        for t in transfers:
            flags = result.exists[t.pool_name]
            assert len(flags) == len(keys)
            assert all(truth[t.pool_name][i] for i, f in enumerate(flags) if f)  # never claims a missing one
    # The enums' plain values mean what the members mean (not "no policy": every key a hit);
    # anything else is refused.
    plain = [PoolTransfer(pool_name="kv", keys=tuple(keys), hit_policy="all_pages"),
             PoolTransfer(pool_name="mamba", keys=tuple(keys), hit_policy="trailing_pages")]  # fmt: skip
    assert [t.hit_policy for t in plain] == [PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES]
    assert (await backend.batch_exists_v2(keys, plain)).num_hit_pages == answers[2]
    for bad in ({"hit_policy": "some_pages"}, {"pool_name": "ssm"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            PoolTransfer(**{"pool_name": PoolName.KV, "keys": tuple(keys), **bad})
    # a hole in the KV prefix cuts the hit at the hole, then back to the deepest state
    await harness.raw_put(backend, backend.object_name(PoolName.KV, keys[2]), b"")
    assert await hit_pages(backend, keys, kv_transfer(keys), mamba_transfer(keys)) == 2
    assert await hit_pages(backend, keys[:0], kv_transfer([]), mamba_transfer([])) == 0


async def test_exists_probes_long_prefixes_in_windows(harness: Harness) -> None:
    keys = make_keys(300, seed="long")
    backend, _kv, mamba = await opened(harness)
    kv_big, _ = make_pools(num_items=300)
    backend2 = harness.open()
    await backend2.register_host_pool_v2(PoolName.KV, kv_big)
    await backend2.register_host_pool_v2(PoolName.MAMBA, mamba)
    await put(backend2, kv_transfer(keys[:290], range(290)), mamba_transfer([keys[40]], [0]))
    assert await hit_pages(backend, keys, kv_transfer(keys)) == 290
    assert await hit_pages(backend, keys, kv_transfer(keys), mamba_transfer(keys)) == 41
    # A prefix stored whole has its state at its end: that key alone is looked up for it.
    await put(backend2, mamba_transfer([keys[289]], [1]))
    probed: list[int] = []
    real = backend._object_sizes

    async def counted(names: list[str]) -> list[int | None]:
        probed.append(len(names))
        return await real(names)

    backend._object_sizes = counted  # type: ignore[method-assign]
    assert await hit_pages(backend, keys, kv_transfer(keys), mamba_transfer(keys)) == 290
    assert sum(probed) == 300 + 1 and probed[-1] == 1  # the KV windows (to the one with the miss), then one


# ---- writes ----------------------------------------------------------------------------------
async def test_put_if_absent_keeps_the_first_object(harness: Harness) -> None:
    keys = make_keys(1)
    backend, kv, _mamba = await opened(harness)
    assert await put(backend, kv_transfer(keys, [0])) == [[True]]
    assert await put(backend, kv_transfer(keys, [1])) == [[True]]  # present: success, not rewritten
    assert await get(backend, kv_transfer(keys, [2])) == [[True]]
    assert slot(kv, 2) == slot(kv, 0) != slot(kv, 1)
    stats = backend.statistics()
    assert (stats.num_writes, stats.num_write_skips) == (1, 1)


async def test_concurrent_writers_of_one_key(harness: Harness) -> None:
    keys = make_keys(1, seed="race")
    writers = [await opened(harness, seed=s) for s in (11, 12)]
    calls = [put(b, kv_transfer(keys, [i]), mamba_transfer(keys, [i])) for b, _, _ in writers for i in range(6)]
    async with asyncio.timeout(DEADLINE_S):
        results = await asyncio.gather(*calls)
    assert all(r == [[True], [True]] for r in results)
    reader, kv, mamba = await opened(harness, seed=None)
    assert await get(reader, kv_transfer(keys, [7]), mamba_transfer(keys, [7])) == [[True], [True]]
    assert slot(kv, 7) in [slot(k, i) for _, k, _ in writers for i in range(6)]
    assert slot(mamba, 7) in [slot(m, i) for _, _, m in writers for i in range(6)]
    assert sum(b.statistics().num_writes for b, _, _ in writers) == 2  # one KV page, one state


def delay_method(obj: object, name: str, delay_s: float, started: list[int], *, blocking: bool) -> None:
    """Make ``obj.name`` take ``delay_s`` longer: a sleep in its worker thread (``blocking``) or
    on the event loop; ``started`` grows by one as each call starts."""
    method = getattr(obj, name)
    if blocking:

        def slowed(*args: object, **kwargs: object) -> object:
            started.append(1)
            time.sleep(delay_s)
            return method(*args, **kwargs)

    else:

        async def slowed(*args: object, **kwargs: object) -> object:  # type: ignore[misc]
            started.append(1)
            await asyncio.sleep(delay_s)
            return await method(*args, **kwargs)

    setattr(obj, name, slowed)


def slow_writes(backend: ObjectBackend, delay_s: float) -> list[int]:
    """Make every object write of ``backend`` take ``delay_s`` longer (a slow disk or bucket);
    the returned list grows by one as each write starts."""
    started: list[int] = []
    if isinstance(backend, LocalDiskBackend):
        delay_method(backend, "_write_file", delay_s, started, blocking=True)
    else:
        delay_method(backend, "_write_object", delay_s, started, blocking=False)
    return started


async def test_reads_and_probes_do_not_wait_behind_a_write_back(harness: Harness) -> None:
    """A request's lookup and load go before the write-back of earlier requests: with every
    slot taken by a long write batch, a probe and a read complete while the batch still runs."""
    backend = harness.open(max_concurrency=2)
    kv, mamba = make_pools(24, seed=5, shared=harness.shared_pools)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    stored = make_keys(2, seed="stored")
    assert await put(backend, kv_transfer(stored, [0, 1]), mamba_transfer(stored[1:], [0])) == [[True, True], [True]]
    started = slow_writes(backend, 0.05)
    pending = make_keys(20, seed="write-back")  # 20 objects, 2 at a time: at least 0.5 s
    write_back = asyncio.create_task(put(backend, kv_transfer(pending, range(2, 22))))
    while len(started) < 2:  # the write-back holds both slots
        await asyncio.sleep(0.005)
    kv_all = PoolTransfer(pool_name=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert await hit_pages(backend, stored, kv_all) == 2
    assert await get(backend, kv_transfer(stored, [22, 23]), mamba_transfer(stored[1:], [1])) == [[True, True], [True]]
    assert not write_back.done()
    assert slot(kv, 22) == slot(kv, 0) and slot(kv, 23) == slot(kv, 1) and slot(mamba, 1) == slot(mamba, 0)
    assert await write_back == [[True] * 20]
    reader, kv2, _ = await opened(harness, seed=None)
    assert await get(reader, kv_transfer(pending[-2:], [0, 1])) == [[True, True]]
    assert slot(kv2, 0) == slot(kv, 20) and slot(kv2, 1) == slot(kv, 21)


async def test_large_objects(harness: Harness) -> None:
    layers, item = 2, 6 << 20  # 12 MiB objects: multipart on S3 (threshold lowered below)
    options = {"multipart_threshold_bytes": 8 << 20, "multipart_part_bytes": 5 << 20} if harness.kind == "s3" else {}
    keys = make_keys(2, seed="large")
    pools = []
    for layout in ("page_first", "layer_first"):
        pool = ItemPool(name=f"big_{layout}", layer_ids=tuple(range(layers)), num_items=3, item_bytes=item,
                        layout=layout, pin=False)
        assert pool.buffer is not None
        pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
        backend = harness.open(**options)
        await backend.register_host_pool_v2(PoolName.KV, pool)
        pools.append((backend, pool))
    (b1, p1), (b2, p2) = pools
    async with asyncio.timeout(DEADLINE_S):
        first = await asyncio.gather(put(b1, kv_transfer(keys, [0, 1])), put(b2, kv_transfer(keys[:1], [2])))
    assert first == [[[True, True]], [[True]]]
    assert await get(b2, kv_transfer(keys, [0, 1])) == [[True, True]]
    assert slot(p2, 1) == slot(p1, 1)
    assert slot(p2, 0) in (slot(p1, 0), slot(p2, 2))  # one writer's object, whole
    assert await hit_pages(b1, keys, kv_transfer(keys)) == 2
    assert b2.statistics().bytes_read == 2 * layers * item


# ---- invalid objects: never loaded, counted, removed -------------------------------------------
def _rewrite_header(data: bytes, **fields: int) -> bytes:
    out = bytearray(data)
    if "version" in fields:
        struct.pack_into("<H", out, 4, fields["version"])
    hlen = struct.unpack_from("<H", out, 6)[0]
    struct.pack_into("<I", out, 24, 0)
    struct.pack_into("<I", out, 24, zlib.crc32(out[:hlen]))
    return bytes(out)


DAMAGE = {
    "flip_payload_byte": lambda d, other: d[:-100] + bytes([d[-100] ^ 0x01]) + d[-99:],
    "flip_header_byte": lambda d, other: d[:70] + bytes([d[70] ^ 0x40]) + d[71:],
    "flip_checksum": lambda d, other: d[:16] + bytes([d[16] ^ 0xFF]) + d[17:],
    "cut_one_byte": lambda d, other: d[:-1],
    "cut_half": lambda d, other: d[: len(d) // 2],
    "header_only": lambda d, other: d[:64],
    "empty": lambda d, other: b"",
    "extra_bytes": lambda d, other: d + b"\0\0",
    "garbage_same_size": lambda d, other: bytes(len(d)),
    "another_models_object": lambda d, other: other,
    "newer_format_version": lambda d, other: _rewrite_header(d, version=FORMAT_VERSION + 1),
    "older_format_version": lambda d, other: _rewrite_header(d, version=FORMAT_VERSION - 1),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_invalid_objects_are_misses_and_removed(harness: Harness, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    keys = make_keys(2, seed="damage")
    backend, kv, _mamba = await opened(harness, seed=3)
    foreign, _fkv, _ = await opened(harness, namespace=OTHER_NAMESPACE, seed=4)
    await put(backend, kv_transfer(keys, [0, 1]))
    await put(foreign, kv_transfer(keys[:1], [0]))
    name = backend.object_name(PoolName.KV, keys[0])
    good = await harness.raw_get(backend, name)
    other = await harness.raw_get(foreign, foreign.object_name(PoolName.KV, keys[0]))
    assert good is not None and other is not None and len(good) == len(other) and good != other
    await harness.raw_put(backend, name, DAMAGE[damage](good, other))

    reader, kv2, _ = await opened(harness, seed=None)
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await get(reader, kv_transfer(keys, [0, 1])) == [[False, True]]
    assert slot(kv2, 1) == slot(kv, 1)
    stats = reader.statistics()
    assert (stats.num_corrupt, stats.num_hits, stats.num_misses) == (1, 1, 1)
    assert await harness.raw_get(backend, name) is None  # removed
    assert "invalid objects" in caplog.text
    assert await hit_pages(reader, keys, kv_transfer(keys)) == 0
    # the key can be stored again
    assert await put(backend, kv_transfer(keys[:1], [0])) == [[True]]
    assert await get(reader, kv_transfer(keys[:1], [3])) == [[True]] and slot(kv2, 3) == slot(kv, 0)


async def test_an_invalid_object_read_into_two_slots_is_two_misses_and_removed_once(harness: Harness) -> None:
    """A batch may read one object into several slots: an invalid one is a miss in each, is
    removed once, and the key can be written again at once (no write waits on the removal)."""
    keys = make_keys(1, seed="twice")
    backend, kv, _ = await opened(harness, seed=6)
    await put(backend, kv_transfer(keys, [0]))
    name = backend.object_name(PoolName.KV, keys[0])
    good = await harness.raw_get(backend, name)
    assert good is not None
    await harness.raw_put(backend, name, DAMAGE["flip_payload_byte"](good, b""))
    assert await get(backend, kv_transfer(keys * 2, [1, 2])) == [[False, False]]
    assert backend.statistics().num_corrupt == 2
    assert await harness.raw_get(backend, name) is None
    assert await put(backend, kv_transfer(keys, [0])) == [[True]]
    assert await get(backend, kv_transfer(keys, [3])) == [[True]] and slot(kv, 3) == slot(kv, 0)


async def test_object_under_another_key_is_a_miss(harness: Harness) -> None:
    keys = make_keys(2, seed="swap")
    backend, _kv, _ = await opened(harness)
    await put(backend, kv_transfer(keys[:1], [0]))
    data = await harness.raw_get(backend, backend.object_name(PoolName.KV, keys[0]))
    assert data is not None
    await harness.raw_put(backend, backend.object_name(PoolName.KV, keys[1]), data)
    assert await hit_pages(backend, keys[1:], kv_transfer(keys[1:])) == 1  # same size: only a read can tell
    assert await get(backend, kv_transfer(keys[1:], [1])) == [[False]]
    assert backend.statistics().num_corrupt == 1


async def test_wrongly_sized_objects_are_removed_at_exists(harness: Harness) -> None:
    keys = make_keys(3, seed="sized")
    backend, _kv, _ = await opened(harness)
    await put(backend, kv_transfer(keys, [0, 1, 2]))
    name = backend.object_name(PoolName.KV, keys[1])
    data = await harness.raw_get(backend, name)
    assert data is not None
    # longer than any valid object (a compressed object's size varies below that bound)
    await harness.raw_put(backend, name, data + bytes(10))
    assert await hit_pages(backend, keys, kv_transfer(keys)) == 1
    assert await harness.raw_get(backend, name) is None
    assert backend.statistics().num_corrupt == 1


@pytest.mark.parametrize("damage", ["empty", "truncated", "extended"])
async def test_a_write_replaces_an_object_of_a_size_no_valid_object_has(harness: Harness, damage: str) -> None:
    """An object under the key's name whose size no valid object of the key has (a power loss
    after an un-fsynced link leaves an empty or short file) is not "already present": the write
    replaces it. A success means a valid object is stored: the tier marks the node archived on
    it and may then drop the only other copy."""
    keys = make_keys(1, seed=f"resize-{damage}")
    backend, kv, _ = await opened(harness, seed=5)
    await put(backend, kv_transfer(keys, [0]))
    name = backend.object_name(PoolName.KV, keys[0])
    good = await harness.raw_get(backend, name)
    assert good is not None
    bad = {"empty": b"", "truncated": good[: len(good) // 2], "extended": good + bytes(len(good))}[damage]
    await harness.raw_put(backend, name, bad)
    assert await put(backend, kv_transfer(keys, [0])) == [[True]]
    reader, kv2, _ = await opened(harness, seed=None)
    assert await get(reader, kv_transfer(keys, [1])) == [[True]]
    assert slot(kv2, 1) == slot(kv, 0)
    assert reader.statistics().num_corrupt == 0


# ---- capacity ----------------------------------------------------------------------------------
async def test_capacity_limit_evicts_least_recently_used(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    keys = make_keys(5, seed="cap")
    probe = harness.open()
    size = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), keys[0])
    backend, _kv, _mamba = await opened(harness, capacity_bytes=3 * size)
    for i in range(3):
        assert await put(backend, kv_transfer(keys[i : i + 1], [i])) == [[True]]
    assert await get(backend, kv_transfer(keys[:1], [7])) == [[True]]  # key 0 is now the most recent
    assert await put(backend, kv_transfer(keys[3:5], [3, 4])) == [[True, True]]
    present = [await harness.raw_get(backend, backend.object_name(PoolName.KV, k)) is not None for k in keys]
    assert present == [True, False, False, True, True]
    stats = backend.statistics()
    assert stats.num_evictions == 2 and stats.used_bytes == 3 * size and stats.capacity_bytes == 3 * size
    # an object larger than the whole capacity is refused, with a warning and a counter
    tiny, _, _ = await opened(harness, capacity_bytes=size - 1)
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await put(tiny, kv_transfer(keys[1:2], [1])) == [[False]]
    assert tiny.statistics().num_rejected == 1 and "no room" in caplog.text
    # a new backend over the same store finds what is there
    again, _, _ = await opened(harness, capacity_bytes=3 * size)
    assert await hit_pages(again, keys, kv_transfer(keys)) == 1
    assert again.statistics().used_bytes == 3 * size


async def test_a_read_that_found_an_object_absent_while_a_write_stored_it_keeps_it_counted(harness: Harness) -> None:
    """A read finds a key absent; before its answer is taken, a write stores the key. The miss
    must not take the stored object out of the capacity index: the store would then outgrow
    the capacity (nothing counts or evicts that object again)."""
    keys = make_keys(3, seed="absent-race")
    probe = harness.open()
    size = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), keys[0])
    backend, _kv, _ = await opened(harness, capacity_bytes=2 * size)
    read_many = backend._read_many
    found, gate = asyncio.Event(), asyncio.Event()

    async def answer_late(items: list) -> list:  # the read's outcomes, taken late
        outcomes = await read_many(items)
        found.set()
        await gate.wait()
        return outcomes

    backend._read_many = answer_late  # type: ignore[method-assign]
    reader = asyncio.create_task(get(backend, kv_transfer(keys[:1], [5])))
    await asyncio.wait_for(found.wait(), DEADLINE_S)
    backend._read_many = read_many  # type: ignore[method-assign]
    assert await put(backend, kv_transfer(keys[:1], [0])) == [[True]]
    gate.set()
    assert await reader == [[False]]  # absent when it looked
    assert backend.statistics().used_bytes == size  # still counted
    assert await put(backend, kv_transfer(keys[1:3], [1, 2])) == [[True, True]]
    present = [await harness.raw_get(backend, backend.object_name(PoolName.KV, k)) is not None for k in keys]
    assert present == [False, True, True]  # the first object was counted, and evicted
    stats = backend.statistics()
    assert stats.used_bytes == 2 * size and stats.num_evictions == 1


async def test_a_stored_object_put_again_under_a_full_capacity_stays_and_evicts_nothing(harness: Harness) -> None:
    """Put-if-absent holds at capacity too: the object is found, not evicted to make room for
    itself, and no other object goes — also while a reader holds it."""
    keys = make_keys(3, seed="reput")
    probe = harness.open()
    size = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), keys[0])
    backend, kv, _ = await opened(harness, capacity_bytes=3 * size)
    assert await put(backend, kv_transfer(keys, [0, 1, 2])) == [[True, True, True]]
    assert await put(backend, kv_transfer(keys[2:], [5])) == [[True]]  # other bytes, same key
    assert await get(backend, kv_transfer(keys, [3, 4, 6])) == [[True, True, True]]
    assert [slot(kv, i) for i in (3, 4, 6)] == [slot(kv, i) for i in (0, 1, 2)]
    stats = backend.statistics()
    assert stats.num_evictions == 0 and stats.num_write_skips == 1 and stats.used_bytes == 3 * size
    # The same while a read of it is in flight (it is busy, so it could not be a victim).
    reading = asyncio.create_task(get(backend, kv_transfer(keys[:1], [7])))
    await asyncio.sleep(0)
    assert await put(backend, kv_transfer(keys[:1], [5])) == [[True]]
    assert await reading == [[True]] and slot(kv, 7) == slot(kv, 0)
    assert backend.statistics().num_rejected == 0 and backend.statistics().num_evictions == 0


async def test_a_cancelled_put_leaves_the_capacity_usable(harness: Harness) -> None:
    """A put cut short by its caller's timeout settles its reservation: the bytes it may have
    stored are counted (never under the disk), and later puts still find room by eviction."""
    keys = make_keys(3, seed="cancelput")
    probe = harness.open()
    size = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), keys[0])
    backend, kv, _ = await opened(harness, capacity_bytes=2 * size)
    real = backend._write_many
    gate = asyncio.Event()

    async def stuck(items):  # the writes land, then the call waits on: its caller gives up
        out = await real(items)
        await gate.wait()
        return out

    backend._write_many = stuck  # type: ignore[method-assign]
    for key in keys[:2]:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await backend.batch_set_v2([kv_transfer([key], [0])])
    backend._write_many = real  # type: ignore[method-assign]
    assert backend.statistics().used_bytes == 2 * size  # both landed and are counted
    assert await put(backend, kv_transfer(keys[2:], [1])) == [[True]]  # room by eviction
    stats = backend.statistics()
    assert stats.num_rejected == 0 and stats.num_evictions == 1 and stats.used_bytes == 2 * size
    assert await get(backend, kv_transfer(keys[2:], [7])) == [[True]] and slot(kv, 7) == slot(kv, 1)


def spec_transfer(keys: list[str], indices: list[int]) -> PoolTransfer:
    """A speculative KV write (storage-only snapshots are written so)."""
    return PoolTransfer(pool_name=PoolName.KV, keys=tuple(keys), host_indices=torch.tensor(indices), speculative=True)


async def kv_object_bytes(h: Harness, key: str) -> int:
    return h.open().codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), key)


async def test_speculative_objects_only_fill_free_room(harness: Harness) -> None:
    """A speculative write takes free room or a speculative object's, never a regular object's:
    without such room it is skipped (counted, not reported as a failure); a regular write that
    needs room evicts speculative objects first, however recent."""
    keys = make_keys(6, seed="spec")
    size = await kv_object_bytes(harness, keys[0])
    backend, _, _ = await opened(harness, capacity_bytes=3 * size)
    assert await put(backend, kv_transfer(keys[:2], [0, 1])) == [[True, True]]
    assert await put(backend, spec_transfer(keys[2:3], [2])) == [[True]]  # the free room
    assert await put(backend, spec_transfer(keys[3:4], [3])) == [[True]]  # the older speculative one's
    assert await put(backend, kv_transfer(keys[:1], [0])) == [[True]]  # key 0 refreshed: key 1 is the LRU
    present = [await harness.raw_get(backend, backend.object_name(PoolName.KV, k)) is not None for k in keys]
    assert present == [True, True, False, True, False, False]
    stats = backend.statistics()
    assert (stats.num_evictions, stats.num_speculative_skipped, stats.used_bytes) == (1, 0, 3 * size)
    # Full of regular objects but for one speculative: a regular write evicts it, not key 1.
    assert await put(backend, kv_transfer(keys[4:5], [4])) == [[True]]
    present = [await harness.raw_get(backend, backend.object_name(PoolName.KV, k)) is not None for k in keys]
    assert present == [True, True, False, False, True, False]
    # Only regular objects left: a speculative write finds no room and displaces nothing.
    assert await put(backend, spec_transfer(keys[5:6], [5])) == [[False]]
    stats = backend.statistics()
    assert (stats.num_evictions, stats.num_speculative_skipped, stats.num_rejected) == (2, 1, 0)
    assert await hit_pages(backend, keys[:2], kv_transfer(keys[:2])) == 2


@pytest.mark.parametrize("how", ["read", "regular-write"])
async def test_a_speculative_object_read_or_written_again_becomes_regular(harness: Harness, how: str) -> None:
    keys = make_keys(4, seed="promote-" + how)
    size = await kv_object_bytes(harness, keys[0])
    backend, kv, _ = await opened(harness, capacity_bytes=3 * size)
    assert await put(backend, spec_transfer(keys[:1], [0])) == [[True]]
    assert await put(backend, kv_transfer(keys[1:3], [1, 2])) == [[True, True]]
    if how == "read":
        assert await get(backend, kv_transfer(keys[:1], [7])) == [[True]] and slot(kv, 7) == slot(kv, 0)
    else:
        assert await put(backend, kv_transfer(keys[:1], [0])) == [[True]]  # put-if-absent: found
    # Now the most recent regular object: the next write evicts key 1, the LRU regular one.
    assert await put(backend, kv_transfer(keys[3:4], [3])) == [[True]]
    present = [await harness.raw_get(backend, backend.object_name(PoolName.KV, k)) is not None for k in keys]
    assert present == [True, False, True, True]
    # A speculative write of a regular object leaves it regular (and finds it).
    assert await put(backend, spec_transfer(keys[2:3], [2])) == [[True]]
    assert await put(backend, kv_transfer(keys[1:2], [1])) == [[True]]  # the LRU goes: key 0
    present = [await harness.raw_get(backend, backend.object_name(PoolName.KV, k)) is not None for k in keys]
    assert present == [False, True, True, True]


async def test_without_a_capacity_a_speculative_write_is_a_write(harness: Harness) -> None:
    keys = make_keys(2, seed="nocap")
    backend, kv, _ = await opened(harness)
    assert await put(backend, spec_transfer(keys, [0, 1])) == [[True, True]]
    assert await get(backend, kv_transfer(keys, [4, 5])) == [[True, True]] and slot(kv, 5) == slot(kv, 1)
    assert backend.statistics().num_writes == 2


# ---- misuse raises before any I/O ----------------------------------------------------------------
TRAVERSAL_KEYS = ["../../../../etc/passwd", "ab/../../cd", "/etc/passwd", "..", "", ".", "a" * 7,
                  "ABCDEF0123456789", "0123456789abcdef/", "0123456789abcdef\0", "0123456789abcdeg",
                  "../" + "0" * 16, "0" * 129, "%2e%2e%2f00000000"]


@pytest.mark.parametrize("key", TRAVERSAL_KEYS)
async def test_keys_that_attempt_path_traversal_are_refused(harness: Harness, key: str) -> None:
    backend, _kv, _ = await opened(harness)
    before = await harness.raw_names()
    for call in (put(backend, kv_transfer([key], [0])), get(backend, kv_transfer([key], [0])),
                 backend.batch_exists_v2([key], [kv_transfer([])])):
        with pytest.raises(ConfigError, match="invalid storage key"):
            await call
    with pytest.raises(ConfigError):
        backend.object_name(PoolName.KV, key)
    with pytest.raises(ConfigError):
        backend.object_name("../kv", "0" * 16)
    assert await harness.raw_names() == before
    assert backend.statistics().num_failures == 0


async def test_malformed_calls_raise(harness: Harness) -> None:
    keys = make_keys(2)
    backend = harness.open()
    with pytest.raises(ConfigError, match="not registered"):
        await backend.batch_get_v2([kv_transfer(keys, [0, 1])])
    backend, _kv, mamba = await opened(harness)
    with pytest.raises(ConfigError, match="host indices"):
        await backend.batch_set_v2([kv_transfer(keys, [0])])
    with pytest.raises(ConfigError, match="outside pool"):
        await backend.batch_set_v2([kv_transfer(keys, [0, 99])])
    with pytest.raises(ConfigError, match="one host slot"):
        await backend.batch_get_v2([kv_transfer(keys, [1, 1])])
    with pytest.raises(ConfigError, match="already registered"):
        await backend.register_host_pool_v2(PoolName.KV, mamba)
    await backend.register_host_pool_v2(PoolName.KV, make_pools()[0])  # same geometry: fine
    # Keys without a transfer: nothing says what a hit is (every key was one).
    with pytest.raises(ConfigError, match="no pool transfer"):
        await backend.batch_exists_v2(keys, [])
    assert (await backend.batch_exists_v2([], [])).num_hit_pages == 0  # asks nothing
    await backend.aclose()
    with pytest.raises(BackendError, match="closed"):
        await backend.batch_get_v2([kv_transfer(keys, [0, 1])])
    with pytest.raises(BackendError, match="closed"):  # was accepted silently
        await backend.register_host_pool_v2(PoolName.KV, make_pools()[0])
    with pytest.raises(ConfigError, match="namespace"):
        harness.open(namespace="")


async def test_statistics_snapshot_is_frozen(harness: Harness) -> None:
    backend, _kv, _ = await opened(harness)
    stats = backend.statistics()
    with pytest.raises(AttributeError):
        stats.num_hits = 3  # type: ignore[misc]
    assert stats.uri and stats.used_bytes is None and stats.capacity_bytes is None
    assert NAMESPACE in repr(backend)


# ---- first-use setup ---------------------------------------------------------------------------
def failing_setup(backend: ObjectBackend, *, hang: bool) -> dict[str, int | bool]:
    """Make ``backend``'s first-use setup fail — by hanging (a store that never answers) or
    raising at once — until ``state["fail"]`` is set False; ``state["attempts"]`` counts them."""
    state: dict[str, int | bool] = {"attempts": 0, "fail": True}
    prepare = backend._prepare

    async def failing() -> None:
        state["attempts"] += 1
        if state["fail"]:
            if hang:
                await asyncio.Event().wait()
            raise BackendError("store unavailable")
        await prepare()

    backend._prepare = failing  # type: ignore[method-assign]
    return state


async def test_first_use_setup_is_shared_bounded_and_backs_off_after_a_failure(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """Concurrent first calls share one setup attempt, bounded by ``timeout_s``; after it
    failed, calls are misses at once, counted, until ``setup_retry_s`` has passed."""
    timeout_s = 1.0
    backend, kv, _ = await opened(harness, capacity_bytes=1 << 30, timeout_s=timeout_s)
    backend.setup_retry_s = 3600.0  # the calls below all come within it
    state = failing_setup(backend, hang=True)
    keys = make_keys(2, seed="setup")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        async with asyncio.timeout(10 * timeout_s):
            results = await asyncio.gather(
                *(backend.batch_get_v2([kv_transfer(keys, [2 * i, 2 * i + 1])]) for i in range(3)),
                backend.batch_set_v2([kv_transfer(keys, [0, 1])]),
                backend.batch_exists_v2(keys, [kv_transfer(keys)]),
            )
    assert time.monotonic() - t0 < 3 * timeout_s  # one attempt, not one per call in turn
    assert state["attempts"] == 1
    assert results[:4] == [[[False, False]]] * 4 and results[4].num_hit_pages == 0
    stats = backend.statistics()
    assert (stats.num_misses, stats.num_failures, stats.num_timeouts) == (6, 10, 10)
    assert "not ready" in caplog.text
    # within the back-off: a miss at once, counted, and no new attempt
    async with asyncio.timeout(timeout_s / 2):
        assert await backend.batch_get_v2([kv_transfer(keys, [0, 1])]) == [[False, False]]
    stats = backend.statistics()
    assert state["attempts"] == 1 and (stats.num_misses, stats.num_failures, stats.num_timeouts) == (8, 12, 10)
    # once the back-off has passed, the next call tries again
    state["fail"] = False
    backend.setup_retry_s = 0.0
    assert await put(backend, kv_transfer(keys, [0, 1])) == [[True, True]]
    assert state["attempts"] == 2
    assert await get(backend, kv_transfer(keys, [4, 5])) == [[True, True]]
    assert [slot(kv, 4), slot(kv, 5)] == [slot(kv, 0), slot(kv, 1)]


async def test_a_failed_setup_counts_and_reports_every_item(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    backend, _, _ = await opened(harness, capacity_bytes=1 << 30)
    backend.setup_retry_s = 0.0  # every call tries the setup again
    state = failing_setup(backend, hang=False)
    keys = make_keys(4, seed="setupcount")
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await get(backend, kv_transfer(keys[:3], [0, 1, 2])) == [[False] * 3]
        assert "3 of 3 items failed" in caplog.text
        assert await put(backend, kv_transfer(keys[:2], [0, 1])) == [[False] * 2]
        assert "2 of 2 items failed" in caplog.text
        assert await hit_pages(backend, keys, kv_transfer(keys), mamba_transfer(keys)) == 0
        assert "4 of 4 items failed" in caplog.text
    assert state["attempts"] == 3
    stats = backend.statistics()
    assert (stats.num_misses, stats.num_failures, stats.num_hits) == (3, 9, 0)
    # A probe that fails fails every key of its window.
    state["fail"] = False

    async def refused(names: list[str]) -> list[int | None]:
        raise BackendError("probe refused")

    backend._object_sizes = refused  # type: ignore[method-assign]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await hit_pages(backend, keys[:3], kv_transfer(keys[:3])) == 0
    assert "3 of 3 items failed" in caplog.text
    assert backend.statistics().num_failures == 9 + 3


def slow_listing(backend: ObjectBackend, *, pages: int | None, page_s: float, hang_after: int | None = None) -> dict[str, int]:
    """Make ``backend``'s listing of its stored objects find ``pages`` pages (``None``: pages
    without end), ``page_s`` apart, each reported, before the real listing — or stop answering
    after ``hang_after`` pages. ``state`` counts the listings started, finished and stopped."""
    state = {"started": 0, "finished": 0, "stopped": 0}
    real = backend._list_objects

    async def slow(progress: Callable[[int], None]) -> list[tuple[str, int]]:
        state["started"] += 1
        try:
            page = 0
            while pages is None or page < pages:
                if page == hang_after:
                    await asyncio.Event().wait()
                await asyncio.sleep(page_s)
                page += 1
                progress(page)
            found = await real(progress)
        except asyncio.CancelledError:
            state["stopped"] += 1
            raise
        state["finished"] += 1
        return found

    backend._list_objects = slow  # type: ignore[method-assign]
    return state


async def test_a_listing_longer_than_timeout_s_runs_to_its_end_while_calls_are_misses(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """With a capacity, the first use lists the stored objects. A listing that takes longer
    than ``timeout_s`` in all but keeps finding objects runs to its end: the first call waits
    for it at most ``timeout_s``, the calls after it are misses (and skipped writes) at once,
    counted and reported, and once it is done the backend serves what it listed."""
    timeout_s = 0.5
    keys = make_keys(4, seed="longlist")
    writer, _, _ = await opened(harness)
    assert await put(writer, kv_transfer(keys[:3], [0, 1, 2])) == [[True] * 3]
    backend, kv, _ = await opened(harness, capacity_bytes=1 << 30, timeout_s=timeout_s)
    state = slow_listing(backend, pages=8, page_s=timeout_s / 2)  # 4 × timeout_s in all
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await get(backend, kv_transfer(keys[:3], [3, 4, 5])) == [[False] * 3]
        assert timeout_s * 0.9 <= time.monotonic() - t0 < 2 * timeout_s  # waited, at most timeout_s
        t1 = time.monotonic()
        assert await hit_pages(backend, keys, kv_transfer(keys)) == 0
        assert await put(backend, kv_transfer(keys[3:], [3])) == [[False]]
        assert time.monotonic() - t1 < timeout_s / 2  # misses at once
    assert "listing the stored objects" in caplog.text
    stats = backend.statistics()
    assert (stats.num_misses, stats.num_failures, stats.num_timeouts) == (3, 3 + 4 + 1, 3)
    async with asyncio.timeout(DEADLINE_S):
        while not state["finished"]:
            await asyncio.sleep(0.05)
    assert await get(backend, kv_transfer(keys[:3], [3, 4, 5])) == [[True] * 3]
    assert [slot(kv, i) for i in (3, 4, 5)] == [slot(kv, i) for i in (0, 1, 2)]
    assert backend.statistics().used_bytes == await stored_bytes(harness, backend)
    assert await put(backend, kv_transfer(keys[3:], [3])) == [[True]]
    assert state["started"] == 1


async def test_a_listing_that_stops_answering_fails_timeout_s_after_its_last_page(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A listing that stops finding anything (a store that hangs) fails ``timeout_s`` after the
    last page it found; the back-off follows, then another attempt."""
    timeout_s = 0.5
    backend, _, _ = await opened(harness, capacity_bytes=1 << 30, timeout_s=timeout_s)
    backend.setup_retry_s = 3600.0
    listing = backend._list_objects
    state = slow_listing(backend, pages=4, page_s=timeout_s / 2, hang_after=2)
    keys = make_keys(2, seed="hunglist")
    assert await get(backend, kv_transfer(keys, [0, 1])) == [[False] * 2]
    await asyncio.sleep(timeout_s + 0.2)  # two pages (timeout_s), then timeout_s of silence
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await get(backend, kv_transfer(keys, [0, 1])) == [[False] * 2]
    assert "nothing new for 0.5 s (2 found)" in caplog.text and "the setup failed" in caplog.text
    assert state == {"started": 1, "finished": 0, "stopped": 1}
    backend._list_objects = listing  # type: ignore[method-assign]
    backend.setup_retry_s = 0.0  # the store answers again: the next call sets the backend up
    assert await put(backend, kv_transfer(keys, [0, 1])) == [[True] * 2]


async def test_aclose_stops_a_listing_in_progress(harness: Harness) -> None:
    """``aclose`` does not wait for a first-use listing (however long ``timeout_s``): it stops
    it, and the calls waiting for it are misses."""
    backend, _, _ = await opened(harness, capacity_bytes=1 << 30, timeout_s=DEADLINE_S)
    state = slow_listing(backend, pages=None, page_s=0.05)  # never done, never silent
    keys = make_keys(2, seed="closelist")
    waiting = asyncio.create_task(get(backend, kv_transfer(keys, [0, 1])))
    await asyncio.sleep(0.2)
    assert not waiting.done() and state["started"] == 1
    t0 = time.monotonic()
    async with asyncio.timeout(DEADLINE_S):
        await backend.aclose()
    assert time.monotonic() - t0 < 2.0
    assert await waiting == [[False] * 2]
    assert state == {"started": 1, "finished": 0, "stopped": 1}


# ---- lifecycle ---------------------------------------------------------------------------------
def slow_reads(backend: ObjectBackend, delay_s: float) -> list[int]:
    """Make every object read of ``backend`` take ``delay_s`` longer (with reader processes:
    every batch); the returned list grows by one as each starts."""
    started: list[int] = []
    if isinstance(backend, LocalDiskBackend) and backend._readers is not None:
        delay_method(backend._readers, "read", delay_s, started, blocking=False)
    elif isinstance(backend, LocalDiskBackend):
        delay_method(backend, "_read_range", delay_s, started, blocking=True)
    else:
        delay_method(backend, "_read_object", delay_s, started, blocking=False)
    return started


async def test_aclose_waits_for_the_calls_in_flight(harness: Harness) -> None:
    """``aclose`` returns once no call of the backend runs: what the calls in flight had not
    started fails (misses), and nothing is read into a host slot after it has returned."""
    n = 16
    keys = make_keys(n, seed="closing")
    writer = harness.open()
    src, _ = make_pools(n, seed=6, shared=harness.shared_pools)
    await writer.register_host_pool_v2(PoolName.KV, src)
    assert await put(writer, kv_transfer(keys, range(n))) == [[True] * n]
    reader = harness.open(max_concurrency=1)
    dst, _ = make_pools(n, seed=None, shared=harness.shared_pools)
    await reader.register_host_pool_v2(PoolName.KV, dst)
    started = slow_reads(reader, 0.1)  # n objects one at a time: 1.6 s at least
    reading = asyncio.create_task(reader.batch_get_v2([kv_transfer(keys, range(n))]))
    deadline = time.monotonic() + DEADLINE_S
    while not started:  # poll under a deadline
        assert time.monotonic() < deadline, "the read never started"
        await asyncio.sleep(0.005)
    async with asyncio.timeout(DEADLINE_S):
        await reader.aclose()
    assert reading.done()
    at_close = [slot(dst, i) for i in range(n)]
    got = (await reading)[0]
    assert [slot(dst, i) for i in range(n)] == at_close
    assert sum(got) < n  # the items not started when it closed were not read
    for i, ok in enumerate(got):
        assert at_close[i] == (slot(src, i) if ok else bytes([0xAB]) * SPEC.kv_page_bytes)
    with pytest.raises(BackendError, match="closed"):
        await reader.batch_get_v2([kv_transfer(keys[:1], [0])])


async def test_a_cancelled_aclose_is_finished_by_the_next(harness: Harness) -> None:
    """A close cut short by its caller's deadline goes on; a repeated or concurrent ``aclose``
    waits for that same close, which releases the backend's resources once."""
    backend, _, _ = await opened(harness)
    assert await put(backend, kv_transfer(make_keys(1, seed="cancelclose"), [0])) == [[True]]
    release, closes = asyncio.Event(), []
    close = backend._close

    async def slow_close() -> None:  # e.g. waiting for reader processes that are starting
        await release.wait()
        await close()
        closes.append(1)

    backend._close = slow_close  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await backend.aclose()
    assert closes == []
    release.set()
    async with asyncio.timeout(DEADLINE_S):
        assert await asyncio.gather(backend.aclose(), backend.aclose()) == [None, None]
    assert closes == [1]
    if isinstance(backend, LocalDiskBackend):
        assert backend._workers._state.closed
        if backend._readers is not None:
            assert backend._readers._closed and backend._readers._children == [None, None]
    with pytest.raises(BackendError, match="closed"):
        await backend.batch_get_v2([kv_transfer(make_keys(1, seed="cancelclose"), [1])])


# ---- invalid objects and write-back; deletes that fail -------------------------------------------
async def test_invalid_objects_are_removed_without_waiting_behind_a_write_back(harness: Harness) -> None:
    """A read or a probe that meets an invalid object removes it before it returns, and that
    removal goes before a write-back in progress, like the read itself."""
    backend = harness.open(max_concurrency=2)
    kv, _ = make_pools(48, seed=7, shared=harness.shared_pools)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    bad = make_keys(2, seed="badobjects")
    assert await put(backend, kv_transfer(bad, [0, 1])) == [[True, True]]
    names = [backend.object_name(PoolName.KV, k) for k in bad]
    data = await harness.raw_get(backend, names[0])
    assert data is not None
    await harness.raw_put(backend, names[0], DAMAGE["flip_payload_byte"](data, b""))  # found by a read
    await harness.raw_put(backend, names[1], data + bytes(10))  # found by a probe (its size)
    started = slow_writes(backend, 0.05)
    pending = make_keys(40, seed="write-back-2")  # 40 objects, 2 at a time: at least 1 s
    write_back = asyncio.create_task(put(backend, kv_transfer(pending, range(2, 42))))
    while len(started) < 2:  # the write-back holds both slots
        await asyncio.sleep(0.005)
    assert await get(backend, kv_transfer(bad[:1], [42])) == [[False]]
    assert await hit_pages(backend, bad[1:], kv_transfer(bad[1:])) == 0
    assert not write_back.done()
    assert await harness.raw_get(backend, names[0]) is None and await harness.raw_get(backend, names[1]) is None
    assert backend.statistics().num_corrupt == 2
    assert await write_back == [[True] * 40]


async def stored_bytes(harness: Harness, backend: ObjectBackend) -> int:
    total = 0
    for name in await harness.raw_names():
        data = await harness.raw_get(backend, name)
        total += 0 if data is None else len(data)
    return total


async def refused_delete(names: list[str], *args: object, **kwargs: object) -> None:
    raise BackendError("delete refused")


async def test_a_put_whose_eviction_fails_is_skipped_and_the_store_stays_within_capacity(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An eviction victim whose delete fails is still stored: it stays in the capacity's count
    (and is the next victim), and the object it was to make room for is not written — a skipped
    write, counted as rejected and reported — so deletes that keep failing never let the store
    grow past its capacity. Objects that fit without eviction are still written."""
    keys = make_keys(8, seed="evictfail")
    probe = harness.open()
    size = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), keys[0])
    backend, _, _ = await opened(harness, capacity_bytes=3 * size)
    assert await put(backend, kv_transfer(keys[:1], [0])) == [[True]]
    delete = backend._delete_objects
    backend._delete_objects = refused_delete  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        # two fit as they are; the third needs keys[0] evicted, which fails: skipped
        assert await put(backend, kv_transfer(keys[1:4], [1, 2, 3])) == [[True, True, False]]
        assert "1 of 3 items failed" in caplog.text and "no room" in caplog.text and "delete refused" in caplog.text
        for i in range(4, 7):  # deletes keep failing: every new object is skipped
            assert await put(backend, kv_transfer(keys[i : i + 1], [i])) == [[False]]
    assert backend.statistics().used_bytes == await stored_bytes(harness, backend) == 3 * size
    stats = backend.statistics()
    assert (stats.num_rejected, stats.num_evictions, stats.num_failures, stats.num_writes) == (4, 0, 4, 3)
    assert await get(backend, kv_transfer(keys[3:7], [3, 4, 5, 6])) == [[False] * 4]  # not stored
    backend._delete_objects = delete  # type: ignore[method-assign]
    assert await put(backend, kv_transfer(keys[7:8], [7])) == [[True]]  # evicts keys[0], still the LRU
    assert backend.statistics().used_bytes == await stored_bytes(harness, backend) == 3 * size
    present = [await harness.raw_get(backend, backend.object_name(PoolName.KV, k)) is not None for k in keys]
    assert present == [False, True, True, False, False, False, False, True]
    assert backend.statistics().num_evictions == 1


async def test_a_put_that_counted_on_another_calls_failed_eviction_is_skipped(harness: Harness) -> None:
    """Room freed by one call's eviction may be reserved by a concurrent call (a large victim
    makes room for several small objects). That call writes only once the eviction's delete is
    done: when it fails, the victim is still stored, and both calls' new objects are skipped."""
    keys = make_keys(4, seed="evictshare")
    probe = harness.open()
    kv, mamba = make_pools(1)
    large = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, kv), keys[0])
    small = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.MAMBA, mamba), keys[1])
    assert large >= 2 * small  # the large victim's room takes both small objects
    backend, _, _ = await opened(harness, capacity_bytes=large + small)
    assert await put(backend, kv_transfer(keys[:1], [0])) == [[True]]  # the least recently used
    assert await put(backend, mamba_transfer(keys[1:2], [1])) == [[True]]
    deleting, gate = asyncio.Event(), asyncio.Event()

    async def held(names: list[str], *args: object, **kwargs: object) -> None:
        deleting.set()
        await gate.wait()
        raise BackendError("delete refused")

    backend._delete_objects = held  # type: ignore[method-assign]
    evicting = asyncio.create_task(put(backend, mamba_transfer(keys[2:3], [2])))  # evicts keys[0]
    try:
        async with asyncio.timeout(DEADLINE_S):
            await deleting.wait()
        sharing = asyncio.create_task(put(backend, mamba_transfer(keys[3:4], [3])))  # fits in the room freed
        await asyncio.sleep(0.05)
        assert not sharing.done()  # waits for the delete its room rests on
    finally:
        gate.set()
    assert await evicting == [[False]] and await sharing == [[False]]
    stats = backend.statistics()
    assert stats.used_bytes == await stored_bytes(harness, backend) == large + small
    assert (stats.num_rejected, stats.num_evictions) == (2, 0)


async def test_a_put_of_a_key_being_evicted_waits_for_its_delete(harness: Harness) -> None:
    """A put of a key whose eviction delete is in flight would find the old object, report it
    stored and be undone by the delete: it waits for the delete and writes the key again."""
    keys = make_keys(4, seed="evictrace")
    probe = harness.open()
    size = probe.codec.object_bytes(ObjectGeometry.of_pool(PoolName.KV, make_pools(1)[0]), keys[0])
    backend, _, _ = await opened(harness, capacity_bytes=2 * size)
    assert await put(backend, kv_transfer(keys[:2], [0, 1])) == [[True] * 2]
    delete, gate, deleting = backend._delete_objects, asyncio.Event(), asyncio.Event()

    held_name = backend.object_name(PoolName.KV, keys[0])

    async def held(names: list[str], *args: object, **kwargs: object) -> None:
        if held_name in names:  # the delete of keys[0] lags; any other goes through
            deleting.set()
            await gate.wait()
        await delete(names, *args, **kwargs)

    backend._delete_objects = held  # type: ignore[method-assign]
    evicting = asyncio.create_task(put(backend, kv_transfer(keys[2:3], [2])))  # evicts keys[0]
    async with asyncio.timeout(DEADLINE_S):
        await deleting.wait()
    again = asyncio.create_task(put(backend, kv_transfer(keys[:1], [0])))  # evicts keys[1]
    await asyncio.sleep(0.05)
    gate.set()
    backend._delete_objects = delete  # type: ignore[method-assign]
    assert await evicting == [[True]] and await again == [[True]]
    assert await harness.raw_get(backend, backend.object_name(PoolName.KV, keys[0])) is not None
    assert await get(backend, kv_transfer(keys[:1], [5])) == [[True]]


async def test_an_object_truncated_between_the_probe_and_the_read_is_a_miss(harness: Harness) -> None:
    """The probe finds a page and a state; both are cut short before the read: each is a miss
    (counted corrupt, removed), and the other page of the batch is served exactly."""
    backend, kv, _ = await opened(harness)
    keys = make_keys(2, seed="probe-then-read")
    assert await put(backend, kv_transfer(keys, [0, 1]), mamba_transfer(keys[1:], [1])) == [[True, True], [True]]
    async with asyncio.timeout(DEADLINE_S):
        probe = await backend.batch_exists_v2(
            keys,
            [
                PoolTransfer(pool_name=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES),
                PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES),
            ],
        )
    assert probe.num_hit_pages == 2
    names = [backend.object_name(PoolName.KV, keys[1]), backend.object_name(PoolName.MAMBA, keys[1])]
    for name in names:
        data = await harness.raw_get(backend, name)
        assert data is not None
        await harness.raw_put(backend, name, data[:-100])
    assert await get(backend, kv_transfer(keys, [2, 3]), mamba_transfer(keys[1:], [2])) == [[True, False], [False]]
    assert slot(kv, 2) == slot(kv, 0)
    assert backend.statistics().num_corrupt == 2
    assert [await harness.raw_get(backend, name) for name in names] == [None, None]
