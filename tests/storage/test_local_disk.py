"""Local-disk specifics: a full disk, leftovers of crashed writers, timeouts, cancellation."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Self

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_harness import (
    NAMESPACE,
    kv_transfer,
    make_keys,
    make_pools,
    mamba_transfer,
    slot,
)

from asynccache.errors import BackendError, ConfigError
from asynccache.storage import PoolName
from storage_backends import disk_jobs, local_disk, object_reads
from storage_backends.local_disk import STALE_TMP_S, LocalDiskBackend
from storage_backends.object_format import payload_range
from storage_backends.ranged_reads import item_outcomes, read_units


async def open_disk(root: Path, **options: object) -> tuple[LocalDiskBackend, object, object]:
    backend = LocalDiskBackend(f"file://{root}", namespace=NAMESPACE, **options)
    kv, mamba = make_pools(seed=1)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    return backend, kv, mamba


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


async def test_disk_full_skips_the_backup_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    backend, _kv, _ = await open_disk(tmp_path)
    keys = make_keys(3, seed="full")
    assert await backend.batch_set_v2([kv_transfer(keys[:1], [0])]) == [[True]]

    def no_space(fd: int, views: list[memoryview], offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_jobs, "pwritev_all", no_space)
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await backend.batch_set_v2([kv_transfer(keys[1:], [1, 2])]) == [[False, False]]
    assert "2 of 2 items failed" in caplog.text and "No space left" in caplog.text
    assert backend.statistics().num_failures == 2
    assert not any(f.endswith(".tmp") for f in files(tmp_path))
    assert await backend.batch_exists_v2(keys, [kv_transfer([])]) is not None
    assert (await backend.batch_exists_v2(keys, [kv_transfer([])])).num_hit_pages == 1
    await backend.aclose()


async def test_a_temporary_file_that_cannot_be_removed_fails_no_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The object is linked to its name, then its temporary file cannot be removed: the write
    stored the object — a success, the leftover logged — not a failure."""
    backend, kv, _ = await open_disk(tmp_path, fsync=False)
    keys = make_keys(2, seed="tmp-stays")
    unlink = os.unlink

    def refuse_tmp(path: str, *args: object, **kwargs: object) -> None:
        if str(path).endswith(".tmp"):
            raise OSError(errno.EACCES, "Permission denied", path)
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse_tmp)
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await backend.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[True, True]]
    monkeypatch.undo()
    assert "could not remove the temporary file" in caplog.text and "Permission denied" in caplog.text
    stats = backend.statistics()
    assert stats.num_failures == 0 and stats.num_writes == 2
    assert sum(f.endswith(".tmp") for f in files(tmp_path)) == 2
    assert await backend.batch_get_v2([kv_transfer(keys, [6, 7])]) == [[True, True]]
    assert [slot(kv, 6), slot(kv, 7)] == [slot(kv, 0), slot(kv, 1)]
    await backend.aclose()


