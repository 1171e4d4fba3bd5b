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

The measurements are built from ``asynccache.bench.copy_timing`` (the pool pair, the timers and
the bit-for-bit check) and ``asynccache.bench.gemm_contention`` (the GEMM slowdown), which
``python -m kernels.tune`` shares (their names are importable from here too); the per-layer
load is ``asynccache.bench.layer_load``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from asynccache.bench.copy_timing import (
    UNCAPPED,
    PoolPair,
    check_copy,
    contiguous_seconds,
    grid_for,
    make_pool_pair,
    scattered_seconds,
    time_median_s,
)
from asynccache.bench.gemm_contention import gemm_kernel_footprint, gemm_slowdown
from asynccache.bench.layer_load import method_label, per_layer_load
from asynccache.bench.options import positive_float, positive_int
from asynccache.errors import ConfigError
from asynccache.spec import HybridSpec

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


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferResult:
    method: str  # "triton" | "dma" on CUDA, "torch" on CPU
    direction: str
    item_bytes: int
    num_items: int
    ctas: int
    gbps: float
    ratio: float


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
    parser.add_argument("--total-mib", type=positive_float, default=None, help="MiB per copy (default 256 CUDA, 8 CPU)")
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
        scenario_rows = per_layer_load(
            spec, device, runs, link["h2d"], states=args.states, tokens=args.tokens,
            consecutive=args.consecutive, reps=reps, progress=_progress,
        )  # fmt: skip

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
            f"per-layer load ({s['launches']} calls, {s['bytes'] / 1e9:.2f} GB, {method_label(s['method'], s['ctas'])}): "
            f"{s['gbps']:.1f} GB/s = {s['ratio']:.3f} of contiguous H2D; {s['issue_ms']:.1f} ms to enqueue"
        )
