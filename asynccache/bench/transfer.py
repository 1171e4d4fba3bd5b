"""``asynccache bench transfer``: scattered item copies against a contiguous pinned memcpy.

What it measures (on CUDA), for each copy method of ``copy_items`` (``--methods``: the Triton
kernel, ``"triton"``, and the copy engines, ``"dma"``, in the same run):

- **Scattered copies**, H2D (pinned host pool → device pool) and D2H, for item sizes from 4 KiB
  to 2 MiB plus the KV page and Mamba state item of a real spec (``--preset``), the kernel at
  several CTA caps (``--ctas``; ``0`` = uncapped), the DMA path once (no CTAs): GB/s and the
  ratio to a contiguous pinned ``cudaMemcpyAsync`` of the same number of bytes, measured in the
  same run. Items are gathered from random indices of a pool twice as large and scattered to
  random indices; each (size, direction, method) is checked bit for bit.
- **GEMM slowdown**: bf16 ``N³`` matmuls on one stream, alone and next to one long copy of KV
  pages on another stream: the kernel capped at 4, 8 and 16 CTAs, and the DMA path (both
  directions; ``gemm_slowdown`` is the kernel's worse direction at 8 CTAs,
  ``gemm_slowdown_dma`` the DMA path's worse direction), plus the matmul kernel's grid,
  registers and shared memory.
- **Per-layer load** of the Mamba states of ``--states`` requests and ``--tokens`` tokens of KV
  (the spec's geometry): one ``copy_items`` call per layer over all layers in order, as the
  controller does before a forward pass — the kernel at each cap, the DMA path, and the
  automatic choice (``method="auto"``, kernel cap 8); total GB/s, the ratio to the contiguous
  H2D bandwidth, and the host time the calls take to enqueue every layer. Indices are random
  permutations, or with ``--consecutive`` the same ascending run on both sides (what a load
  after a flush gets from the allocators; the DMA path then issues one strided 2D memcpy per
  layer).

On CPU the same command measures ``copy_items``' torch-indexing path (host → host; ``ctas`` is
reported as 0, ``method`` as ``"torch"``) against a contiguous ``copy_`` and says so; no GEMM.
``--json PATH`` writes::

    {"device": "cuda"|"cpu",
     "results": [{"method", "direction", "item_bytes", "num_items", "ctas", "gbps", "ratio"}, ...],
     "gemm_slowdown": float | null,
     "gemm_slowdown_dma": float | null,
     "contiguous_gbps": {"h2d": float, "d2h": float},
     "per_layer_load": [{"method", "ctas", "bytes", "gbps", "ratio", "launches", "issue_ms", "indices"}, ...],
     "gemm": [{"method", "direction", "ctas", "slowdown", "gemm_kernel"}, ...],
     "dma_runtime": {"path", "runtime_version", "driver_version", "batch_signature", "batch_check"} | null}

``ctas`` is the grid actually launched (for an uncapped run, one CTA per tile; 0 for DMA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from asynccache.bench.options import positive_float, positive_int
from asynccache.errors import ConfigError
from asynccache.pools.base import ItemPool, PoolLayout
from asynccache.pools.device import DeviceKVPool, DeviceMambaPool
from asynccache.pools.host import HostKVPool, MambaPoolHost
from asynccache.spec import HybridSpec
from kernels.api import copy_items

__all__ = [
    "UNCAPPED",
    "PoolPair",
    "TransferResult",
    "add_arguments",
    "contiguous_seconds",
    "gemm_kernel_footprint",
    "gemm_slowdown",
    "make_pool_pair",
    "run",
    "scattered_seconds",
    "time_median_s",
]

KiB = 1024
MiB = 1024 * KiB
_FILL_PERIOD = 1048573  # a prime number of bytes
#: ``--ctas 0`` means uncapped: one CTA per tile.
UNCAPPED = 2**31 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferResult:
    method: str  # "triton" | "dma" on CUDA, "torch" on CPU
    direction: str
    item_bytes: int
    num_items: int
    ctas: int
    gbps: float
    ratio: float


@dataclass(slots=True)
class PoolPair:
    """A host pool and a device pool of ``2·num_items`` single-layer items, and the scattered
    index lists (``num_items`` distinct random indices on each side)."""

    host: ItemPool
    device: ItemPool
    host_indices: torch.Tensor
    device_indices: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.host_indices.numel() * self.host.item_bytes

    def ends(self, direction: str) -> tuple[ItemPool, ItemPool, torch.Tensor, torch.Tensor]:
        """(src, dst, src_indices, dst_indices) for ``"h2d"`` or ``"d2h"``."""
        if direction == "h2d":
            return self.host, self.device, self.host_indices, self.device_indices
        return self.device, self.host, self.device_indices, self.host_indices


# ---- building blocks (also used by kernels/tune.py) --------------------------------------------


def make_pool_pair(item_bytes: int, num_items: int, device: torch.device, *, seed: int = 0) -> PoolPair:
    """Pools filled with random bytes (never time on zeros)."""
    gen = torch.Generator().manual_seed(seed)
    pin = True if device.type == "cuda" else None
    host = ItemPool(
        name="bench_host", layer_ids=(0,), num_items=2 * num_items, item_bytes=item_bytes,
        layout=PoolLayout.PAGE_FIRST, device="cpu", pin=pin,
    )  # fmt: skip
    dev = ItemPool(
        name="bench_device", layer_ids=(0,), num_items=2 * num_items, item_bytes=item_bytes,
        layout=PoolLayout.LAYER_FIRST, device=device, pin=False,
    )  # fmt: skip
    _fill_random(dev.buffer, seed)
    _fill_random(host.buffer, seed + 1)
    host_indices = torch.randperm(2 * num_items, generator=gen)[:num_items]
    device_indices = torch.randperm(2 * num_items, generator=gen)[:num_items]
    return PoolPair(host, dev, host_indices, device_indices)


def _fill_random(buf: torch.Tensor | None, seed: int) -> None:
    assert buf is not None
    flat = buf.view(-1)
    if flat.numel() == 0:
        return
    if flat.device.type == "cuda":
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        flat.random_(0, 256, generator=gen)
    elif flat.is_pinned() and torch.cuda.is_available():
        tmp = torch.empty_like(flat, device="cuda")
        tmp.random_(0, 256, generator=torch.Generator(device="cuda").manual_seed(seed))
        flat.copy_(tmp)
    else:
        # A random block of prime length repeated: cheap on a small CPU, and two items can only
        # hold the same bytes if their offsets differ by a multiple of the prime (> any pool here).
        period = min(flat.numel(), _FILL_PERIOD)
        block = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        whole = flat.numel() // period
        flat[: whole * period].view(whole, period).copy_(block.expand(whole, period))
        flat[whole * period :].copy_(block[: flat.numel() - whole * period])


def time_median_s(fn: Callable[[], object], *, reps: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of ``fn`` (CUDA events around each call on the current stream; a host
    clock on CPU)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def contiguous_seconds(pair: PoolPair, direction: str, num_bytes: int, *, reps: int) -> float:
    """One contiguous copy of ``num_bytes`` between the pools' buffers (pinned memcpy on CUDA)."""
    assert pair.host.buffer is not None and pair.device.buffer is not None
    host = pair.host.buffer.view(-1)[:num_bytes]
    dev = pair.device.buffer.view(-1)[:num_bytes]
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    non_blocking = dev.device.type == "cuda"
    return time_median_s(lambda: dst.copy_(src, non_blocking=non_blocking), reps=reps, device=dev.device)