SMALL_FS_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys
    sys.path[:0] = [{tests!r}, {repo!r}]
    from storage_harness import NAMESPACE, kv_transfer, make_keys, make_pools
    from asynccache.storage import PoolName
    from storage_backends.local_disk import LocalDiskBackend

    async def main():
        backend = LocalDiskBackend("file://" + sys.argv[1], namespace=NAMESPACE, fsync=True)
        kv, _ = make_pools(num_items=64, seed=3)
        await backend.register_host_pool_v2(PoolName.KV, kv)
        keys = make_keys(64, seed="smallfs")
        results = (await backend.batch_set_v2([kv_transfer(keys, range(64))]))[0]
        kv2, _ = make_pools(num_items=64, seed=None)
        await backend.register_host_pool_v2(PoolName.KV, kv2)
        stored = [k for k, ok in zip(keys, results) if ok]
        idx = [keys.index(k) for k in stored]
        got = (await backend.batch_get_v2([kv_transfer(stored, idx)]))[0]
        same = all(kv.index_bytes(i).numpy().tobytes() == kv2.index_bytes(i).numpy().tobytes() for i in idx)
        tmp = [f for _, _, fs in os.walk(sys.argv[1]) for f in fs if f.endswith(".tmp")]
        stats = backend.statistics()
        await backend.aclose()
        print(json.dumps({{"written": sum(results), "read_back": all(got), "same": same, "tmp": len(tmp),
                          "failures": stats.num_failures}}))

    asyncio.run(main())
    """
)


def test_a_really_full_filesystem(tmp_path: Path) -> None:
    """A 1 MiB tmpfs in a private mount namespace (skipped where unshare is not allowed)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) not available")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    script = tmp_path / "fill.py"
    tests_dir = str(Path(__file__).parent)
    repo = str(Path(__file__).parents[2])
    script.write_text(SMALL_FS_SCRIPT.format(tests=tests_dir, repo=repo))
    cmd = (f"mount -t tmpfs -o size=1m tmpfs {mount_point} && "
           f"exec {sys.executable} -W error {script} {mount_point}")
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip(f"unprivileged mount namespaces unavailable: {probe.stderr.decode()[:200]}")
    proc = subprocess.run([unshare, "-rm", "sh", "-c", cmd], capture_output=True, timeout=120, text=True, check=False)
    if proc.returncode != 0 and "mount" in proc.stderr and "permission" in proc.stderr.lower():
        pytest.skip(f"tmpfs mount refused: {proc.stderr[:200]}")
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 64 pages of 32 KiB do not fit in 1 MiB: some are stored, the rest fail cleanly
    assert 0 < out["written"] < 64 and out["failures"] == 64 - out["written"]
    assert out["read_back"] and out["same"] and out["tmp"] == 0


@pytest.mark.parametrize("capacity_bytes", [1 << 20, None])
async def test_stale_temporary_files_are_removed_at_first_use(tmp_path: Path, capacity_bytes: int | None) -> None:
    """By the capacity's scan, or without a capacity by a sweep beside the calls."""
    backend, _kv, _ = await open_disk(tmp_path, capacity_bytes=capacity_bytes)
    keys = make_keys(2, seed="tmp")
    await backend.batch_set_v2([kv_transfer(keys, [0, 1])])
    name = backend.object_name(PoolName.KV, keys[0])
    stale, fresh = Path(name + ".dead.tmp"), Path(name + ".live.tmp")
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 100)
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    Path(backend.namespace_dir, "kv", "zz").mkdir()
    Path(backend.namespace_dir, "kv", "zz", "not-a-key").write_bytes(b"z")
    await backend.aclose()
    again, _, _ = await open_disk(tmp_path, capacity_bytes=capacity_bytes)
    result = await again.batch_exists_v2(keys, [kv_transfer([])])
    assert result.num_hit_pages == 2
    if capacity_bytes is None:
        async with asyncio.timeout(10):
            assert again._sweep is not None
            await again._sweep
    assert not stale.exists() and fresh.exists()
    if capacity_bytes is not None:
        size = again.codec.object_bytes(again._geometry(PoolName.KV)[1], keys[0])
        assert again.statistics().used_bytes == 2 * size  # foreign files are not counted
    await again.aclose()


