"""The local disk's reader processes (``read_processes``): reads into shared-memory pools in
child processes; failures of a child are misses, never wrong bytes; a cancelled read waits for
the child; children start without torch and stop with the backend. (The whole conformance
suite also runs on them: the ``disk-procs`` harness.)"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from storage_harness import (
    NAMESPACE,
    SPEC,
    kv_transfer,
    make_keys,
    make_pools,
    mamba_transfer,
    slot,
)

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError
from asynccache.storage import PoolName
from storage_backends.local_disk import LocalDiskBackend
from storage_backends.reader_processes import _CHILD, _PACKAGES_ROOT


async def open_procs(root: Path, *, shared: bool = True, **options: object):
    backend = LocalDiskBackend(root.as_uri(), namespace=NAMESPACE, read_processes=2, fsync=False, **options)
    kv, mamba = make_pools(16, seed=3, shared=shared)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    return backend, kv, mamba


async def stored(backend: LocalDiskBackend, n: int, seed: str) -> list[str]:
    keys = make_keys(n, seed=seed)
    assert await backend.batch_set_v2([kv_transfer(keys, range(n)), mamba_transfer(keys[-1:], [0])]) == [
        [True] * n, [True]]
    return keys


def test_a_reader_process_imports_no_torch() -> None:
    probe = _CHILD.replace(
        "serve_reader(Connection(int(sys.argv[2])))", "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe, _PACKAGES_ROOT, "0"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['numpy']"


async def test_reads_land_exactly_and_run_in_the_children(tmp_path: Path) -> None:
    backend, kv, mamba = await open_procs(tmp_path)
    keys = await stored(backend, 8, "exact")
    calls = []
    real = backend._readers.read

    async def counted(units):
        calls.append(len(units))
        return await real(units)

    backend._readers.read = counted  # type: ignore[method-assign]
    got = await backend.batch_get_v2([kv_transfer(keys, range(8, 16)), mamba_transfer(keys[-1:], [1])])
    assert got == [[True] * 8, [True]]
    assert [slot(kv, 8 + i) for i in range(8)] == [slot(kv, i) for i in range(8)]
    assert slot(mamba, 1) == slot(mamba, 0)
    assert calls == [9]
    children = [c.process for c in backend._readers._children if c is not None]
    assert len(children) == 2 and all(p.poll() is None for p in children)
    await backend.aclose()
    assert all(p.poll() is not None for p in children)  # stopped with the backend


async def test_pools_outside_shared_memory_are_read_by_the_threads(tmp_path: Path) -> None:
    backend, kv, _ = await open_procs(tmp_path, shared=False)
    keys = await stored(backend, 4, "threads")

    async def refuse(units):
        raise AssertionError("the reader processes cannot reach these pools")

    backend._readers.read = refuse  # type: ignore[method-assign]
    assert await backend.batch_get_v2([kv_transfer(keys, range(8, 12))]) == [[True] * 4]
    assert [slot(kv, 8 + i) for i in range(4)] == [slot(kv, i) for i in range(4)]
    await backend.aclose()


async def test_a_killed_child_costs_misses_never_wrong_bytes_and_is_replaced(tmp_path: Path) -> None:
    backend, kv, _ = await open_procs(tmp_path)
    keys = await stored(backend, 8, "killed")
    assert await backend.batch_get_v2([kv_transfer(keys, range(8, 16))]) == [[True] * 8]
    victim = backend._readers._children[0]
    victim.process.kill()
    victim.process.wait()
    kv.buffer[8:16].fill_(0)
    got = await backend.batch_get_v2([kv_transfer(keys, range(8, 16))])
    assert not all(got[0])  # the dead child's units are misses
    for i, hit in enumerate(got[0]):
        if hit:
            assert slot(kv, 8 + i) == slot(kv, i)
    assert backend.statistics().num_failures >= 1
    assert await backend.batch_get_v2([kv_transfer(keys, range(8, 16))]) == [[True] * 8]  # started again
    assert [slot(kv, 8 + i) for i in range(8)] == [slot(kv, i) for i in range(8)]
    await backend.aclose()


async def test_a_cancelled_read_returns_only_after_the_child_is_done(tmp_path: Path) -> None:
    """The child blocks opening a FIFO in place of the object; the cancelled caller must wait
    until the child has answered (it may be writing into the slot until then)."""
    backend, _, _ = await open_procs(tmp_path)
    keys = await stored(backend, 1, "fifo")
    path = backend.object_name(PoolName.KV, keys[0])
    os.unlink(path)
    os.mkfifo(path)
    await backend._readers_start  # the children are up
    reading = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, [9])]))
    async with asyncio.timeout(10):
        while not any(c.pending for c in backend._readers._children if c is not None):
            await asyncio.sleep(0.01)  # until the unit is with a child
    await asyncio.sleep(0.1)
    reading.cancel()
    await asyncio.sleep(0.3)
    assert not reading.done()  # still waiting for the child, which is blocked in open()
    fd = os.open(path, os.O_WRONLY)  # lets the child's open return: a wrongly sized object
    os.close(fd)
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await reading
    os.unlink(path)
    await backend.aclose()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"read_processes": -1}, "read_processes must be an int >= 0"),
        ({"read_processes": 2, "compression": "zstd"}, "cannot be combined"),
        ({"read_processes": 2, "direct_io": True}, "cannot be combined"),
    ],
)
def test_bad_options_are_refused(tmp_path: Path, options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, **options)


async def test_the_cache_puts_its_host_pools_in_shared_memory_for_reader_processes(tmp_path: Path) -> None:
    def config(**options: object) -> HybridCacheConfig:
        return HybridCacheConfig(
            device_kv_pages=8, device_state_slots=4, host_kv_bytes=8 * SPEC.kv_page_bytes,
            host_state_bytes=2 * SPEC.state_bytes, storage_uri=tmp_path.as_uri(), storage_options=options,
        )

    async with HybridCache(SPEC, config(read_processes=2)) as cache:
        assert cache.host_kv.shared_memory is not None and cache.host_mamba.shared_memory is not None
    async with HybridCache(SPEC, config()) as cache:
        assert cache.host_kv.shared_memory is None and cache.host_mamba.shared_memory is None
