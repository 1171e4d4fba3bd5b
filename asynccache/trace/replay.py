"""Trace replay through the real tree and pools, in accounting mode, on simulated time.

For each request of a :class:`~asynccache.trace.loader.Trace`, in timestamp order (one at a
time: a request's prefill and insert complete before the next arrives)::

    tokens = synthesised prompt (same block id → same tokens)
    match  = tree.match_prefix(tokens[:-1])                     hits on device / host
    n      = storage.lookup(match); prefetch into host; match   hits from storage
    load   = host → device copy of what the match needs         (SyncTransfer: tree protocol)
    insert = tree.insert(full pages, fresh device pages, states at the admission's positions)
    backup = write policy's device → host copies; storage archive / dense storage states
    budget = evict device, then host, down to their byte budgets (ByteBudget: tree.evict_bytes)

Pools are ``materialize=False`` (indices and bytes only), so a TiB host tier costs a few MB;
every copy goes through ``kernels.copy_items``, which counts bytes. The tree's clock is the
trace's: ``last_access`` and every policy see trace seconds (made strictly increasing, so two
touches never tie). Only full pages are cached and a request reuses at most ``input_length − 1``
tokens. Outputs are not replayed (traces give no ids for output tokens, so no later prompt could
match them): the figures are about prompt tokens, like the bound they are compared with.

Policies hook in three ways beyond the tree's own interfaces (all optional, duck-typed):

- ``admission.storage_positions(prompt_len, page_size=, match=) -> set[int]``: snapshots that go
  to storage only (dense checkpoints where bytes are cheap);
- ``policy.observe_match(match, prompt_len=, now=)`` and ``policy.observe_insert(result, now=)``
  for admission and eviction policies that learn from observed reuse;
- ``eviction.superseded_states(match, result) -> list[TreeNode]``: states an insert made
  useless (a resumed prompt end the request extended), released at once through
  ``tree.release_states`` (counted as ``evictions["released_states"]``).

The ``attention-only`` admission is a reference, not a hybrid policy: a state at every page
that costs no bytes (the budgets count KV only), i.e. a cache of attention layers alone where
any cached prefix is reusable.

Primitives: :class:`TraceReplay` (one replay of one trace, synchronous copies) and
:func:`replay_trace` (run one); what to replay, :class:`ReplayConfig`, lives in
:mod:`asynccache.trace.config` and is re-exported here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from asynccache.errors import CapacityError
from asynccache.policy import WritePolicy
from asynccache.pools import DeviceKVPool, DeviceMambaPool, HostKVPool, MambaPoolHost
from asynccache.storage import PoolName
from asynccache.storage_admission import ArchiveAdmission
from asynccache.trace.bound import BoundResult, infinite_cache_bound
from asynccache.trace.budget import ByteBudget
from asynccache.trace.config import ReplayConfig
from asynccache.trace.flops import FlopModel
from asynccache.trace.loader import Trace
from asynccache.trace.policies import ATTENTION_ONLY, make_admission, make_eviction
from asynccache.trace.results import ReplayResult
from asynccache.trace.storage_index import AccountingStorage
from asynccache.trace.storage_tier import ReplayStorageTier
from asynccache.trace.synth import make_synthesizer
from asynccache.tree import (
    HybridRadixTree,
    InsertResult,
    MatchResult,
    SyncTransfer,
    Tier,
    TreeNode,
)

__all__ = ["ReplayConfig", "TraceReplay", "replay_trace"]

#: Smallest step of the replay clock: touches within one trace millisecond stay ordered.
_CLOCK_EPS_S = 1e-7


class TraceReplay:
    """One replay of one trace under one :class:`ReplayConfig` (see the module docstring)."""

    def __init__(
        self,
        trace: Trace,
        config: ReplayConfig,
        *,
        bound: BoundResult | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        spec = config.spec
        self.synth = make_synthesizer(trace, spec)
        self.trace = trace
        self.config = config
        self.spec = spec
        self.page = spec.page_size
        self.bound = bound if bound is not None else infinite_cache_bound(trace, page_size=spec.page_size)
        self.progress = progress
        self.flops = FlopModel.from_spec(spec, active_params=config.active_params)
        self._now = 0.0
        self._tick = float("-inf")

        budget = config.budget
        kv_bytes, state_bytes = spec.kv_page_bytes, spec.state_bytes
        # Either pool of a tier may take the whole budget (ByteBudget enforces the sum); the
        # headroom holds one request in flight beyond the budget.
        max_pages = int(np.max(trace.input_lengths)) // self.page + 1
        headroom_pages = 2 * max_pages + 64
        headroom_states = 2 * max_pages + 64
        combo = config.combo
        self.attention_only = combo.admission == ATTENTION_ONLY
        if self.attention_only:
            state_bytes = kv_bytes  # a state per page, budgeted at nothing: one slot per page
        self.device_kv = DeviceKVPool(spec, budget.device // kv_bytes + headroom_pages, materialize=False)
        self.device_mamba = DeviceMambaPool(spec, budget.device // state_bytes + headroom_states, materialize=False)
        self.host_kv = self.host_mamba = None
        if budget.host:
            self.host_kv = HostKVPool(spec, num_pages=budget.host // kv_bytes + headroom_pages, materialize=False)
            self.host_mamba = MambaPoolHost(
                spec, num_slots=budget.host // state_bytes + headroom_states, materialize=False
            )
        self.admission = make_admission(combo.admission, spec=spec, budget=budget, flops=self.flops)
        self.eviction = make_eviction(combo.eviction, spec=spec, flops=self.flops)
        write_policy = WritePolicy.parse(combo.write_policy)
        self.tree = HybridRadixTree(
            spec,
            device_kv=self.device_kv,
            device_mamba=self.device_mamba,
            host_kv=self.host_kv,
            host_mamba=self.host_mamba,
            admission=self.admission,
            eviction=self.eviction,
            write_policy=write_policy,
            clock=self._clock,
        )
        self.transfer = SyncTransfer(self.tree)
        self.backups_kv_pages = 0
        self.backups_states = 0
        self.released_states = 0
        self.tree.write_back = self._write_back
        self.storage: AccountingStorage | None = None
        self.storage_tier: ReplayStorageTier | None = None
        if budget.storage:
            self.storage = AccountingStorage(budget.storage)
            self.storage_tier = ReplayStorageTier(
                self.tree, self.storage, write=combo.storage_write, backup=self._backup
            )
            # Both engines' tiers share it (the controller engine's own tier takes it over).
            self.storage_tier.admission = ArchiveAdmission(self.eviction, now=lambda: self._now)
        count_states = not self.attention_only
        self.device_budget = ByteBudget(
            tree=self.tree, tier=Tier.DEVICE, budget_bytes=budget.device, count_states=count_states
        )
        self.host_budget: ByteBudget | None = None
        if budget.host:
            self.host_budget = ByteBudget(
                tree=self.tree,
                tier=Tier.HOST,
                budget_bytes=budget.host,
                demote=self.storage_tier.demote if self.storage_tier and combo.storage_write == "demote" else None,
                count_states=count_states,
            )
        self._observers = [p for p in (self.admission, self.eviction) if hasattr(p, "observe_match")]
        #: the storage-only snapshots of the request being replayed: (node, positions)
        self._snapshots: tuple[TreeNode, list[int]] | None = None

    # ---- clock ---------------------------------------------------------------------------
    def _clock(self) -> float:
        """Trace time, strictly increasing across calls."""
        step = self._tick + _CLOCK_EPS_S
        if step == self._tick:  # past ~2³⁰ s the epsilon is below the float's resolution
            step = math.nextafter(self._tick, math.inf)
        self._tick = max(self._now, step)
        return self._tick

    # ---- copies ------------------------------------------------------------------------
    def _backup(self, nodes: Sequence[TreeNode]) -> bool:
        plan = self.transfer.backup(nodes)
        if plan is None:
            return False
        self.backups_kv_pages += plan.num_kv_pages
        self.backups_states += plan.num_states
        if self.storage_tier is not None:
            self.storage_tier.on_backup(plan.nodes)
        return True

    def _write_back(self, nodes: Sequence[TreeNode]) -> bool:
        return self._backup(nodes)

    # ---- one request -------------------------------------------------------------------
    def _begin(self, i: int) -> tuple[np.ndarray, int, MatchResult]:
        """Set the clock to request ``i``'s arrival, synthesise its prompt, match it."""
        length = int(self.trace.input_lengths[i])
        self._now = float(self.trace.timestamps_s[i])
        tokens = self.synth.tokens(self.trace.hash_ids_of(i), length)
        return tokens, length, self.tree.match_prefix(tokens[: length - 1])

    def _observe_match(self, match: MatchResult, length: int) -> None:
        for obs in self._observers:
            obs.observe_match(match, prompt_len=length, now=self._now)

    def _insert_locked(self, tokens: np.ndarray, length: int, match: MatchResult) -> InsertResult | None:
        token = self.tree.lock(match.last_node)
        try:
            result = self._insert(tokens, length, match)
        finally:
            self.tree.unlock(match.last_node, token)
        if result is not None:
            for obs in self._observers:
                if hasattr(obs, "observe_insert"):
                    obs.observe_insert(result, now=self._now)
        superseded = getattr(self.eviction, "superseded_states", None)
        if superseded is not None:
            nodes = superseded(match, result)
            if nodes:
                self.released_states += self.tree.release_states(nodes).num_states
        return result

    def _enforce_budgets(self) -> None:
        if self.storage_tier is not None:
            # The write-backs' archives are written once the device's eviction is over, as the
            # controller engine writes them (then before the host evicts, in both).
            with self.storage_tier.deferring():
                self.device_budget.enforce()
        else:
            self.device_budget.enforce()
        if self.host_budget is not None:
            self.host_budget.enforce()

    def _request(self, i: int) -> tuple[int, int, int]:
        """Replay request ``i``; returns tokens hit on (device, host, storage)."""
        tree, page = self.tree, self.page
        tokens, length, match = self._begin(i)
        hit_device, hit_host = match.num_device_tokens, match.num_host_tokens
        hit_storage = 0
        if self.storage_tier is not None:
            n = self.storage_tier.lookup(match, max_pages=(length - 1) // page)
            if n * page > match.num_tokens and self.storage_tier.prefetch(tokens, match, n):
                before = match.num_tokens
                match = tree.match_prefix(tokens[: length - 1])
                hit_storage = max(0, match.num_tokens - before)
        self._observe_match(match, length)
        if match.needs_load and self.transfer.load(match) is None:
            raise CapacityError(f"request {i}: no device room to load {match.num_tokens} cached tokens")
        result = self._insert_locked(tokens, length, match)
        if result is not None and result.backup_nodes:
            self._backup(result.backup_nodes)
        self._archive_snapshots()
        self._enforce_budgets()
        return hit_device, hit_host, hit_storage

    def _insert(self, tokens: np.ndarray, length: int, match: MatchResult) -> InsertResult | None:
        tree, page = self.tree, self.page
        full = length // page
        if full == 0:
            return None
        positions = sorted(
            p for p in tree.state_positions(length, match=match) if match.num_tokens < p <= full * page
        )
        # Fresh pages for every full page: the tree keeps the new ones and frees duplicates.
        kv = self.device_kv.alloc(full)
        slots = self.device_mamba.alloc(len(positions))
        if kv is None or slots is None:
            raise CapacityError("device pools exhausted during replay (headroom too small)")
        result = tree.insert(
            tokens[: full * page], kv, states=dict(zip(positions, slots.tolist(), strict=True)), prompt_len=length
        )
        storage_positions = getattr(self.admission, "storage_positions", None)
        if self.storage_tier is not None and storage_positions is not None:
            dense = sorted(
                p for p in storage_positions(length, page_size=page, match=match) if match.num_tokens < p <= full * page
            )
            if dense:
                self._snapshots = (result.last_node, dense)
        return result

    def _archive_snapshots(self) -> None:
        """Write the request's storage-only snapshots (on the inserted path) to storage, after
        its backup as the controller engine does: straight through the replay's storage tier."""
        pending, self._snapshots = self._snapshots, None
        if pending is not None and self.storage_tier is not None:
            self.storage_tier.archive_states(*pending)

    # ---- the whole trace ---------------------------------------------------------------
    def run(self) -> ReplayResult:
        t0 = time.perf_counter()
        trace = self.trace
        n = len(trace)
        hits = np.zeros((n, 3), dtype=np.int64)
        every = self.config.check_integrity_every
        for i in range(n):
            hits[i] = self._request(i)
            if every and (i + 1) % every == 0:
                self.tree.check_integrity()
            if self.progress is not None and self.config.progress_every and (i + 1) % self.config.progress_every == 0:
                self.progress(i + 1, n)
        return self._result(hits, time.perf_counter() - t0)

    def _result(self, hits: np.ndarray, wall_s: float) -> ReplayResult:
        spec, trace = self.spec, self.trace
        per_request = hits.sum(axis=1)
        prompt = trace.input_lengths
        flops_total = float(np.sum(self.flops.prefill_flops(prompt.astype(np.float64))))
        flops_saved = float(np.sum(self.flops.prefill_flops(per_request.astype(np.float64))))
        kv_b, st_b = spec.kv_page_bytes, spec.state_bytes
        moved = {
            "h2d": self.transfer.bytes_loaded,
            "d2h": self.transfer.bytes_backed_up,
            "d2h_kv": self.backups_kv_pages * kv_b,
            "d2h_state": self.backups_states * st_b,
        }
        evictions = {
            "device_kv": self.device_budget.counts.kv_pages,
            "device_state": self.device_budget.counts.states,
            "device_lost_states": self.device_budget.counts.lost_states,
            "device_stuck": self.device_budget.counts.stuck,
            "released_states": self.released_states,
        }
        if self.attention_only:  # its states cost nothing: their copies do not count
            moved["h2d"] -= self.transfer.state_bytes_loaded
            moved["d2h"] -= self.transfer.state_bytes_backed_up
            moved["d2h_state"] = 0
        peak = {"device": self.device_budget.peak_bytes}
        if self.host_budget is not None:
            evictions["host_kv"] = self.host_budget.counts.kv_pages
            evictions["host_state"] = self.host_budget.counts.states
            evictions["host_lost_states"] = self.host_budget.counts.lost_states
            evictions["host_stuck"] = self.host_budget.counts.stuck
            peak["host"] = self.host_budget.peak_bytes
        extra: dict[str, Any] = {"engine": "sync", "bound_hit_tokens": self.bound.hit_tokens}
        if self.storage is not None and self.storage_tier is not None:
            c = self.storage.counters()
            moved["storage_write"] = sum(c.bytes_written.values())
            moved["storage_read"] = sum(c.bytes_read.values())
            # the staging of storage-only snapshots, as the controller engine counts it
            moved["d2h"] += self.storage_tier.staged_kv_bytes + self.storage_tier.staged_state_bytes
            evictions["storage_objects"] = sum(c.num_evicted.values())
            peak["storage"] = c.capacity_bytes if c.bytes_evicted else c.used_bytes
            extra["storage_objects"] = c.num_objects
            extra["prefetches"] = self.storage_tier.num_prefetches
            if self.storage_tier.admission is not None:
                extra["storage_admission"] = self.storage_tier.admission.counts()
            extra["storage_kv_bytes_written"] = self.storage.written_bytes(PoolName.KV)
            extra["storage_state_bytes_written"] = self.storage.written_bytes(PoolName.MAMBA)
        stats = self.tree.stats()
        extra["final_tree"] = {
            "nodes": stats.num_nodes,
            "device_kv_pages": stats.device_kv_pages,
            "device_states": stats.device_states,
            "host_kv_pages": stats.host_kv_pages,
            "host_states": stats.host_states,
        }
        describe = getattr(self.eviction, "describe", None)
        if describe is not None:
            extra["eviction_state"] = describe()
        describe = getattr(self.admission, "describe", None)
        if describe is not None:
            extra["admission_state"] = describe()
        combo = self.config.combo
        return ReplayResult(
            admission=combo.admission,
            eviction=combo.eviction,
            write_policy=combo.write_label,
            budget=self.config.budget,
            num_requests=len(trace),
            prompt_tokens=int(prompt.sum()),
            hit_tokens=int(per_request.sum()),
            hit_tokens_by_tier={
                "device": int(hits[:, 0].sum()),
                "host": int(hits[:, 1].sum()),
                "storage": int(hits[:, 2].sum()),
            },
            bound_hit_rate=self.bound.hit_rate,
            flops_total=flops_total,
            flops_saved=flops_saved,
            bytes_moved=moved,
            evictions=evictions,
            peak_bytes=peak,
            extra=extra,
            wall_s=wall_s,
        )


def replay_trace(
    trace: Trace,
    config: ReplayConfig,
    *,
    bound: BoundResult | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` under ``config`` and return its figures (see :class:`TraceReplay`)."""
    return TraceReplay(trace, config, bound=bound, progress=progress).run()

