"""The multi-turn workload end to end: hit rates per mode against the ideal, cancellation."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import torch

from asynccache.bench import multiturn
from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import CapacityError
from asynccache.reference.model import HybridModel
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.spec import HybridSpec
from kernels import LayerCopy, PoolPair


def bench_args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    multiturn.add_arguments(p)
    args = p.parse_args([])
    args.clients, args.rounds, args.request_len, args.output_len, args.max_parallel = 6, 3, 24, 6, 3
    args.device = "cpu"
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def setup() -> tuple[HybridSpec, HybridModel]:
    spec = HybridSpec.preset("tiny", page_size=1)
    return spec, HybridModel(spec, seed=0)


async def run(mode: str, setup: tuple[HybridSpec, HybridModel], storage: str | None = None) -> dict:
    spec, model = setup
    args = bench_args()
    budgets = multiturn._default_budgets(args, spec)
    res = await multiturn.run_mode(
        mode, model=model, spec=spec, args=args, budgets=budgets, storage_uri=storage, progress=lambda: None
    )
    return res.summary()


async def test_offloading_states_reaches_the_ideal_hit_rate(setup: tuple[HybridSpec, HybridModel]) -> None:
    full = await run("kv+mamba-offload", setup)
    kv_only = await run("kv-offload", setup)
    none = await run("no-offload", setup)
    assert full["ideal_hit_rate"] > 0.5
    assert full["hit_rate"] >= 0.99 * full["ideal_hit_rate"]
    # States only on the device: with fewer device state slots than clients, KV on host is
    # useless for the clients whose state was evicted.
    assert kv_only["hit_rate"] < 0.9 * full["hit_rate"]
    assert none["hit_rate"] <= full["hit_rate"]
    assert full["cached_by_tier"]["host"] > 0


async def test_storage_mode_hits_come_from_storage(setup: tuple[HybridSpec, HybridModel], tmp_path: Path) -> None:
    s = await run("kv+mamba+storage", setup, storage=(tmp_path / "l3").as_uri())
    assert s["hit_rate"] >= 0.99 * s["ideal_hit_rate"]
    # Device and host are flushed between rounds: every hit came from storage.
    assert s["cached_by_tier"]["storage"] > 0
    assert s["cached_by_tier"]["device"] == 0 and s["cached_by_tier"]["host"] == 0


def test_cli_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    args = bench_args(
        modes="kv-offload,kv+mamba-offload", clients=3, rounds=2, request_len=16, output_len=4, json_path=str(out),
        plot=str(png), page_size=1, preset="tiny", dtype=None,
        device_kv_pages=None, device_state_slots=None, host_kv_bytes=None, host_state_bytes=None, storage=None,
    )
    assert multiturn.run(args) == 0
    data = json.loads(out.read_text())
    for mode in ("kv-offload", "kv+mamba-offload"):
        m = data["modes"][mode]
        assert 0.0 <= m["hit_rate"] <= m["ideal_hit_rate"] + 1e-9
        assert set(m["ttft_ms"]) == {"mean", "p50", "p99"}
        assert len(m["rounds"]) == 2 and {"hit_rate", "ttft_ms_mean"} <= set(m["rounds"][0])
    assert png.stat().st_size > 1000


async def test_cancelled_requests_free_everything(setup: tuple[HybridSpec, HybridModel]) -> None:
    spec, model = setup
    cfg = HybridCacheConfig(
        device_kv_pages=2048, device_state_slots=64, host_kv_bytes=4096 * spec.kv_page_bytes,
        host_state_bytes=64 * spec.state_bytes,
    )
    async with HybridCache(spec, cfg) as cache, Scheduler(model, cache, SchedulerConfig(chunk_size=16)) as sched:
        base = [(5 * t) % 250 + 1 for t in range(60)]
        await sched.generate(base, 4)
        await cache.controller.wait_idle()
        tree_pages = cache.device_kv.num_items - cache.device_kv.num_free
        futs = [sched.submit(base + [i, i + 1, i + 2] * 10, 20) for i in range(12)]
        for i, f in enumerate(futs):
            # Cancel at different points: queued, mid chunked prefill, mid decode.
            for _ in range(i):
                await asyncio.sleep(0)
            if i % 3:
                f.cancel()
        done = await asyncio.gather(*futs, return_exceptions=True)
        assert sum(isinstance(d, asyncio.CancelledError) for d in done) >= 4
        await cache.controller.wait_idle()
        # Only tree-owned pages and states remain; cancelled requests left nothing behind.
        cache.tree.check_integrity()
        owned = cache.device_kv.num_items - cache.device_kv.num_free
        assert owned >= tree_pages
        cache.flush_device()
        cache.tree.check_integrity()
        assert cache.tree.stats().device_kv_pages == cache.device_kv.num_items - cache.device_kv.num_free


async def test_chunked_prefill_gives_the_same_greedy_output(setup: tuple[HybridSpec, HybridModel]) -> None:
    spec, model = setup
    cfg = HybridCacheConfig(device_kv_pages=1024, device_state_slots=32)
    prompt = [(3 * t + 1) % 250 + 1 for t in range(70)]
    outs = []
    for chunk in (8, 4096):
        async with HybridCache(spec, cfg) as cache, Scheduler(
            model, cache, SchedulerConfig(chunk_size=chunk, use_cache=False)
        ) as sched:
            outs.append((await sched.generate(prompt, 6)).output_ids)
    assert outs[0] == outs[1]
    assert torch.tensor(outs[0]).numel() == 6


async def test_a_flushed_prefix_loads_into_one_piece_of_device_pages(setup: tuple[HybridSpec, HybridModel]) -> None:
    # The request's own page is taken after the load's pages: the pages the flush freed
    # together stay together, so each layer's KV is one copy.
    spec, model = setup
    cfg = HybridCacheConfig(
        device_kv_pages=256, device_state_slots=16, host_kv_bytes=512 * spec.kv_page_bytes,
        host_state_bytes=16 * spec.state_bytes,
    )
    loads: list[torch.Tensor] = []
    async with HybridCache(spec, cfg) as cache, Scheduler(model, cache, SchedulerConfig(chunk_size=64)) as sched:
        ctrl = cache.controller
        make = ctrl.layer_copier

        def spy(pair: PoolPair, src: torch.Tensor, dst: torch.Tensor) -> LayerCopy:
            if pair.src is cache.host_kv:
                loads.append(dst.clone())
            return make(pair, src, dst)

        ctrl.layer_copier = spy  # type: ignore[method-assign]
        prefix = [(7 * t) % 250 + 1 for t in range(100)]
        await sched.generate(prefix + [3, 4], 2)
        await ctrl.wait_idle()
        for turn in range(3):
            cache.flush_device()
            await sched.generate(prefix + [9, 9 + turn], 2)
            await ctrl.wait_idle()
        cache.tree.check_integrity()
    # (The first turn may still find the first request's nodes on the device: they are backed
    # up, and so evictable, only once written.)
    assert len(loads) >= 2
    for pages in loads:
        assert pages.numel() >= 100 // spec.page_size
        assert torch.equal(pages, torch.arange(int(pages[0]), int(pages[0]) + pages.numel()))


async def test_a_load_admitted_without_room_for_the_own_pages_is_cancelled(setup: tuple[HybridSpec, HybridModel]) -> None:
    # Room for the cached prefix but not for the pages after it (two of the pool's pages are held
    # outside the tree): the queued load is cancelled, its pages and the request's slots go back,
    # and the request fails with CapacityError.
    spec, model = setup
    prefix = [(11 * t) % 250 + 1 for t in range(40)]
    cfg = HybridCacheConfig(
        device_kv_pages=44, device_state_slots=8, host_kv_bytes=64 * spec.kv_page_bytes,
        host_state_bytes=8 * spec.state_bytes,
    )
    async with HybridCache(spec, cfg) as cache, Scheduler(model, cache, SchedulerConfig(chunk_size=64)) as sched:
        ctrl = cache.controller
        await sched.generate(prefix + [1], 2)
        await ctrl.wait_idle()
        cache.flush_device()
        assert cache.device_kv.num_free == cache.device_kv.num_items
        held = cache.tree.alloc_device(2, 0)
        assert held is not None
        with pytest.raises(CapacityError):
            await sched.generate(prefix + [1, 2, 3], 2)  # 40 cached + 4 new pages > 42 free
        await ctrl.wait_idle()
        cache.device_kv.free(held.kv_indices)
        assert ctrl.statistics().counts.get("load_cancelled", 0) >= 1
        assert cache.device_kv.num_free == cache.device_kv.num_items
        assert cache.device_mamba.num_free == cache.device_mamba.num_items
        cache.tree.check_integrity()
        # The prefix is still cached on the host and serves a request that fits.
        r = await sched.generate(prefix + [2], 2)
        assert r.cached_tokens == len(prefix)


def test_storage_refused_by_the_backend_is_found_before_any_mode_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file:// root that is a regular file is a usage error found when the backend opens,
    before the other modes run, not a storage mode of misses."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    args = bench_args(modes="kv-offload,kv+mamba+storage", storage=a_file.as_uri(), preset="tiny", page_size=1)
    assert multiturn.run(args) == 2
    captured = capsys.readouterr()
    assert "is not a directory" in captured.err and "mode kv-offload" not in captured.out


def test_storage_the_backend_cannot_set_up_is_found_before_any_mode_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A root under a regular file opens (a path is only checked at first use) but cannot be
    made: the first use fails, and that is a usage error too, not a storage mode of misses."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    args = bench_args(modes="kv-offload,kv+mamba+storage", storage=(a_file / "root").as_uri(), preset="tiny", page_size=1)
    assert multiturn.run(args) == 2
    captured = capsys.readouterr()
    assert "--storage" in captured.err and "not ready" in captured.err and "mode kv-offload" not in captured.out


def test_storage_options_without_the_storage_mode_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_args(modes="kv-offload", storage_option=["max_concurrency=2"], preset="tiny", page_size=1)
    assert multiturn.run(args) == 2
    assert "kv+mamba+storage mode only" in capsys.readouterr().err


def test_the_table_keeps_its_columns_apart_for_ttfts_of_ten_seconds_and_more(capsys: pytest.CaptureFixture[str]) -> None:
    from asynccache.bench.multiturn_report import print_tables

    rounds = [{"hit_rate": 0.0, "ttft_ms_mean": 13566.2}, {"hit_rate": 0.129, "ttft_ms_mean": 367.7}]
    ttft = {"mean": 4272.4, "p50": 3958.3, "p99": 10119.1}
    print_tables({"no-offload": {"hit_rate": 0.077, "ideal_hit_rate": 0.618, "fraction_of_ideal": 0.125,
                                  "ttft_ms": ttft, "throughput_tok_s": 270, "rounds": rounds}})  # fmt: skip
    row, cells = (line for line in capsys.readouterr().out.splitlines() if line.startswith("no-offload"))
    assert row.split()[4:7] == ["4272.4ms", "3958.3ms", "10119.1ms"]
    assert cells.split()[1:] == ["0.000", "/", "13566.2", "0.129", "/", "367.7"]
