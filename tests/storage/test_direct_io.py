"""Direct (``O_DIRECT``) reads of the local disk (``direct_io``): which ranges go direct, exact
bytes either way, corruption still a miss, the fallback where the filesystem refuses, and the
option's way through the cache's config."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from storage_harness import (
    NAMESPACE,
    kv_transfer,
    make_keys,
    make_pools,
    mamba_transfer,
    slot,
)

from asynccache.bench import raw_paths
from asynccache.errors import ConfigError
from asynccache.pools.memory import HOST_ALIGN, allocate_bytes
from asynccache.storage import PoolName
from storage_backends import disk_jobs, local_disk, object_reads
from storage_backends.file_io import (
    DIRECT_ALIGN,
    aligned_empty,
    direct_views,
    probe_direct,
)
from storage_backends.local_disk import LocalDiskBackend
from storage_backends.object_format import ObjectCodec, ObjectGeometry
from storage_backends.page_residency import in_page_cache


def needs_direct(path: Path) -> None:
    reason = probe_direct(str(path))
    if reason is not None:
        pytest.skip(f"no direct reads here: {reason}")


@pytest.fixture
def uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every range reads as if the page cache held none of it (the objects a test just wrote
    are all there), so that direct reads go direct."""
    monkeypatch.setattr(object_reads, "in_page_cache", lambda fd, offset, length: False)


def drop_from_page_cache(paths: list[str]) -> None:
    """Write the files back and drop their pages; skips where the kernel keeps them."""
    raw_paths.drop_from_page_cache(paths)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            if in_page_cache(fd, 0, os.fstat(fd).st_size):
                pytest.skip("the kernel keeps this filesystem's pages (tmpfs?)")
        finally:
            os.close(fd)


def test_direct_views_split_aligned_bodies_and_a_tail() -> None:
    buf = aligned_empty(8 * DIRECT_ALIGN)
    a, b = buf[:DIRECT_ALIGN], buf[2 * DIRECT_ALIGN : 5 * DIRECT_ALIGN - 100]
    body, tail = direct_views([a, b], 2 * DIRECT_ALIGN)  # type: ignore[misc]
    assert [v.ctypes.data for v in body] == [a.ctypes.data, b.ctypes.data]
    assert [v.nbytes for v in body] == [DIRECT_ALIGN, 2 * DIRECT_ALIGN]
    assert tail is not None and tail.ctypes.data == b.ctypes.data + 2 * DIRECT_ALIGN and tail.nbytes == DIRECT_ALIGN - 100
    body, tail = direct_views([a], 0)  # type: ignore[misc]
    assert [v.ctypes.data for v in body] == [a.ctypes.data] and tail is None
    short = buf[:100]
    body, tail = direct_views([short], 0)  # type: ignore[misc]
    assert body == [] and tail is not None and tail.nbytes == 100
    # what cannot go direct: an unaligned file offset, address, or length before the last view
    assert direct_views([a], 64) is None
    assert direct_views([buf[64 : 64 + DIRECT_ALIGN]], 0) is None
    assert direct_views([buf[: DIRECT_ALIGN - 8], b], 0) is None


def test_host_buffers_are_aligned_for_direct_reads() -> None:
    for nbytes in (100, 11264, 1 << 20, 3 << 20):
        buf, pinned, _ = allocate_bytes(nbytes, device=torch.device("cpu"), pin=False, what="test")
        assert buf.numel() == nbytes and buf.data_ptr() % HOST_ALIGN == 0 and not pinned
        buf.fill_(7)  # the whole slice is usable
        assert int(buf.sum()) == 7 * nbytes


