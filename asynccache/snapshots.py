"""Storage-only snapshots: recurrent states that go to storage without becoming tree nodes.

An admission policy may want states in storage that the tree does not keep (dense checkpoints
where disk bytes are cheap: ``AdaptiveAdmission.storage_positions``). The engine computes them
into device state slots of its own like any snapshot, and hands them to
``HybridCacheController.archive_snapshots(node, {position: device_slot})``:

- **Staging.** The states, and the KV pages of ``node``'s path up to the deepest position that
  have no host copy, are copied device → host into staging slots taken from the host pools' free
  room (with ``evict_host=True``, made through the tree's host eviction as a backup does; without
  it a snapshot never costs the host tier a cached prefix). The copy is queued like a backup
  (:class:`~asynccache.ops.CacheOperation` of kind ``WRITE`` without a tree plan) and issued by
  the next ``start_writing()``, in the same launch as the step's backups.
- **Storing.** Once the copy has landed, in the storage tier's task group: the KV of the path's
  pages ``[0, deepest)`` (regular objects, put-if-absent; from the tree's host copies where it
  has them, else from staging; pages of nodes marked archived are skipped when the backend does
  not evict), then each state under the page hash of the last page it covers as a
  *speculative* object (``PoolTransfer.speculative``): a backend that evicts for room stores it
  only in room it can make without evicting a regular object, evicts it first, and makes it
  regular when it is read or written again as a regular object. A state is written only when
  the KV of every page before it was. Lookups and prefetches find them exactly like other
  stored states (KV ``ALL_PAGES``, state ``TRAILING_PAGES``).

Ownership: the device slots stay the caller's and are only read. They must hold the snapshots,
unchanged, from the call until :attr:`SnapshotArchive.staged` is done (the staging copy
completed, failed or was cancelled); the copy is ordered after the caller's current stream when
``start_writing()`` issues it. ``node`` is locked on the device until then (its device pages are
copied) and on the host until the archive ends (its host copies are read). Staging slots are the
controller's and are freed on every path — stored, failed, cancelled, shut down — once no copy
into them can be in flight.

- :class:`SnapshotArchiver` — one per storage tier: ``start`` validates, stages and spawns;
- :class:`SnapshotArchive` — the handle: ``op``, ``staged``, ``await`` for
  ``{position: stored}``.

Call from the event-loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asynccache.checks import as_int
from asynccache.errors import ClosedError, ConfigError, TransferError
from asynccache.ops import CacheOperation, OpKind
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolName, PoolTransfer
from asynccache.tree import BackupPlan

if TYPE_CHECKING:
    from asynccache.tiering import StorageTier

__all__ = ["SnapshotArchive", "SnapshotArchiver"]

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class SnapshotArchive:
    """What :meth:`HybridCacheController.archive_snapshots` returns.

    ``op``: the device → host staging copy (queued; ``controller.cancel(op)`` while it is);
    ``task``: the storage writes, resolving to ``{position: stored}`` (True: stored now or
    already; False: not stored, or the KV before it was not). ``await archive`` waits for it.
    """

    positions: tuple[int, ...]
    op: CacheOperation
    task: asyncio.Task[dict[int, bool]]

    @property
    def staged(self) -> asyncio.Future[None]:
        """Done once the caller's device slots are no longer read (whatever the outcome)."""
        return self.op.future

    def __await__(self) -> Generator[Any, None, dict[int, bool]]:
        return asyncio.shield(self.task).__await__()


@dataclass(slots=True)
class _Plan:
    """What one archive stores: the KV keys (each from a tree host page, or from staging:
    ``None``), the state keys, per position how many of the KV keys precede it, and the tree's
    host page of each page read from the tree (``{page: host index}``, checked again before
    the write)."""

    kv_keys: tuple[str, ...]
    kv_host: list[int | None]
    state_keys: tuple[str, ...]
    kv_needed: list[int]
    tree_pages: dict[int, int]