async def test_a_timed_out_read_never_touches_the_slot_after_returning(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _kv, mamba = await open_disk(tmp_path, timeout_s=0.2, read_piece_bytes=4096)  # many pieces: the deadline is checked between them
    keys = make_keys(1, seed="slow")
    await backend.batch_set_v2([mamba_transfer(keys, [0])])
    _dst_kv, dst = make_pools(seed=None)
    await backend.register_host_pool_v2(PoolName.MAMBA, dst)
    release = threading.Event()
    real = object_reads.preadv_all
    returned = threading.Event()

    def slow(fd: int, views: list[memoryview], offset: int) -> None:
        if offset > 0:  # payload pieces: wait past the deadline, then continue
            release.wait(1.0)
        real(fd, views, offset)
        returned.set()

    monkeypatch.setattr(object_reads, "preadv_all", slow)
    async with asyncio.timeout(20):
        assert await backend.batch_get_v2([mamba_transfer(keys, [1])]) == [[False]]
    assert returned.is_set()  # the worker's last write into the slot happened before the call returned
    assert backend.statistics().num_timeouts == 1
    assert slot(dst, 1) != slot(mamba, 0)  # never completed
    await backend.aclose()


async def test_no_fsync_and_no_leftovers(tmp_path: Path) -> None:
    backend, _kv, _mamba = await open_disk(tmp_path, fsync=False, max_concurrency=3)
    keys = make_keys(20, seed="nofsync")
    assert await backend.batch_set_v2([kv_transfer(keys[:8], range(8)), mamba_transfer(keys[8:16], range(8))]) == [
        [True] * 8, [True] * 8]
    names = files(tmp_path)
    assert len(names) == 16 and not any(n.endswith(".tmp") for n in names)
    assert all(len(Path(n).parts) == 4 for n in names)  # namespace / pool / shard / key
    await backend.aclose()


@pytest.mark.parametrize("piece", [4096, 4 << 20])
async def test_read_piece_size_round_trips_and_catches_corruption(tmp_path: Path, piece: int) -> None:
    backend = LocalDiskBackend((tmp_path / "l3").as_uri(), namespace=NAMESPACE, read_piece_bytes=piece)
    kv, mamba = make_pools(num_items=8, seed=3)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    keys = make_keys(3, seed=f"piece{piece}")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1, 2]), mamba_transfer(keys[-1:], [0])]) == [[True] * 3, [True]]
    assert await backend.batch_get_v2([kv_transfer(keys, [4, 5, 6]), mamba_transfer(keys[-1:], [5])]) == [[True] * 3, [True]]
    assert [slot(kv, i) for i in (4, 5, 6)] == [slot(kv, i) for i in (0, 1, 2)]
    assert slot(mamba, 5) == slot(mamba, 0)
    path = Path(backend.object_name(PoolName.MAMBA, keys[-1]))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    assert await backend.batch_get_v2([mamba_transfer(keys[-1:], [6])]) == [[False]]
    await backend.aclose()


def test_read_piece_size_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="read_piece_bytes"):
        LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, read_piece_bytes=100)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("piece", [4096, 4 << 20])
async def test_large_objects_are_read_as_ranges_and_checked_as_a_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, piece: int
) -> None:
    monkeypatch.setattr(local_disk, "READ_RANGE_BYTES", 4096)  # every object of the tiny spec is "large"
    backend = LocalDiskBackend((tmp_path / "l3").as_uri(), namespace=NAMESPACE, read_piece_bytes=piece)
    kv, mamba = make_pools(num_items=8, layout=layout, seed=5)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    keys = make_keys(3, seed=f"ranges-{layout}-{piece}")
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1, 2]), mamba_transfer(keys[-1:], [0])]) == [[True] * 3, [True]]
    calls: list[tuple[bool, int, int]] = []
    real = backend._read_range

    def spy(stop: threading.Event, deadline: float, item: object, offset: int, length: int) -> object:
        calls.append((item.pool is mamba, offset, length))  # type: ignore[attr-defined]
        return real(stop, deadline, item, offset, length)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "_read_range", spy)
    assert await backend.batch_get_v2([kv_transfer(keys, [4, 5, 6]), mamba_transfer(keys[-1:], [5])]) == [[True] * 3, [True]]
    assert [slot(kv, i) for i in (4, 5, 6)] == [slot(kv, i) for i in (0, 1, 2)]
    assert slot(mamba, 5) == slot(mamba, 0)
    state_bytes = len(slot(mamba, 0))
    state_ranges = [(o, n) for is_state, o, n in calls if is_state]
    assert sorted(state_ranges) == [(o, min(4096, state_bytes - o)) for o in range(0, state_bytes, 4096)]
    assert len(calls) > 4  # the pages too: more ranges than objects
    # A flipped byte in the state's last range (not the one that carries the header) is caught
    # when the ranges' checksums are added up: a miss, counted as a corruption, the object removed.
    path = Path(backend.object_name(PoolName.MAMBA, keys[-1]))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    before = backend.statistics().num_corrupt
    assert await backend.batch_get_v2([mamba_transfer(keys[-1:], [6])]) == [[False]]
    assert backend.statistics().num_corrupt == before + 1
    assert not path.exists()
    await backend.aclose()


