"""``asynccache bench trace``: replay a Mooncake-format trace under cache policies and budgets.

Every (policy combination, host budget, storage budget) cell replays the whole trace through the
real tree and pools in accounting mode on the trace's own clock — through the asyncio controller
(``asynccache.trace.controller_replay``, the default ``--engine controller``) or the tree's
synchronous stand-in (``asynccache.trace.replay``, ``--engine sync``) —
and reports the token hit rate overall and by tier, its fraction of the infinite-cache bound,
the prefill FLOPs saved, the bytes moved per tier and the evictions. Cells run in parallel
processes (``--jobs``). Output: a table on stdout (``--markdown`` for Markdown), a PNG comparing
the policies across budgets (``--plot``) and ``--json PATH``::

    {"bound": float, "results": [{"admission": str, "eviction": str,
      "budget_bytes": {"device": int, "host": int, "storage": int},
      "hit_rate": float, "fraction_of_bound": float, "flops_saved": float,
      "bytes_moved": {"h2d": int, "d2h": int, …},
      "evictions": {"device_kv": int, "device_state": int, "device_stuck": int, …}, …}], …}

(every key of ``bytes_moved`` and ``evictions``: ``asynccache.trace.results.ReplayResult``).

Policies are ``admission/eviction[/write_policy[/storage_write]]`` (see
``asynccache.trace.policies``). The default set: the tree's defaults (``ends/lru``), a state at
every page, a block grid of 8 pages, branch points with LRU, Marconi-style
(``branch/cost-aware``), Marconi-style with write-back demotion, ours
(``adaptive/reuse/write_back``), and the attention-only reference of the same bytes (states at
every page that cost nothing; write-through and write-back; replayed without storage only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asynccache.bench.options import positive_float, positive_int
from asynccache.errors import ConfigError
from asynccache.spec import PRESETS, HybridSpec
from asynccache.trace.bound import BoundResult, infinite_cache_bound
from asynccache.trace.config import ReplayConfig
from asynccache.trace.controller_replay import replay_trace_with_controller
from asynccache.trace.flops import FlopModel
from asynccache.trace.loader import MOONCAKE_BLOCK_SIZE, Trace, load_trace
from asynccache.trace.policies import (
    ATTENTION_ONLY,
    PolicyCombo,
    make_admission,
    make_eviction,
    parse_combo,
)
from asynccache.trace.replay import replay_trace
from asynccache.trace.report import format_markdown_table, format_table, plot_results
from asynccache.trace.results import (
    ReplayResult,
    TierBudget,
    format_size,
    parse_size,
    results_to_json,
)
from asynccache.trace.synth import make_synthesizer

__all__ = ["DEFAULT_POLICIES", "add_arguments", "load_spec", "run"]

DEFAULT_POLICIES = (
    "ends/lru",
    "every-page/lru",
    "block-grid:8/lru",
    "branch/lru",
    "branch/cost-aware",
    "branch/cost-aware/write_back",
    "adaptive/reuse/write_back",
    "attention-only/lru/write_through",
    "attention-only/lru/write_back",
)

#: Device memory for the prefix cache on an H200 (141 GB) serving Qwen3-Next-80B with FP8
#: weights (~80 GB): what is left after weights, activations and the running batch's KV.
DEFAULT_DEVICE_BUDGET = "32GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL trace (timestamp, input_length, …, hash_ids)")
    p.add_argument(
        "--from-json",
        default=None,
        help="re-print the table and re-plot a previous --json file instead of replaying (with --plot, --markdown; "
        "--json is refused)",
    )
    p.add_argument("--spec", default="qwen3-next-80b", help=f"preset ({', '.join(PRESETS)}) or an HF config path")
    p.add_argument(
        "--page-size",
        type=positive_int,
        default=None,
        help="tokens per page (default: --block-size); it must divide the block size and hold the tokens that "
        "spell a block id",
    )
    p.add_argument("--block-size", type=positive_int, default=MOONCAKE_BLOCK_SIZE, help="tokens per trace hash id (default 512)")
    p.add_argument(
        "--device-budget", default=DEFAULT_DEVICE_BUDGET, help=f"device cache bytes (default {DEFAULT_DEVICE_BUDGET})"
    )
    p.add_argument(
        "--budgets", default="128GiB,512GiB,2TiB", help="host budgets, comma-separated (default 128GiB,512GiB,2TiB)"
    )
    p.add_argument(
        "--storage-budgets", default="0,8TiB", help="storage budgets, comma-separated; 0 = no storage (default 0,8TiB)"
    )
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="admission/eviction[/write_policy[/storage_write]], comma-separated (default: %(default)s)",
    )
    p.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--active-params",
        type=positive_float,
        default=None,
        help="active parameters per token, a finite number > 0 (default: estimated from the spec)",
    )
    p.add_argument(
        "--engine",
        choices=("controller", "sync"),
        default="controller",
        help="controller: copies through the asyncio HybridCacheController (default); sync: the tree's "
        "synchronous stand-in (the same figures, faster)",
    )
    p.add_argument(
        "--jobs", type=positive_int, default=min(2, os.cpu_count() or 1), help="parallel replays (default: min(2, cores))"
    )
    p.add_argument("--json", dest="json_path", default=None, help="write results as JSON to this path")
    p.add_argument(
        "--plot", default=None, help="write a PNG comparing policies across budgets to this path (ending in .png)"
    )
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")


def load_spec(name: str, *, page_size: int) -> HybridSpec:
    """A preset name or an HF config path (file or folder) → spec with ``page_size``."""
    if name in PRESETS:
        return HybridSpec.preset(name, page_size=page_size)
    if Path(name).exists():
        return HybridSpec.from_hf_config(name, page_size=page_size)
    raise ConfigError(f"--spec {name!r} is neither a preset ({sorted(PRESETS)}) nor a config path")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Cell:
    spec_name: str
    page_size: int
    budget: TierBudget
    combo: PolicyCombo
    active_params: float | None
    engine: str


def _run_cell(cell: _Cell, trace: Trace, bound: BoundResult) -> ReplayResult:
    """One replay of ``trace`` (read once, by the parent: every replay replays what the bound
    was computed on, and a pipe can be the trace)."""
    spec = load_spec(cell.spec_name, page_size=cell.page_size)
    config = ReplayConfig(spec=spec, budget=cell.budget, combo=cell.combo, active_params=cell.active_params)
    if cell.engine == "controller":
        return replay_trace_with_controller(trace, config, bound=bound)
    return replay_trace(trace, config, bound=bound)


def _parse_list(text: str, what: str) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{what}: empty list")
    return [parse_size(t) for t in items]


def _plot_title(doc: dict[str, Any]) -> str:
    """``trace (N requests), spec`` from a result file's metadata (each optional, but typed)."""
    trace, spec, n = doc.get("trace", ""), doc.get("spec", ""), doc.get("num_requests", 0)
    if not (isinstance(trace, str) and isinstance(spec, str)):
        raise ConfigError(f"trace and spec must be strings, got {trace!r} and {spec!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"num_requests must be an integer >= 0, got {n!r}")
    return f"{trace} ({n:,} requests), {spec}"


def _from_json(args: argparse.Namespace) -> int:
    try:
        doc = json.loads(Path(args.from_json).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"cannot read {args.from_json}: {e!r}") from None
    try:
        bound = doc["bound"]
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound <= 1:
            raise ValueError(f"bound must be a fraction in [0, 1], got {bound!r}")
        results = [ReplayResult.from_json(r, bound=float(bound)) for r in doc["results"]]
        for r in results:
            if not 0 <= r.hit_tokens <= r.prompt_tokens or sum(r.hit_tokens_by_tier.values()) > r.hit_tokens:
                raise ValueError(f"{r.hit_tokens} tokens hit of {r.prompt_tokens} ({r.hit_tokens_by_tier} by tier)")
        title = _plot_title(doc)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ConfigError(f"{args.from_json} is not a result of this benchmark ({type(e).__name__}: {e})") from None
    if args.plot and not results:
        raise ConfigError(f"--plot: {args.from_json} holds no results, nothing to plot")
    print(format_markdown_table(results) if args.markdown else format_table(results, bound=bound))
    if args.plot:
        plot_results(results, args.plot, bound=bound, title=title)
        print(f"wrote {args.plot}")
    return 0


def _check_outputs_apart(args: argparse.Namespace) -> None:
    """``--json`` and ``--plot`` name files other than ``--trace`` and each other: the run would
    otherwise overwrite its input, or one output the other."""
    named = [("--trace", args.trace), ("--json", args.json_path), ("--plot", args.plot)]
    seen: dict[Path, str] = {}
    for flag, path in named:
        if not path:
            continue
        resolved = Path(path).resolve()
        if resolved in seen:
            raise ConfigError(f"{flag} {path} is the file {seen[resolved]} names too")
        seen[resolved] = flag


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        return _from_json(args)
    if not args.trace:
        raise ConfigError("--trace FILE is required (or --from-json PATH to re-report a previous run)")
    _check_outputs_apart(args)
    t0 = time.perf_counter()
    if args.page_size is None:
        args.page_size = args.block_size
    spec = load_spec(args.spec, page_size=args.page_size)
    combos = [parse_combo(c) for c in args.policies.split(",") if c.strip()]
    if not combos:
        raise ConfigError("--policies names no policy")
    device = parse_size(args.device_budget)
    hosts = _parse_list(args.budgets, "--budgets")
    storages = _parse_list(args.storage_budgets, "--storage-budgets")
    configs = _replay_configs(spec, combos, device, hosts, storages, args.active_params)
    _check_policies(combos, spec, configs[0].budget, args.active_params)
    trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    make_synthesizer(trace, spec)  # a page no replay of this trace can use, refused before any replay
    bound = infinite_cache_bound(trace, page_size=spec.page_size)
    cells = [
        _Cell(
            spec_name=args.spec,
            page_size=args.page_size,
            budget=config.budget,
            combo=config.combo,
            active_params=args.active_params,
            engine=args.engine,
        )
        for config in configs
    ]
    print(
        f"trace {trace.name}: {len(trace):,} requests over {trace.duration_s:,.0f} s, "
        f"{trace.num_prompt_tokens:,} prompt tokens; spec {spec.model_id} (page {spec.page_size}, "
        f"KV {format_size(spec.kv_page_bytes)}/page, state {spec.state_bytes:,} B); "
        f"infinite-cache bound {100 * bound.hit_rate:.2f} %; {len(cells)} replays ({args.engine} engine) "
        f"on {args.jobs} process(es)",
        flush=True,
    )
    results = _run_cells(cells, trace, bound, jobs=args.jobs)
    total_s = time.perf_counter() - t0
    print()
    print(format_markdown_table(results) if args.markdown else format_table(results, bound=bound.hit_rate))
    print(f"\n{len(results)} replays in {total_s:.0f} s wall ({sum(r.wall_s for r in results):.0f} s of replay)")
    meta: dict[str, Any] = {
        "trace": trace.name,
        "num_requests": len(trace),
        "spec": spec.model_id,
        "page_size": spec.page_size,
        "engine": args.engine,
        "bound_definition": (
            "Σ floor(min(m, L−1)/page)·page / Σ L, m = leading tokens seen in an earlier request (whole "
            "blocks, or a partial block's seen tokens)"
        ),
        "total_wall_s": total_s,
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results_to_json(bound.hit_rate, results, **meta), indent=1))
        print(f"wrote {args.json_path}")
    if args.plot:
        title = f"{trace.name} ({len(trace):,} requests), {spec.model_id}, device {format_size(device)}"
        plot_results(results, args.plot, bound=bound.hit_rate, title=title)
        print(f"wrote {args.plot}")
    return 0


