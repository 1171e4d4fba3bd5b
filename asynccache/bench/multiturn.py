"""``asynccache bench multiturn``: multi-turn conversations served through the cache.

N clients × R rounds (``asynccache.reference.workload``), run round by round with at most
``--max-parallel`` requests in flight, under four modes that differ only in the tiers enabled:

=====================  ==================================================================
``no-offload``         device tier only
``kv-offload``         + host KV tier; Mamba states only on the device (reference baseline)
``kv+mamba-offload``   + host state tier
``kv+mamba+storage``   + L3 storage (``--storage URI``, default a temporary directory);
                       device and host tiers flushed between rounds, so hits come from storage
=====================  ==================================================================

Reports per mode: hit rate (cached ÷ prompt tokens), the workload's ideal hit rate, TTFT
mean/p50/p99 overall and its mean per round, throughput; a table, a PNG plot (``--plot``) and
``--json`` (the results and the report: :mod:`asynccache.bench.multiturn_report`).

Primitives: :data:`MODES`, ``add_arguments`` / ``run`` (the command), :func:`run_mode` (one
mode's run, a :class:`~asynccache.bench.multiturn_report.ModeResult`).

The model is a hybrid one: a spec (``--preset``, a preset's name or an HF config path) without
attention layers or without recurrent layers is refused, since the modes differ in where each
kind's cache lives. Every selected mode's cache budgets are checked before the first runs, and
the storage URI and options opened once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import uvloop

from asynccache.bench.backend_options import add_option_argument, parse_options
from asynccache.bench.multiturn_report import ModeResult, plot, print_tables
from asynccache.bench.options import (
    device_name,
    positive_int,
    seed_int,
    spec_from_preset,
    unit_fraction,
)
from asynccache.bench.progress import progress_bar
from asynccache.cache import HybridCache, effective_storage_options, host_memory_sizes
from asynccache.config import HybridCacheConfig
from asynccache.errors import BackendError, ConfigError
from asynccache.pools.memory import check_host_bytes
from asynccache.reference.model import MODEL_DTYPE_NAMES, HybridModel
from asynccache.reference.scheduler import RequestResult, Scheduler, SchedulerConfig
from asynccache.reference.workload import ProcessedPrefixes, make_conversations
from asynccache.spec import HybridSpec, dtype_from_name
from asynccache.storage import open_backend
from storage_backends.base import ObjectBackend

MODES = ("no-offload", "kv-offload", "kv+mamba-offload", "kv+mamba+storage")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=positive_int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--rounds", type=positive_int, default=4, help="rounds per conversation (default 4)")
    p.add_argument("--request-len", type=positive_int, default=192, help="tokens of each new question (default 192)")
    p.add_argument("--output-len", type=positive_int, default=16, help="tokens generated per answer (default 16)")
    p.add_argument("--max-parallel", type=positive_int, default=4, help="requests in flight at once (default 4)")
    p.add_argument("--max-running", type=positive_int, default=None,
                   help="requests the scheduler runs at once; the rest of those in flight wait for room "
                   "(default: --max-parallel)")  # fmt: skip
    p.add_argument("--lookahead-host-fraction", type=unit_fraction, default=SchedulerConfig().lookahead_host_fraction,
                   help="share of the host KV pool that the storage lookups of requests waiting for room may "
                   "bring ahead of their admission, 0 to 1 (default %(default)s)")  # fmt: skip
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--preset", default="small", help="model preset (small, tiny, hybrid-3b, …) or an HF config path "
                   "(of a hybrid model: attention and recurrent layers)")  # fmt: skip
    p.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page (default 1)")
    p.add_argument(
        "--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N"
    )
    p.add_argument("--dtype", default=None, choices=MODEL_DTYPE_NAMES, metavar="DTYPE",
                   help="model dtype: fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on CUDA)")  # fmt: skip
    p.add_argument("--device-kv-pages", type=positive_int, default=None, help="device KV pages (default: the requests in flight plus ~3 whole conversations)")
    p.add_argument(
        "--device-state-slots", type=positive_int, default=None, help="device state slots (default: room for half the clients)"
    )
    p.add_argument("--host-kv-bytes", type=positive_int, default=None, help="host KV bytes (default: holds every client)")
    p.add_argument("--host-state-bytes", type=positive_int, default=None, help="host state bytes (default: 4 states per client per round)")
    p.add_argument(
        "--storage", default=None, help="storage URI for kv+mamba+storage only (default: a temporary directory)"
    )
    add_option_argument(
        p,
        "--storage-option",
        "an option of the storage backend, repeatable (e.g. read_processes=0 to read with threads on CUDA); "
        "kv+mamba+storage only",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and prompts, 0 to 2**63-1 (default 0)")
    p.add_argument("--json", dest="json_path", default=None, help="write results as JSON to this path")
    p.add_argument("--plot", default=None, help="write a PNG of hit rate and TTFT per round to this path (ending in .png)")


def _default_budgets(args: argparse.Namespace, spec: HybridSpec) -> dict[str, int]:
    page = spec.page_size
    conv_tokens = args.rounds * (args.request_len + args.output_len)
    pages_per_conv = -(-conv_tokens // page)
    # Working set of the requests in flight (pages + a private slot and ≤ 3 snapshots each).
    working_pages = args.max_parallel * (pages_per_conv + 1)
    return {
        "device_kv_pages": args.device_kv_pages or working_pages + 3 * pages_per_conv,
        # Each running request holds a working slot and ≤ 3 snapshot slots; each finished
        # conversation keeps ≤ 3 states (ends admission). Room for about half the clients'.
        "device_state_slots": args.device_state_slots or 4 * args.max_parallel + 3 * max(1, args.clients // 2),
        "host_kv_bytes": args.host_kv_bytes or 2 * args.clients * pages_per_conv * spec.kv_page_bytes,
        "host_state_bytes": args.host_state_bytes or 4 * args.clients * args.rounds * spec.state_bytes,
    }


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_running=args.max_running or args.max_parallel,
        chunk_size=4096,
        max_batch_tokens=16384,
        lookahead_host_fraction=args.lookahead_host_fraction,
    )


def _mode_config(
    mode: str, budgets: dict[str, int], storage_uri: str | None, storage_options: dict[str, Any] | None = None
) -> HybridCacheConfig:
    host_kv = budgets["host_kv_bytes"] if mode != "no-offload" else 0
    host_state = budgets["host_state_bytes"] if mode in ("kv+mamba-offload", "kv+mamba+storage") else 0
    return HybridCacheConfig(
        device_kv_pages=budgets["device_kv_pages"],
        device_state_slots=budgets["device_state_slots"],
        host_kv_bytes=host_kv,
        host_state_bytes=host_state,
        write_policy="write_through",
        storage_uri=storage_uri if mode == "kv+mamba+storage" else None,
        storage_options=(storage_options or {}) if mode == "kv+mamba+storage" else {},
        prefetch_policy="wait_complete",
    )


async def run_mode(
    mode: str,
    *,
    model: HybridModel,
    spec: HybridSpec,
    args: argparse.Namespace,
    budgets: dict[str, int],
    storage_uri: str | None,
    progress: Any,
    storage_options: dict[str, Any] | None = None,
) -> ModeResult:
    convs = make_conversations(
        num_clients=args.clients,
        num_rounds=args.rounds,
        request_len=args.request_len,
        vocab_size=spec.vocab_size,
        seed=args.seed,
    )
    cfg = _mode_config(mode, budgets, storage_uri, storage_options)
    # A salt of this run's own: a --storage that an earlier run filled holds nothing it can hit.
    salt = uuid.uuid4().hex
    res = ModeResult()
    seen = ProcessedPrefixes()
    history: list[list[int]] = [[] for _ in convs]
    sem = asyncio.Semaphore(args.max_parallel)
    t0 = time.perf_counter()
    async with HybridCache(spec, cfg, device=args.device) as cache, Scheduler(
        model, cache, _scheduler_config(args)
    ) as sched:
        if cfg.storage_uri is not None:
            res.storage_options = dict(cache.storage_options)
            # open the store now: an option it refuses only at first use (direct_io=true where
            # the filesystem refuses O_DIRECT) is a usage error, not a run of misses
            await cache.controller.tiering.backend.batch_exists_v2([], [])

        async def one(c: int, prompt: list[int]) -> RequestResult:
            async with sem:
                r = await sched.generate(prompt, args.output_len, salt=salt)
            progress()
            return r

        for rnd in range(args.rounds):
            prompts = [convs[c].prompt(rnd, history[c]) for c in range(len(convs))]
            res.ideal.append([seen.ideal_cached(p) for p in prompts])
            results = await asyncio.gather(*(one(c, p) for c, p in enumerate(prompts)))
            res.results.append(list(results))
            for c, (p, r) in enumerate(zip(prompts, results, strict=True)):
                history[c] = p + r.output_ids
                seen.add(p + r.output_ids[:-1])
            if mode == "kv+mamba+storage":
                await cache.controller.wait_idle()
                if cache.controller.tiering is not None:
                    await cache.controller.tiering.drain()
                cache.flush_device()
                cache.flush_host()
    res.wall_s = time.perf_counter() - t0
    return res


async def _check_storage(
    spec: HybridSpec, budgets: dict[str, int], uri: str, options: dict[str, Any], device: str
) -> None:
    """Open the storage mode's backend as the cache will and use it once, then close it: a bad
    URI, or an option it refuses (at opening or at first use), is a usage error found before
    any mode runs, not after the others."""
    cfg = _mode_config("kv+mamba+storage", budgets, uri, options)
    backend = open_backend(uri, namespace=spec.namespace_id, **effective_storage_options(cfg, device))
    try:
        if isinstance(backend, ObjectBackend):  # set up now: a root or endpoint it cannot use
            await backend.first_use()
        else:
            await backend.batch_exists_v2([], [])
    except BackendError as e:
        raise ConfigError(f"--storage: {e}") from None
    finally:
        await backend.aclose()


def _check_spec(spec: HybridSpec, name: str) -> None:
    """The bench's own needs of a spec (the model checks the rest): both kinds of layers, and
    a vocabulary of at least two tokens (prompts draw ids from ``[1, vocab_size)``)."""
    kinds = {"attention": spec.attention_layer_ids, "recurrent": spec.mamba_layer_ids}
    lacking = [kind for kind, ids in kinds.items() if not ids]
    if lacking:
        raise ConfigError(
            f"--preset {name}: multiturn compares where a hybrid model's KV and recurrent states are "
            f"cached, and this model has no {lacking[0]} layers"
        )
    if spec.vocab_size < 2:
        raise ConfigError(f"--preset {name}: prompts need a vocab_size of at least 2, got {spec.vocab_size}")


def _check_modes(spec: HybridSpec, modes: list[str], budgets: dict[str, int], device: str) -> None:
    """Build every mode's cache without memory (``materialize=False``) and check its host pools
    against the host's memory: a budget a mode cannot use is refused before any mode runs."""
    for mode in modes:
        cfg = _mode_config(mode, budgets, None)  # the storage URI and options: _check_storage
        try:
            HybridCache(spec, cfg, device=device, materialize=False)
            check_host_bytes(host_memory_sizes(spec, cfg, device))
        except ConfigError as e:
            raise ConfigError(f"mode {mode}: {e}") from e


