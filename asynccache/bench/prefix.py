"""``asynccache bench prefix``: TTFT of a request whose long prefix is cached on each tier.

One request = a ``--prefix-tokens`` prefix + ``--new-tokens`` fresh tokens, served through the
reference scheduler. Measured in one run, median of ``--repeats`` (``--pairs`` for device and
host):

- ``cold``: nothing cached (a fresh prefix each repeat, once the previous one's write-back has
  settled); ``cold_short`` and ``cold_shorter``: the same at a quarter and a sixteenth of the
  length (for the prefill-time fit);
- ``device``: the prefix (KV + state) is on the device;
- ``host``: demoted to pinned host memory, loaded back layer by layer. Device and host repeats
  alternate, ``--pairs`` times (each pair a few tens of milliseconds, so more of them than of
  the others); besides the ratio of the two medians, the median of the pairs' ratios and of
  their differences, which a machine's slow spells (several milliseconds, lasting a few
  requests) move less;
- ``disk``: only in local-disk storage (device and host flushed, the objects dropped from the
  page cache) — once restoring everything (read to host, then loaded layer by layer), once with
  the storage tier's cost model (``RestoreCost`` from the measured read bandwidth and prefill
  times, corrected by the read times the tier observes from one repeat to the next), which picks
  recomputing, restoring everything, or a split restore: the head of the prefix computed while
  the tail is read. The two alternate, each repeat right after a raw read of the prefix's
  objects.

On CUDA the run also times one contiguous pinned host → device copy of the prefix's bytes: the
link's floor for the host row, and the host tier's physical optimum ``max(device TTFT, link
time)`` (a forward faster than the link cannot hide the load).

The same run measures the raw read bandwidth of the stored objects
(``asynccache.bench.raw_reads``) — plain sequential file reads, the same reads spread over as
many threads as the backend uses, and those with ``O_DIRECT`` (past the page cache, where the
filesystem allows it) — and reports the physical optimum for the disk case, ``min over a of
max(bytes(a) / raw_read_bw, cold_compute(L − a))``, with each and with the best of them. The threaded reads are also made of only the objects that
the prefix's request stored (``raw_disk_prefix_parallel_read_gbps``, ``disk_optimum_prefix_*``):
a restore reads one prefix, a burst of 0.6 GB, while reading every object of the run streams
several GB. Those reads, cut as the backend cuts them, also run before every disk restore: the
optimum with their median (``disk_optimum_interleaved_ms``), and the median over the repeats of
each restore's TTFT over the optimum with the read just before it
(``disk_split_over_optimum_paired``), meet a disk whose speed drifts through the run where the
restores meet it. ``cold_compute(L − a)`` is taken two ways: at the cold
prefill's average rate (``disk_optimum_*``), and as the compute of positions ``[a, L)`` after a
prefix of ``a`` (``disk_optimum_fit_*``) from a fit of cold prefills of ``L``, ``L / 4`` and
``L / 16`` tokens (``RestoreCost.fit``: a pass's fixed cost, a flat per-token cost, and
attention's, which grows with the position). The cost model computes its heads with the same fit. With compressed objects
(``--storage-option compression=zstd``) the cost model reads at the raw speed divided by the
fraction of the payload the objects take, and the bench also reports the optimum with the bytes
they take (``disk_optimum_fit_stored_parallel_ms``). ``--json PATH`` writes every
figure, ``--plot PATH`` draws the TTFT of each tier and the device/host pairs, and
``--from-json PATH`` re-reports (and re-plots) an earlier ``--json`` file without measuring.
Before measuring, the scheduler captures the CUDA graphs of a prompt's first pass at every
bucket length, as a server does at start (``--warm-up-graphs``, on by default;
``warmed_graphs`` in the JSON): a split restore's head is such a pass, of a length the run has
not computed before.

Primitives: ``add_arguments`` / ``check_arguments`` (the command line:
:mod:`asynccache.bench.prefix_options`, re-exported here) and ``run`` (measure or re-read, then
report through :mod:`asynccache.bench.prefix_report`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import uvloop

from asynccache.bench.prefix_options import add_arguments, check_arguments
from asynccache.bench.prefix_report import plot, print_report
from asynccache.bench.progress import progress_bar
from asynccache.bench.raw_reads import (
    drop_page_cache,
    object_files,
    ranged_read_bytes_per_s,
    raw_read_bytes_per_s,
    stored_fraction,
)
from asynccache.bench.storage import parse_options
from asynccache.bench.transfer import time_median_s
from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError
from asynccache.reference.model import HybridModel
from asynccache.reference.padding import BUCKET_MAX_TOKENS
from asynccache.reference.scheduler import Scheduler, SchedulerConfig
from asynccache.spec import HybridSpec
from asynccache.tiering import RestoreCost
from storage_backends.file_io import probe_direct
from storage_backends.local_disk import LocalDiskBackend

__all__ = ["add_arguments", "check_arguments", "run"]


def _h2d_link_ms(num_bytes: int, device: str, repeats: int = 3) -> float | None:
    """Median time of one contiguous pinned host → device copy of ``num_bytes`` on a side
    stream, after a warm-up copy (``None`` off CUDA)."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    with torch.cuda.stream(torch.cuda.Stream(device=dst.device)):
        return time_median_s(lambda: dst.copy_(src, non_blocking=True), reps=repeats, device=dst.device) * 1e3


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="asynccache-prefix-") as tmp:
        return await _measure(args, Path(args.storage_dir).resolve() if args.storage_dir else Path(tmp))


