"""The local disk's reader processes (``read_processes``): reads into shared-memory pools in
child processes; failures of a child are misses, never wrong bytes; a cancelled read waits for
the child; children start without torch and stop with the backend. (The whole conformance
suite also runs on them: the ``disk-procs`` harness.)"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
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

from asynccache.cache import HybridCache, effective_storage_options
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError
from asynccache.read_landing import ReadLanding
from asynccache.storage import PoolName
from storage_backends import reader_child, reader_processes
from storage_backends.local_disk import LocalDiskBackend
from storage_backends.reader_child import _CHILD, _PACKAGES_ROOT


async def open_procs(root: Path, *, shared: bool = True, **options: object):
    options.setdefault("read_processes", 2)
    backend = LocalDiskBackend(root.as_uri(), namespace=NAMESPACE, fsync=False, **options)
    kv, mamba = make_pools(16, seed=3, shared=shared)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    return backend, kv, mamba


async def stored(backend: LocalDiskBackend, n: int, seed: str) -> list[str]:
    keys = make_keys(n, seed=seed)
    assert await backend.batch_set_v2([kv_transfer(keys, range(n)), mamba_transfer(keys[-1:], [0])]) == [
        [True] * n, [True]]
    return keys


async def reads_back(backend: LocalDiskBackend, kv: object, keys: list[str]) -> None:
    """The pages of ``keys`` (slots 0…) read back into slots 8…, every one a hit, bytes equal."""
    n = len(keys)
    assert await backend.batch_get_v2([kv_transfer(keys, range(8, 8 + n))]) == [[True] * n]
    assert [slot(kv, 8 + i) for i in range(n)] == [slot(kv, i) for i in range(n)]


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

    async def counted(units, **options):
        calls.append(len(units))
        return await real(units, **options)

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


async def test_a_backend_dropped_unclosed_kills_its_children(tmp_path: Path) -> None:
    """The loop's watch of a child's socket kept the children running after their backend was
    collected, until the loop closed: the backend's finalizer kills them, and the watch reaps
    them."""
    backend, kv, _ = await open_procs(tmp_path)
    await reads_back(backend, kv, await stored(backend, 2, "dropped"))
    procs = [c.process for c in backend._readers._children if c is not None]
    assert procs and all(p.poll() is None for p in procs)
    ref = weakref.ref(backend)
    del backend
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert all(p.poll() is not None for p in procs)


async def test_pools_outside_shared_memory_are_read_by_the_threads(tmp_path: Path) -> None:
    backend, kv, _ = await open_procs(tmp_path, shared=False)
    keys = await stored(backend, 4, "threads")

    async def refuse(units, **options):
        raise AssertionError("the reader processes cannot reach these pools")

    backend._readers.read = refuse  # type: ignore[method-assign]
    await reads_back(backend, kv, keys)
    await backend.aclose()


async def test_a_child_killed_mid_read_costs_no_hit_and_no_wrong_byte(tmp_path: Path, monkeypatch) -> None:
    """A child killed with a chunk in hand: the threads read that chunk's units again, every
    unit is a hit with the stored bytes, and the next read starts a new child."""
    backend, kv, _ = await open_procs(tmp_path)
    keys = await stored(backend, 8, "killed")
    assert await backend.batch_get_v2([kv_transfer(keys, range(8, 16))]) == [[True] * 8]
    victim = backend._readers._children[0]
    send = reader_processes.ReaderProcesses._send

    def send_then_kill(self: object, child: object, msg: tuple) -> object:
        fut = send(self, child, msg)
        if child is victim and msg[0] == "read":
            victim.process.kill()
        return fut

    monkeypatch.setattr(reader_processes.ReaderProcesses, "_send", send_then_kill)
    kv.buffer[8:16].fill_(0)
    assert await backend.batch_get_v2([kv_transfer(keys, range(8, 16))]) == [[True] * 8]
    assert [slot(kv, 8 + i) for i in range(8)] == [slot(kv, i) for i in range(8)]
    assert victim.dead and backend.statistics().num_failures == 0
    monkeypatch.undo()
    kv.buffer[8:16].fill_(0)
    await reads_back(backend, kv, keys)
    async with asyncio.timeout(10):  # started again, beside the reads
        while not backend._readers._is_up(0):
            await asyncio.sleep(0.01)
    assert backend._readers._children[0] is not victim
    await backend.aclose()


async def test_a_child_killed_with_a_reply_untaken_and_a_request_unread_fails_the_request_at_once(
    tmp_path: Path,
) -> None:
    """The child answers one request, then is killed with the next unread: its connection is
    reset behind the reply. uvloop calls the socket's reader once (which takes the reply) and
    then drops the descriptor, so the socket's end is never seen; the request must still fail
    within moments, not wait for its kill timer (30 s here) and then for ever."""
    backend, kv, _ = await open_procs(tmp_path, timeout_s=30.0)
    keys = await stored(backend, 2, "reset")
    await reads_back(backend, kv, keys)  # the children are up
    readers = backend._readers
    child = readers._children[0]
    answered = readers._send(child, ("ping",))
    time.sleep(0.5)  # noqa: ASYNC251 — the loop must not run: the reply waits in our socket
    os.kill(child.process.pid, signal.SIGSTOP)
    unread = readers._send(child, ("ping",))  # lands in the stopped child's socket, unread
    child.process.kill()
    child.process.wait()
    with contextlib.suppress(reader_child.ReaderLost):  # (found dead before its reply was taken)
        assert (await answered)[0] == "ok"
    with pytest.raises(reader_child.ReaderLost):
        async with asyncio.timeout(5):
            await unread
    assert child.dead
    await reads_back(backend, kv, keys)  # the other child, the threads or a new child read
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


@pytest.mark.parametrize(
    "uri,device,options,host,expected",
    [
        ("file:///tmp/x", "cuda", {}, True, 8),  # the local disk's default concurrency
        ("file:///tmp/x", "cuda:1", {"max_concurrency": 3}, True, 3),
        ("file:///tmp/x", "cuda", {"max_concurrency": 64}, True, 16),  # one per usable core at most
        ("file:///tmp/x", "cuda", {"read_processes": 0}, True, 0),  # the caller's choice stays
        ("file:///tmp/x", "cuda", {"read_processes": 2}, True, 2),
        ("file:///tmp/x", "cpu", {}, True, None),  # threads on CPU
        ("file:///tmp/x", "cuda", {"compression": "zstd"}, True, None),  # cannot be combined
        ("file:///tmp/x", "cuda", {"direct_io": True}, True, 8),  # the children read directly
        ("file:///tmp/x", "cuda", {"direct_io": False}, True, 8),  # through the page cache
        ("file:///tmp/x", "cuda", {}, False, None),  # no host pools for children to fill
        ("memory://", "cuda", {}, True, None),
        ("s3://bucket/p", "cuda", {}, True, None),
    ],
)
def test_reader_processes_are_the_default_for_a_local_disk_on_cuda(
    uri: str, device: str, options: dict[str, object], host: bool, expected: int | None, monkeypatch
) -> None:
    import storage_backends.base

    monkeypatch.setattr(LocalDiskBackend, "default_max_concurrency", 8)
    monkeypatch.setattr(storage_backends.base, "usable_cores", lambda: 16)
    cfg = HybridCacheConfig(
        device_kv_pages=8, device_state_slots=4, host_kv_bytes=SPEC.kv_page_bytes if host else 0,
        storage_uri=uri, storage_options=options,
    )
    got = effective_storage_options(cfg, device)
    assert got.get("read_processes") == expected
    chosen = expected is not None and "read_processes" not in options
    # processes the cache chose read directly where the filesystem allows, unless told otherwise
    assert {k: v for k, v in got.items() if k != "read_processes"} == {
        **({"direct_io": None} if chosen else {}), **{k: v for k, v in options.items() if k != "read_processes"}}
    # accounting pools (trace replay) have no memory for children to map
    assert "read_processes" not in effective_storage_options(cfg, device, materialize=False) or "read_processes" in options


async def test_shared_pools_the_cache_chose_fall_back_to_threads_when_unavailable(tmp_path: Path, monkeypatch) -> None:
    """Reader processes the cache chose itself (CUDA) fall back to the threads when shared host
    memory cannot be had (here: registration refused); asked for by the caller, it is an error."""
    import asynccache.cache as cache_module
    from asynccache.errors import SharedMemoryError
    from asynccache.pools import memory

    def refuse(self: object, size: int, *, pin: bool, what: str) -> None:
        raise SharedMemoryError(f"{what}: cudaHostRegister refused")

    monkeypatch.setattr(memory.SharedHostMemory, "__init__", refuse)
    def as_on_cuda(config: HybridCacheConfig, device: object, *, materialize: bool = True) -> dict[str, object]:
        return {"read_processes": 2, **config.storage_options}

    monkeypatch.setattr(cache_module, "effective_storage_options", as_on_cuda)
    cfg = HybridCacheConfig(
        device_kv_pages=8, device_state_slots=4, host_kv_bytes=8 * SPEC.kv_page_bytes,
        host_state_bytes=2 * SPEC.state_bytes, storage_uri=tmp_path.as_uri(),
    )
    async with HybridCache(SPEC, cfg) as cache:
        assert cache.storage_options == {"read_processes": 0}
        assert cache.host_kv.shared_memory is None and cache.controller.tiering.backend._readers is None
    with pytest.raises(SharedMemoryError, match="refused"):
        HybridCache(SPEC, HybridCacheConfig(
            device_kv_pages=8, device_state_slots=4, host_kv_bytes=8 * SPEC.kv_page_bytes,
            storage_uri=tmp_path.as_uri(), storage_options={"read_processes": 2},
        ))


async def test_a_stuck_child_never_blocks_the_event_loop(tmp_path: Path) -> None:
    """Many batches queue on a child stuck in open() (a FIFO in place of the object): the loop
    must keep running (a child holds at most two chunks of all batches, so no send blocks)."""
    backend, _, _ = await open_procs(tmp_path)
    keys = await stored(backend, 1, "stuck")
    await backend._readers_start
    path = backend.object_name(PoolName.KV, keys[0])
    os.unlink(path)
    os.mkfifo(path)
    batches = [asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, [8 + i % 8])])) for i in range(200)]
    for _ in range(20):  # the loop keeps turning
        async with asyncio.timeout(1):
            await asyncio.sleep(0.01)
    assert not any(b.done() for b in batches)
    os.unlink(path)  # the object is gone, and the stuck child dies: every batch is a miss
    for child in backend._readers._children:
        child.process.kill()
    async with asyncio.timeout(30):
        got = await asyncio.gather(*batches)
    assert all(g == [[False]] for g in got)
    await backend.aclose()


async def test_children_that_cannot_start_leave_the_reads_to_the_threads(tmp_path: Path, monkeypatch, caplog) -> None:
    """No child can start (here: no descriptors for its socket): the threads read every unit,
    and the children are not tried again before ``RETRY_START_S``; then they are."""
    backend, kv, _ = await open_procs(tmp_path)
    keys = await stored(backend, 4, "nostart")
    await backend._readers_start
    readers = backend._readers
    for child in readers._children:
        child.process.kill()
        child.process.wait()
    tries = []
    socketpair = socket.socketpair

    def no_fds() -> None:
        tries.append(1)
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(reader_child.socket, "socketpair", no_fds)
    for _ in range(2):  # dead children's units, then every unit, go to the threads: all hits
        kv.buffer[8:12].fill_(0)
        await reads_back(backend, kv, keys)
    async with asyncio.timeout(10):  # the starts, beside the reads, fail
        while len(tries) < 2 or any(readers._starting):
            await asyncio.sleep(0.01)
    assert "could not start" in caplog.text and not readers.available()
    await reads_back(backend, kv, keys)
    assert len(tries) == 2 and not any(readers._starting)  # not tried again so soon
    monkeypatch.setattr(reader_processes, "RETRY_START_S", 0.0)
    monkeypatch.setattr(reader_child.socket, "socketpair", socketpair)
    await reads_back(backend, kv, keys)
    async with asyncio.timeout(10):
        while not all(readers._is_up(slot) for slot in range(2)):
            await asyncio.sleep(0.01)
    assert backend.statistics().num_failures == 0
    await backend.aclose()


async def test_registering_a_shared_pool_starts_the_children_and_maps_it(tmp_path: Path) -> None:
    """The children are up, with the pools mapped, once registration returns: the first reads
    neither wait for them nor run beside their start."""
    backend, kv, mamba = await open_procs(tmp_path)
    readers = backend._readers
    assert backend._readers_start is not None and backend._readers_start.done()
    ids = {readers.memory_id(kv.shared_memory), readers.memory_id(mamba.shared_memory)}
    assert all(c is not None and not c.dead and c.mapped >= ids for c in readers._children)
    await backend.aclose()
    # a pool in ordinary memory starts nothing: the threads read into it
    idle = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, read_processes=2, fsync=False)
    plain_kv, _ = make_pools(4, seed=None, shared=False)
    await idle.register_host_pool_v2(PoolName.KV, plain_kv)
    assert idle._readers_start is None and idle._readers._children == [None, None]
    await idle.aclose()


async def test_a_child_that_never_answers_its_start_is_killed_and_the_threads_read(tmp_path: Path, monkeypatch) -> None:
    """A child stuck before it answers (a hung import, say) is killed after
    ``START_TIMEOUT_S``: registration returns, and the reads go to the threads."""
    monkeypatch.setattr(reader_child, "_CHILD", "import time; time.sleep(3600)\n")
    monkeypatch.setattr(reader_processes, "START_TIMEOUT_S", 0.5)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, read_processes=1, fsync=False, timeout_s=0.1)
    kv, mamba = make_pools(16, seed=3, shared=True)
    async with asyncio.timeout(10):
        await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    (child,) = backend._readers._children
    assert child.dead and child.process.wait(5) is not None
    keys = await stored(backend, 4, "stuck-start")
    async with asyncio.timeout(10):
        await reads_back(backend, kv, keys)
    await backend.aclose()


async def test_a_cache_whose_entry_is_cancelled_stops_its_reader_processes(tmp_path: Path) -> None:
    """Entering the cache starts the children (registration); a timeout meanwhile closes the
    backend, and no child outlives it."""
    cfg = HybridCacheConfig(
        device_kv_pages=8, device_state_slots=4, host_kv_bytes=8 * SPEC.kv_page_bytes,
        host_state_bytes=2 * SPEC.state_bytes, storage_uri=tmp_path.as_uri(), storage_options={"read_processes": 2},
    )
    cache = HybridCache(SPEC, cfg)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            async with cache:
                pytest.fail("entered before the children could start")
    backend = cache.controller.tiering.backend
    assert backend._closed and backend._readers._children == [None, None]
    assert cache.controller._tg is None


def slow_children(monkeypatch: pytest.MonkeyPatch, seconds_per_unit: float) -> None:
    """Children that take ``seconds_per_unit`` over each unit they read."""
    monkeypatch.setattr(reader_child, "_CHILD", _CHILD.replace(
        "from storage_backends.object_reads import serve_reader",
        "import time\nimport storage_backends.object_reads as reads\nread = reads.read_object_range\n"
        f"def slow(*a, **k):\n    time.sleep({seconds_per_unit!r})\n    return read(*a, **k)\n"
        "reads.read_object_range = slow\nfrom storage_backends.object_reads import serve_reader",
    ))


async def test_a_send_that_fails_on_a_live_child_waits_for_its_end(tmp_path: Path, monkeypatch) -> None:
    """A send fails (ENOBUFS) while the child still reads an earlier chunk: the child is
    killed, and the call returns only once it has exited — the threads' hits are never
    overwritten by it afterwards."""
    slow_children(monkeypatch, 0.2)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, read_processes=1, fsync=False)
    kv, _ = make_pools(16, seed=3, shared=True)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    keys = make_keys(8, seed="enobufs")
    assert await backend.batch_set_v2([kv_transfer(keys, range(8))]) == [[True] * 8]
    (child,) = backend._readers._children
    send, sends = reader_processes.ReaderProcesses._send, []

    def failing_second_read(self: object, c: object, msg: tuple) -> object:
        if msg[0] == "read" and len(sends) == 1:
            real = c.conn.send

            def refuse(m: object) -> None:
                raise OSError(errno.ENOBUFS, "No buffer space available")

            c.conn.send = refuse
            try:
                return send(self, c, msg)
            finally:
                c.conn.send = real
        sends.append(msg[0])
        return send(self, c, msg)

    monkeypatch.setattr(reader_processes.ReaderProcesses, "_send", failing_second_read)
    kv.buffer[8:16].fill_(0)
    assert await backend.batch_get_v2([kv_transfer(keys, range(8, 16))]) == [[True] * 8]
    assert child.process.poll() is not None  # it had exited when the call returned
    assert [slot(kv, 8 + i) for i in range(8)] == [slot(kv, i) for i in range(8)]
    await backend.aclose()


@pytest.mark.parametrize("num_chunks", [1, 7, 32, 600])
def test_a_batch_is_dealt_into_chunks_of_nearly_equal_bytes(num_chunks: int) -> None:
    """A 32k-token restore's units (a state's 4 MiB ranges first, then 512 KV pages): every
    unit once, each chunk's indices ascending, the chunks' bytes within one unit of each other,
    and the state's ranges spread (one per chunk while there are chunks for them)."""
    sizes = [4 << 20] * 13 + [1_149_184] * 512
    chunks = reader_processes.deal_by_bytes(sizes, num_chunks)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(sizes)))
    assert all(chunk == sorted(chunk) for chunk in chunks)
    assert len(chunks) == min(num_chunks, len(sizes))
    totals = [sum(sizes[i] for i in chunk) for chunk in chunks]
    assert max(totals) - min(totals) <= max(sizes)
    assert max(sum(i < 13 for i in chunk) for chunk in chunks) == max(1, -(-13 // len(chunks)))


async def test_a_batch_goes_out_at_once_so_the_children_read_while_the_loop_is_busy(
    tmp_path: Path, monkeypatch
) -> None:
    """Every chunk of a batch is sent before any reply is taken: a forward pass that holds the
    event loop (its launches waiting for the device) does not leave the children idle."""
    slow_children(monkeypatch, 0.3)  # no reply comes back while the batch is being sent
    backend, kv, _ = await open_procs(tmp_path)
    keys = await stored(backend, 8, "at-once")
    send, sent_units = reader_processes.ReaderProcesses._send, []

    def counted(self: object, c: object, msg: tuple, **options: object) -> object:
        if msg[0] == "read":
            sent_units.append(len(msg[1]))
        return send(self, c, msg, **options)

    monkeypatch.setattr(reader_processes.ReaderProcesses, "_send", counted)
    reading = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, range(8, 16))]))
    for _ in range(20):  # the read's dispatch: a few loop turns, far below one unit's 0.3 s
        await asyncio.sleep(0)
    assert sum(sent_units) == 8 and len(sent_units) > 2  # all of it, in chunks for both children
    assert not reading.done()
    assert await reading == [[True] * 8]
    assert [slot(kv, 8 + i) for i in range(8)] == [slot(kv, i) for i in range(8)]
    await backend.aclose()


