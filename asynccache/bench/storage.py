"""``asynccache bench storage``: page objects through a storage backend against the raw path.

What it measures, for ``--uri`` (default: a temporary local directory):

- **Backend path**: ``batch_set_v2`` then ``batch_get_v2`` of the KV pages and Mamba states of a
  real spec (``--preset``, ``--tp-size``; Qwen3-Next-80B at tp 1: 1.5 MiB per 64-token KV page,
  77 MB per state), ``--batch-pages`` pages per call, from page_first host pools into fresh host
  slots — object header, payload checksum, put-if-absent, atomic link/conditional PUT included.
- **Raw path** (``asynccache.bench.raw_paths``), the same bytes in the same run: for ``file://``
  plain sequential file I/O (one ``open``/``write``/[``fsync`` when the backend fsyncs]/``close``
  per object, ``readinto`` the destination slot); for ``s3://`` obstore ``put``/``get`` of each payload with as many requests
  in flight as the backend allows and the same multipart shape for large objects, each reply
  copied into the destination slot. (Sequential requests would measure latency, not the path.)

Each of ``--rounds`` rounds runs both paths on fresh keys, alternating which goes first (page
cache and writeback then favour neither); throughputs are medians over rounds, in GB/s of payload
(10⁹ bytes/s), and each ratio is the median of the per-round ratios (both paths of a round run
back to back, so a machine whose load drifts during the run still compares like with like). Every read is checked against the written bytes. Reads are served from the page
cache unless ``--cold-reads`` (file:// only) drops both paths' objects from it first
(``fdatasync`` + ``POSIX_FADV_DONTNEED``, untimed). ``--json PATH`` writes::

    {"uri", "write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps", "write_ratio",
     "read_ratio", "preset", "tp_size", "num_pages", "num_states", "bytes_per_round", "rounds",
     "options", "usable_cores", "fsync", "cold_reads"}

(``options``: the backend's options besides the namespace; ``usable_cores``: the cores this
process may run on.) Everything the run writes is removed at the end (the temporary directory,
or this run's namespace and raw objects under a given URI, and the folders of a ``file://`` root
that did not exist before the run, where they are left empty); the run's namespace is its own, so
``--option namespace=…`` is refused. A removal that fails is logged and does not hide the
run's own error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import torch
import uvloop

from asynccache.bench.backend_options import add_option_argument, parse_options
from asynccache.bench.options import nonnegative_int, positive_int
from asynccache.bench.raw_paths import RawFile, RawPath, RawS3, drop_from_page_cache
from asynccache.errors import AsyncCacheError, BackendError, ConfigError
from asynccache.pools.base import ItemPool
from asynccache.pools.host import HostKVPool, MambaPoolHost
from asynccache.spec import HybridSpec
from asynccache.storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    open_backend,
    storage_scheme,
)
from storage_backends.base import ObjectBackend, usable_cores
from storage_backends.local_disk import LocalDiskBackend, parse_file_uri
from storage_backends.object_store import ObjectStoreBackend

__all__ = ["add_arguments", "add_option_argument", "parse_options", "run"]

MiB = 1 << 20
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uri", default=None, help="file:// or s3:// URI (default: a temporary local directory)")
    parser.add_argument("--preset", default="qwen3-next-80b", help="HybridSpec preset (default qwen3-next-80b)")
    parser.add_argument("--tp-size", type=positive_int, default=1, help="TP shard of the spec (default 1)")
    parser.add_argument("--num-pages", type=nonnegative_int, default=256, help="KV pages per round (default 256)")
    parser.add_argument("--num-states", type=nonnegative_int, default=2, help="Mamba states per round (default 2)")
    parser.add_argument("--batch-pages", type=positive_int, default=64, help="pages per batch call (default 64)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds, medians reported (default 3)")
    parser.add_argument(
        "--max-concurrency", type=positive_int, default=None, help="backend's objects in flight (default: the backend's)"
    )
    parser.add_argument("--no-fsync", action="store_true", help="file://: do not fsync (backend and raw)")
    parser.add_argument(
        "--cold-reads",
        action="store_true",
        help="file://: drop the objects of both paths from the page cache before each read pass",
    )
    add_option_argument(
        parser,
        "--option",
        "a backend option, repeatable, e.g. --option inline_bytes=0; not namespace (the run writes under a "
        "namespace of its own)",
        dest="options",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON to this path")


def _random_pool(pool: ItemPool, seed: int) -> None:
    assert pool.buffer is not None
    flat = pool.buffer.view(-1)
    gen = torch.Generator().manual_seed(seed)
    words = flat[: flat.numel() // 8 * 8].view(torch.int64)
    words.copy_(torch.randint(-(2**62), 2**62, words.shape, dtype=torch.int64, generator=gen))


def _indices(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64)


async def _cleanup_backend(backend: ObjectBackend, names: list[str]) -> None:
    if isinstance(backend, LocalDiskBackend):
        await asyncio.to_thread(shutil.rmtree, backend.namespace_dir, True)
    elif isinstance(backend, ObjectStoreBackend):
        import obstore

        for start in range(0, len(names), 500):
            await obstore.delete_async(backend.store, names[start : start + 500])


async def _timed(fn: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def _bounded(n: int, limit: int, one: Callable[[int], Awaitable[None]]) -> None:
    sem = asyncio.Semaphore(limit)

    async def guarded(i: int) -> None:
        async with sem:
            await one(i)

    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(guarded(i))


async def _bench(args: argparse.Namespace, uri: str, user_options: dict[str, Any]) -> dict[str, Any]:
    spec = HybridSpec.preset(args.preset, tp_size=args.tp_size)
    run_id = uuid.uuid4().hex[:12]
    options: dict[str, Any] = {"namespace": f"{spec.namespace_id}|bench-{run_id}"}
    if args.max_concurrency is not None:
        options["max_concurrency"] = args.max_concurrency
    if args.no_fsync and urlsplit(uri).scheme == "file":
        options["fsync"] = False
    options.update(user_options)
    n_pages, n_states = args.num_pages, args.num_states
    src_kv = HostKVPool(spec, num_pages=n_pages)
    src_state = MambaPoolHost(spec, num_slots=n_states)
    dst_kv = HostKVPool(spec, num_pages=n_pages)
    dst_state = MambaPoolHost(spec, num_slots=n_states)
    _random_pool(src_kv, 1)
    _random_pool(src_state, 2)
    for pool in (dst_kv, dst_state):  # touch every page now: first-touch faults would bias round 0
        assert pool.buffer is not None
        pool.buffer.zero_()
    objects = [(src_kv, dst_kv, i) for i in range(n_pages)] + [(src_state, dst_state, i) for i in range(n_states)]
    bytes_per_round = n_pages * spec.kv_page_bytes + n_states * spec.state_bytes

    backend = open_backend(uri, **options)
    if not isinstance(backend, ObjectBackend):
        raise ConfigError(f"{uri}: the benchmark needs a built-in backend")
    raw: RawPath
    if isinstance(backend, LocalDiskBackend):
        try:
            raw = RawFile(backend, run_id)
        except OSError as e:  # a root that cannot be made or written: bad input, found before any write
            await backend.aclose()
            raise ConfigError(f"{uri}: cannot write under {backend.root} ({e.strerror or e})") from None
    elif isinstance(backend, ObjectStoreBackend):
        raw = RawS3(backend, run_id)
    else:
        await backend.aclose()
        raise ConfigError(f"{uri}: no raw path to compare with (file:// and s3:// have one)")

    written: list[str] = []

    def transfers(round_id: int, lo: int, hi: int, states: bool) -> list[PoolTransfer]:
        keys = tuple(f"{round_id:08x}{i:024x}" for i in range(lo, hi))
        out = [PoolTransfer(pool_name=PoolName.KV, keys=keys, host_indices=torch.arange(lo, hi))]
        if states:
            skeys = tuple(f"{round_id:08x}{i:024x}" for i in range(n_states))
            out.append(PoolTransfer(pool_name=PoolName.MAMBA, keys=skeys, host_indices=_indices(n_states),
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES))
        written.extend(backend.object_name(t.pool_name, k) for t in out for k in t.keys)
        return out

    async def backend_pass(round_id: int, write: bool) -> None:
        call = backend.batch_set_v2 if write else backend.batch_get_v2
        for lo in range(0, max(n_pages, 1), args.batch_pages):
            hi = min(n_pages, lo + args.batch_pages)
            results = await call(transfers(round_id, lo, hi, states=lo == 0))
            if not all(all(r) for r in results):
                failed = sum(not ok for r in results for ok in r)
                raise BackendError(
                    f"backend {'write' if write else 'read'} failed: {failed} of {sum(map(len, results))} objects "
                    f"(the backend's log says why)"
                )

    def raw_name(round_id: int, i: int) -> str:
        src, _, index = objects[i]
        return f"{round_id}-{src.name}-{index}"

    def evict(path: str, round_id: int) -> None:
        if path == "raw":
            raw.evict([raw_name(round_id, i) for i in range(len(objects))])
            return
        if not isinstance(backend, LocalDiskBackend):
            raise AsyncCacheError("--cold-reads needs a file:// URI")
        keys = [f"{round_id:08x}{i:024x}" for i in range(max(n_pages, n_states))]
        paths = [backend.object_name(PoolName.KV, k) for k in keys[:n_pages]]
        paths += [backend.object_name(PoolName.MAMBA, k) for k in keys[:n_states]]
        drop_from_page_cache(paths)

    async def raw_pass(round_id: int, write: bool) -> None:
        async def one(i: int) -> None:
            src, dst, index = objects[i]
            name = raw_name(round_id, i)
            if write:
                await raw.put(name, memoryview(src.index_bytes(index).numpy()).cast("B"))
            else:
                await raw.get(name, memoryview(dst.index_bytes(index).numpy()).cast("B"))

        await _bounded(len(objects), raw.in_flight, one)

    def check_and_clear() -> None:
        for src, dst in ((src_kv, dst_kv), (src_state, dst_state)):
            assert src.buffer is not None and dst.buffer is not None
            if not torch.equal(src.buffer, dst.buffer):
                raise AsyncCacheError("read-back bytes differ from the written bytes")
            dst.buffer.zero_()

    rows: list[dict[str, float]] = []
    try:
        await backend.register_host_pool_v2(PoolName.KV, src_kv)
        await backend.register_host_pool_v2(PoolName.MAMBA, src_state)
        for r in range(args.rounds):
            times: dict[str, float] = {}
            order = ("backend", "raw") if r % 2 == 0 else ("raw", "backend")
            for path in order:
                p = backend_pass if path == "backend" else raw_pass
                if path == "backend":
                    await backend.register_host_pool_v2(PoolName.KV, src_kv)
                    await backend.register_host_pool_v2(PoolName.MAMBA, src_state)
                times[f"{path}_write"] = await _timed(lambda p=p, r=r: p(r, True))
                if args.cold_reads:
                    await asyncio.to_thread(evict, path, r)
                if path == "backend":
                    await backend.register_host_pool_v2(PoolName.KV, dst_kv)
                    await backend.register_host_pool_v2(PoolName.MAMBA, dst_state)
                times[f"{path}_read"] = await _timed(lambda p=p, r=r: p(r, False))
                check_and_clear()
            row = {k: bytes_per_round / v / 1e9 for k, v in times.items()}
            rows.append(row)
            print(
                f"round {r}: backend write {row['backend_write']:.3f} read {row['backend_read']:.3f} GB/s | "
                f"raw write {row['raw_write']:.3f} read {row['raw_read']:.3f} GB/s",
                flush=True,
            )
    finally:
        try:
            await _cleanup_backend(backend, sorted(set(written)))
            await raw.cleanup()
        except Exception as e:  # noqa: BLE001 (logged: it must not hide the run's own error)
            first = str(e).splitlines()[0] if str(e) else ""
            log.warning("%s: removing the run's objects failed: %s: %s", uri, type(e).__name__, first)
        finally:
            await backend.aclose()

    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {
        "uri": uri,
        "write_gbps": med["backend_write"],
        "read_gbps": med["backend_read"],
        "raw_write_gbps": med["raw_write"],
        "raw_read_gbps": med["raw_read"],
        "write_ratio": statistics.median(row["backend_write"] / row["raw_write"] for row in rows),
        "read_ratio": statistics.median(row["backend_read"] / row["raw_read"] for row in rows),
        "preset": args.preset,
        "tp_size": args.tp_size,
        "num_pages": n_pages,
        "num_states": n_states,
        "bytes_per_round": bytes_per_round,
        "rounds": args.rounds,
        "options": {k: v for k, v in options.items() if k != "namespace"},
        "usable_cores": usable_cores(),
        "fsync": bool(getattr(backend, "fsync", False)),
        "cold_reads": bool(args.cold_reads),
    }


def _missing_folders(uri: str) -> list[str]:
    """The folders of a ``file://`` URI's root that do not exist yet, deepest first (the run
    creates them); none for other schemes."""
    if urlsplit(uri).scheme != "file":
        return []
    missing: list[str] = []
    path = os.path.abspath(parse_file_uri(uri))
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_folders(folders: list[str]) -> None:
    """Remove ``folders`` (deepest first) while they are empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except (FileNotFoundError, NotADirectoryError):  # never made (a file above it: NotADirectoryError)
            continue
        except OSError as e:
            log.warning("%s: not removed: %s", folder, e.strerror or type(e).__name__)
            return