def scattered_seconds(pair: PoolPair, direction: str, ctas: int, *, reps: int, method: str = "triton") -> float:
    """Median seconds of one scattered ``copy_items`` of the pair (``method`` as there; CPU: torch)."""
    src, dst, si, di = pair.ends(direction)
    return time_median_s(
        lambda: copy_items(src, dst, si, di, max_ctas=ctas, method=None if method == "torch" else method),
        reps=reps,
        device=pair.device.device,
    )


def check_copy(pair: PoolPair, direction: str) -> None:
    """Raise if the last scattered copy did not land bit for bit (compared on the device)."""
    src, dst, si, di = pair.ends(direction)
    assert src.buffer is not None and dst.buffer is not None
    dev = pair.device.device
    got = dst.buffer.to(dev).view(dst.num_items, -1)[di.to(dev)]
    want = src.buffer.to(dev).view(src.num_items, -1)[si.to(dev)]
    if not torch.equal(got, want):
        raise RuntimeError(f"{direction} scattered copy of {src.item_bytes}-byte items is wrong")


def grid_for(pair: PoolPair, direction: str, ctas: int, method: str = "triton") -> int:
    """The grid a CUDA launch of this copy uses (0 on CPU and for DMA, where there is no grid)."""
    if pair.device.device.type != "cuda" or method == "dma":
        return 0
    from kernels.triton_copy import plan_launch

    src, dst, si, di = pair.ends(direction)
    planned = plan_launch(src, dst, si, di, max_ctas=ctas)
    assert planned is not None
    return planned[0].grid