async def _warmup(model: HybridModel, spec: HybridSpec, args: argparse.Namespace) -> None:
    cfg = HybridCacheConfig(device_kv_pages=-(-(args.request_len + args.output_len) // spec.page_size) + 2,
                            device_state_slots=8)
    async with HybridCache(spec, cfg, device=args.device) as cache, Scheduler(model, cache) as sched:
        await sched.generate([1 + t % (spec.vocab_size - 1) for t in range(args.request_len)], args.output_len)


def run(args: argparse.Namespace) -> int:
    try:
        storage_options = parse_options(args.storage_option)
    except ConfigError as e:
        print(f"error: --storage-option: {e}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        why = f"unknown modes {unknown}; known: {list(MODES)}" if modes else "--modes names no mode"
        print(f"error: --modes: {why}", file=sys.stderr)
        return 2
    storage_mode = "kv+mamba+storage" in modes
    if not storage_mode and (args.storage is not None or args.storage_option):
        print("error: --storage and --storage-option apply to the kv+mamba+storage mode only, which --modes leaves out",
              file=sys.stderr)  # fmt: skip
        return 2
    spec = spec_from_preset(args.preset, page_size=args.page_size)
    _check_spec(spec, args.preset)
    budgets = _default_budgets(args, spec)
    _check_modes(spec, modes, budgets, args.device)
    summaries: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="asynccache-multiturn-") as tmp:
        storage_uri = args.storage or Path(tmp).as_uri()
        if storage_mode:
            try:
                uvloop.run(_check_storage(spec, budgets, storage_uri, storage_options, args.device))
            except ConfigError as e:  # a URI or an option the backend refuses
                print(f"error: {e}", file=sys.stderr)
                return 2
        dtype = dtype_from_name(args.dtype) if args.dtype else (torch.bfloat16 if args.device != "cpu" else torch.float32)
        model = HybridModel(spec, device=args.device, dtype=dtype, seed=args.seed)
        print(
            f"multiturn: {args.clients} clients × {args.rounds} rounds, question {args.request_len} tokens, "
            f"answer {args.output_len} tokens, ≤{args.max_parallel} in flight, "
            f"≤{args.max_running or args.max_parallel} running; model {args.preset} on {args.device} "
            f"({dtype}), page {spec.page_size}; budgets {budgets}"
        )
        # Warm up (kernel compilation, allocator) outside the timed modes.
        uvloop.run(_warmup(model, spec, args))
        for mode in modes:
            print(f"mode {mode}" + (f" (storage {storage_uri})" if mode == "kv+mamba+storage" else ""))
            try:
                res = uvloop.run(
                    run_mode(
                        mode,
                        model=model,
                        spec=spec,
                        args=args,
                        budgets=budgets,
                        storage_uri=storage_uri,
                        storage_options=storage_options,
                        progress=progress_bar(args.clients * args.rounds, "requests"),
                    )
                )
            except ConfigError as e:  # a storage option the backend refuses
                print(f"error: {e}", file=sys.stderr)
                return 2
            summaries[mode] = res.summary()
    print_tables(summaries)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"modes": summaries, "budgets": budgets}, indent=2))
        print(f"wrote {args.json_path}")
    if args.plot:
        plot(summaries, args.plot, f"{args.preset} on {args.device}: {args.clients}×{args.rounds}")
        print(f"wrote {args.plot}")
    return 0