def test_local_disk_objects_have_4k_headers(tmp_path: Path) -> None:
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE)
    geo = ObjectGeometry(pool_name="kv", dtype="uint8", num_layers=2, item_bytes=100)
    key = make_keys(1)[0]
    assert backend.codec.header_bytes(geo, key) == DIRECT_ALIGN
    assert ObjectCodec(NAMESPACE).header_bytes(geo, key) < DIRECT_ALIGN  # other backends keep 64-byte padding
    with pytest.raises(ConfigError, match="header_align"):
        ObjectCodec(NAMESPACE, header_align=100)


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("range_bytes", [4096, 4 << 20])
async def test_direct_and_buffered_reads_are_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uncached: None, direct_io: bool, layout: str, range_bytes: int
) -> None:
    if direct_io:
        needs_direct(tmp_path)
    monkeypatch.setattr(local_disk, "READ_RANGE_BYTES", range_bytes)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, direct_io=direct_io, fsync=False)
    kv, mamba = make_pools(num_items=8, layout=layout, seed=11)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    opened: list[bool] = []
    real_open = object_reads.open_read
    monkeypatch.setattr(object_reads, "open_read", lambda path, direct: opened.append(direct) or real_open(path, direct))
    keys = make_keys(4, seed=f"direct-{direct_io}-{layout}-{range_bytes}")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1, 2, 3]), mamba_transfer(keys[-1:], [0])]) == [
        [True] * 4,
        [True],
    ]
    got = await backend.batch_get_v2([kv_transfer(keys, [4, 5, 6, 7]), mamba_transfer(keys[-1:], [4])])
    assert got == [[True] * 4, [True]]
    assert [slot(kv, i) for i in (4, 5, 6, 7)] == [slot(kv, i) for i in (0, 1, 2, 3)]
    assert slot(mamba, 4) == slot(mamba, 0)
    assert backend.direct_io is direct_io
    if not direct_io:
        assert not any(opened)
    elif layout == "page_first":
        # KV pages (32 KiB slots) and state slot 4 (at 4 × 11264 B, 4 KiB-aligned, with a
        # 3 KiB tail) go direct
        assert all(opened)
    else:
        # layer_first: the KV items (16 KiB) are aligned, the state's 5632-byte items are not
        assert any(opened) and not all(opened)
    await backend.aclose()


async def test_a_flipped_bit_read_directly_is_a_miss(tmp_path: Path, uncached: None) -> None:
    needs_direct(tmp_path)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, direct_io=True, fsync=False)
    kv, mamba = make_pools(num_items=8, seed=12)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    keys = make_keys(2, seed="direct-flip")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1]), mamba_transfer(keys[-1:], [0])]) == [[True] * 2, [True]]
    for name, where in ((backend.object_name(PoolName.KV, keys[0]), 5000), (backend.object_name(PoolName.MAMBA, keys[-1]), -5)):
        data = bytearray(Path(name).read_bytes())
        data[where] ^= 0x04  # a KV page's body; the state's tail, read through the bounce block
        Path(name).write_bytes(bytes(data))
    got = await backend.batch_get_v2([kv_transfer(keys, [2, 3]), mamba_transfer(keys[-1:], [4])])
    assert got == [[False, True], [False]]
    assert slot(kv, 3) == slot(kv, 1)
    assert backend.statistics().num_corrupt == 2
    await backend.aclose()


async def test_filesystems_without_direct_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_jobs, "probe_direct", lambda directory: "the filesystem refuses O_DIRECT (test)")
    auto = LocalDiskBackend((tmp_path / "a").as_uri(), namespace=NAMESPACE, direct_io=None)
    kv, mamba = make_pools(num_items=4, seed=13)
    await auto.register_host_pool_v2(PoolName.KV, kv)
    await auto.register_host_pool_v2(PoolName.MAMBA, mamba)
    keys = make_keys(2, seed="no-direct")
    assert await auto.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[True, True]]
    assert await auto.batch_get_v2([kv_transfer(keys, [2, 3])]) == [[True, True]]
    assert auto.direct_io is False and [slot(kv, 2), slot(kv, 3)] == [slot(kv, 0), slot(kv, 1)]
    await auto.aclose()
    demanded = LocalDiskBackend((tmp_path / "b").as_uri(), namespace=NAMESPACE, direct_io=True)
    await demanded.register_host_pool_v2(PoolName.KV, kv)
    with pytest.raises(ConfigError, match="direct_io=True, but the filesystem refuses O_DIRECT"):
        await demanded.batch_get_v2([kv_transfer(keys, [2, 3])])
    await demanded.aclose()
    with pytest.raises(ConfigError, match="direct_io"):
        LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, direct_io="yes")  # type: ignore[arg-type]