def _replay_configs(
    spec: HybridSpec,
    combos: list[PolicyCombo],
    device: int,
    hosts: list[int],
    storages: list[int],
    active_params: float | None,
) -> list[ReplayConfig]:
    """Every cell's config, built (and so checked) before the trace is read: a spec or budget
    that a replay would refuse is refused before any replay runs."""
    configs = [
        ReplayConfig(
            spec=spec, budget=TierBudget(device=device, host=h, storage=s), combo=c, active_params=active_params
        )
        for s in storages
        for h in hosts
        for c in combos
        if not (s and c.admission == ATTENTION_ONLY)  # the reference has no storage tier
    ]
    if not configs:
        raise ConfigError(
            "no replay to run: the attention-only reference is replayed without storage only "
            "(add 0 to --storage-budgets, or a hybrid policy to --policies)"
        )
    return configs


def _check_policies(combos: list[PolicyCombo], spec: HybridSpec, budget: TierBudget, active_params: float | None) -> None:
    """Build every policy once, so that a name no replay can run is refused before any replay."""
    flops = FlopModel.from_spec(spec, active_params=active_params)
    for combo in combos:
        make_admission(combo.admission, spec=spec, budget=budget, flops=flops)
        make_eviction(combo.eviction, spec=spec, flops=flops)