def run(args: argparse.Namespace) -> int:
    if args.num_pages + args.num_states == 0:
        print("error: --num-pages and --num-states are both 0: nothing to measure", file=sys.stderr)
        return 2
    try:
        scheme = "file" if args.uri is None else storage_scheme(args.uri)
    except ConfigError as e:
        print(f"error: --uri: {e}", file=sys.stderr)
        return 2
    if args.cold_reads and scheme != "file":
        print("error: --cold-reads drops objects from the page cache: a file:// URI only", file=sys.stderr)
        return 2
    try:
        user_options = parse_options(args.options)
    except ConfigError as e:
        print(f"error: --option: {e}", file=sys.stderr)
        return 2
    if "namespace" in user_options:
        print("error: --option namespace: the run writes under a namespace of its own, which it removes at the end",
              file=sys.stderr)  # fmt: skip
        return 2
    tmp = None
    uri = args.uri
    if uri is None:
        tmp = tempfile.mkdtemp(prefix="asynccache-bench-")
        uri = f"file://{tmp}"
    created: list[str] = []
    try:
        created = _missing_folders(uri) if tmp is None else []
        spec = HybridSpec.preset(args.preset, tp_size=args.tp_size)
        print(
            f"storage benchmark: {uri}\n  {args.preset} tp{args.tp_size}: {args.num_pages} KV pages x "
            f"{spec.kv_page_bytes / MiB:.2f} MiB + {args.num_states} states x {spec.state_bytes / MiB:.1f} MiB "
            f"per round, {args.rounds} rounds",
            flush=True,
        )
        # uvloop: obstore completes futures from its own threads; see docs/benchmarks.md.
        report = uvloop.run(_bench(args, uri, user_options))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AsyncCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_folders(created)
    print(
        f"median: backend write {report['write_gbps']:.3f} read {report['read_gbps']:.3f} GB/s; "
        f"raw write {report['raw_write_gbps']:.3f} read {report['raw_read_gbps']:.3f} GB/s; "
        f"ratio write {report['write_ratio']:.2f} read {report['read_ratio']:.2f}"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0
