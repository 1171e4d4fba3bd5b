"""S3 specifics: how objects are cut into upload parts and stepped on the loop, and against a real
SeaweedFS: a server killed mid-batch, a hung server, bad credentials."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Generator

import numpy as np
import pytest
from storage_harness import (
    NAMESPACE,
    SeaweedServer,
    kv_transfer,
    make_keys,
    make_pools,
    mamba_transfer,
    slot,
)

from asynccache.storage import PoolName
from storage_backends.object_store import ObjectStoreBackend, _cut_at_parts, _on_loop


async def open_s3(server: SeaweedServer, prefix: str, **options: object):
    backend = ObjectStoreBackend(server.uri(prefix), namespace=NAMESPACE, **options)
    kv, mamba = make_pools(num_items=64, seed=7)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    return backend, kv, mamba


@pytest.mark.parametrize("sizes", [[64, 1000, 40, 3], [1, 1, 1], [4096], [100, 0, 28]])
def test_parts_are_cut_at_part_boundaries_without_a_copy(sizes: list[int]) -> None:
    part = 128
    buffers = [np.arange(n, dtype=np.uint8) + i for i, n in enumerate(sizes)]
    pieces = _cut_at_parts([b"head", *buffers], part)
    assert b"".join(bytes(p) for p in pieces) == b"head" + b"".join(b.tobytes() for b in buffers)
    ends = np.cumsum([len(p) for p in pieces])
    assert set(range(part, int(ends[-1]) + 1, part)) <= set(ends.tolist())  # every boundary is a cut
    assert all(len(p) <= part for p in pieces)
    assert np.shares_memory(np.frombuffer(pieces[1], dtype=np.uint8), buffers[0])


async def test_stepwise_work_on_the_loop_lets_other_tasks_run() -> None:
    log: list[str] = []

    def steps(name: str, n: int) -> Generator[None, None, str]:
        for i in range(n):
            if i:
                yield
            log.append(name)
        return name

    assert await asyncio.gather(_on_loop(steps("a", 3)), _on_loop(steps("b", 3))) == ["a", "b"]
    assert log == ["a", "b", "a", "b", "a", "b"]


@pytest.mark.s3
async def test_server_killed_mid_batch(private_seaweedfs: SeaweedServer, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    server = private_seaweedfs
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    backend, kv, _mamba = await open_s3(server, "killed", timeout_s=2.0, max_retries=1, max_concurrency=2)
    keys = make_keys(64, seed="killed")
    assert await backend.batch_set_v2([kv_transfer(keys, range(64)), mamba_transfer(keys[:4], range(4))]) == [
        [True] * 64, [True] * 4]
    reader, kv2, mamba2 = await open_s3(server, "killed", timeout_s=2.0, max_retries=1, max_concurrency=2)
    for pool in (kv2, mamba2):
        assert pool.buffer is not None
        pool.buffer.fill_(0xAB)

    async def kill_after_some_reads() -> None:
        deadline = time.monotonic() + 20
        while not all(slot(kv2, i) == slot(kv, i) for i in range(4)):  # poll under a deadline
            assert time.monotonic() < deadline, "the batch made no progress"
            await asyncio.sleep(0.001)
        server.kill()

    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        async with asyncio.timeout(30):
            _, results = await asyncio.gather(
                kill_after_some_reads(), reader.batch_get_v2([kv_transfer(keys, range(64))]))
    loaded = [i for i, ok in enumerate(results[0]) if ok]
    assert 4 <= len(loaded) < 64
    for i in loaded:  # what was loaded is right
        assert slot(kv2, i) == slot(kv, i)
    stats = reader.statistics()
    assert stats.num_failures == 64 - len(loaded) and stats.num_hits == len(loaded)
    assert "items failed" in caplog.text
    # with the server gone: misses and skipped backups, no exceptions, within the deadline
    async with asyncio.timeout(30):
        exists = await reader.batch_exists_v2(keys, [kv_transfer([]), mamba_transfer([])])
        writes = await reader.batch_set_v2([kv_transfer(make_keys(3, seed="after"), [0, 1, 2])])
    assert exists.num_hit_pages == 0 and writes == [[False] * 3]
    assert server.secret_key not in caplog.text and server.secret_key not in repr(reader)
    assert server.secret_key not in str(reader.statistics())
    await backend.aclose()
    await reader.aclose()


@pytest.mark.s3
async def test_a_hung_server_times_out_into_misses(private_seaweedfs: SeaweedServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    server = private_seaweedfs
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    backend, _kv, _mamba = await open_s3(server, "hung", timeout_s=1.0, max_retries=0)
    keys = make_keys(4, seed="hung")
    assert await backend.batch_set_v2([kv_transfer(keys, range(4))]) == [[True] * 4]
    server.pause()
    try:
        t0 = time.monotonic()
        async with asyncio.timeout(20):
            got = await backend.batch_get_v2([kv_transfer(keys, [10, 11, 12, 13])])
            put = await backend.batch_set_v2([kv_transfer(make_keys(2, seed="hung2"), [0, 1])])
            exists = await backend.batch_exists_v2(keys, [kv_transfer([])])
        elapsed = time.monotonic() - t0
    finally:
        server.resume()
    assert got == [[False] * 4] and put == [[False] * 2] and exists.num_hit_pages == 0
    assert elapsed < 10
    stats = backend.statistics()
    assert stats.num_failures >= 7 and stats.num_hits == 0
    # the server is back: so are the hits
    async with asyncio.timeout(20):
        assert await backend.batch_get_v2([kv_transfer(keys, [10, 11, 12, 13])]) == [[True] * 4]
    await backend.aclose()


@pytest.mark.s3
async def test_a_close_beside_a_hung_server_ends_its_reads_after_the_grace(private_seaweedfs: SeaweedServer,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests in flight are not the backend's threads: past the close's grace their
    items end as closed (misses), not at their own ``timeout_s``."""
    server = private_seaweedfs
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    backend, _kv, _mamba = await open_s3(server, "hung-close", timeout_s=60.0, max_retries=0)
    backend.close_grace_s = 0.3
    keys = make_keys(4, seed="hung-close")
    assert await backend.batch_set_v2([kv_transfer(keys, range(4))]) == [[True] * 4]
    server.pause()
    try:
        reading = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, [10, 11, 12, 13])]))
        await asyncio.sleep(0.3)  # the GETs are sent
        t0 = time.monotonic()
        async with asyncio.timeout(20):
            await backend.aclose()
        elapsed = time.monotonic() - t0
        assert reading.done()
        assert reading.result() == [[False] * 4]
    finally:
        server.resume()
    assert elapsed < 5
    assert backend.statistics().num_timeouts == 0  # ended as closed, not timed out