@pytest.mark.parametrize("processes", [2, 0], ids=["processes", "threads"])
async def test_a_read_reports_when_its_bytes_landed_not_when_the_loop_took_them(
    tmp_path: Path, monkeypatch, processes: int
) -> None:
    """A forward pass holds the loop while the reads land: the read reports the time its last
    bytes were in, stamped in the child (or on the worker thread), not when the loop took the
    replies — a split restore's tail is timed by its read."""
    if processes:
        slow_children(monkeypatch, 0.1)
    backend, kv, _ = await open_procs(tmp_path, read_processes=processes)
    if not processes:
        real = backend._read_range

        def slow(*args: object) -> object:
            time.sleep(0.1)
            return real(*args)

        monkeypatch.setattr(backend, "_read_range", slow)
    keys = await stored(backend, 8, "landing")
    if processes:
        await backend._readers.start()
        assert all(c is not None and c.clock_shared for c in backend._readers._children)
    landing = ReadLanding()

    async def read() -> list[list[bool]]:
        with landing.observing():
            return await backend.batch_get_v2([kv_transfer(keys, range(8, 16))])

    started = time.perf_counter()
    reading = asyncio.create_task(read())
    for _ in range(20):  # the read's dispatch: a few loop turns, far below one unit's 0.1 s
        await asyncio.sleep(0)
    time.sleep(1.5)  # noqa: ASYNC251 — the loop is held (a forward pass); the reads land meanwhile
    held_until = time.perf_counter()
    assert await reading == [[True] * 8]
    assert [slot(kv, 8 + i) for i in range(8)] == [slot(kv, i) for i in range(8)]
    assert landing.at is not None and started + 0.1 < landing.at < held_until
    await backend.aclose()


