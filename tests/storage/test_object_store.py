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
    backend, kv, mamba = await open_s3(server, "killed", timeout_s=2.0, max_retries=1, max_concurrency=2)
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
    backend, kv, mamba = await open_s3(server, "hung", timeout_s=1.0, max_retries=0)
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
async def test_wrong_credentials_are_failures_and_never_logged(s3_env: SeaweedServer, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    wrong = "not-the-secret-" + s3_env.secret_key[::-1]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    backend, kv, _ = await open_s3(s3_env, "badcreds", timeout_s=5.0, max_retries=0)
    keys = make_keys(2, seed="creds")
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await backend.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[False, False]]
        assert await backend.batch_get_v2([kv_transfer(keys, [2, 3])]) == [[False, False]]
    assert backend.statistics().num_failures == 4
    assert "PermissionDenied" in caplog.text or "Unauthenticated" in caplog.text or "Forbidden" in caplog.text
    for secret in (wrong, s3_env.secret_key):
        assert secret not in caplog.text and secret not in repr(backend)
    await backend.aclose()