@pytest.mark.s3
async def test_a_hung_server_at_first_use_costs_each_call_one_timeout(private_seaweedfs: SeaweedServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With a capacity, the first use lists the bucket. Calls that come while the server hangs
    share that one listing, bounded by ``timeout_s`` (they do not take turns, each with its own);
    the calls right after it failed are misses at once."""
    server = private_seaweedfs
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    timeout_s = 1.0
    backend, _, _ = await open_s3(server, "hungsetup", timeout_s=timeout_s, max_retries=0, capacity_bytes=1 << 30)
    backend.setup_retry_s = 3600.0
    keys = make_keys(4, seed="hungsetup")
    server.pause()
    try:
        t0 = time.monotonic()

        async def lookup() -> float:
            await backend.batch_exists_v2(keys, [kv_transfer([]), mamba_transfer([])])
            return time.monotonic() - t0

        async with asyncio.timeout(20):
            elapsed = await asyncio.gather(*(lookup() for _ in range(5)))
            t1 = time.monotonic()
            assert await backend.batch_get_v2([kv_transfer(keys, [0, 1, 2, 3])]) == [[False] * 4]
            again = time.monotonic() - t1
    finally:
        server.resume()
    assert max(elapsed) < 2.5 * timeout_s, elapsed
    assert again < 0.9 * timeout_s  # no second timeout: a miss at once
    stats = backend.statistics()
    assert (stats.num_failures, stats.num_misses) == (5 * 4 + 4, 4)
    backend.setup_retry_s = 0.0  # the server is back: the next call sets the backend up
    async with asyncio.timeout(20):
        assert await backend.batch_set_v2([kv_transfer(keys, range(4))]) == [[True] * 4]
    await backend.aclose()


@pytest.mark.s3
async def test_wrong_credentials_are_failures_and_never_logged(s3_env: SeaweedServer, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    wrong = "not-the-secret-" + s3_env.secret_key[::-1]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    backend, _kv, _ = await open_s3(s3_env, "badcreds", timeout_s=5.0, max_retries=0)
    keys = make_keys(2, seed="creds")
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await backend.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[False, False]]
        assert await backend.batch_get_v2([kv_transfer(keys, [2, 3])]) == [[False, False]]
    assert backend.statistics().num_failures == 4
    assert "PermissionDenied" in caplog.text or "Unauthenticated" in caplog.text or "Forbidden" in caplog.text
    for secret in (wrong, s3_env.secret_key):
        assert secret not in caplog.text and secret not in repr(backend)
    await backend.aclose()


def test_inline_bytes_is_checked() -> None:
    from asynccache.errors import ConfigError

    with pytest.raises(ConfigError, match="inline_bytes"):
        ObjectStoreBackend("s3://bucket/p?endpoint_url=http://127.0.0.1:1", namespace=NAMESPACE, inline_bytes=-1)


@pytest.mark.s3
@pytest.mark.parametrize("inline_bytes", [0, 4 << 20])
async def test_pages_on_workers_or_on_the_loop_round_trip_and_catch_corruption(s3_env: SeaweedServer,
                                                                                inline_bytes: int) -> None:
    import obstore

    backend, kv, mamba = await open_s3(s3_env, f"inline{inline_bytes}", inline_bytes=inline_bytes)
    assert backend.inline_bytes == inline_bytes
    keys = make_keys(4, seed=f"inline{inline_bytes}")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1, 2, 3]), mamba_transfer(keys[-1:], [0])]) == [
        [True] * 4,
        [True],
    ]
    assert await backend.batch_get_v2([kv_transfer(keys, [10, 11, 12, 13]), mamba_transfer(keys[-1:], [5])]) == [
        [True] * 4,
        [True],
    ]
    assert [slot(kv, i) for i in (10, 11, 12, 13)] == [slot(kv, i) for i in (0, 1, 2, 3)]
    assert slot(mamba, 5) == slot(mamba, 0)
    name = backend.object_name(PoolName.KV, keys[1])
    data = bytearray(await (await obstore.get_async(backend.store, name)).bytes_async())
    data[-1] ^= 0x01  # one flipped payload bit
    await obstore.put_async(backend.store, name, bytes(data))
    assert await backend.batch_get_v2([kv_transfer(keys[1:2], [20])]) == [[False]]
    assert backend.statistics().num_corrupt >= 1
    await backend.aclose()


@pytest.mark.s3
@pytest.mark.parametrize("damage", ["flip_first_range", "flip_last_range", "truncate", "extend", "other_key"])
async def test_large_objects_read_in_ranges_catch_damage(s3_env: SeaweedServer, damage: str) -> None:
    """Objects above the multipart threshold are read as ranged GETs, each range checksummed on
    its own: a flipped byte in any range, a cut or padded object, and another key's object are
    misses, counted as corrupt, and never served."""
    import obstore
    import torch

    from asynccache.pools.base import ItemPool

    options = {"multipart_threshold_bytes": 8 << 20, "multipart_part_bytes": 5 << 20}
    backend = ObjectStoreBackend(s3_env.uri(f"ranges-{damage}"), namespace=NAMESPACE, **options)
    pool = ItemPool(name="big", layer_ids=(0, 1), num_items=4, item_bytes=6 << 20, layout="layer_first", pin=False)
    assert pool.buffer is not None
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    await backend.register_host_pool_v2(PoolName.KV, pool)
    keys = make_keys(2, seed=f"ranges-{damage}")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[True, True]]
    assert await backend.batch_get_v2([kv_transfer(keys[:1], [2])]) == [[True]]  # intact: read whole
    assert slot(pool, 2) == slot(pool, 0)
    name = backend.object_name(PoolName.KV, keys[0])
    data = bytearray(await (await obstore.get_async(backend.store, name)).bytes_async())
    if damage == "flip_first_range":
        data[len(data) - (12 << 20) + 100] ^= 0x01
    elif damage == "flip_last_range":
        data[-3] ^= 0x80
    elif damage == "truncate":
        data = data[: len(data) - 4096]
    elif damage == "extend":
        data += b"\0" * 4096
    else:
        other = backend.object_name(PoolName.KV, keys[1])
        data = bytearray(await (await obstore.get_async(backend.store, other)).bytes_async())
    await obstore.put_async(backend.store, name, bytes(data))
    pool.index_bytes(3).zero_()
    assert await backend.batch_get_v2([kv_transfer(keys[:1], [3])]) == [[False]]
    assert backend.statistics().num_corrupt == 1
    await backend.aclose()


@pytest.mark.s3
async def test_a_large_object_replaced_while_read_is_a_failure_not_corruption(s3_env: SeaweedServer) -> None:
    import obstore
    import torch

    from asynccache.pools.base import ItemPool

    options = {"multipart_threshold_bytes": 8 << 20, "multipart_part_bytes": 5 << 20}
    backend = ObjectStoreBackend(s3_env.uri("ranges-replaced"), namespace=NAMESPACE, **options)
    pool = ItemPool(name="big", layer_ids=(0, 1), num_items=3, item_bytes=6 << 20, layout="page_first", pin=False)
    assert pool.buffer is not None
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    await backend.register_host_pool_v2(PoolName.KV, pool)
    keys = make_keys(1, seed="ranges-replaced")
    assert await backend.batch_set_v2([kv_transfer(keys, [0])]) == [[True]]
    name = backend.object_name(PoolName.KV, keys[0])
    original = await (await obstore.get_async(backend.store, name)).bytes_async()
    real = backend._get_range
    calls = []

    async def replace_after_first(*args: object) -> object:
        got = await real(*args)  # type: ignore[arg-type]
        if not calls:  # another version of the object lands after the first range was read
            changed = bytearray(original)
            changed[-1] ^= 0x01
            await obstore.put_async(backend.store, name, bytes(changed))
        calls.append(args)
        return got

    backend._get_range = replace_after_first  # type: ignore[method-assign]
    assert await backend.batch_get_v2([kv_transfer(keys, [2])]) == [[False]]
    stats = backend.statistics()
    assert stats.num_corrupt == 0 and stats.num_failures == 1
    await backend.aclose()


# ---- plain HTTP endpoints ----------------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.parametrize("cut", ["first_range", "later_range"])
async def test_a_ranged_read_whose_body_comes_back_short_is_a_failure_never_served(
    s3_env: SeaweedServer, cut: str
) -> None:
    """A range's body shorter than asked for (a faulty gateway) fails the read: the slot's bytes
    past the body were never written, and a stretch of zero bytes adds nothing to the checksum,
    so a mostly-zero state would otherwise pass as a hit with the slot's old bytes. The object
    itself is whole: it is not counted corrupt, and a later read serves it."""
    import torch

    from asynccache.pools.base import ItemPool

    options = {"multipart_threshold_bytes": 8 << 20, "multipart_part_bytes": 5 << 20}
    backend = ObjectStoreBackend(s3_env.uri(f"ranges-short-{cut}"), namespace=NAMESPACE, **options)
    pool = ItemPool(name="big", layer_ids=(0, 1), num_items=3, item_bytes=6 << 20, layout="layer_first", pin=False)
    assert pool.buffer is not None
    pool.buffer.zero_()
    pool.index_bytes(0).reshape(-1)[:4096] = 7  # a mostly-zero state
    await backend.register_host_pool_v2(PoolName.KV, pool)
    keys = make_keys(1, seed=f"ranges-short-{cut}")
    assert await backend.batch_set_v2([kv_transfer(keys, [0])]) == [[True]]
    real = backend._get_range

    async def short(name: str, start: int, end: int, etag: object) -> object:
        got = await real(name, start, end, etag)
        if got is not None and (start > 0) == (cut == "later_range"):
            return got[0][: 4096 if start > 0 else end - start - 4096], got[1]
        return got

    backend._get_range = short  # type: ignore[method-assign]
    pool.index_bytes(1).fill_(0xEE)  # a reused slot's old bytes
    assert await backend.batch_get_v2([kv_transfer(keys, [1])]) == [[False]]
    stats = backend.statistics()
    assert stats.num_corrupt == 0 and stats.num_failures == 1
    backend._get_range = real  # type: ignore[method-assign]
    assert await backend.batch_get_v2([kv_transfer(keys, [2])]) == [[True]]
    assert torch.equal(pool.index_bytes(2), pool.index_bytes(0))
    await backend.aclose()


@pytest.mark.s3
@pytest.mark.parametrize("given", ["uri-uppercase-scheme", "env-endpoint-url", "env-endpoint", "env-allow-http"])
async def test_a_plain_http_endpoint_works_however_it_is_given(s3_env: SeaweedServer, monkeypatch: pytest.MonkeyPatch,
                                                               given: str) -> None:
    """An http:// endpoint allows plain HTTP whatever the case of its scheme and wherever it comes
    from: the URI's endpoint_url, or AWS_ENDPOINT_URL / AWS_ENDPOINT when the URI names none."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    if given == "uri-uppercase-scheme":
        uri = s3_env.uri(f"http-{given}").replace("endpoint_url=http://", "endpoint_url=HTTP://")
    else:
        monkeypatch.setenv("AWS_ENDPOINT" if given == "env-endpoint" else "AWS_ENDPOINT_URL", s3_env.endpoint)
        if given == "env-allow-http":
            monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
        uri = f"s3://{s3_env.bucket}/http-{given}?region=us-east-1"
    backend = ObjectStoreBackend(uri, namespace=NAMESPACE, timeout_s=5.0, max_retries=0)
    kv, _ = make_pools(num_items=4, seed=11)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    keys = make_keys(2, seed=f"http-{given}")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[True, True]]
    assert await backend.batch_get_v2([kv_transfer(keys, [2, 3])]) == [[True, True]]
    assert [slot(kv, 2), slot(kv, 3)] == [slot(kv, 0), slot(kv, 1)]
    assert backend.statistics().num_failures == 0
    await backend.aclose()