async def _measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    spec = HybridSpec.preset(args.preset, page_size=args.page_size)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    buckets = {"auto": None, "on": True, "off": False}[args.bucket_passes]
    model = HybridModel(spec, device=args.device, dtype=dtype, seed=0, bucket_passes=buckets)
    rng = np.random.default_rng(0)
    vocab = spec.vocab_size

    def tokens(n: int) -> list[int]:
        return rng.integers(1, vocab, size=n).tolist()

    L = args.prefix_tokens + args.new_tokens
    cold_lengths = {"cold": L, "cold_short": max(1, L // 4), "cold_shorter": max(1, L // 16)}
    # A salt of this run's own: a --storage-dir that an earlier run filled holds nothing it can hit.
    salt = uuid.uuid4().hex
    pages = -(-L // spec.page_size) + 2
    cfg = HybridCacheConfig(
        device_kv_pages=3 * pages,
        device_state_slots=16,
        host_kv_bytes=3 * pages * spec.kv_page_bytes,
        host_state_bytes=8 * spec.state_bytes,
        storage_uri=root.as_uri(),
        storage_options=parse_options(args.storage_option),
        prefetch_policy="wait_complete",
        copy_method=args.copy_method,
    )
    out: dict[str, Any] = {"device": args.device, "preset": args.preset, "prefix_tokens": args.prefix_tokens,
                           "new_tokens": args.new_tokens, "bucket_passes": model.bucket_passes}
    times: dict[str, list[float]] = {
        k: [] for k in (*cold_lengths, "device", "host", "disk_all", "disk_split")
    }
    cached: dict[str, list[int]] = {k: [] for k in times}
    warm_up = BUCKET_MAX_TOKENS if args.warm_up_graphs == "on" else 0
    async with HybridCache(spec, cfg, device=args.device) as cache, Scheduler(
        model, cache, SchedulerConfig(max_running=1, chunk_size=L, max_batch_tokens=L, warm_up_tokens=warm_up)
    ) as sched:
        out["warmed_graphs"] = sched.warmed_graphs
        out["storage_options"] = dict(cache.storage_options)  # with the defaults the cache chose
        ctrl = cache.controller
        tier = ctrl.tiering
        assert tier is not None

        graphs = model.layer_graphs
        # one throwaway, and a pass short enough for graphs until its shape is captured
        throwaway = {
            k: graphs.eager_runs + 1 if graphs is not None and n <= graphs.max_tokens else 1
            for k, n in cold_lengths.items()
        }
        tick = progress_bar(sum(throwaway.values()) + 1 + 5 * args.repeats + 2 * args.pairs, "requests")

        async def serve(prompt: list[int], key: str) -> None:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            r = await sched.generate(prompt, 1, salt=salt)
            times[key].append(r.ttft_s * 1e3)
            cached[key].append(r.cached_tokens)
            tick()

        async def settle() -> None:
            await ctrl.wait_idle()
            await tier.drain()

        # Cold prefills of three lengths: attention makes a token's cost grow with its
        # position and a pass has a fixed cost, and the lengths give the cost model (and the
        # optimum) every term. Each length starts with throwaway prompts (compilation, the
        # allocator, and for passes short enough for CUDA graphs, the eager run and the capture
        # of their shape). Every cold repeat starts once the one before is settled: its
        # write-through to the host and to storage would otherwise run beside the next prefill
        # (~0.5 s of a 32k prefill's 1.4 s on an H200), and the cost model and the optimum
        # would take that slowed prefill for the model's speed.
        for key, n in cold_lengths.items():
            for _ in range(throwaway[key]):
                await serve(tokens(n), key)
                await settle()
            times[key].clear()
            cached[key].clear()
            for _ in range(args.repeats):
                await serve(tokens(n), key)
                await settle()
        prefill_tps = L / (statistics.median(times["cold"]) / 1e3)
        prefills = [(n, statistics.median(times[key]) / 1e3) for key, n in cold_lengths.items()]
        prefix = tokens(args.prefix_tokens)
        stored_before = object_files(root)
        await serve(prefix + tokens(args.new_tokens), "device")  # populates device, host, disk
        times["device"].clear()
        cached["device"].clear()
        await settle()
        # what the prefix's first request stored: the prefix's pages and state, which a restore
        # reads, and its own last page and state (a restore's volume, not one more GB)
        prefix_files = object_files(root) - stored_before
        # Device and host alternate, so both see the same machine conditions.
        for _ in range(args.pairs):
            await serve(prefix + tokens(args.new_tokens), "device")
            await settle()
            cache.flush_device()
            await serve(prefix + tokens(args.new_tokens), "host")
            await settle()
        link_ms = _h2d_link_ms(args.prefix_tokens * spec.kv_bytes_per_token + spec.state_bytes, args.device)
        raw_bps, stored_bytes = raw_read_bytes_per_s(root)
        par_threads = getattr(tier.backend, "max_concurrency", LocalDiskBackend.default_max_concurrency)
        raw_par_bps, _ = raw_read_bytes_per_s(root, threads=par_threads)
        # The same reads of only the prefix's objects (a 0.6 GB burst, as a restore reads, not a
        # stream of every object the run stored), median of three.
        raw_prefix_bps = statistics.median(
            raw_read_bytes_per_s(root, threads=par_threads, only=prefix_files)[0] for _ in range(3)
        )
        # and cut as the backend cuts them (states in ranges, no thread left with one at the end)
        raw_ranges_bps = statistics.median(
            ranged_read_bytes_per_s(root, prefix_files, par_threads)[0] for _ in range(3)
        )
        direct_refused = probe_direct(str(root))
        raw_direct_bps = None
        if direct_refused is None:
            raw_direct_bps, _ = raw_read_bytes_per_s(root, threads=par_threads, direct=True)
        best_bps = max(raw_bps, raw_par_bps, raw_direct_bps or 0.0)
        storage_direct_io = getattr(tier.backend, "direct_io", None)  # settled by the first use
        stored_share = stored_fraction(root, spec)
        compressed = getattr(getattr(tier.backend, "codec", None), "compression", "none") != "none"
        # the cost model's prior: the raw speed of the way the backend reads, in payload bytes
        # (a compressed payload arrives faster than its stored bytes do)
        backend_bps = raw_direct_bps if storage_direct_io and raw_direct_bps else max(raw_bps, raw_par_bps)
        if compressed:
            backend_bps /= stored_share
        split_cost = RestoreCost.fit(read_bytes_per_s=backend_bps, prefills=prefills)
        # Whole and split restores alternate, each after a raw read of the prefix's objects (cut
        # as the backend cuts them), so that a disk whose speed drifts through the run meets
        # both kinds alike and each restore has a raw read of the same files just before it.
        paired_bps: dict[str, list[float]] = {"disk_all": [], "disk_split": []}
        for _ in range(args.repeats):
            for key, cost in (("disk_all", None), ("disk_split", split_cost)):
                paired_bps[key].append(ranged_read_bytes_per_s(root, prefix_files, par_threads)[0])
                tier.cost = cost
                cache.flush_device()
                cache.flush_host()
                drop_page_cache(root)
                await serve(prefix + tokens(args.new_tokens), key)
                await settle()
        tier.cost = None
        out["read_time_correction"] = {
            "alone": tier.read_alone.factor,
            "beside_compute": tier.read_beside_compute.factor,
            "alone_observed": list(tier.read_alone.ratios),
            "beside_compute_observed": list(tier.read_beside_compute.ratios),
            "head_compute": tier.compute_beside_reads.factor,
            "head_compute_observed": list(tier.compute_beside_reads.ratios),
        }
    med = {k: statistics.median(v) for k, v in times.items()}
    pairs = list(zip(times["device"], times["host"], strict=True))
    per_token_bytes = spec.kv_bytes_per_token

    def optimum_s(read_bps: float, *, fit: bool = False, stored: bool = False) -> float:
        """Physical optimum for the disk tier: reading a tokens overlapped with computing the
        rest, at the cold prefill's average rate or (``fit``) as positions ``[a, L)`` continuing a
        prefix of ``a`` from the fit (they cost more per token than the average).
        The bytes read are the payload's; ``stored``: the bytes the objects take on disk."""
        grid = range(0, args.prefix_tokens + 1, spec.page_size)
        scale = stored_share if stored else 1.0
        return min(
            max(
                scale * (a * per_token_bytes + (spec.state_bytes if a else 0)) / read_bps,
                split_cost.compute_s(a, L) if fit else (L - a) / prefill_tps,
            )
            for a in grid
        )

    opt_ms, opt_par_ms = optimum_s(raw_bps) * 1e3, optimum_s(raw_par_bps) * 1e3
    opt_best_ms = optimum_s(best_bps) * 1e3
    fit_par_ms, fit_best_ms = optimum_s(raw_par_bps, fit=True) * 1e3, optimum_s(best_bps, fit=True) * 1e3
    prefix_par_ms = optimum_s(raw_prefix_bps) * 1e3
    ranges_ms = optimum_s(raw_ranges_bps) * 1e3
    stored_par_ms = optimum_s(raw_par_bps, fit=True, stored=True) * 1e3
    paired_ms = {k: [optimum_s(bps) * 1e3 for bps in v] for k, v in paired_bps.items()}
    interleaved_bps = statistics.median(paired_bps["disk_all"] + paired_bps["disk_split"])
    interleaved_ms = optimum_s(interleaved_bps) * 1e3
    out.update(
        {
            "ttft_ms": med,
            "ttft_ms_repeats": times,
            "cached_tokens": {k: int(statistics.median(v)) for k, v in cached.items()},
            "cached_tokens_repeats": cached,
            "prefill_tokens_per_s": prefill_tps,
            "prefill_fit": {
                "prefills_ms": [[n, t * 1e3] for n, t in prefills],
                "tokens_per_s": split_cost.prefill_tokens_per_s,
                "s_per_context_token": split_cost.prefill_s_per_context_token,
                "s_per_pass": split_cost.prefill_s_per_pass,
            },
            "raw_disk_read_gbps": raw_bps / 1e9,
            "raw_disk_parallel_read_gbps": raw_par_bps / 1e9,
            "raw_disk_parallel_threads": par_threads,
            "raw_disk_prefix_parallel_read_gbps": raw_prefix_bps / 1e9,
            "raw_disk_prefix_ranges_read_gbps": raw_ranges_bps / 1e9,
            "prefix_files": len(prefix_files),
            "raw_disk_direct_read_gbps": None if raw_direct_bps is None else raw_direct_bps / 1e9,
            "raw_disk_direct_refused": direct_refused,
            "storage_direct_io": storage_direct_io,
            "stored_bytes": stored_bytes,
            "storage_compressed": compressed,
            "stored_fraction": stored_share,
            "disk_optimum_fit_stored_parallel_ms": stored_par_ms,
            "disk_split_over_optimum_fit_stored_parallel": med["disk_split"] / stored_par_ms,
            "prefix_bytes": args.prefix_tokens * per_token_bytes + spec.state_bytes,
            "disk_optimum_ms": opt_ms,
            "disk_optimum_parallel_ms": opt_par_ms,
            "disk_optimum_best_ms": opt_best_ms,
            "disk_optimum_fit_parallel_ms": fit_par_ms,
            "disk_optimum_fit_best_ms": fit_best_ms,
            "host_over_device": med["host"] / med["device"],
            "host_over_device_pairwise": statistics.median(h / d for d, h in pairs),
            "host_minus_device_ms": statistics.median(h - d for d, h in pairs),
            "h2d_link_ms": link_ms,
            "host_optimum_ms": None if link_ms is None else max(med["device"], link_ms),
            "host_over_optimum": None if link_ms is None else med["host"] / max(med["device"], link_ms),
            "disk_split_over_cold": med["disk_split"] / med["cold"],
            "disk_split_over_optimum": med["disk_split"] / opt_ms,
            "disk_split_over_optimum_parallel": med["disk_split"] / opt_par_ms,
            "disk_optimum_prefix_parallel_ms": prefix_par_ms,
            "disk_split_over_optimum_prefix_parallel": med["disk_split"] / prefix_par_ms,
            "disk_all_over_optimum_prefix_parallel": med["disk_all"] / prefix_par_ms,
            "disk_optimum_prefix_ranges_ms": ranges_ms,
            "disk_split_over_optimum_prefix_ranges": med["disk_split"] / ranges_ms,
            "disk_all_over_optimum_prefix_ranges": med["disk_all"] / ranges_ms,
            "raw_disk_paired_read_gbps": {k: [b / 1e9 for b in v] for k, v in paired_bps.items()},
            "disk_optimum_interleaved_ms": interleaved_ms,
            "disk_split_over_optimum_interleaved": med["disk_split"] / interleaved_ms,
            "disk_all_over_optimum_interleaved": med["disk_all"] / interleaved_ms,
            "disk_split_over_optimum_paired": statistics.median(
                t / o for t, o in zip(times["disk_split"], paired_ms["disk_split"], strict=True)
            ),
            "disk_all_over_optimum_paired": statistics.median(
                t / o for t, o in zip(times["disk_all"], paired_ms["disk_all"], strict=True)
            ),
            "disk_split_over_optimum_best": med["disk_split"] / opt_best_ms,
            "disk_split_over_optimum_fit_parallel": med["disk_split"] / fit_par_ms,
            "disk_split_over_optimum_fit_best": med["disk_split"] / fit_best_ms,
            "disk_all_over_optimum": med["disk_all"] / opt_ms,
            "disk_all_over_optimum_parallel": med["disk_all"] / opt_par_ms,
        }
    )
    return out


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        try:
            res = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as e:
            print(f"error: cannot read {args.from_json}: {e}", file=sys.stderr)
            return 2
        if not isinstance(res, dict):
            print(f"error: {args.from_json} is not a result of this benchmark (not a JSON object)", file=sys.stderr)
            return 2
    else:
        if (why := check_arguments(args)) is not None:
            print(f"error: {why}", file=sys.stderr)
            return 2
        try:
            res = uvloop.run(_run(args))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(res, indent=2))
    print_report(res)
    if args.plot:
        plot(res, args.plot)
        print(f"wrote {args.plot}")
    return 0