def gemm_slowdown(
    src: ItemPool,
    dst: ItemPool,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    ctas: int,
    n: int,
    copy_seconds: float,
    tuning: object | None = None,
    rounds: int = 3,
    method: str = "triton",
) -> float:
    """Relative slowdown of ``n³`` bf16 matmuls next to one long copy (the Triton kernel capped
    at ``ctas`` CTAs, or with ``method="dma"`` the copy engines).

    The copy is the same call launched back to back (a copy may not write an item twice, so
    the index lists are not repeated), enqueued on another stream before the matmuls and sized
    to outlast them threefold, so it runs the whole time, as during a long load-back; that it
    did outlast them is checked with events (the copy is made longer and the round repeated
    otherwise). Returns ``t_concurrent / t_alone − 1`` (medians).
    """
    from kernels.dma_copy import launch_dma
    from kernels.triton_copy import launch_copy

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def gemms(k: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(gemm_stream):
            start.record()
            for _ in range(k):
                torch.mm(a, b, out=c)
            end.record()
        return start, end

    gemms(3)
    torch.cuda.synchronize()
    s, e = gemms(4)
    torch.cuda.synchronize()
    one_gemm_s = s.elapsed_time(e) / 4e3
    k = max(4, int(0.02 / one_gemm_s))  # ~20 ms of matmuls
    repeat = max(1, int(3 * k * one_gemm_s / copy_seconds) + 1)
    alone: list[float] = []
    together: list[float] = []
    while len(together) < rounds:
        s, e = gemms(k)
        torch.cuda.synchronize()
        t_alone = s.elapsed_time(e)
        copy_start, copy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(copy_stream):
            copy_start.record()
            for _ in range(repeat):
                if method == "dma":
                    launch_dma(src, dst, src_indices, dst_indices, stream=copy_stream)
                else:
                    launch_copy(
                        src, dst, src_indices, dst_indices,
                        max_ctas=ctas, stream=copy_stream, tuning=tuning,  # type: ignore[arg-type]
                    )  # fmt: skip
            copy_end.record()
        s, e = gemms(k)
        torch.cuda.synchronize()
        if copy_start.elapsed_time(copy_end) < copy_start.elapsed_time(e):
            if repeat > 64 * (1 + int(3 * k * one_gemm_s / copy_seconds)):
                raise RuntimeError("the copy keeps ending before the matmuls: cannot measure the slowdown")
            repeat *= 2  # the matmuls outlasted the copy: measure again with a longer copy
            continue
        alone.append(t_alone)
        together.append(s.elapsed_time(e))
    return statistics.median(together) / statistics.median(alone) - 1.0


def gemm_kernel_footprint(n: int) -> dict[str, object]:
    """Name, grid, block, registers and shared memory of the kernel an ``n³`` bf16 matmul runs
    (from the profiler's trace): what a copy CTA has to fit beside on an SM."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.mm(a, a)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [ev for ev in events if ev.get("cat") == "kernel"]
    if not kernels:
        return {"error": "no kernel in the profiler trace"}
    kernel = max(kernels, key=lambda ev: ev.get("dur", 0))
    args = kernel.get("args", {})
    keys = ("grid", "block", "registers per thread", "shared memory", "blocks per SM", "warps per SM")
    return {"name": str(kernel.get("name", ""))[:120], **{key: args.get(key) for key in keys}}


# ---- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma-separated item sizes in bytes, or 'kv' / 'state' for the preset's items "
        "(default: 4 KiB…2 MiB plus kv and state on CUDA; a few on CPU)",
    )
    parser.add_argument(
        "--ctas", default="4,8,16,0", help="comma-separated CTA caps of the kernel; 0 = uncapped (checked on CPU too)"
    )
    parser.add_argument(
        "--methods",
        default="triton,dma",
        help="copy methods to measure on CUDA: triton, dma (comma-separated; checked on CPU too, which measures torch)",
    )
    parser.add_argument("--total-mib", type=positive_float, default=None, help="bytes per copy (default 256 CUDA, 8 CPU)")
    parser.add_argument("--reps", type=positive_int, default=None, help="timed repetitions (median; default 5 CUDA, 3 CPU)")
    parser.add_argument("--preset", default="qwen3-next-80b", help="HybridSpec preset for kv/state items")
    parser.add_argument("--gemm-n", type=positive_int, default=8192, help="GEMM size for the slowdown test")
    parser.add_argument("--no-gemm", action="store_true", help="skip the concurrent-GEMM test")
    parser.add_argument("--states", type=positive_int, default=None, help="per-layer load: states (default 64 CUDA, 1 CPU)")
    parser.add_argument(
        "--tokens",
        type=positive_int,
        default=None,
        help="per-layer load: KV tokens, at least the preset's page size and rounded down to whole pages "
        "(default 32768 / 512)",
    )
    parser.add_argument("--no-scenario", action="store_true", help="skip the per-layer load scenario")
    parser.add_argument(
        "--consecutive", action="store_true", help="per-layer load: consecutive indices on both sides (default random)"
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON to this path")


def _device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sizes(text: str | None, spec: HybridSpec, cuda: bool) -> list[int]:
    if text is None:
        text = "4096,16384,65536,kv,262144,1048576,2097152,state" if cuda else "4096,65536,kv,state"
    named = {"kv": spec.kv_item_bytes, "state": spec.state_item_bytes}
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if tok in named:
            out.append(named[tok])
        elif tok.isdigit() and int(tok) > 0:
            out.append(int(tok))
        else:
            raise ConfigError(f"--sizes: {tok!r} is neither a positive byte count nor one of {sorted(named)}")
    return out


def _caps(text: str) -> list[int]:
    try:
        caps = [int(tok) for tok in text.split(",") if tok.strip()]
    except ValueError:
        raise ConfigError(f"--ctas: {text!r} is not a comma-separated list of integers") from None
    if not caps or min(caps) < 0:
        raise ConfigError(f"--ctas: {text!r} must name CTA caps >= 0 (0 = uncapped)")
    return caps


def _methods(text: str) -> list[str]:
    out = [tok.strip().lower() for tok in text.split(",") if tok.strip()]
    bad = [m for m in out if m not in ("triton", "dma")]
    if bad or not out:
        raise ConfigError(f"--methods: {bad or text!r} not among triton, dma")
    return out


def _dma_runtime(device: torch.device) -> dict[str, object] | None:
    """The CUDA runtime the DMA path binds and whether its batch call passed the self-check."""
    if device.type != "cuda":
        return None
    from kernels.cudart import cuda_runtime
    from kernels.dma_copy import batch_check

    assert device.index is not None
    return {**cuda_runtime().describe(), "batch_check": batch_check(device.index)}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    device = _device(args.device)
    cuda = device.type == "cuda"
    spec = HybridSpec.preset(args.preset)
    if args.tokens is not None and args.tokens < spec.page_size and not args.no_scenario:
        raise ConfigError(f"--tokens: {args.tokens} is smaller than the page size of {args.preset!r} ({spec.page_size})")
    sizes = _sizes(args.sizes, spec, cuda)
    caps, methods = _caps(args.ctas), _methods(args.methods)  # checked on CPU too, where they do not apply
    if not cuda:
        caps, methods = [0], ["torch"]
    # (method, CTA cap) per measurement: the kernel at every cap, the DMA path once.
    runs = [("triton" if cuda else "torch", cap) for cap in caps if "triton" in methods or not cuda]
    runs += [("dma", 0)] if "dma" in methods else []
    total_bytes = int((args.total_mib if args.total_mib is not None else (256 if cuda else 8)) * MiB)
    reps = args.reps if args.reps is not None else (5 if cuda else 3)
    dma_runtime = _dma_runtime(device) if "dma" in methods else None
    if cuda:
        name = torch.cuda.get_device_name(device)
        print(f"# transfer on {name}: {', '.join(methods)} (pinned host memory); CUDA runtime {dma_runtime}")
    else:
        print("# transfer on CPU: no CUDA device, measuring copy_items' torch-indexing path (host → host)")

    results: list[TransferResult] = []
    contiguous: dict[str, list[float]] = {"h2d": [], "d2h": []}
    steps = len(sizes) * 2 * len(runs)
    step = 0
    for item_bytes in sizes:
        num_items = max(1, total_bytes // item_bytes)
        pair = make_pool_pair(item_bytes, num_items, device)
        for direction in ("h2d", "d2h"):
            base_s = contiguous_seconds(pair, direction, pair.num_bytes, reps=reps)
            contiguous[direction].append(pair.num_bytes / base_s / 1e9)
            checked: set[str] = set()
            for method, cap in runs:
                step += 1
                ctas = UNCAPPED if cap == 0 else cap
                secs = scattered_seconds(pair, direction, ctas, reps=reps, method=method)
                if method not in checked:
                    check_copy(pair, direction)
                    checked.add(method)
                res = TransferResult(
                    method=method, direction=direction, item_bytes=item_bytes, num_items=num_items,
                    ctas=grid_for(pair, direction, ctas, method), gbps=pair.num_bytes / secs / 1e9, ratio=base_s / secs,
                )  # fmt: skip
                results.append(res)
                _progress(
                    f"[{step}/{steps}] {method} {direction} {item_bytes} B × {num_items}, ctas {res.ctas}: "
                    f"{res.gbps:.1f} GB/s ({res.ratio:.2f} of contiguous)"
                )
        del pair
    link = {d: statistics.median(v) for d, v in contiguous.items()}

    gemm_rows: list[dict[str, object]] = []
    if cuda and not args.no_gemm:
        gemm_rows = _gemm_rows(device, spec, args.gemm_n, reps, methods)
    scenario_rows: list[dict[str, object]] = []
    if not args.no_scenario:
        scenario_rows = _scenario(spec, device, runs, link["h2d"], args, reps)

    gemm_8 = [float(r["slowdown"]) for r in gemm_rows if r["method"] == "triton" and r["ctas"] == 8]  # type: ignore[arg-type]
    gemm_dma = [float(r["slowdown"]) for r in gemm_rows if r["method"] == "dma"]  # type: ignore[arg-type]
    report = {
        "device": device.type,
        "results": [asdict(r) for r in results],
        "gemm_slowdown": max(gemm_8) if gemm_8 else None,
        "gemm_slowdown_dma": max(gemm_dma) if gemm_dma else None,
        "contiguous_gbps": link,
        "per_layer_load": scenario_rows,
        "gemm": gemm_rows,
        "dma_runtime": dma_runtime,
    }
    _print_tables(report, cuda)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _gemm_rows(
    device: torch.device, spec: HybridSpec, n: int, reps: int, methods: list[str]
) -> list[dict[str, object]]:
    """Slowdown of the GEMM beside a long copy of KV pages: the kernel at caps 4, 8, 16, the DMA
    path (both directions)."""
    try:
        footprint = gemm_kernel_footprint(n)
    except (RuntimeError, OSError, ValueError) as e:  # the profiler is optional here
        footprint = {"error": f"{type(e).__name__}: {e}"}
    _progress(f"gemm {n}³ bf16 kernel: {footprint}")
    pair = make_pool_pair(spec.kv_item_bytes, 256 * MiB // spec.kv_item_bytes, device, seed=7)
    runs = [("triton", cap) for cap in (4, 8, 16)] if "triton" in methods else []
    runs += [("dma", 0)] if "dma" in methods else []
    rows: list[dict[str, object]] = []
    for direction in ("h2d", "d2h"):
        src, dst, si, di = pair.ends(direction)
        for method, cap in runs:
            secs = scattered_seconds(pair, direction, cap or UNCAPPED, reps=reps, method=method)
            slow = gemm_slowdown(src, dst, si, di, ctas=cap or UNCAPPED, n=n, copy_seconds=secs, method=method)
            rows.append(
                {"method": method, "direction": direction, "ctas": cap, "slowdown": slow, "gemm_kernel": footprint}
            )
            what = f"{cap}-CTA" if method == "triton" else "DMA"
            _progress(f"gemm {n}³ bf16 beside a {what} {direction} copy: {slow * 100:+.1f} %")
    return rows


def _scenario(
    spec: HybridSpec,
    device: torch.device,
    runs: list[tuple[str, int]],
    link_gbps: float,
    args: argparse.Namespace,
    reps: int,
) -> list[dict[str, object]]:
    """Per-layer H2D load of ``states`` Mamba states and ``tokens`` tokens of KV, all layers:
    each (method, cap) of ``runs``, then (on CUDA) the automatic choice at cap 8."""
    cuda = device.type == "cuda"
    num_states = args.states if args.states is not None else (64 if cuda else 1)
    num_pages = (args.tokens if args.tokens is not None else (32768 if cuda else 512)) // spec.page_size
    pin = True if cuda else None
    host_kv = HostKVPool(spec, num_pages=num_pages, layout=PoolLayout.PAGE_FIRST, pin=pin)
    host_mamba = MambaPoolHost(spec, num_slots=num_states, layout=PoolLayout.PAGE_FIRST, pin=pin)
    dev_kv = DeviceKVPool(spec, num_pages, device=device)
    dev_mamba = DeviceMambaPool(spec, num_states, device=device)
    for i, pool in enumerate((host_kv, host_mamba, dev_kv, dev_mamba)):
        _fill_random(pool.buffer, 100 + i)
    gen = torch.Generator().manual_seed(3)
    if args.consecutive:
        kv_idx, st_idx = (torch.arange(num_pages),) * 2, (torch.arange(num_states),) * 2
    else:
        kv_idx = (torch.randperm(num_pages, generator=gen), torch.randperm(num_pages, generator=gen))
        st_idx = (torch.randperm(num_states, generator=gen), torch.randperm(num_states, generator=gen))
    total = num_pages * spec.kv_page_bytes + num_states * spec.state_bytes
    order = "consecutive" if args.consecutive else "random"
    _progress(
        f"per-layer load: {num_states} states + {num_pages * spec.page_size} tokens of KV = {total / 1e9:.2f} GB, "
        f"{order} indices"
    )
    rows: list[dict[str, object]] = []
    if cuda:
        runs = [*runs, ("auto", 8)]
    for method, cap in runs:
        ctas = UNCAPPED if cap == 0 else cap

        def load_all_layers(ctas: int = ctas, method: str = method) -> None:
            for layer_id in range(spec.num_layers):
                if layer_id in spec.attention_layer_ids:
                    src, dst, (si, di) = host_kv, dev_kv, kv_idx
                elif layer_id in spec.mamba_layer_ids:
                    src, dst, (si, di) = host_mamba, dev_mamba, st_idx
                else:
                    continue
                li = src.layer_index(layer_id)
                copy_items(
                    src, dst, si, di, layer_begin=li, layer_end=li + 1, max_ctas=ctas,
                    method=None if method == "torch" else method,
                )  # fmt: skip

        secs = time_median_s(load_all_layers, reps=min(reps, 3) if cuda else 1, device=device)
        t0 = time.perf_counter()
        load_all_layers()  # host time to enqueue every layer (what the caller's thread spends)
        issue_ms = (time.perf_counter() - t0) * 1e3
        if cuda:
            torch.cuda.synchronize(device)
        gbps = total / secs / 1e9
        launches = len(spec.attention_layer_ids) + len(spec.mamba_layer_ids)
        rows.append(
            {
                "method": method, "ctas": cap, "bytes": total, "gbps": gbps, "ratio": gbps / link_gbps,
                "launches": launches, "issue_ms": issue_ms, "indices": order,
            }
        )  # fmt: skip
        _progress(
            f"per-layer load, {_label(method, cap)}: {gbps:.1f} GB/s ({gbps / link_gbps:.2f} of link), "
            f"{issue_ms:.1f} ms to enqueue"
        )
    return rows


def _label(method: str, cap: int) -> str:
    if method == "dma":
        return "dma"
    if method == "torch":
        return "torch"
    return f"{method} cap {cap or 'none'}"


def _print_tables(report: dict[str, object], cuda: bool) -> None:
    link = report["contiguous_gbps"]
    assert isinstance(link, dict)
    what = "pinned memcpy" if cuda else "copy_ (CPU)"
    print(f"contiguous {what}: h2d {link['h2d']:.1f} GB/s, d2h {link['d2h']:.1f} GB/s")
    print(f"{'method':<7} {'direction':<9} {'item_bytes':>10} {'items':>7} {'ctas':>6} {'GB/s':>7} {'ratio':>6}")
    for r in report["results"]:  # type: ignore[attr-defined]
        print(
            f"{r['method']:<7} {r['direction']:<9} {r['item_bytes']:>10} {r['num_items']:>7} {r['ctas']:>6} "
            f"{r['gbps']:>7.1f} {r['ratio']:>6.3f}"
        )
    gemm_rows = report["gemm"]
    assert isinstance(gemm_rows, list)
    if gemm_rows:
        print(f"gemm kernel: {gemm_rows[0]['gemm_kernel']}")
    for g in gemm_rows:
        what = f"{g['ctas']}-CTA" if g["method"] == "triton" else "DMA"
        print(f"gemm slowdown beside {what} {g['direction']} copy: {g['slowdown'] * 100:+.1f} %")
    for s in report["per_layer_load"]:  # type: ignore[attr-defined]
        print(
            f"per-layer load ({s['launches']} calls, {s['bytes'] / 1e9:.2f} GB, {_label(s['method'], s['ctas'])}): "
            f"{s['gbps']:.1f} GB/s = {s['ratio']:.3f} of contiguous H2D; {s['issue_ms']:.1f} ms to enqueue"
        )