def _describe(cell: _Cell) -> str:
    return f"{cell.combo.label} @ {cell.budget.label}"


def _run_cells(cells: list[_Cell], trace: Trace, bound: BoundResult, *, jobs: int) -> list[ReplayResult]:
    results: list[ReplayResult | None] = [None] * len(cells)
    done = 0

    def report(i: int, r: ReplayResult) -> None:
        nonlocal done
        done += 1
        results[i] = r
        print(
            f"[{done}/{len(cells)}] {_describe(cells[i])}: hit {100 * r.hit_rate:.2f} % "
            f"({r.fraction_of_bound:.3f} of bound) in {r.wall_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    if jobs <= 1:
        for i, cell in enumerate(cells):
            report(i, _run_cell(cell, trace, bound))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures: dict[Future[ReplayResult], int] = {
                pool.submit(_run_cell, c, trace, bound): i for i, c in enumerate(cells)
            }
            try:
                for fut in as_completed(futures):
                    report(futures[fut], fut.result())
            except BaseException:
                pool.shutdown(cancel_futures=True)  # a failed replay: start no queued one
                raise
    return [r for r in results if r is not None]


if __name__ == "__main__":  # pragma: no cover - `asynccache bench trace` is the entry point
    from asynccache.cli import main

    sys.exit(main(["bench", "trace", *sys.argv[1:]]))
