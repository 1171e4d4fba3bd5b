"""Trace replay driven by the asyncio :class:`~asynccache.controller.HybridCacheController`.

Same requests, tree, pools, budgets and policies as :class:`~asynccache.trace.replay.TraceReplay`
(whose synchronous copies stand in for the controller), but every copy goes through the
controller a serving engine uses:

- storage lookups and prefetches: ``controller.prefetch`` / ``wait_prefetch`` (the controller's
  storage tier, ``batch_exists_v2`` + ``batch_get_v2`` on an
  :class:`~asynccache.trace.storage_index.AccountingStorage` backend, landing in host slots);
- host → device loads: ``controller.load`` + ``start_loading`` (one launch per layer);
- device → host backups: ``controller.write`` + ``start_writing``; under ``write_back`` the tree's
  callback is ``controller.write_back``; completed host writes are archived to storage by the
  controller's storage tier (``storage_write="through"``; with ``"demote"`` that archiving is
  off: storage gets only what host eviction lets go, as in the synchronous engine).

- the admission policy's storage-only snapshots: ``controller.archive_snapshots`` from device
  state slots the replay allocates for them (and frees once they are staged), queued once the
  request's backup has landed, so the path's KV is read from the host copies that backup made
  (under ``write_back``, staged from the device) and the backup's archive is written first, as
  in the synchronous engine, whenever copies complete; they land in the backend as speculative
  objects.
- budgets: the device's, then, once the archives of its write-backs are written (until then
  they hold their host copies), the host's.

The replay's own storage tier still writes, with ``storage_write="demote"``, what host eviction
lets go (the controller has no demote mode; see docs/followups.md). On CPU the controller
completes copies synchronously, so a request's copies have landed before the next request
arrives; nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import torch

from asynccache.config import HybridCacheConfig, PrefetchPolicy
from asynccache.controller import HybridCacheController
from asynccache.errors import CapacityError
from asynccache.snapshots import SnapshotArchive
from asynccache.trace.bound import BoundResult
from asynccache.trace.config import ReplayConfig
from asynccache.trace.loader import Trace
from asynccache.trace.replay import TraceReplay
from asynccache.trace.results import ReplayResult

__all__ = ["ControllerReplay", "replay_trace_with_controller"]


class ControllerReplay(TraceReplay):
    """:class:`TraceReplay` with the asyncio controller moving the bytes (module docstring)."""

    def __init__(
        self,
        trace: Trace,
        config: ReplayConfig,
        *,
        bound: BoundResult | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(trace, config, bound=bound, progress=progress)
        host_kv, host_mamba = self.host_kv, self.host_mamba
        cache_config = HybridCacheConfig(
            device_kv_pages=self.device_kv.num_items,
            device_state_slots=self.device_mamba.num_items,
            host_kv_bytes=host_kv.size_bytes if host_kv is not None else 0,
            host_state_bytes=host_mamba.size_bytes if host_mamba is not None else 0,
            write_policy=config.combo.write_policy,
            prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
            max_backups_in_flight=1 << 16,
        )
        self.controller = HybridCacheController(
            self.tree,
            device_kv=self.device_kv,
            device_mamba=self.device_mamba,
            host_kv=host_kv,
            host_mamba=host_mamba,
            config=cache_config,
            backend=self.storage,
        )
        self.tree.write_back = self.controller.write_back
        if self.storage_tier is not None:
            # The controller's storage tier archives completed host writes itself (by the same
            # storage admission rule: see started).
            self.storage_tier.archive_backups = False

    def _queue_snapshots(self) -> tuple[SnapshotArchive, torch.Tensor] | None:
        """Queue the request's storage-only snapshots (``controller.archive_snapshots``) from
        device slots taken for them; the archive and the slots, or None."""
        pending, self._snapshots = self._snapshots, None
        if pending is None:
            return None
        node, positions = pending
        slots = self.device_mamba.alloc(len(positions))
        if slots is None:
            raise CapacityError("device state pool exhausted during replay (headroom too small)")
        archive = self.controller.archive_snapshots(node, dict(zip(positions, slots.tolist(), strict=True)))
        if archive is None:
            self.device_mamba.free(slots)
            return None
        return archive, slots

    async def _arequest(self, i: int) -> tuple[int, int, int]:
        tree, ctrl = self.tree, self.controller
        tokens, length, match = self._begin(i)
        key = tokens[: length - 1]
        hit_device, hit_host = match.num_device_tokens, match.num_host_tokens
        hit_storage = 0
        if ctrl.tiering is not None:
            task = ctrl.prefetch(key, match, salt=match.salt)
            fetched = None if task is None else await ctrl.wait_prefetch(task, len(key))
            if fetched is not None and fetched.num_tokens > match.num_tokens:  # else nothing to see
                before = match.num_tokens
                match = tree.match_prefix(key)
                hit_storage = max(0, match.num_tokens - before)
        self._observe_match(match, length)
        if match.needs_load:
            op = ctrl.load(match)
            if op is None:
                raise CapacityError(f"request {i}: no device room to load {match.num_tokens} cached tokens")
            ctrl.start_loading()
            await op
        result = self._insert_locked(tokens, length, match)
        if result is not None and result.backup_nodes:
            op = ctrl.write(result.backup_nodes)
            ctrl.start_writing()
            if op is not None:
                await op  # its archive is queued now, ahead of the snapshots' writes
        snapshots = self._queue_snapshots()
        ctrl.start_writing()
        if snapshots is not None:
            archive, slots = snapshots
            await archive
            self.device_mamba.free(slots)
        if ctrl.tiering is not None:
            await ctrl.tiering.drain()
        self.device_budget.enforce()
        if ctrl.tiering is not None:
            # The device's write-backs are archived before the host evicts, as in the
            # synchronous engine (meanwhile their archives hold the host copies).
            await ctrl.tiering.drain()
        if self.host_budget is not None:
            self.host_budget.enforce()
        return hit_device, hit_host, hit_storage

    def started(self) -> None:
        """Set the controller up for the replay, once it has started (``async with
        replay.controller``); then :meth:`_arequest` replays one request at a time."""
        if self.controller.tiering is not None and self.storage_tier is not None:
            self.controller.tiering.admission = self.storage_tier.admission
        if self.controller.tiering is not None and self.config.combo.storage_write == "demote":
            # The controller's tier archives every completed host write; demote writes only
            # host victims (the replay's tier, through the host budget's hook).
            self.controller.tiering.archive_host_writes = False

    async def arun(self) -> ReplayResult:
        """Replay the whole trace inside the controller's lifetime."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        n = len(self.trace)
        hits = np.zeros((n, 3), dtype=np.int64)
        every = self.config.check_integrity_every
        async with self.controller:
            self.started()
            for i in range(n):
                hits[i] = await self._arequest(i)
                if every and (i + 1) % every == 0:
                    self.tree.check_integrity()
                if self.progress is not None and self.config.progress_every and (i + 1) % self.config.progress_every == 0:
                    self.progress(i + 1, n)
            stats = self.controller.statistics()
        result = self._result(hits, loop.time() - t0)
        moved = dict(result.bytes_moved)
        moved["h2d"] = stats.bytes_total("h2d")
        # d2h: every device → host copy, the snapshots' staging included; d2h_kv / d2h_state:
        # the backups' alone, as in the synchronous engine.
        counts = self.controller.tiering.counts if self.controller.tiering is not None else {}
        moved["d2h"] = stats.bytes_total("d2h")
        moved["d2h_kv"] = stats.bytes.get("d2h:kv", 0) - counts.get("snapshot_staged_kv_pages", 0) * self.spec.kv_page_bytes
        moved["d2h_state"] = stats.bytes.get("d2h:mamba", 0) - counts.get("snapshot_staged_states", 0) * self.spec.state_bytes
        if self.attention_only:  # its states cost nothing: their copies do not count
            moved["h2d"] -= stats.bytes.get("h2d:mamba", 0)
            moved["d2h"] -= moved["d2h_state"]
            moved["d2h_state"] = 0
        extra = dict(result.extra)
        extra["engine"] = "controller"
        if self.controller.tiering is not None:
            extra["prefetches"] = self.controller.tiering.counts.get("prefetch_hit", 0)
            extra["snapshot_counts"] = {k: v for k, v in self.controller.tiering.counts.items() if k.startswith("snapshot_")}
        extra["controller_counts"] = {k: v for k, v in stats.counts.items() if v}
        return ReplayResult(
            **{
                **{f: getattr(result, f) for f in result.__dataclass_fields__},
                "bytes_moved": moved,
                "extra": extra,
            }
        )

    def run(self) -> ReplayResult:
        return asyncio.run(self.arun())


def replay_trace_with_controller(
    trace: Trace,
    config: ReplayConfig,
    *,
    bound: BoundResult | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` under ``config`` through the asyncio controller."""
    return ControllerReplay(trace, config, bound=bound, progress=progress).run()