def test_read_units_put_the_ranges_of_large_objects_first() -> None:
    from types import SimpleNamespace

    def item(payload: int) -> object:
        return SimpleNamespace(geometry=SimpleNamespace(payload_bytes=payload))

    big = local_disk.READ_RANGE_BYTES
    units = read_units([item(100), item(big), item(2 * big + 16), item(7)], big)  # type: ignore[list-item]
    assert units == [(2, 0, big), (2, big, big), (2, 2 * big, 16), (0, 0, 100), (1, 0, big), (3, 0, 7)]


def test_item_outcomes_combine_the_ranges() -> None:
    from asynccache.errors import ObjectFormatError

    units = [(0, 0, 4096), (0, 4096, 4096), (1, 0, 10), (2, 0, 4096), (2, 4096, 4096), (3, 0, 4096), (3, 4096, 5)]
    corrupt = ObjectFormatError("bad header")
    f = (1, 10)  # the file each range read
    results: list[object] = [(7, 3, f), (None, 4, f), False, (9, 5, f), OSError("io"), (2**64 - 1, 2**64 - 1, f), (None, 0, f)]
    outcomes = item_outcomes(4, units, results)
    assert outcomes[0] is True  # 3 + 4 == 7
    assert outcomes[1] is False  # absent
    assert isinstance(outcomes[2], OSError)
    assert outcomes[3] is True  # sums wrap mod 2**64: (2**64 - 1) + 0
    mismatch = item_outcomes(1, units[:2], [(7, 3, f), (None, 5, f)])[0]
    assert isinstance(mismatch, ObjectFormatError) and "checksum" in str(mismatch)
    # Ranges that read two files (the object was replaced between them): a failure, not a
    # corruption, even though their checksums do not add up.
    replaced = item_outcomes(1, units[:2], [(7, 3, f), (None, 5, (1, 11))])[0]
    assert isinstance(replaced, BackendError) and not isinstance(replaced, ObjectFormatError)
    assert "replaced" in str(replaced)
    absent_late = item_outcomes(1, units[:2], [(7, 3, f), False])[0]
    assert absent_late is False  # removed between two ranges: a miss
    first_error = item_outcomes(1, units[:2], [OSError("io"), corrupt])[0]
    assert first_error is corrupt  # a corruption is reported before other failures


def test_payload_range_crosses_buffers() -> None:
    import numpy as np

    bufs = [np.arange(10, dtype=np.uint8), np.arange(10, 16, dtype=np.uint8), np.arange(16, 20, dtype=np.uint8)]
    assert np.concatenate(payload_range(bufs, 8, 17)).tolist() == list(range(8, 17))
    assert np.concatenate(payload_range(bufs, 0, 20)).tolist() == list(range(20))
    assert [v.tolist() for v in payload_range(bufs, 16, 20)] == [[16, 17, 18, 19]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    range_blocks=st.integers(1, 4),
    layout=st.sampled_from(["page_first", "layer_first"]),
    piece=st.sampled_from([4096, 8192, 4 << 20]),
    flip=st.one_of(st.none(), st.floats(0.0, 1.0, exclude_max=True)),
    bit=st.integers(0, 7),
)
async def test_ranged_reads_serve_exact_bytes_or_miss(
    tmp_path_factory: pytest.TempPathFactory, range_blocks: int, layout: str, piece: int, flip: float | None, bit: int
) -> None:
    """Whatever the range size, slot layout and piece size: an intact object reads back bit for
    bit, and one flipped bit anywhere in the file (header or payload) is a miss, never served."""
    root = tmp_path_factory.mktemp("ranged")
    saved = local_disk.READ_RANGE_BYTES
    local_disk.READ_RANGE_BYTES = range_blocks * 4096
    try:
        backend = LocalDiskBackend(root.as_uri(), namespace=NAMESPACE, read_piece_bytes=piece, fsync=False)
        kv, mamba = make_pools(num_items=4, layout=layout, seed=range_blocks)
        await backend.register_host_pool_v2(PoolName.KV, kv)
        await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
        keys = make_keys(2, seed=f"prop-{range_blocks}-{layout}-{piece}")
        assert await backend.batch_set_v2([kv_transfer(keys, [0, 1]), mamba_transfer(keys[-1:], [0])]) == [[True] * 2, [True]]
        if flip is not None:
            path = Path(backend.object_name(PoolName.MAMBA, keys[-1]))
            data = bytearray(path.read_bytes())
            data[int(flip * len(data))] ^= 1 << bit
            path.write_bytes(bytes(data))
        got = await backend.batch_get_v2([kv_transfer(keys, [2, 3]), mamba_transfer(keys[-1:], [1])])
        assert got[0] == [True, True]
        assert [slot(kv, 2), slot(kv, 3)] == [slot(kv, 0), slot(kv, 1)]
        if flip is None:
            assert got[1] == [True] and slot(mamba, 1) == slot(mamba, 0)
        else:
            assert got[1] == [False]
        await backend.aclose()
    finally:
        local_disk.READ_RANGE_BYTES = saved