def test_a_childs_stamps_count_only_when_its_clock_is_ours() -> None:
    assert reader_processes.clock_shared(1.0, ("ok", 1.5), 2.0)
    assert not reader_processes.clock_shared(1.0, ("ok", 2.5), 2.0)  # another clock
    assert not reader_processes.clock_shared(1.0, ("ok", 0.5), 2.0)
    assert not reader_processes.clock_shared(1.0, ("ok",), 2.0)  # a child that sends no stamp


async def test_a_mapping_behind_a_busy_childs_reads_does_not_get_it_killed(tmp_path: Path, monkeypatch) -> None:
    """A pool registered while a child reads a batch: its mapping waits behind the child's
    units, each of which has ``timeout_s``; the child is not killed for that."""
    slow_children(monkeypatch, 0.4)  # the chunks ahead of the mapping: 6 units, 2.4 s
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, read_processes=1, fsync=False, timeout_s=1.0)
    kv, mamba = make_pools(16, seed=3, shared=True)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    keys = make_keys(6, seed="busy")
    assert await backend.batch_set_v2([kv_transfer(keys, range(6))]) == [[True] * 6]
    (child,) = backend._readers._children
    reading = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, range(8, 14))]))
    await asyncio.sleep(0.1)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    assert await reading == [[True] * 6]
    assert child.process.poll() is None and not child.dead and backend._readers._children[0] is child
    await backend.aclose()


