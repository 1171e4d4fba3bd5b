"""``asynccache bench overlap``: does layer-by-layer load-back hide behind compute?

A forward over every cached layer of a spec, with synthetic per-layer compute (bf16 GEMMs sized
to ``--compute-ratio`` × the slowest layer's measured load time, reading the layer's loaded pages
so the dependency is real), is timed three ways in one run:

- (a) ``device``: the prefix is already on the device (nothing to load);
- (b) ``layerwise``: the prefix is on host; the controller loads it layer by layer and the forward
  ``await``s each layer (``LayerTransferCounter``);
- (c) ``load_first``: the same load, but the forward starts only after every layer has landed.

It uses the real tree, pools, controller and kernels: the prefix is inserted, backed up to host,
demoted off the device, matched and loaded back. ``--json PATH`` writes the three times and the
ratios b/a and c/a. On CPU the numbers only exercise the path (copies are synchronous).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from asynccache.bench.options import device_name, positive_float, positive_int
from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError
from asynccache.spec import HybridSpec
from kernels.api import COPY_METHOD_HELP
from kernels.cudart import elapsed_ms

#: Tokens per page of the bench's spec: the prefix is whole pages.
PAGE_SIZE = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3-next-80b", help="spec preset (default qwen3-next-80b)")
    p.add_argument(
        "--prefix-tokens",
        type=positive_int,
        default=32768,
        help=f"cached prefix length, a multiple of the page size, {PAGE_SIZE} (default 32768)",
    )
    p.add_argument(
        "--compute-ratio",
        type=positive_float,
        default=1.25,
        help="per-layer compute ÷ the slowest layer's load time, a finite number > 0 (default 1.25; "
        "at least one GEMM per layer)",
    )
    p.add_argument("--repeats", type=positive_int, default=5, help="timed repetitions per variant (median reported)")
    p.add_argument("--max-ctas", type=positive_int, default=8, help="CTA cap of the copy kernels")
    p.add_argument(
        "--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N"
    )
    p.add_argument("--copy-method", default="auto", help=COPY_METHOD_HELP)
    p.add_argument("--json", dest="json_path", default=None)


def _elapsed_ms(device: torch.device, t0: Any, t1: Any) -> float:
    if device.type == "cuda":
        t1.synchronize()
        return float(t0.elapsed_time(t1))
    return (t1 - t0) * 1e3


def _mark(device: torch.device) -> Any:
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    spec = HybridSpec.preset(args.preset, page_size=PAGE_SIZE)
    num_pages = args.prefix_tokens // spec.page_size
    cfg = HybridCacheConfig(
        device_kv_pages=num_pages + 8,
        device_state_slots=4,
        host_kv_bytes=(num_pages + 8) * spec.kv_page_bytes,
        host_state_bytes=4 * spec.state_bytes,
        write_policy="write_through",
        max_ctas=args.max_ctas,
        copy_method=args.copy_method,
    )
    layer_ids = spec.cached_layer_ids
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    async with HybridCache(spec, cfg, device=device) as cache:
        # Built once the pools are: a prefix too large for this machine is a typed error there,
        # not a token list that exhausts memory first.
        tokens = list(range(1, num_pages * spec.page_size + 1))
        ctrl, tree = cache.controller, cache.tree
        # Populate: a prefix with its state, backed up to host.
        kv = cache.device_kv.alloc(num_pages)
        slot = cache.device_mamba.alloc(1)
        assert kv is not None and slot is not None
        cache.device_kv.buffer.random_(0, 255)  # type: ignore[union-attr]
        cache.device_mamba.buffer.random_(0, 255)  # type: ignore[union-attr]
        ins = tree.insert(tokens, kv, states={len(tokens): int(slot[0])})
        op = ctrl.write(ins.backup_nodes or [ins.last_node])
        assert op is not None
        ctrl.start_writing()
        await op

        # Per-layer load time, measured: load everything once, event per layer.
        async def load_all() -> Any:
            cache.flush_device()
            m = tree.match_prefix(tokens)
            op = ctrl.load(m)
            assert op is not None and m.needs_load
            return m, op

        def compute_for(ms: float) -> Callable[[], None]:
            n = 2048
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            # Calibrate GEMMs per layer to the target duration.
            for _ in range(3):
                a @ b
            t0 = _mark(device)
            for _ in range(10):
                a @ b
            per = _elapsed_ms(device, t0, _mark(device)) / 10
            reps = max(1, round(ms / max(per, 1e-6)))

            def run_layer() -> None:
                for _ in range(reps):
                    torch.mm(a, b)

            return run_layer

        _m, op = await load_all()
        t0 = _mark(device)
        counter = ctrl.start_loading()
        for lid in layer_ids:
            await counter.wait(lid)
        t1 = _mark(device)
        await op
        load_ms = _elapsed_ms(device, t0, t1)
        per_layer_load_ms = load_ms / len(layer_ids)
        # The goal holds "whenever per-layer load time ≤ per-layer compute time": size the
        # compute from the slowest layer's load (attention layers carry most of the bytes).
        max_layer_load_ms = per_layer_load_ms
        if device.type == "cuda":
            prev = t0
            durations = []
            for lid in layer_ids:
                ev = counter.cuda_event(lid)
                if ev is not None:
                    durations.append(elapsed_ms(prev, ev))
                    prev = ev
            max_layer_load_ms = max(durations) if durations else per_layer_load_ms
        compute_target_ms = max_layer_load_ms * args.compute_ratio
        layer_compute = compute_for(compute_target_ms)
        kv_pool, st_pool = cache.device_kv, cache.device_mamba

        def touch(lid: int) -> None:
            # Read what the layer loaded: a real dependency on the copy.
            if lid in kv_pool._layer_index:
                kv_pool.layer_items(lid)[:num_pages].sum(dtype=torch.int64)
            if lid in st_pool._layer_index:
                st_pool.layer_items(lid).sum(dtype=torch.int64)

        async def forward(wait: Callable[[int], Awaitable[None]]) -> None:
            for lid in layer_ids:
                await wait(lid)
                touch(lid)
                layer_compute()

        async def no_wait(lid: int) -> None:
            return None

        times: dict[str, list[float]] = {"device": [], "layerwise": [], "load_first": [], "enqueue_host": []}
        for _ in range(args.repeats + 1):  # first round is warm-up
            # (a) on device
            t0 = _mark(device)
            await forward(no_wait)
            times["device"].append(_elapsed_ms(device, t0, _mark(device)))
            # (b) layer by layer
            _m, op = await load_all()
            t0 = _mark(device)
            counter = ctrl.start_loading()
            await forward(counter.wait)
            times["layerwise"].append(_elapsed_ms(device, t0, _mark(device)))
            await op
            # (c) load everything first
            _m, op = await load_all()
            t0 = _mark(device)
            h0 = time.perf_counter()
            counter = ctrl.start_loading()
            for lid in layer_ids:
                await counter.wait(lid)
            times["enqueue_host"].append((time.perf_counter() - h0) * 1e3)
            await forward(no_wait)
            times["load_first"].append(_elapsed_ms(device, t0, _mark(device)))
            await op
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {
        "device": str(device),
        "spec": args.preset,
        "prefix_tokens": args.prefix_tokens,
        "num_layers": len(layer_ids),
        "per_layer_load_ms": per_layer_load_ms,
        "max_layer_load_ms": max_layer_load_ms,
        "per_layer_compute_target_ms": compute_target_ms,
        "device_ms": med["device"],
        "layerwise_ms": med["layerwise"],
        "load_first_ms": med["load_first"],
        "load_enqueue_host_ms": med["enqueue_host"],
        "layerwise_ratio": med["layerwise"] / med["device"],
        "load_first_ratio": med["load_first"] / med["device"],
    }


def run(args: argparse.Namespace) -> int:
    import uvloop

    if args.prefix_tokens % PAGE_SIZE:
        raise ConfigError(f"--prefix-tokens ({args.prefix_tokens}) must be a multiple of the page size ({PAGE_SIZE})")
    res = uvloop.run(_run(args))
    print(
        f"overlap on {res['device']}: {res['spec']}, {res['prefix_tokens']}-token prefix, {res['num_layers']} layers, "
        f"load {res['per_layer_load_ms']:.3f} ms/layer (max {res['max_layer_load_ms']:.3f}), "
        f"compute ≈{res['per_layer_compute_target_ms']:.3f} ms/layer"
    )
    print(f"{'variant':<28}{'time (ms)':>12}{'÷ device':>10}")
    print(f"{'(a) prefix on device':<28}{res['device_ms']:>12.2f}{1.0:>10.3f}")
    print(f"{'(b) layer-by-layer load':<28}{res['layerwise_ms']:>12.2f}{res['layerwise_ratio']:>10.3f}")
    print(f"{'(c) load all, then compute':<28}{res['load_first_ms']:>12.2f}{res['load_first_ratio']:>10.3f}")
    print(f"host time to enqueue every layer's load: {res['load_enqueue_host_ms']:.2f} ms")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(res, indent=2))
    return 0