async def test_a_root_that_cannot_be_made_is_a_miss_until_it_can(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Setting the backend up at first use can fail like any I/O (a file where the root should
    be): the calls are misses, counted and reported, and a call after ``setup_retry_s`` tries
    again."""
    blocker = tmp_path / "store"
    blocker.write_bytes(b"not a directory")
    backend, kv, _ = await open_disk(blocker / "root", capacity_bytes=1 << 30)
    backend.setup_retry_s = 0.0  # every call tries again
    keys = make_keys(2, seed="notready")
    with caplog.at_level(logging.WARNING, logger="asynccache.storage"):
        assert await backend.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[False, False]]
        assert await backend.batch_get_v2([kv_transfer(keys, [2, 3])]) == [[False, False]]
        res = await backend.batch_exists_v2(keys, [kv_transfer([])])
    assert res.num_hit_pages == 0 and res.exists[PoolName.KV] == (False, False)
    assert backend.statistics().num_failures == 2 + 2 + 2 and "not ready" in caplog.text
    blocker.unlink()  # the obstacle is gone: the next call sets the backend up
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[True, True]]
    assert await backend.batch_get_v2([kv_transfer(keys, [2, 3])]) == [[True, True]]
    assert [slot(kv, 2), slot(kv, 3)] == [slot(kv, 0), slot(kv, 1)]
    await backend.aclose()


async def test_objects_removed_during_the_scan_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first-use scan races with other processes: a shard directory or an object that is
    gone by the time it is looked at is skipped, not an error."""
    writer, _, _ = await open_disk(tmp_path)
    keys = make_keys(6, seed="scanrace")
    assert await writer.batch_set_v2([kv_transfer(keys, range(6))]) == [[True] * 6]
    await writer.aclose()
    real_scandir = os.scandir
    vanished = {writer.object_name(PoolName.KV, keys[0])}
    gone_shard = os.path.dirname(writer.object_name(PoolName.KV, keys[1]))

    class Vanishing:
        def __init__(self, entry: os.DirEntry) -> None:
            self._entry = entry
            self.name, self.path = entry.name, entry.path

        def is_file(self, *, follow_symlinks: bool = True) -> bool:
            return self._entry.is_file(follow_symlinks=follow_symlinks)

        def is_dir(self, *, follow_symlinks: bool = True) -> bool:
            return self._entry.is_dir(follow_symlinks=follow_symlinks)

        def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
            if self.path in vanished:
                raise FileNotFoundError(self.path)
            return self._entry.stat(follow_symlinks=follow_symlinks)

    class Listing(list):  # what os.scandir gives: iterable and a context manager
        def __enter__(self) -> Self:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def scandir(path: str) -> Listing:
        if path == gone_shard:
            raise FileNotFoundError(path)
        with real_scandir(path) as entries:
            return Listing(Vanishing(e) for e in entries)

    monkeypatch.setattr(disk_jobs.os, "scandir", scandir)
    backend, _, _ = await open_disk(tmp_path, capacity_bytes=1 << 30)
    res = await backend.batch_exists_v2(keys[2:], [kv_transfer([])])
    monkeypatch.undo()
    assert res.num_hit_pages == 4
    listed = {name for name, _ in backend._scan(threading.Event())}
    assert {backend.object_name(PoolName.KV, k) for k in keys} == listed
    skipped = {backend.object_name(PoolName.KV, k) for k in keys[:2]}
    tracked = set(backend._capacity._sizes)  # type: ignore[union-attr]
    assert tracked.isdisjoint(skipped) and len(tracked) >= 4
    await backend.aclose()


async def test_a_scan_longer_than_timeout_s_runs_to_its_end_and_aclose_stops_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first-use scan of a large namespace (here: slow directory listings, as on a network
    filesystem) may take longer than ``timeout_s`` in all: it reports each shard directory it
    has listed, so it runs to its end while calls are misses, and the backend then serves what
    it found. ``aclose`` stops a scan in progress between files."""
    writer, _, _ = await open_disk(tmp_path)
    keys = make_keys(8, seed="slowscan")
    assert await writer.batch_set_v2([kv_transfer(keys, range(8))]) == [[True] * 8]
    await writer.aclose()
    stored = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    real_scandir = os.scandir
    delay_s = {"shard": 0.15}  # per shard directory: 8 of them, 1.2 s in all

    def slow_scandir(path: str) -> object:
        if os.path.basename(os.path.dirname(path)) == "kv":  # a shard directory of the kv pool
            time.sleep(delay_s["shard"])
        return real_scandir(path)

    monkeypatch.setattr(local_disk.os, "scandir", slow_scandir)
    backend, _, _ = await open_disk(tmp_path, capacity_bytes=1 << 30, timeout_s=0.3)
    t0 = time.monotonic()
    assert await backend.batch_get_v2([kv_transfer(keys[:2], [0, 1])]) == [[False] * 2]
    assert time.monotonic() - t0 < 1.0  # waited for the setup at most timeout_s
    async with asyncio.timeout(20):
        while await backend.batch_get_v2([kv_transfer(keys[:2], [0, 1])]) != [[True] * 2]:
            await asyncio.sleep(0.05)
    assert backend.statistics().used_bytes == stored
    await backend.aclose()

    delay_s["shard"] = 0.5
    closing, _, _ = await open_disk(tmp_path, capacity_bytes=1 << 30, timeout_s=20.0)
    waiting = asyncio.create_task(closing.batch_get_v2([kv_transfer(keys[:2], [0, 1])]))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    t0 = time.monotonic()
    await closing.aclose()
    assert time.monotonic() - t0 < 2.0  # the scan stopped after the directory it was listing
    assert await waiting == [[False] * 2]
    monkeypatch.undo()


async def test_aclose_returns_while_a_scan_is_stuck_in_a_system_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first-use scan stuck in one directory listing (a hung mount: the call does not return,
    so the scan never reaches its next check of ``stop``) holds neither ``aclose`` nor the calls
    that waited for the setup; its thread exits once the listing returns."""
    release = threading.Event()
    real_scandir = os.scandir

    def hung_scandir(path: str) -> object:
        if os.path.basename(os.path.dirname(path)) == "kv":
            release.wait(30)
        return real_scandir(path)

    writer, _, _ = await open_disk(tmp_path)
    keys = make_keys(2, seed="hungscan")
    assert await writer.batch_set_v2([kv_transfer(keys, [0, 1])]) == [[True] * 2]
    await writer.aclose()
    monkeypatch.setattr(local_disk.os, "scandir", hung_scandir)
    backend, _, _ = await open_disk(tmp_path, capacity_bytes=1 << 30, timeout_s=20.0)
    waiting = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, [0, 1])]))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    threads = list(backend._workers._state.threads)
    try:
        t0 = time.monotonic()
        async with asyncio.timeout(10):
            await backend.aclose()
        assert time.monotonic() - t0 < 2.0
        assert await waiting == [[False] * 2]
        assert any(t.is_alive() for t in threads)  # still in the listing
    finally:
        release.set()
    async with asyncio.timeout(10):
        while any(t.is_alive() for t in threads):
            await asyncio.sleep(0.02)
    monkeypatch.undo()