async def test_an_object_with_the_old_64_byte_header_is_a_miss_and_removed(tmp_path: Path) -> None:
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, fsync=False)
    kv, mamba = make_pools(num_items=4, seed=14)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    key = make_keys(1, seed="legacy")[0]
    geometry = ObjectGeometry.of_pool(PoolName.KV, kv)
    path = Path(backend.object_name(PoolName.KV, key))
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(ObjectCodec(NAMESPACE).encode(geometry, key, [np.asarray(kv.index_bytes(0).numpy()).reshape(-1)])))
    assert await backend.batch_get_v2([kv_transfer([key], [1])]) == [[False]]
    assert not path.exists() and backend.statistics().num_corrupt == 1
    assert await backend.batch_set_v2([kv_transfer([key], [0])]) == [[True]]  # written again, readable
    assert await backend.batch_get_v2([kv_transfer([key], [2])]) == [[True]] and slot(kv, 2) == slot(kv, 0)
    await backend.aclose()


async def test_the_cache_config_passes_storage_options_to_the_backend(tmp_path: Path) -> None:
    from storage_harness import SPEC

    from asynccache.cache import HybridCache
    from asynccache.config import HybridCacheConfig

    needs_direct(tmp_path)
    cfg = HybridCacheConfig(
        device_kv_pages=8,
        device_state_slots=2,
        host_kv_bytes=8 * SPEC.kv_page_bytes,
        host_state_bytes=2 * SPEC.state_bytes,
        storage_uri=tmp_path.as_uri(),
        storage_options={"direct_io": True, "max_concurrency": 3},
    )
    async with HybridCache(SPEC, cfg, device="cpu") as cache:
        backend = cache.controller.tiering.backend  # type: ignore[union-attr]
        assert isinstance(backend, LocalDiskBackend) and backend.max_concurrency == 3
        await backend.batch_exists_v2(make_keys(1), [kv_transfer([])])  # first use: the probe
        assert backend.direct_io is True
    for bad, message in (({"namespace": "x"}, "namespace"), ({"no such": 1}, "option names")):
        with pytest.raises(ConfigError, match=message):
            HybridCacheConfig(device_kv_pages=1, device_state_slots=1, storage_options=bad)


def test_the_probe_names_why_direct_reads_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from storage_backends import file_io

    def refuse(path: str, direct: bool) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(file_io, "open_read", refuse)
    assert file_io.probe_direct(str(tmp_path)) == "the filesystem refuses O_DIRECT (Invalid argument)"
    assert list(tmp_path.iterdir()) == []  # the probe file is gone either way

    def broken(path: str, direct: bool) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(file_io, "open_read", broken)
    with pytest.raises(OSError, match="Input/output"):
        file_io.probe_direct(str(tmp_path))  # other errors are not a refusal
    assert list(tmp_path.iterdir()) == []


