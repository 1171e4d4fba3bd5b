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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

from asynccache.bench import transfer
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
