"""Sweep the copy kernel's knobs on a CUDA GPU and pick per-direction defaults.

``python -m kernels.tune --out DIR [--bench]`` times every candidate ``CopyTuning`` for H2D and
D2H scattered copies of 4 KiB pages, KV pages and Mamba state items of ``--preset`` at CTA caps
4 and 8 (ratio to a contiguous pinned memcpy of the same bytes, same run), measures the slowdown
of a concurrent bf16 GEMM beside a 4- and an 8-CTA H2D copy for each candidate, and prints the
compiled kernel's registers and spills and the GEMM kernel's footprint. The pick per direction
maximizes the worst ratio at 8 CTAs over the sizes among candidates whose GEMM slowdown at 8
CTAs is ≤ 3 %; if none is, it takes the least intrusive candidate within 0.02 of the best ratio.
``--bench`` then runs ``asynccache bench transfer`` with the picked tunings as defaults. Results
go to ``DIR/tune.json`` (and ``DIR/bench.json``). The figures that end up in ``kernels.plan``'s
``DEFAULT_TUNING`` come from here.

``python -m kernels.tune --dma --out DIR`` instead compares the DMA path's engines
(``kernels.dma_copy``: one batch call with and without the overlap-with-compute hint, one memcpy
per item, one 2-D memcpy per item over all layers) with the kernel at 8 CTAs for each item size
and direction, checks whether the batch call accepts the legacy default stream, measures the
GEMM slowdown beside batch copies of 64 KiB and state-sized items, and prints the smallest item size
from which the batch engine is at least as fast as the kernel in both directions (the
``kernels.plan.DMA_MIN_RUN_BYTES`` candidate). Results go to ``DIR/dma.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

from asynccache.bench import transfer
from asynccache.pools.base import ItemPool
from asynccache.spec import HybridSpec
from kernels import plan as plan_module
from kernels.plan import CopyTuning
from kernels.triton_copy import launch_copy

CANDIDATES: tuple[CopyTuning, ...] = tuple(
    CopyTuning(num_warps=w, tile_bytes=t * 1024, chunk_bytes=c * 1024, pipeline=p)
    for w, t, c, p in (
        (16, 32, 4, False),
        (16, 16, 4, False),
        (8, 16, 4, False),
        (4, 16, 8, False),
        (4, 32, 8, False),
        (2, 16, 8, False),
        (4, 8, 4, True),
        (4, 16, 8, True),
        (8, 16, 4, True),
        (16, 32, 16, True),
    )
)
GEMM_LIMIT = 0.03


def _label(t: CopyTuning) -> str:
    return f"w{t.num_warps}/t{t.tile_bytes // 1024}K/c{t.chunk_bytes // 1024}K/{'pipe' if t.pipeline else 'flat'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="qwen3-next-80b")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--bench", action="store_true", help="run the transfer bench with the picked tunings")
    parser.add_argument("--dma", action="store_true", help="compare the DMA engines with the kernel instead")
    parser.add_argument(
        "--write-defaults", action="store_true", help="write the picked tunings into kernels/plan.py's DEFAULT_TUNING"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.tune needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device())
    spec = HybridSpec.preset(args.preset)
    if args.dma:
        return tune_dma(args, device, spec)
    sizes = (4096, spec.kv_item_bytes, spec.state_item_bytes)
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {_triton_version()}", flush=True)

    pairs = {s: transfer.make_pool_pair(s, args.total_mib * transfer.MiB // s, device, seed=s % 97) for s in sizes}
    base = {
        (d, s): transfer.contiguous_seconds(p, d, p.num_bytes, reps=args.reps)
        for s, p in pairs.items()
        for d in ("h2d", "d2h")
    }
    for (d, s), secs in base.items():
        print(f"contiguous {d} {pairs[s].num_bytes} B: {pairs[s].num_bytes / secs / 1e9:.1f} GB/s", flush=True)

    rows: list[dict[str, object]] = []
    for tuning in CANDIDATES:
        for direction in ("h2d", "d2h"):
            for size, pair in pairs.items():
                src, dst, si, di = pair.ends(direction)
                for cap in (4, 8):

                    def once(cap: int = cap) -> object:
                        return launch_copy(src, dst, si, di, max_ctas=cap, tuning=tuning)

                    launch = once()
                    secs = transfer.time_median_s(once, reps=args.reps, device=device)
                    if cap == 8:
                        transfer.check_copy(pair, direction)
                    kernel = launch.kernel if launch is not None else None
                    row = {
                        "tuning": asdict(tuning), "label": _label(tuning), "direction": direction,
                        "item_bytes": size, "ctas": cap, "gbps": pair.num_bytes / secs / 1e9,
                        "ratio": base[(direction, size)] / secs,
                        "regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                    }  # fmt: skip
                    rows.append(row)
                    print(
                        f"{_label(tuning):<18} {direction} {size:>8} B cap {cap}: {row['gbps']:.1f} GB/s "
                        f"ratio {row['ratio']:.3f} regs {row['regs']} spills {row['spills']}",
                        flush=True,
                    )
    try:
        print(f"gemm kernel: {transfer.gemm_kernel_footprint(8192)}", flush=True)
    except (RuntimeError, OSError, ValueError) as e:  # the profiler is informative only
        print(f"gemm kernel: profiler unavailable ({type(e).__name__}: {e})", flush=True)
    gemm: dict[tuple[str, int], float] = {}
    kv = pairs[spec.kv_item_bytes]
    src, dst, si, di = kv.ends("h2d")
    for tuning in CANDIDATES:
        for cap in (4, 8):
            secs = transfer.time_median_s(
                lambda: launch_copy(src, dst, si, di, max_ctas=cap, tuning=tuning), reps=3, device=device
            )
            try:
                slow = transfer.gemm_slowdown(src, dst, si, di, ctas=cap, n=8192, copy_seconds=secs, tuning=tuning)
            except RuntimeError as e:  # the copy could not be made to outlast the matmuls
                print(f"gemm beside {cap}-CTA h2d copy, {_label(tuning)}: {e}", flush=True)
                slow = float("inf")
            gemm[(_label(tuning), cap)] = slow
            print(f"gemm beside {cap}-CTA h2d copy, {_label(tuning)}: {slow * 100:+.1f} %", flush=True)

    picks: dict[str, CopyTuning] = {}
    for direction in ("h2d", "d2h"):
        scored = []
        for tuning in CANDIDATES:
            worst = min(
                float(r["ratio"])  # type: ignore[arg-type]
                for r in rows
                if r["label"] == _label(tuning) and r["direction"] == direction and r["ctas"] == 8
            )
            scored.append((worst, gemm[(_label(tuning), 8)], tuning))
        best_ratio = max(w for w, _, _ in scored)
        feasible = [x for x in scored if x[1] <= GEMM_LIMIT]
        if feasible:  # the best copy among those that leave the GEMM alone
            best = max(feasible, key=lambda x: x[0])
        else:  # nothing meets the GEMM limit: the least intrusive among the near-best copies
            near = [x for x in scored if x[0] >= best_ratio - 0.02]
            best = min(near, key=lambda x: x[1])
        picks[direction] = best[2]
        print(
            f"pick {direction}: {_label(best[2])} (worst ratio at 8 CTAs {best[0]:.3f}, "
            f"gemm {best[1] * 100:+.1f} %; best ratio of all {best_ratio:.3f})",
            flush=True,
        )

    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(
            {
                "rows": rows,
                "gemm": [{"label": k[0], "ctas": k[1], "slowdown": v} for k, v in gemm.items()],
                "picks": {d: asdict(t) for d, t in picks.items()},
            },
            f,
            indent=1,
        )
    if args.write_defaults:
        write_defaults(picks)
    del pairs, kv
    torch.cuda.empty_cache()
    if args.bench:
        plan_module.DEFAULT_TUNING.update(picks)
        bench_parser = argparse.ArgumentParser()
        transfer.add_arguments(bench_parser)
        return transfer.run(bench_parser.parse_args(["--json", os.path.join(args.out, "bench.json")]))
    return 0


def tune_dma(args: argparse.Namespace, device: torch.device, spec: HybridSpec) -> int:
    """The ``--dma`` sweep (module docstring); writes ``DIR/dma.json``."""
    from kernels.cudart import cuda_runtime
    from kernels.dma_copy import batch_check, launch_dma, plan_segments

    rt = cuda_runtime()
    assert device.index is not None
    info = {**rt.describe(), "batch_check": batch_check(device.index)}
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}; runtime {info}", flush=True)
    info["legacy_stream"] = _legacy_stream_probe(device)
    print(f"batch call on the legacy default stream: {info['legacy_stream']}", flush=True)

    def batch_fn(src: ItemPool, dst: ItemPool, si: torch.Tensor, di: torch.Tensor, prefer: bool) -> object:
        seg = plan_segments(
            item_bytes=src.item_bytes, src_layer_stride_bytes=src.layer_stride_bytes,
            src_item_stride_bytes=src.item_stride_bytes, dst_layer_stride_bytes=dst.layer_stride_bytes,
            dst_item_stride_bytes=dst.item_stride_bytes, src_indices=si, dst_indices=di, layer_begin=0, layer_end=1,
        )  # fmt: skip
        assert src.buffer is not None and dst.buffer is not None
        s, d = seg.src_offsets + src.buffer.data_ptr(), seg.dst_offsets + dst.buffer.data_ptr()
        stream = torch.cuda.current_stream(device).cuda_stream
        return lambda: rt.memcpy_batch_async(
            d.data_ptr(), s.data_ptr(), seg.sizes.data_ptr(), seg.num_copies, stream, prefer_overlap=prefer
        )

    sizes = (4096, 16384, 32768, 65536, spec.kv_item_bytes, 262144, spec.state_item_bytes)
    rows: list[dict[str, object]] = []
    side = torch.cuda.Stream(device=device)
    for size in sizes:
        pair = transfer.make_pool_pair(size, args.total_mib * transfer.MiB // size, device, seed=size % 89)
        for direction in ("h2d", "d2h"):
            src, dst, si, di = pair.ends(direction)
            base = transfer.contiguous_seconds(pair, direction, pair.num_bytes, reps=args.reps)
            row: dict[str, object] = {"direction": direction, "item_bytes": size, "num_items": si.numel()}
            row["triton8"] = base / transfer.time_median_s(
                lambda: launch_copy(src, dst, si, di, max_ctas=8), reps=args.reps, device=device
            )
            with torch.cuda.stream(side):  # the batch call needs a stream other than the legacy one
                for name, prefer in (("batch", True), ("batch_noflag", False)):
                    fn = batch_fn(src, dst, si, di, prefer)
                    row[name] = base / transfer.time_median_s(fn, reps=args.reps, device=device)  # type: ignore[arg-type]
                    transfer.check_copy(pair, direction)
            row["loop"] = base / transfer.time_median_s(
                lambda: launch_dma(src, dst, si, di, engine="loop"), reps=args.reps, device=device
            )
            transfer.check_copy(pair, direction)
            rows.append(row)
            print(
                f"{direction} {size:>8} B: triton@8 {row['triton8']:.3f}  batch {row['batch']:.3f}  "
                f"batch(no hint) {row['batch_noflag']:.3f}  loop {row['loop']:.3f}  (ratio to contiguous)",
                flush=True,
            )
        del pair
    info["multi_layer"] = _multi_layer_engines(device, spec, args.reps)
    gemm: list[dict[str, object]] = []
    # Items the automatic choice sends to the copy engines. (Below ~32 KiB a batch is bound by
    # the host's submission, so the copy cannot be made to run beside the matmuls.)
    for size in (65536, spec.state_item_bytes):
        pair = transfer.make_pool_pair(size, 128 * transfer.MiB // size, device, seed=5)
        for direction in ("h2d", "d2h"):
            src, dst, si, di = pair.ends(direction)
            secs = transfer.time_median_s(lambda: launch_dma(src, dst, si, di), reps=3, device=device)
            try:
                slow = transfer.gemm_slowdown(src, dst, si, di, ctas=8, n=8192, copy_seconds=secs, method="dma")
            except RuntimeError as e:  # the copy could not be made to outlast the matmuls
                print(f"gemm beside a DMA {direction} copy of {size}-byte items: {e}", flush=True)
                slow = float("inf")
            gemm.append({"direction": direction, "item_bytes": size, "slowdown": slow})
            print(f"gemm beside a DMA {direction} copy of {size}-byte items: {slow * 100:+.1f} %", flush=True)
        del pair
    threshold = None
    for size in sorted(sizes, reverse=True):
        wins = [r for r in rows if r["item_bytes"] == size and float(r["batch"]) >= float(r["triton8"])]  # type: ignore[arg-type]
        if len(wins) < 2:
            break
        threshold = size
    print(f"smallest item size from which batch DMA >= triton@8 in both directions: {threshold}", flush=True)
    with open(os.path.join(args.out, "dma.json"), "w") as f:
        json.dump({"runtime": info, "rows": rows, "gemm": gemm, "threshold": threshold}, f, indent=1)
    return 0


def _legacy_stream_probe(device: torch.device) -> str:
    """Whether ``cudaMemcpyBatchAsync`` accepts the legacy default stream (a CUDA error name if not)."""
    from asynccache.errors import TransferError
    from kernels.cudart import cuda_runtime

    rt = cuda_runtime()
    if not rt.has_batch:
        return "no batch call"
    host = torch.ones(64, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(64, dtype=torch.uint8, device=device)
    ptrs = torch.tensor([host.data_ptr(), dev.data_ptr(), 64], dtype=torch.int64)
    try:
        rt.memcpy_batch_async(ptrs[1:2].data_ptr(), ptrs[0:1].data_ptr(), ptrs[2:3].data_ptr(), 1, 0)
    except TransferError as e:
        return f"rejected: {e}"
    finally:
        torch.cuda.synchronize(device)
    return "accepted" if bool((dev == 1).all()) else "accepted, wrong bytes"


def _multi_layer_engines(device: torch.device, spec: HybridSpec, reps: int) -> list[dict[str, object]]:
    """A backup of KV pages over 8 layers, device ``layer_first`` → host ``page_first`` (and back):
    the batch engine, one 2-D memcpy per page, one memcpy per (layer, page), as ratios of the
    contiguous copy of the same bytes."""
    from asynccache.pools.base import PoolLayout
    from kernels.dma_copy import launch_dma

    size, layers, items = spec.kv_item_bytes, 8, 256
    dev = ItemPool(name="t_dev", layer_ids=tuple(range(layers)), num_items=2 * items, item_bytes=size,
                   layout=PoolLayout.LAYER_FIRST, device=device)  # fmt: skip
    host = ItemPool(name="t_host", layer_ids=tuple(range(layers)), num_items=2 * items, item_bytes=size,
                    layout=PoolLayout.PAGE_FIRST, pin=True)  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    hi, di = torch.randperm(2 * items, generator=gen)[:items], torch.randperm(2 * items, generator=gen)[:items]
    assert dev.buffer is not None and host.buffer is not None
    nbytes = items * layers * size
    flat_h, flat_d = host.buffer.view(-1)[:nbytes], dev.buffer.view(-1)[:nbytes]
    out: list[dict[str, object]] = []
    side = torch.cuda.Stream(device=device)
    for direction, (src, dst, s_idx, d_idx) in (("d2h", (dev, host, di, hi)), ("h2d", (host, dev, hi, di))):
        a, b = (flat_d, flat_h) if direction == "d2h" else (flat_h, flat_d)
        base = transfer.time_median_s(lambda: b.copy_(a, non_blocking=True), reps=reps, device=device)
        row: dict[str, object] = {"direction": direction, "item_bytes": size, "layers": layers, "items": items}
        with torch.cuda.stream(side):
            for engine in ("batch", "2d", "loop"):
                secs = transfer.time_median_s(
                    lambda engine=engine: launch_dma(src, dst, s_idx, d_idx, engine=engine), reps=reps, device=device
                )
                row[engine] = base / secs
        out.append(row)
        print(f"all-layer {direction} of {items} pages × {layers} layers: "
              + ", ".join(f"{e} {row[e]:.3f}" for e in ("batch", "2d", "loop")), flush=True)  # fmt: skip
    return out


def write_defaults(picks: dict[str, CopyTuning]) -> None:
    """Rewrite the h2d/d2h entries between the "tuned:" markers of kernels/plan.py."""
    path = plan_module.__file__
    with open(path) as f:
        lines = f.read().split("\n")
    begin = next(i for i, line in enumerate(lines) if "# tuned: begin" in line)
    end = next(i for i, line in enumerate(lines) if "# tuned: end" in line)
    indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
    body = [
        f'{indent}"{d}": CopyTuning(num_warps={t.num_warps}, tile_bytes={t.tile_bytes}, '
        f"chunk_bytes={t.chunk_bytes}, pipeline={t.pipeline}),"
        for d, t in sorted(picks.items())
    ]
    lines[begin + 1 : end] = body
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {sorted(picks)} defaults into {path}", flush=True)


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    sys.exit(main())
