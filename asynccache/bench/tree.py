"""``asynccache bench tree``: latency of ``match_prefix`` and ``insert`` on a large tree (CPU).

The tree is first filled to ``--tree-pages`` pages (default 100,000, page 64) with requests that
share system prompts and have random bodies, each with the states of ``--admission`` (the
default, ``ends``: the prompt end, the last page boundary before it and the output end). Pools are in accounting mode (``materialize=False``), so no cache memory is
allocated. Then, for every prompt size:

- ``match``: a cached multi-turn conversation of that many tokens (states at the ends of each of
  up to 16 turns; with ``--admission every-page`` at every page) is matched in full — the walk
  reaches the deepest node. Token ids are an int64 numpy array (the form a scheduler holds them
  in); ``list`` input is reported beside it.
- ``insert``: a fresh prompt of that size (all pages new, two states) is inserted; the
  duplicate-only re-insert of the same prompt is reported beside it.

Figures are medians over ``--repeats`` runs. ``--json PATH`` writes
``{"match_us": {"<tokens>": µs, …}, "insert_us": {"<tokens>": µs, …}}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from asynccache.bench.options import (
    distinct_positive_int_list,
    nonnegative_int,
    positive_int,
)
from asynccache.errors import CapacityError, ConfigError
from asynccache.policy import EndsAdmission, EveryPageAdmission
from asynccache.pools import DeviceKVPool, DeviceMambaPool, HostKVPool, MambaPoolHost
from asynccache.spec import HybridSpec
from asynccache.tree import HybridRadixTree

__all__ = ["add_arguments", "run"]

DEFAULT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=distinct_positive_int_list,
        default=list(DEFAULT_SIZES),
        help="prompt sizes in tokens, comma-separated, distinct, each at least --page-size (default 1k…128k)",
    )
    parser.add_argument("--page-size", type=positive_int, default=64)
    parser.add_argument("--tree-pages", type=positive_int, default=100_000, help="pages held by the tree before measuring")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed runs per size (median reported)")
    parser.add_argument("--preset", default="qwen3-next-80b", help="HybridSpec preset for the pool geometry")
    parser.add_argument(
        "--admission",
        choices=("ends", "every-page"),
        default="ends",
        help="admission of the requests filling the tree and of the probes (every-page: one node per page)",
    )
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON to this path")


#: Token counts of the requests filling the tree: ``[low, high)`` of a system prompt, a body and
#: an output.
_SYSTEM_TOKENS = (512, 4096)
_BODY_TOKENS = (256, 24_000)
_OUTPUT_TOKENS = (16, 1024)
#: The most tokens one filling request has: the fill stops once the tree holds ``--tree-pages``
#: pages, so the last request may go past it by up to this many tokens.
_MAX_REQUEST_TOKENS = sum(high - 1 for _, high in (_SYSTEM_TOKENS, _BODY_TOKENS, _OUTPUT_TOKENS))
#: States a probe conversation takes with ``ends`` admission: up to 16 turns of 3.
_CONVERSATION_STATES = 16 * 3


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _build_tree(args: argparse.Namespace, sizes: list[int]) -> HybridRadixTree:
    """A tree over accounting pools large enough for the fill, the probe conversations and every
    timed insert (``--repeats`` fresh prompts and re-inserts per size)."""
    spec = HybridSpec.preset(args.preset, page_size=args.page_size)
    slack = _pages(_MAX_REQUEST_TOKENS, args.page_size)
    per_size = (args.repeats + 2) * sum(size // args.page_size + 1 for size in sizes)
    num_pages = args.tree_pages + slack + per_size
    if args.admission == "every-page":
        num_states = num_pages
    else:
        # Fill: up to 3 states a request, and each request brings at least the pages of its
        # body and output; then each size's probe conversation and 2 states per timed insert.
        new_pages = max(1, (_BODY_TOKENS[0] + _OUTPUT_TOKENS[0]) // args.page_size)
        fill_states = 3 * (args.tree_pages // new_pages + 1)
        num_states = fill_states + len(sizes) * (_CONVERSATION_STATES + 2 * args.repeats)
    return HybridRadixTree(
        spec,
        admission=EveryPageAdmission() if args.admission == "every-page" else EndsAdmission(),
        device_kv=DeviceKVPool(spec, num_pages, materialize=False),
        device_mamba=DeviceMambaPool(spec, num_states, materialize=False),
        host_kv=HostKVPool(spec, num_pages=num_pages, materialize=False),
        host_mamba=MambaPoolHost(spec, num_slots=num_states, materialize=False),
    )


def _alloc(tree: HybridRadixTree, num_pages: int, num_states: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = tree.device_kv.alloc(num_pages)
    slots = tree.device_mamba.alloc(num_states) if num_states else torch.empty(0, dtype=torch.int64)
    if kv is None or slots is None:
        raise CapacityError(
            f"benchmark pools are too small: {num_pages} pages and {num_states} states wanted, "
            f"{tree.device_kv.num_free} and {tree.device_mamba.num_free} free"
        )
    return kv, slots


def _insert(tree: HybridRadixTree, tokens: np.ndarray, prompt_len: int) -> None:
    n_pages = tokens.shape[0] // tree.page_size
    positions = sorted(tree.state_positions(prompt_len, total_len=tokens.shape[0]))
    kv, slots = _alloc(tree, n_pages, len(positions))
    tree.insert(tokens, kv, states=dict(zip(positions, slots.tolist(), strict=True)), prompt_len=prompt_len)


def _fill(tree: HybridRadixTree, rng: np.random.Generator, target_pages: int) -> int:
    """Requests sharing one of 16 system prompts, with random bodies and outputs."""
    systems = [rng.integers(0, 150_000, int(rng.integers(*_SYSTEM_TOKENS)), dtype=np.int64) for _ in range(16)]
    num_requests = 0
    while tree.stats().device_kv_pages < target_pages:
        system = systems[int(rng.integers(0, len(systems)))]
        body = rng.integers(0, 150_000, int(rng.integers(*_BODY_TOKENS)), dtype=np.int64)
        output = rng.integers(0, 150_000, int(rng.integers(*_OUTPUT_TOKENS)), dtype=np.int64)
        prompt = np.concatenate([system, body])
        _insert(tree, np.concatenate([prompt, output]), prompt.shape[0])
        num_requests += 1
    return num_requests


def _conversation(tree: HybridRadixTree, rng: np.random.Generator, size: int) -> np.ndarray:
    """A cached conversation of ``size`` tokens: one insert per turn (states at turn ends)."""
    tokens = rng.integers(0, 150_000, size, dtype=np.int64)
    turns = max(1, min(16, size // 1024))
    ends = [size * (t + 1) // turns for t in range(turns)]
    for end in ends:
        _insert(tree, tokens[:end], max(end - 64, 0))
    return tokens


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000.0


def run(args: argparse.Namespace) -> int:
    sizes = sorted(args.sizes)
    if sizes[0] < args.page_size:
        raise ConfigError(f"--sizes: {sizes[0]} is smaller than --page-size ({args.page_size}): no page to match")
    rng = np.random.default_rng(args.seed)
    tree = _build_tree(args, sizes)
    t0 = time.perf_counter()
    num_requests = _fill(tree, rng, args.tree_pages)
    probes = {size: _conversation(tree, rng, size) for size in sizes}
    build_s = time.perf_counter() - t0
    stats = tree.stats()
    print(
        f"tree: {stats.device_kv_pages} pages, {stats.num_nodes} nodes, {stats.device_states} states "
        f"({num_requests} requests, page {args.page_size}, built in {build_s:.1f} s)"
    )
    # The tree's objects are long-lived; keep the cyclic collector from walking them mid-timing.
    gc.collect()
    gc.freeze()
    try:
        match_us: dict[str, float] = {}
        insert_us: dict[str, float] = {}
        rows = []
        for size in sizes:
            tokens = probes[size]
            as_list = tokens.tolist()
            m = tree.match_prefix(tokens)
            assert m.num_tokens == size // args.page_size * args.page_size, (size, m.num_tokens)
            match_ns, list_ns, insert_ns, reinsert_ns = [], [], [], []
            for _ in range(args.repeats):
                t = time.perf_counter_ns()
                tree.match_prefix(tokens)
                match_ns.append(time.perf_counter_ns() - t)
            for _ in range(max(3, args.repeats // 5)):
                t = time.perf_counter_ns()
                tree.match_prefix(as_list)
                list_ns.append(time.perf_counter_ns() - t)
            n_pages = size // args.page_size
            for _ in range(args.repeats):
                fresh = rng.integers(0, 150_000, size, dtype=np.int64)
                # States at the prompt end and the page boundary before it (one state for a
                # one-page prompt, which has no boundary before its end).
                positions = [n_pages * args.page_size, (n_pages - 1) * args.page_size][: min(n_pages, 2)]
                kv, slots = _alloc(tree, n_pages, len(positions))
                states = dict(zip(positions, slots.tolist(), strict=True))
                t = time.perf_counter_ns()
                tree.insert(fresh, kv, states=states)
                insert_ns.append(time.perf_counter_ns() - t)
                kv2, _ = _alloc(tree, n_pages, 0)
                t = time.perf_counter_ns()
                tree.insert(fresh, kv2)
                reinsert_ns.append(time.perf_counter_ns() - t)
            match_us[str(size)] = round(_median_us(match_ns), 2)
            insert_us[str(size)] = round(_median_us(insert_ns), 2)
            rows.append(
                (
                    size,
                    len(tree.path_to(m.last_node)),
                    match_us[str(size)],
                    _median_us(list_ns),
                    insert_us[str(size)],
                    _median_us(reinsert_ns),
                )
            )
    finally:
        gc.unfreeze()

    print(f"{'tokens':>8} {'nodes':>6} {'match µs':>10} {'match(list) µs':>15} {'insert µs':>10} {'re-insert µs':>13}")
    for size, nodes, mu, lu, iu, ru in rows:
        print(f"{size:>8} {nodes:>6} {mu:>10.1f} {lu:>15.1f} {iu:>10.1f} {ru:>13.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"match_us": match_us, "insert_us": insert_us}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