async def test_exists_on_slow_metadata_stops_at_its_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _, _ = await open_disk(tmp_path, timeout_s=0.2)
    keys = make_keys(200, seed="slowstat")
    await backend.batch_exists_v2(keys[:1], [kv_transfer([])])  # set up before the slow part
    real_stat = os.stat

    def slow_stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).startswith(str(tmp_path)):
            time.sleep(0.01)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(local_disk.os, "stat", slow_stat)
    t0 = time.perf_counter()
    res = await backend.batch_exists_v2(keys, [kv_transfer([])])
    took = time.perf_counter() - t0
    monkeypatch.undo()
    assert res.num_hit_pages == 0 and backend.statistics().num_timeouts == len(keys)  # each key of the window
    assert took < 1.0  # 200 stats of 10 ms would take 2 s: the job stopped at the timeout
    await backend.aclose()


async def test_closing_during_a_call_makes_its_unread_items_misses(tmp_path: Path) -> None:
    writer, _, _ = await open_disk(tmp_path)
    keys = make_keys(8, seed="closing")
    assert await writer.batch_set_v2([kv_transfer(keys, range(8))]) == [[True] * 8]
    await writer.aclose()
    backend, _, _ = await open_disk(tmp_path, max_concurrency=1)
    await backend.batch_exists_v2(keys[:1], [kv_transfer([])])  # set up
    call = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys[:4], [4, 5, 6, 7])]))
    await asyncio.sleep(0)  # the call is past its checks
    await backend.aclose()
    got = await call  # no exception: what was read is a hit, the rest misses
    assert len(got[0]) == 4 and backend.statistics().num_failures == got[0].count(False)
    with pytest.raises(Exception, match="closed"):
        await backend.batch_get_v2([kv_transfer(keys[:1], [4])])