class _Hold:
    """What an archive holds until it ends: ``node`` locked on both tiers (the device lock goes
    once the staging copy is done) and its staging host slots, claimed as in flight in the tree
    (``check_integrity`` counts them owned). :meth:`release` is idempotent."""

    def __init__(self, tree: Any, node: Any, pools: tuple[ItemPool, ItemPool]) -> None:
        self.tree, self.node, self.pools = tree, node, pools
        self.token = tree.lock(node)
        tree.lock_host(node)
        self.device_locked = self.host_locked = True
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None  # KV pages, state slots

    def stage(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        for pool, indices in zip(self.pools, (kv, slots), strict=True):
            self.tree.claim_in_flight(pool, indices)
        self.staged = (kv, slots)

    def unlock_device(self) -> None:
        if self.device_locked:
            self.device_locked = False
            self.tree.unlock(self.node, self.token)

    def release(self) -> None:
        if self.staged is not None:
            for pool, indices in zip(self.pools, self.staged, strict=True):
                self.tree.release_in_flight(pool, indices)
                if indices.numel():
                    pool.free(indices)
            self.staged = None
        self.unlock_device()
        if self.host_locked:
            self.host_locked = False
            self.tree.unlock_host(self.node)

    def release_after(self, op: CacheOperation) -> None:
        """Release once no copy into the staging slots can be in flight (``op`` done)."""
        if op.future.done():
            self.release()
        else:
            op.future.add_done_callback(lambda _: self.release())


class SnapshotArchiver:
    """Archives storage-only snapshots for one :class:`~asynccache.tiering.StorageTier` (see
    the module docstring)."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier
        self.tree = tier.tree
        self.pools = tier.controller.pools

    def start(
        self, node: Any, snapshots: Mapping[int, int], *, evict_host: bool = False, priority: int = 0
    ) -> SnapshotArchive | None:
        """Validate, stage and spawn the storage writes; the caller queues the returned
        archive's ``op``. ``None`` when ``snapshots`` is empty or the host has no room."""
        positions, slots = self._check(node, snapshots)
        if not positions:
            return None
        host_kv, host_state = self.pools[PoolName.KV][1], self.pools[PoolName.MAMBA][1]
        assert host_kv is not None and host_state is not None  # a storage tier has a host tier
        hold = _Hold(self.tree, node, (host_kv, host_state))
        try:
            plan, device_kv = self._plan(node, positions)
            alloc = self._alloc(int(device_kv.numel()), len(positions), evict_host=evict_host)
            if alloc is None:
                self.tier.counts["snapshot_no_room"] += 1
                hold.release()
                return None
            hold.stage(*alloc)
        except BaseException:
            hold.release()
            raise
        staged_kv, staged_slots = alloc
        op = CacheOperation(
            OpKind.WRITE,
            (
                PoolTransfer(pool_name=PoolName.KV, host_indices=staged_kv, device_indices=device_kv),
                PoolTransfer(
                    pool_name=PoolName.MAMBA,
                    host_indices=staged_slots,
                    device_indices=torch.tensor(slots, dtype=torch.int64),
                ),
            ),
            plan=None,
            priority=priority,
            loop=asyncio.get_running_loop(),
        )
        op.future.add_done_callback(lambda _: hold.unlock_device())  # its pages are read no more
        coro = self._store(op, hold, plan, positions)
        try:
            task = self.tier.spawn(coro, name="asynccache-snapshots")
        except RuntimeError as e:  # shutting down (a background task failed)
            coro.close()
            hold.release()
            raise ClosedError(f"the controller is shutting down: {e}") from e
        task.add_done_callback(lambda _: hold.release_after(op))  # also when cancelled before it ran
        counts = self.tier.counts
        counts["snapshot_archives"] += 1
        counts["snapshot_staged_kv_pages"] += int(device_kv.numel())
        counts["snapshot_staged_states"] += len(positions)
        return SnapshotArchive(positions=tuple(positions), op=op, task=task)

    # ---- validation and planning ---------------------------------------------------------
    def _check(self, node: Any, snapshots: Mapping[int, int]) -> tuple[list[int], list[int]]:
        """Sorted positions and their device slots, or :class:`ConfigError` naming what is off
        (a deleted node is a :class:`~asynccache.tree.TreeError`)."""
        if not isinstance(snapshots, Mapping):
            raise ConfigError(f"archive_snapshots: snapshots must map positions to device slots, got {snapshots!r}")
        if getattr(node, "parent", None) is None:
            raise ConfigError("archive_snapshots: node must be a tree node below the root (its path holds the KV)")
        self.tree.check_alive([node])
        page = self.tree.spec.page_size
        end = node.end_tokens
        num_slots = self.pools[PoolName.MAMBA][0].num_items
        checked: dict[int, int] = {}
        for pos, slot in snapshots.items():
            p, s = as_int(pos), as_int(slot)
            if p is None or p <= 0 or p % page:
                raise ConfigError(f"archive_snapshots: position {pos!r} is not a positive multiple of the page size {page}")
            if p > end:
                raise ConfigError(f"archive_snapshots: position {p} is past the node's path ({end} tokens)")
            if s is None or not 0 <= s < num_slots:
                raise ConfigError(f"archive_snapshots: device slot {slot!r} outside the device state pool [0, {num_slots})")
            checked[p] = s
        slots = [checked[p] for p in sorted(checked)]
        if len(set(slots)) != len(slots):
            raise ConfigError("archive_snapshots: one device slot given for two positions")
        return sorted(checked), slots

    def _plan(self, node: Any, positions: list[int]) -> tuple[_Plan, torch.Tensor]:
        """The keys to write, where each KV page comes from, and the device pages to stage."""
        page = self.tree.spec.page_size
        deepest = positions[-1] // page
        skip_archived = not self.tier.storage_evicts
        keys: list[str] = []
        hosts: list[int | None] = []
        device: list[torch.Tensor] = []
        hashes: list[str] = []  # of every page before ``deepest``
        tree_pages: dict[int, int] = {}
        written = [0]  # written[q]: KV keys written for the pages before page q
        for n in self.tree.path_to(node):
            if n.start_page >= deepest:
                break
            count = min(n.end_page, deepest) - n.start_page
            hashes.extend(n.page_hashes[:count])
            skip = n.host_kv is None and n.archived and skip_archived  # stored, as far as the tier knows
            base = written[-1]
            written.extend(base + (0 if skip else k + 1) for k in range(count))
            if skip:
                continue
            keys.extend(hashes[-count:])
            if n.host_kv is not None:
                read = [int(i) for i in n.host_kv[:count]]
                hosts.extend(read)
                tree_pages.update(zip(range(n.start_page, n.start_page + count), read, strict=True))
            else:
                assert n.device_kv is not None, f"{n} holds no KV on any tier"
                hosts.extend([None] * count)
                device.append(n.device_kv[:count])
        plan = _Plan(
            kv_keys=tuple(keys),
            kv_host=hosts,
            state_keys=tuple(hashes[p // page - 1] for p in positions),
            kv_needed=[written[p // page] for p in positions],
            tree_pages=tree_pages,
        )
        return plan, torch.cat(device) if device else torch.empty(0, dtype=torch.int64)

    # ---- host staging --------------------------------------------------------------------
    def _alloc(self, num_pages: int, num_states: int, *, evict_host: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        if evict_host:
            alloc = self.tree.alloc_host(num_pages, num_states)
            return None if alloc is None else (alloc.kv_indices, alloc.state_slots)
        kv_pool, state_pool = self.pools[PoolName.KV][1], self.pools[PoolName.MAMBA][1]
        assert kv_pool is not None and state_pool is not None
        kv = kv_pool.alloc(num_pages)
        if kv is None:
            return None
        slots = state_pool.alloc(num_states)
        if slots is None:
            kv_pool.free(kv)
            return None
        return kv, slots

    # ---- storing -------------------------------------------------------------------------
    def _host_pages_held(self, node: Any, plan: _Plan) -> bool:
        """Each tree host page the plan reads still holds the page it was read for, its bytes
        landed. A backup in flight when the archive began may have failed or been cancelled
        since, taking its pages, and a later backup may have taken them again: for other pages
        of the path (in another order), or for the same ones with its copy not landed yet."""
        want = plan.tree_pages
        if not want:
            return True
        have: dict[int, int] = {}
        for n in self.tree.path_to(node):
            if n.host_kv is not None:
                have.update(zip(range(n.start_page, n.end_page), n.host_kv.tolist(), strict=True))
        if any(have.get(p) != h for p, h in want.items()):
            return False
        # The backups whose copies have not landed: the archive's staging completed after every
        # backup begun before it, so a page of these was freed and taken again since.
        writing = [p.host_kv_indices.numpy() for p in self.tree.active_plans if isinstance(p, BackupPlan)]
        if not writing:
            return True
        return not np.isin(np.concatenate(writing), np.fromiter(want.values(), np.int64, len(want))).any()

    async def _store(self, op: CacheOperation, hold: _Hold, plan: _Plan, positions: list[int]) -> dict[int, bool]:
        """Wait for the staging copy, then write (see the module docstring); what ``hold``
        holds is released at the end, whatever happens."""
        tier, counts = self.tier, self.tier.counts
        stored = dict.fromkeys(positions, False)
        try:
            try:
                await op
            except asyncio.CancelledError:
                if not op.future.cancelled():
                    raise  # this task was cancelled, not the copy
                counts["snapshot_cancelled"] += 1
                return stored
            except TransferError as e:
                counts["snapshot_failed"] += 1
                log.warning("staging storage-only snapshots failed: %s", e)
                return stored
            async with tier.sem:
                if not self._host_pages_held(hold.node, plan):
                    counts["snapshot_kv_lost"] += 1
                    return stored
                assert hold.staged is not None
                return await self._write(plan, hold.staged, positions, stored)
        finally:
            hold.release_after(op)

    async def _write(
        self, plan: _Plan, staged: tuple[torch.Tensor, torch.Tensor], positions: list[int], stored: dict[int, bool]
    ) -> dict[int, bool]:
        counts, backend = self.tier.counts, self.tier.backend
        staged_kv, staged_slots = staged
        from_staging = iter(staged_kv.tolist())
        kv_host = [h if h is not None else next(from_staging) for h in plan.kv_host]
        try:
            kv_ok: list[bool] = []
            if plan.kv_keys:
                kv = PoolTransfer(
                    pool_name=PoolName.KV, keys=plan.kv_keys, host_indices=torch.tensor(kv_host, dtype=torch.int64)
                )
                kv_ok = (await backend.batch_set_v2([kv]))[0]
            # KV first, then the states whose KV is all there: a stored state always has its KV.
            first_missing = next((i for i, ok in enumerate(kv_ok) if not ok), len(kv_ok))
            todo = [i for i, need in enumerate(plan.kv_needed) if need <= first_missing]
            if todo:
                state = PoolTransfer(
                    pool_name=PoolName.MAMBA,
                    keys=tuple(plan.state_keys[i] for i in todo),
                    host_indices=staged_slots[todo],
                    speculative=True,
                )
                for i, ok in zip(todo, (await backend.batch_set_v2([state]))[0], strict=True):
                    stored[positions[i]] = ok
        except Exception as e:  # noqa: BLE001 - a backend failure is a skipped archive, never a crash
            counts["snapshot_failed"] += 1
            log.warning("archiving storage-only snapshots failed: %s", e)
            return stored
        counts["snapshot_states_stored"] += sum(stored.values())
        counts["snapshot_states_not_stored"] += len(stored) - sum(stored.values())
        return stored
