"""Builders for trace tests: tiny hand-made traces, a tiny spec, replay configs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asynccache.spec import HybridSpec
from asynccache.trace.loader import Trace
from asynccache.trace.policies import parse_combo
from asynccache.trace.replay import ReplayConfig
from asynccache.trace.results import TierBudget

#: Tokens per hash id in the hand-made traces; pages are as large (one page per block).
BLOCK = 8


def make_spec(page_size: int = BLOCK) -> HybridSpec:
    return HybridSpec.preset("tiny", page_size=page_size)


def make_trace(requests: Sequence[tuple[float, Sequence[int]]], *, partial: int = 1, output: int = 4) -> Trace:
    """Requests given as ``(timestamp_s, hash_ids)``; every block is full except the last, which
    holds ``partial`` tokens (so the full pages are all blocks but the last)."""
    rows = [(ts, (len(ids) - 1) * BLOCK + partial, output, list(ids)) for ts, ids in requests]
    return Trace.from_requests(rows, block_size=BLOCK, name="hand-made")


def make_config(
    combo: str,
    *,
    device_pages: float,
    host_pages: float = 0,
    storage_pages: float = 0,
    spec: HybridSpec | None = None,
) -> ReplayConfig:
    """Budgets in units of KV pages of the tiny spec (a state is ~5.5 pages)."""
    spec = spec or make_spec()
    page = spec.kv_page_bytes
    return ReplayConfig(
        spec=spec,
        budget=TierBudget(
            device=int(device_pages * page), host=int(host_pages * page), storage=int(storage_pages * page)
        ),
        combo=parse_combo(combo),
        check_integrity_every=1,
    )



def mixed_trace(seed: int, n: int, *, shared: int) -> Trace:
    """``n`` random requests: 55 % extend a random earlier conversation, the rest start one,
    beginning with up to ``shared`` blocks every conversation may share."""
    rng = np.random.default_rng(seed)
    reqs, convs, next_id = [], [], 1000
    for t in range(n):
        if convs and rng.random() < 0.55:
            c = int(rng.integers(len(convs)))
            ids = convs[c][:-1] + list(range(next_id, next_id + int(rng.integers(1, 4))))
            convs[c] = ids
        else:
            prefix = list(range(shared))[: int(rng.integers(0, shared + 1))]
            ids = prefix + list(range(next_id, next_id + int(rng.integers(2, 6))))
            convs.append(ids)
        next_id += 8
        reqs.append((t * 2.0, ids))
    return make_trace(reqs)