async def test_reader_processes_read_directly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``direct_io`` the reader processes get units marked direct and land the bytes
    exactly; a flipped bit read that way is a miss."""
    needs_direct(tmp_path)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, direct_io=True, fsync=False, read_processes=2)
    kv, mamba = make_pools(num_items=8, seed=15, shared=True)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    assert backend._readers is not None
    sent: list[bool] = []
    real_read = backend._readers.read

    async def spied(units, **options):  # type: ignore[no-untyped-def]
        sent.extend(unit.direct for unit in units)
        return await real_read(units, **options)

    monkeypatch.setattr(backend._readers, "read", spied)
    keys = make_keys(4, seed="direct-procs")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1, 2, 3]), mamba_transfer(keys[-1:], [0])]) == [
        [True] * 4, [True]]
    assert await backend.batch_get_v2([kv_transfer(keys, [4, 5, 6, 7]), mamba_transfer(keys[-1:], [4])]) == [
        [True] * 4, [True]]
    assert sent and all(sent) and backend.direct_io is True
    assert [slot(kv, i) for i in (4, 5, 6, 7)] == [slot(kv, i) for i in (0, 1, 2, 3)] and slot(mamba, 4) == slot(mamba, 0)
    name = backend.object_name(PoolName.KV, keys[1])
    data = bytearray(Path(name).read_bytes())
    data[5000] ^= 0x10
    Path(name).write_bytes(bytes(data))
    names = [backend.object_name(PoolName.KV, k) for k in keys] + [backend.object_name(PoolName.MAMBA, keys[-1])]
    drop_from_page_cache(names)  # read from the drive, past the page cache
    assert slot(kv, 6) != slot(kv, 0)
    assert await backend.batch_get_v2([kv_transfer(keys[:1], [6]), kv_transfer(keys[1:2], [7])]) == [[True], [False]]
    assert slot(kv, 6) == slot(kv, 0)
    assert backend.statistics().num_corrupt == 1
    await backend.aclose()


@pytest.mark.parametrize("direct", [True, False])
def test_a_reader_process_reads_a_unit_as_it_is_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """The child's side: ``ReadUnit.direct`` decides how the object is opened."""
    codec = ObjectCodec(NAMESPACE, header_align=DIRECT_ALIGN)
    geometry = ObjectGeometry(pool_name="kv", dtype="uint8", num_layers=1, item_bytes=2 * DIRECT_ALIGN)
    key = make_keys(1, seed=f"unit-{direct}")[0]
    payload = np.arange(2 * DIRECT_ALIGN, dtype=np.uint32).astype(np.uint8)
    path = tmp_path / "object"
    path.write_bytes(bytes(codec.encode(geometry, key, [payload])))
    opened: list[bool] = []
    real_open = object_reads.open_read
    monkeypatch.setattr(object_reads, "open_read", lambda p, d: opened.append(d) or real_open(p, d))
    memory = aligned_empty(4 * DIRECT_ALIGN)
    unit = object_reads.ReadUnit(str(path), geometry, key, 0, ((0, DIRECT_ALIGN, 2 * DIRECT_ALIGN),), direct=direct)
    reply = object_reads._read_unit(codec, {0: memory}, unit, DIRECT_ALIGN, 10.0)
    assert reply[0] == "ok" and opened == [direct]
    assert bytes(memory[DIRECT_ALIGN : 3 * DIRECT_ALIGN]) == bytes(payload)


def test_the_page_cache_is_asked_without_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``in_page_cache`` through ``cachestat`` and through ``mincore`` give the same answers:
    a file just written is all there; dropped, none of it; a range read back, that range."""
    from storage_backends import page_residency

    path = tmp_path / "object"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        answers = []
        for has_cachestat in (None, False):
            monkeypatch.setattr(page_residency, "_has_cachestat", has_cachestat)
            answers.append(in_page_cache(fd, 0, 4 << 20))
        assert answers == [True, True]
        drop_from_page_cache([str(path)])
        os.pread(fd, 64 << 10, 1 << 20)  # 64 KiB in the middle (and what the kernel reads ahead)
        for has_cachestat in (None, False):
            monkeypatch.setattr(page_residency, "_has_cachestat", has_cachestat)
            got = (in_page_cache(fd, 1 << 20, 64 << 10), in_page_cache(fd, 0, 4096), in_page_cache(fd, 0, 4 << 20))
            assert got == (True, False, False)
            assert not in_page_cache(fd, 0, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("cached", [True, False])
def test_a_direct_read_takes_what_the_page_cache_holds_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    """A range all in the page cache is read through it (``stop_direct``); one that is not,
    past it. The bytes land exactly either way."""
    needs_direct(tmp_path)
    codec = ObjectCodec(NAMESPACE, header_align=DIRECT_ALIGN)
    geometry = ObjectGeometry(pool_name="kv", dtype="uint8", num_layers=1, item_bytes=64 * DIRECT_ALIGN)
    key = make_keys(1, seed=f"cached-{cached}")[0]
    payload = np.random.default_rng(1).integers(0, 256, geometry.payload_bytes, dtype=np.uint8)
    path = tmp_path / "object"
    path.write_bytes(bytes(codec.encode(geometry, key, [payload])))
    if not cached:
        drop_from_page_cache([str(path)])
    stopped: list[int] = []
    real_stop = object_reads.stop_direct
    monkeypatch.setattr(object_reads, "stop_direct", lambda fd: stopped.append(fd) or real_stop(fd))
    for offset in (0, 32 * DIRECT_ALIGN):  # the header's range, and one after it
        dest = aligned_empty(geometry.payload_bytes - offset)
        got = object_reads.read_object_range(
            str(path), codec, geometry, key, offset, [dest], piece_bytes=16 * DIRECT_ALIGN, stop=None,
            deadline=float("inf"), direct=True,
        )
        assert got is not False and bytes(dest) == bytes(payload[offset:])
    assert len(stopped) == (2 if cached else 0)