async def test_a_large_object_replaced_between_its_ranges_is_a_failure_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each range opens the object by name; when another writer replaces it with another valid
    object between two ranges, the read is a failure (tried again later), and the replacement
    stays: it is not taken for a corruption and removed."""
    monkeypatch.setattr(local_disk, "READ_RANGE_BYTES", 4096)  # the small spec's state as ranges
    keys = make_keys(1, seed="replaced")
    backend, _, mamba = await open_disk(tmp_path / "a", max_concurrency=1)
    assert await backend.batch_set_v2([mamba_transfer(keys, [0])]) == [[True]]
    other, _, _ = await open_disk(tmp_path / "b")
    _, other_mamba = make_pools(seed=9)
    await other.register_host_pool_v2(PoolName.MAMBA, other_mamba)
    assert await other.batch_set_v2([mamba_transfer(keys, [0])]) == [[True]]
    name, replacement = backend.object_name(PoolName.MAMBA, keys[0]), other.object_name(PoolName.MAMBA, keys[0])
    real = backend._read_range
    replaced: list[bool] = []

    def read_then_replace(*args):  # type: ignore[no-untyped-def]
        out = real(*args)
        if not replaced:
            replaced.append(True)
            shutil.copyfile(replacement, name + ".x.tmp")
            os.replace(name + ".x.tmp", name)
        return out

    monkeypatch.setattr(backend, "_read_range", read_then_replace)
    assert await backend.batch_get_v2([mamba_transfer(keys, [3])]) == [[False]]
    stats = backend.statistics()
    assert stats.num_corrupt == 0 and stats.num_failures == 1
    assert Path(name).read_bytes() == Path(replacement).read_bytes()  # the replacement stays
    monkeypatch.setattr(backend, "_read_range", real)
    assert await backend.batch_get_v2([mamba_transfer(keys, [3])]) == [[True]]  # read again: whole
    assert slot(mamba, 3) == slot(other_mamba, 0)
    await backend.aclose()
    await other.aclose()


async def test_first_use_sets_up_now_or_raises_why_not(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    bad = LocalDiskBackend((a_file / "root").as_uri(), namespace=NAMESPACE)
    with pytest.raises(BackendError, match="not ready"):
        await bad.first_use()
    await bad.aclose()
    good = LocalDiskBackend((tmp_path / "root").as_uri(), namespace=NAMESPACE)
    await good.first_use()
    assert Path(good.namespace_dir).is_dir()
    await good.first_use()  # once set up, nothing more
    await good.aclose()
    with pytest.raises(BackendError, match="closed"):
        await good.first_use()
