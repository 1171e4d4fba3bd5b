"""Trace replay: real request traces through the real tree, pools and controller, at scale.

- ``loader`` — :class:`Trace` (Mooncake JSONL: timestamp, input/output length, block hash ids).
- ``synth`` — :class:`TokenSynthesizer`: deterministic token ids per block id.
- ``bound`` — :func:`infinite_cache_bound`: the hit rate no policy can beat.
- ``flops`` — :class:`FlopModel`: prefill FLOPs, FLOPs saved by a cached prefix.
- ``storage_index`` / ``storage_tier`` — an accounting L3 (keys and bytes) and how replay feeds it.
- ``budget`` — :class:`ByteBudget`: one byte budget per tier shared by KV pages and states.
- ``policies`` — policy combinations by name (admission / eviction / write / storage feed).
- ``config`` — :class:`ReplayConfig`: what to replay (geometry, budgets, policies).
- ``replay`` / ``controller_replay`` — :class:`TraceReplay` (synchronous copies) and
  :class:`ControllerReplay` (the asyncio controller), on the trace's simulated clock.
- ``results`` / ``report`` — :class:`ReplayResult`, tables, plots, the ``--json`` document.

``asynccache bench trace`` (``asynccache.bench.trace``) runs the matrix of policies × budgets.
"""

from asynccache.trace.bound import BoundResult, infinite_cache_bound
from asynccache.trace.config import ReplayConfig
from asynccache.trace.controller_replay import (
    ControllerReplay,
    replay_trace_with_controller,
)
from asynccache.trace.flops import FlopModel
from asynccache.trace.loader import Trace, TraceFormatError, TraceRequest, load_trace
from asynccache.trace.policies import PolicyCombo, parse_combo
from asynccache.trace.replay import TraceReplay, replay_trace
from asynccache.trace.results import ReplayResult, TierBudget, parse_size
from asynccache.trace.storage_index import AccountingStorage
from asynccache.trace.synth import TokenSynthesizer

__all__ = [
    "AccountingStorage",
    "BoundResult",
    "ControllerReplay",
    "FlopModel",
    "PolicyCombo",
    "ReplayConfig",
    "ReplayResult",
    "TierBudget",
    "TokenSynthesizer",
    "Trace",
    "TraceFormatError",
    "TraceReplay",
    "TraceRequest",
    "infinite_cache_bound",
    "load_trace",
    "parse_combo",
    "parse_size",
    "replay_trace",
    "replay_trace_with_controller",
]