def slow_mappings(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Children that take ``seconds`` over each memory they map."""
    monkeypatch.setattr(reader_child, "_CHILD", _CHILD.replace(
        "from storage_backends.object_reads import serve_reader",
        "import mmap, time, types\nimport storage_backends.object_reads as reads\n"
        f"def slow(*a):\n    time.sleep({seconds!r})\n    return mmap.mmap(*a)\n"
        "reads.mmap = types.SimpleNamespace(mmap=slow, MAP_SHARED=mmap.MAP_SHARED)\n"
        "from storage_backends.object_reads import serve_reader",
    ))


async def test_a_short_read_deadline_does_not_keep_the_children_from_starting(tmp_path: Path, monkeypatch) -> None:
    """A read deadline far below a child's start: the whole start — its first answer and the
    mapping of each pool registered, here each slower than ``timeout_s`` — has the start's
    deadline, and no child is killed."""
    slow_mappings(monkeypatch, 0.3)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, fsync=False, read_processes=2, timeout_s=0.01)
    try:
        kv, mamba = make_pools(16, seed=3, shared=True)
        await backend.register_host_pool_v2(PoolName.KV, kv)  # starts the children: answer, mapping
        await backend.register_host_pool_v2(PoolName.MAMBA, mamba)  # a mapping in each child that is up
        ids = {backend._readers.memory_id(kv.shared_memory), backend._readers.memory_id(mamba.shared_memory)}
        children = backend._readers._children
        assert all(c is not None and c.up and not c.dead and c.mapped == ids for c in children)
        assert all(c.process.poll() is None for c in children)
    finally:
        await backend.aclose()


async def test_a_dead_child_that_still_runs_gets_the_close_grace_when_its_slot_starts_again(
    tmp_path: Path, monkeypatch
) -> None:
    """A child that closed its socket but still runs (its start fails: it is dead, not killed)
    is stopped by the next start of its slot, and killed after ``CLOSE_GRACE_S``, as on close."""
    monkeypatch.setattr(reader_child, "_CHILD", (  # takes its init and the start's ping, then closes
        "import sys, time\nfrom multiprocessing.connection import Connection\n"
        "conn = Connection(int(sys.argv[2]))\nconn.recv()\nconn.recv()\nconn.close()\ntime.sleep(3600)\n"
    ))
    monkeypatch.setattr(reader_processes, "CLOSE_GRACE_S", 0.05)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, fsync=False, read_processes=1)
    lingering = None
    try:
        kv, _ = make_pools(4, shared=True)
        await backend.register_host_pool_v2(PoolName.KV, kv)  # the start fails: its socket closed
        (lingering,) = backend._readers._children
        assert lingering.dead and lingering.process.poll() is None
        monkeypatch.setattr(reader_child, "_CHILD", _CHILD)
        starting = asyncio.create_task(backend._readers.start())
        async with asyncio.timeout(2.5):  # half the readers' default grace
            while lingering.process.poll() is None:
                await asyncio.sleep(0.01)
        assert lingering.process.returncode == -signal.SIGKILL
        async with asyncio.timeout(30):
            await starting
        assert backend._readers._is_up(0)
    finally:
        if lingering is not None:
            lingering.process.kill()
            lingering.process.wait()
        await backend.aclose()


async def test_closing_while_the_first_read_starts_gives_misses(tmp_path: Path) -> None:
    writer, _, _ = await open_procs(tmp_path)
    keys = await stored(writer, 4, "closing")
    await writer.aclose()
    backend, _, _ = await open_procs(tmp_path)
    reading = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, range(8, 12))]))
    await asyncio.sleep(0)
    await backend.aclose()
    got = await reading
    assert len(got[0]) == 4 and all(isinstance(hit, bool) for hit in got[0])


async def test_a_dropped_pool_is_unmapped_in_the_children_and_freed(tmp_path: Path) -> None:
    backend, _, _ = await open_procs(tmp_path)
    keys = await stored(backend, 2, "dropped")
    other_kv, other_mamba = make_pools(4, seed=None, shared=True)
    await backend.register_host_pool_v2(PoolName.KV, other_kv)
    assert await backend.batch_get_v2([kv_transfer(keys, [0, 1])]) == [[True, True]]
    dropped_id = backend._readers.memory_id(other_kv.shared_memory)
    assert dropped_id in backend._readers._memories
    memory = weakref.ref(other_kv.shared_memory)
    kv, _ = make_pools(4, seed=None, shared=True)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    del other_kv, other_mamba
    gc.collect()
    assert memory() is None  # the readers hold no strong reference
    assert await backend.batch_get_v2([kv_transfer(keys, [2, 3])]) == [[True, True]]
    assert dropped_id not in backend._readers._memories
    assert all(dropped_id not in c.mapped for c in backend._readers._children if c is not None)
    await backend.aclose()
    assert backend._readers._memories == {}


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str, which=lambda *args: True) -> list[tuple]:
    """The calls of ``ReaderProcesses.<name>`` for which ``which(*args)`` holds (they still run)."""
    calls: list[tuple] = []
    real = getattr(reader_processes.ReaderProcesses, name)

    def counted(self: object, *args: object, **kwargs: object) -> object:
        if which(*args):
            calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(reader_processes.ReaderProcesses, name, counted)
    return calls


async def test_a_child_whose_restart_hangs_holds_up_no_read(tmp_path: Path, monkeypatch) -> None:
    """Child 1 dies and its start hangs (an import from a stalled mount, say): every read goes
    on at once with child 0 and the threads, while the start runs beside them; once it has
    failed, that slot alone is not started again before ``RETRY_START_S``."""
    monkeypatch.setattr(reader_processes, "START_TIMEOUT_S", 3.0)
    backend, kv, _ = await open_procs(tmp_path, timeout_s=1.0)
    keys = await stored(backend, 8, "restart")
    readers = backend._readers
    first, second = readers._children
    second.process.kill()
    second.process.wait()
    monkeypatch.setattr(reader_child, "_CHILD", "import time; time.sleep(3600)\n")
    spawns = count_calls(monkeypatch, "_spawn")
    first_reads = count_calls(monkeypatch, "_send", lambda child, msg: child is first and msg[0] == "read")
    for _ in range(3):  # the first finds child 1 dead, the next ones start it again
        kv.buffer[8:16].fill_(0)
        async with asyncio.timeout(1.5):  # half of START_TIMEOUT_S
            await reads_back(backend, kv, keys)
    assert len(spawns) == 1 and first_reads and first.process.poll() is None
    async with asyncio.timeout(10):  # the hung start is killed after START_TIMEOUT_S
        while readers._children[1] is second or not readers._children[1].dead:
            await asyncio.sleep(0.05)
    assert readers._children[1].process.wait(5) is not None
    await reads_back(backend, kv, keys)
    assert len(spawns) == 1  # not tried again so soon
    monkeypatch.setattr(reader_processes, "RETRY_START_S", 0.0)
    monkeypatch.setattr(reader_child, "_CHILD", _CHILD)
    await reads_back(backend, kv, keys)
    async with asyncio.timeout(10):
        while not (readers._children[1].up and not readers._children[1].dead):
            await asyncio.sleep(0.05)
    assert len(spawns) == 2 and backend.statistics().num_failures == 0
    await backend.aclose()


async def test_a_child_that_stops_answering_is_killed_and_the_threads_read(tmp_path: Path) -> None:
    """A child stopped with chunks in hand (SIGSTOP: a wedged child) is killed once its chunks
    have had ``timeout_s`` for each unit, and the threads read their units: every unit is a
    hit with the stored bytes."""
    backend, kv, _ = await open_procs(tmp_path, timeout_s=0.2)
    keys = await stored(backend, 8, "stopped")
    stopped = backend._readers._children[0]
    os.kill(stopped.process.pid, signal.SIGSTOP)
    try:
        kv.buffer[8:16].fill_(0)
        reading = asyncio.create_task(reads_back(backend, kv, keys))
        await asyncio.wait([reading], timeout=10)  # (a cancelled read would still wait for the child)
        assert reading.done(), "the read waits for a stopped child"
        await reading
        assert stopped.dead and stopped.process.wait(5) is not None
    finally:
        stopped.process.kill()
    await backend.aclose()


async def test_closing_with_a_stopped_child_kills_it_after_a_grace_period(tmp_path: Path, monkeypatch) -> None:
    """A read cancelled while a stopped child holds its chunk still waits for the child (the
    chunk's ``timeout_s`` is long here); closing the backend kills the child after
    ``CLOSE_GRACE_S``, and both return."""
    monkeypatch.setattr(reader_processes, "CLOSE_GRACE_S", 0.5, raising=False)
    backend, _, _ = await open_procs(tmp_path, timeout_s=600.0)
    backend.close_grace_s = 0.5  # then the children are stopped, with their own grace
    keys = await stored(backend, 8, "close-stopped")
    children = list(backend._readers._children)
    for child in children:
        os.kill(child.process.pid, signal.SIGSTOP)
    try:
        reading = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, range(8, 16))]))
        async with asyncio.timeout(10):
            while not all(c.pending for c in children):
                await asyncio.sleep(0.01)  # until both children hold chunks
        reading.cancel()
        closing = asyncio.create_task(backend.aclose())
        await asyncio.wait([reading, closing], timeout=10)
        assert closing.done() and reading.cancelled(), "closing waits for stopped children"
        assert all(c.process.poll() is not None for c in children)
    finally:
        for child in children:
            child.process.kill()


async def test_a_start_outlived_by_its_caller_is_stopped_with_the_backend(tmp_path: Path, monkeypatch) -> None:
    """A read that finds its child dead is cancelled while a new one is being spawned: the new
    child is not lost — closing the backend stops it."""
    backend, kv, _ = await open_procs(tmp_path, read_processes=1)
    keys = await stored(backend, 2, "spawn")
    await reads_back(backend, kv, keys)
    (child,) = backend._readers._children
    child.process.kill()
    child.process.wait()
    async with asyncio.timeout(5):  # idle, it is found dead by its socket's end
        while not child.dead:
            await asyncio.sleep(0.01)
    entered, gate, spawned = threading.Event(), threading.Event(), []
    spawn = reader_processes.ReaderProcesses._spawn

    def slow_spawn(self: object) -> object:
        entered.set()
        gate.wait(10)
        spawned.append(spawn(self))
        return spawned[-1]

    monkeypatch.setattr(reader_processes.ReaderProcesses, "_spawn", slow_spawn)
    reading = asyncio.create_task(backend.batch_get_v2([kv_transfer(keys, [8, 9])]))
    try:
        async with asyncio.timeout(10):
            while not entered.is_set():
                await asyncio.sleep(0.01)
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        gate.set()
        await backend.aclose()
        async with asyncio.timeout(10):
            while not spawned:
                await asyncio.sleep(0.01)
        assert all(c.process.poll() is not None for c in spawned), "a reader process outlives the backend"
    finally:
        gate.set()
        for c in spawned:
            c.process.kill()
            c.process.wait()
            c.conn.close()


async def test_ctrl_c_leaves_the_children_to_the_parent(tmp_path: Path) -> None:
    """SIGINT — what Ctrl-C sends to the whole process group — does not stop a child: the
    parent decides when they stop (a server drains its requests first)."""
    backend, kv, _ = await open_procs(tmp_path)
    keys = await stored(backend, 8, "sigint")
    readers = backend._readers
    children = list(readers._children)
    for child in children:
        os.kill(child.process.pid, signal.SIGINT)
    for child in children:  # answered after the signal: it survived it
        assert (await readers._request(child, ("ping",)))[0] == "ok"
    kv.buffer[8:16].fill_(0)
    await reads_back(backend, kv, keys)
    assert all(c.process.poll() is None and not c.dead for c in children)
    await backend.aclose()


async def test_closing_while_a_start_hangs_takes_the_close_grace_not_the_start_timeout(
    tmp_path: Path, monkeypatch
) -> None:
    """A child that never answers its first request (a hung start) is killed by the close after
    its grace, not after the start's own, longer timeout."""
    monkeypatch.setattr(reader_child, "_CHILD", "import time; time.sleep(3600)\n")
    monkeypatch.setattr(reader_processes, "START_TIMEOUT_S", 20.0)
    monkeypatch.setattr(reader_processes, "CLOSE_GRACE_S", 0.3, raising=False)
    backend = LocalDiskBackend(tmp_path.as_uri(), namespace=NAMESPACE, fsync=False, read_processes=1, timeout_s=0.2)
    backend.close_grace_s = 0.3
    kv, _ = make_pools(4, shared=True)
    registering = asyncio.create_task(backend.register_host_pool_v2(PoolName.KV, kv))
    async with asyncio.timeout(10):
        while not any(c is not None for c in backend._readers._children):
            await asyncio.sleep(0.01)  # the child is spawned and does not answer
    async with asyncio.timeout(5):  # the start alone would take 20 s
        await backend.aclose()
        with contextlib.suppress(Exception):
            await registering