def test_an_http_endpoint_from_the_environment_that_plain_http_is_forbidden_for_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asynccache.errors import ConfigError

    monkeypatch.delenv("AWS_ENDPOINT", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "false")
    with pytest.raises(ConfigError, match="AWS_ALLOW_HTTP"):
        ObjectStoreBackend("s3://bucket-name/p?region=us-east-1", namespace=NAMESPACE)


@pytest.mark.parametrize("endpoint", ["ftp://host", "http://AKID:hunter2-secret@127.0.0.1:9", "127.0.0.1:9000"])
def test_a_malformed_endpoint_in_the_environment_is_refused_without_echoing_it(
    monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    from asynccache.errors import ConfigError

    monkeypatch.delenv("AWS_ENDPOINT", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(ConfigError, match="AWS_ENDPOINT_URL") as info:
        ObjectStoreBackend("s3://bucket-name/p?region=us-east-1", namespace=NAMESPACE)
    assert "hunter2-secret" not in str(info.value)


# ---- writes over invalid objects -------------------------------------------------------------
async def open_for_objects(server: SeaweedServer, prefix: str, large: bool) -> tuple[ObjectStoreBackend, object]:
    """A backend with one KV pool: pages of the tiny spec (one PUT each), or 12 MiB items above
    the multipart threshold (HEAD, then a multipart upload)."""
    import torch

    from asynccache.pools.base import ItemPool

    if not large:
        backend, kv, _ = await open_s3(server, prefix)
        return backend, kv
    options = {"multipart_threshold_bytes": 8 << 20, "multipart_part_bytes": 5 << 20}
    backend = ObjectStoreBackend(server.uri(prefix), namespace=NAMESPACE, **options)
    pool = ItemPool(name="big", layer_ids=(0, 1), num_items=2, item_bytes=6 << 20, layout="page_first", pin=False)
    assert pool.buffer is not None
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    await backend.register_host_pool_v2(PoolName.KV, pool)
    return backend, pool


@pytest.mark.s3
@pytest.mark.parametrize("large", [False, True], ids=["put", "multipart"])
@pytest.mark.parametrize("damage", ["truncate", "extend", "empty"])
async def test_a_write_replaces_an_object_of_the_wrong_size(s3_env: SeaweedServer, large: bool, damage: str) -> None:
    """An object under the key's name whose size no valid object has is not "already present": the
    write replaces it, so a success means a valid object is stored (the tier above may drop its
    host copy on that success)."""
    import obstore

    backend, pool = await open_for_objects(s3_env, f"replace-{damage}-{large}", large)
    key = make_keys(1, seed=f"replace-{damage}-{large}")
    assert await backend.batch_set_v2([kv_transfer(key, [0])]) == [[True]]
    name = backend.object_name(PoolName.KV, key[0])
    good = bytes(await (await obstore.get_async(backend.store, name)).bytes_async())
    bad = {"truncate": good[:-4096], "extend": good + b"\0" * 4096, "empty": b""}[damage]
    await obstore.put_async(backend.store, name, bad)
    before = backend.statistics()
    assert await backend.batch_set_v2([kv_transfer(key, [0])]) == [[True]]
    assert bytes(await (await obstore.get_async(backend.store, name)).bytes_async()) == good
    after = backend.statistics()
    assert (after.num_writes, after.num_write_skips) == (before.num_writes + 1, before.num_write_skips)
    assert await backend.batch_get_v2([kv_transfer(key, [1])]) == [[True]]
    assert slot(pool, 1) == slot(pool, 0)
    await backend.aclose()


@pytest.mark.s3
@pytest.mark.parametrize("large", [False, True], ids=["put", "multipart"])
async def test_a_write_keeps_an_object_of_the_right_size_which_only_a_read_checks(s3_env: SeaweedServer,
                                                                                 large: bool) -> None:
    """The limit of the size check: an object of the right size is taken as present without being
    read, even when its payload is damaged. The next read finds the damage and removes the object,
    and the write after that stores it again."""
    import obstore

    backend, _ = await open_for_objects(s3_env, f"keep-{large}", large)
    key = make_keys(1, seed=f"keep-{large}")
    assert await backend.batch_set_v2([kv_transfer(key, [0])]) == [[True]]
    name = backend.object_name(PoolName.KV, key[0])
    good = bytes(await (await obstore.get_async(backend.store, name)).bytes_async())
    assert await backend.batch_set_v2([kv_transfer(key, [0])]) == [[True]]  # intact: skipped
    assert backend.statistics().num_write_skips == 1
    flipped = good[:-1] + bytes([good[-1] ^ 0x01])
    await obstore.put_async(backend.store, name, flipped)
    assert await backend.batch_set_v2([kv_transfer(key, [0])]) == [[True]]
    assert backend.statistics().num_write_skips == 2
    assert bytes(await (await obstore.get_async(backend.store, name)).bytes_async()) == flipped
    assert await backend.batch_get_v2([kv_transfer(key, [1])]) == [[False]]
    assert backend.statistics().num_corrupt == 1
    assert await backend.batch_set_v2([kv_transfer(key, [0])]) == [[True]]
    assert bytes(await (await obstore.get_async(backend.store, name)).bytes_async()) == good
    await backend.aclose()


# ---- error messages --------------------------------------------------------------------------
@pytest.mark.s3
async def test_an_s3_error_leads_with_status_and_code_and_keeps_its_cause(s3_env: SeaweedServer,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    import obstore

    from asynccache.errors import BackendError

    wrong = "not-the-secret-" + s3_env.secret_key[::-1]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    backend, _, _ = await open_s3(s3_env, "errcode", timeout_s=5.0, max_retries=0)
    key = make_keys(1, seed="errcode")
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await backend.batch_set_v2([kv_transfer(key, [0])]) == [[False]]
    assert "403 Forbidden SignatureDoesNotMatch" in caplog.text  # in the one line a batch logs
    name = backend.object_name(PoolName.KV, key[0])
    with pytest.raises(BackendError) as info:
        await backend._get(name)
    message = str(info.value)
    assert message.startswith("403 Forbidden SignatureDoesNotMatch")
    assert f"GET {s3_env.endpoint}/{s3_env.bucket}/errcode/{name}" in message
    assert "\n" not in message and "<" not in message
    assert isinstance(info.value.__cause__, obstore.exceptions.PermissionDeniedError)
    for secret in (wrong, s3_env.secret_key):
        assert secret not in message and secret not in caplog.text
    await backend.aclose()
