"""The controller's operations as the tree sees them: made from its plans, then finished,
failed or cancelled.

A load or a backup takes memory on the tier it copies to: the nodes are pinned while the tree
allocates it (evicting that tier), the tree begins its plan on the allocation, and a
:class:`CacheOperation` carries the plan's index lists to the controller's queue. Once the copy
has completed the tree finishes the plan (its nodes unlocked; a backup is archived to the
storage tier); an operation whose copy failed or never happens is undone: the tree aborts its
plan and what it allocated is freed. A load whose copies failed at issue leaves the tree at
once, before the copies enqueued ahead of the failure have run: what it allocated, and the host
copies it reads, stay held until they have.

- :class:`TreeOps` — one per controller: ``load_op`` (host → device, a tree match),
  ``write_op`` (device → host backup of nodes); ``fail_issued`` (a step's copies failed at
  issue), ``complete_step`` and ``complete`` (a copy finished or failed), ``cancel_queued``;
  ``abort`` and ``free``; ``undo_blocked``, the retry of failed operations whose undo waits (for a later operation, or a lock on data computed on them: retried too once
  the tree reports an unlock); ``load_of``, the operation that carries a tree load still in
  flight (how a match that reaches another request's load finds what to await). Loads of
  storage tail restores (``asynccache.prefetch``) and the staging writes of storage-only snapshots
  (``asynccache.snapshots``) have no tree plan: they are completed and undone here too, leaving
  the tree and the caller's pages alone (their host slots are freed by their owner once the
  operation is done).

Synchronous: call from the event-loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from asynccache.errors import TransferError, TreeError
from asynccache.ops import CacheOperation, OpKind, OpState
from asynccache.pools.base import ItemPool
from asynccache.stats import StatsRecorder
from asynccache.storage import PoolName, PoolTransfer

if TYPE_CHECKING:
    from asynccache.tree import HybridRadixTree
    from asynccache.tree.results import ReleasedIndices

__all__ = ["TreeOps"]

log = logging.getLogger("asynccache.controller")  # what befalls the controller's operations


def _slot_tensor(slot: int | None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64) if slot is None else torch.tensor([slot], dtype=torch.int64)


class TreeOps:
    """Makes the controller's operations from the tree's plans (allocating through the tree),
    completes them, and undoes them (freeing what they allocated). Queues and issues nothing:
    the controller does."""

    def __init__(
        self,
        tree: HybridRadixTree,
        pools: dict[PoolName, tuple[ItemPool, ItemPool | None]],
        stats: StatsRecorder,
    ) -> None:
        self.tree = tree
        self.pools = pools  # the controller's (device, host) pools, by name
        self._stats = stats
        #: failed ops whose undo waits for a later op that builds on them, or for a lock on data
        #: computed on them (see ``complete``)
        self._blocked: list[CacheOperation] = []
        #: a retry of the blocked undos is scheduled on the loop (see ``_on_release``)
        self._retry_scheduled = False
        #: plan id → the operation carrying that tree load, while the plan is in flight
        self._loads: dict[int, CacheOperation] = {}
        #: op id → (node, lock token, indices to free) of a load undone when its copies failed
        #: at issue: the hold of the copies enqueued before the failure, released once they ran
        self._landing: dict[int, tuple[Any, int, ReleasedIndices]] = {}

    def load_op(
        self, match: Any, *, priority: int, state_to: Sequence[int], loop: asyncio.AbstractEventLoop
    ) -> CacheOperation | None:
        """The load of a match that needs one (see ``HybridCacheController.load``); ``None``
        when the device has no room."""
        # Pin the match while allocating: eviction must not take the prefix we are loading.
        token = self.tree.lock(match.last_node)
        self.tree.lock_host(match.last_node)
        alloc = None
        try:
            alloc = self.tree.alloc_device(match.num_load_kv_pages, match.num_load_states)
            if alloc is None:
                self._stats.count("load_no_room")
                return None
            plan = self.tree.begin_load(match, alloc.kv_indices, alloc.state_slot)
        except BaseException:
            if alloc is not None:
                self.free(alloc.kv_indices, alloc.state_slots, device=True)
            raise
        finally:
            self.tree.unlock(match.last_node, token)
            self.tree.unlock_host(match.last_node)
        host_state, node_state = _slot_tensor(plan.host_state_slot), _slot_tensor(plan.device_state_slot)
        deferred: tuple[PoolTransfer, ...] = ()
        if state_to:
            # The forward reads the callers' slots: they get the state layer by layer; the node's
            # own slot (read from the next step on) gets it after the step's layers, in one copy.
            deferred = (PoolTransfer(pool_name=PoolName.MAMBA, host_indices=host_state, device_indices=node_state),)
            host_state = torch.tensor([plan.host_state_slot] * len(state_to), dtype=torch.int64)
            node_state = torch.tensor([int(s) for s in state_to], dtype=torch.int64)
        op = CacheOperation(
            OpKind.LOAD,
            (
                PoolTransfer(
                    pool_name=PoolName.KV, host_indices=plan.host_kv_indices, device_indices=plan.device_kv_indices
                ),
                PoolTransfer(pool_name=PoolName.MAMBA, host_indices=host_state, device_indices=node_state),
            ),
            plan=plan,
            priority=priority,
            loop=loop,
            deferred=deferred,
        )
        self._loads[plan.plan_id] = op  # found from the plan by a match its load writes into
        return op

    def write_op(
        self, nodes: Sequence[Any], *, priority: int, loop: asyncio.AbstractEventLoop
    ) -> CacheOperation | None:
        """The device → host backup of ``nodes``; ``None`` when the host has no room."""
        self.tree.check_alive(nodes)
        num_pages, num_states = self.tree.backup_pages_needed(nodes)
        # Pin the nodes on both tiers while making room: host eviction must neither delete them
        # nor drop the host copies of their ancestors (host copies stay contiguous).
        tokens: list[int] = []
        for node in nodes:
            tokens.append(self.tree.lock(node))
            self.tree.lock_host(node)
        alloc = None
        try:
            alloc = self.tree.alloc_host(num_pages, num_states)
            if alloc is None:
                self._stats.count("write_no_room")
                return None
            plan = self.tree.begin_backup(nodes, alloc.kv_indices, alloc.state_slots)
        except BaseException:
            if alloc is not None:
                self.free(alloc.kv_indices, alloc.state_slots, device=False)
            raise
        finally:
            for node, token in zip(nodes, tokens, strict=True):
                self.tree.unlock(node, token)
                self.tree.unlock_host(node)
        return CacheOperation(
            OpKind.WRITE,
            (
                PoolTransfer(
                    pool_name=PoolName.KV, host_indices=plan.host_kv_indices, device_indices=plan.device_kv_indices
                ),
                PoolTransfer(
                    pool_name=PoolName.MAMBA, host_indices=plan.host_state_slots, device_indices=plan.device_state_slots
                ),
            ),
            plan=plan,
            priority=priority,
            loop=loop,
        )

    def fail_issued(self, ops: Sequence[CacheOperation]) -> None:
        """The copies of a step carrying ``ops`` failed at issue; the copies enqueued before the
        failure may still run until the step's event, after which :meth:`complete_step` hears.
        Undo their tree loads now, newest first, so that no match made meanwhile is offered
        pages or a state that never arrived (``pending_load`` and ``wait_loaded`` see the load
        gone, a new match loads the prefix afresh): each under a lock of its own on the load's
        last node — taken first on the device, a reader of the load, so its device pages and
        slot are retired rather than freed; on the host right after the undo, so its host
        sources stay pinned — which :meth:`complete` releases once the copies have run. A load the tree cannot undo yet
        (something built on it is in use) is undone at completion, as before."""
        for op in sorted(ops, key=lambda op: -op.op_id):
            plan = op.plan
            if op.kind is not OpKind.LOAD or plan is None or not plan.nodes or op.op_id in self._landing:
                continue
            node = plan.nodes[-1]  # the load's last node (a split keeps it the lower part)
            token = self.tree.lock(node)
            try:
                released = self.tree.abort_load(plan, drop_below=True)
            except TreeError:
                self.tree.unlock(node, token)
                continue
            # Pinned on the host right after the undo (nothing ran between: the load's own pin
            # held its sources until then), not before: the undo would take that pin for
            # someone else's use of a loaded node's host copy.
            self.tree.lock_host(node)
            # The lock just taken holds the pages and slot (retired): nothing is returned to free
            # (what would be is freed once the copies have run all the same).
            self._loads.pop(plan.plan_id, None)
            self._landing[op.op_id] = (node, token, released)

    def complete_step(self, ops: Sequence[CacheOperation], error: BaseException | None, *, tiering: Any) -> None:
        """The copies of one issued step have run (``error`` None) or failed: :meth:`complete`
        each of ``ops`` — a failed step newest first (by submission, not by the priority order
        it was issued in: a later op's nodes may hang below an earlier op's). Every op resolves,
        also when completing one raises (it fails with a :class:`TransferError`)."""
        for op in ops if error is None else sorted(ops, key=lambda op: -op.op_id):
            try:
                self.complete(op, error, tiering=tiering)
            except Exception as e:  # noqa: BLE001 - every op of the step must still resolve
                log.error("completing %r raised: %s", op, e)
                op.state = OpState.FAILED
                if not op.future.done():
                    op.future.set_exception(TransferError(f"{op!r} could not be completed: {e}"))
                    op.future.exception()  # retrieved: a failed op nobody awaits is no error

    def complete(self, op: CacheOperation, error: BaseException | None, *, tiering: Any) -> None:
        """``op``'s copy has completed (``error`` None: the tree finishes its plan, a backup is
        handed to ``tiering`` for archiving) or failed (the plan is undone; one undone at issue,
        :meth:`fail_issued`, releases the hold of its copies); its waiter hears."""
        if error is None:
            if op.kind is OpKind.LOAD:
                if op.plan is not None:  # None: a tail restore (see load_tail), not a tree load
                    self.tree.finish_load(op.plan)
                    self._loads.pop(op.plan.plan_id, None)
            elif op.plan is not None:  # None: a snapshot's staging (see archive_snapshots)
                self.tree.finish_backup(op.plan)
                if tiering is not None:
                    tiering.on_host_write(op.plan)
            op.state = OpState.DONE
            if op.issued_at is not None:
                self._stats.latency(op.kind.value, time.perf_counter() - op.issued_at)
            if not op.future.done():
                op.future.set_result(None)
            self.undo_blocked()
            return
        landing = self._landing.pop(op.op_id, None)
        if landing is not None:
            # Undone at issue: its copies have run, so what no other lock holds returns to the
            # pools now.
            node, token, released = landing
            try:
                self.tree.unlock_host(node)
            finally:
                self.tree.unlock(node, token)
                self.free(released.kv_indices, released.state_slots, device=True)
            self.undo_blocked()
        else:
            try:
                self.abort(op, failed=True)
            except TreeError as e:
                # A later op still in flight builds on this one (a backup of a child, a load
                # below), or data computed on it is locked: undone once that op has completed or
                # been undone, or that lock released. Its waiter hears now.
                log.warning("the undo of the failed %r waits for a later operation or a lock: %s", op, e)
                self._blocked.append(op)
                self.tree.release_hook = self._on_release
            else:
                self.undo_blocked()
        op.state = OpState.FAILED
        self._stats.count(f"{op.kind.value}_failed")
        if not op.future.done():
            op.future.set_exception(TransferError(f"{op!r} failed: {error}"))
            op.future.exception()  # mark retrieved: a failed op nobody awaits is not an error

    def undo_blocked(self) -> bool:
        """Undo the failed ops that waited for later ones or for locks, newest first, as far as
        the tree now allows (the copies of one failed step are completed in submission order: a
        head's undo would otherwise meet the data its tail's copy still holds below it). True if
        any was undone. Runs after every completion and cancel, soon after a tree unlock while
        any waits (``_on_release``), and before the controller hands out a match's loads."""
        if not self._blocked:
            return False
        undone, progress = False, True
        while progress and self._blocked:
            progress = False
            for op in sorted(self._blocked, key=lambda op: -op.op_id):
                try:
                    self.abort(op, failed=True)
                except TreeError:
                    continue
                self._blocked.remove(op)
                progress = undone = True
        if not self._blocked and self.tree.release_hook == self._on_release:
            self.tree.release_hook = None  # nothing waits: unlocks cost nothing again
        return undone

    def _on_release(self) -> None:
        """The tree's ``release_hook`` while an undo waits: a lock was released, so the undo may
        go through now. Retried from the loop, not here: the unlocking caller may be in the
        middle of its own change to the tree (``load_op`` unlocks a match it just loaded)."""
        if self._retry_scheduled or not self._blocked:
            return
        loop = self._blocked[0].future.get_loop()
        if loop.is_closed():  # the controller is gone: nothing retries any more
            return
        self._retry_scheduled = True
        loop.call_soon(self._retry)

    def _retry(self) -> None:
        self._retry_scheduled = False
        self.undo_blocked()

    def load_of(self, plan: Any) -> CacheOperation | None:
        """The operation carrying tree load ``plan``, while the plan is in flight (also a failed
        one whose undo waits); ``None`` for a plan this controller did not make or that ended."""
        return self._loads.get(plan.plan_id)

    @property
    def num_blocked(self) -> int:
        """Failed operations whose undo still waits for a later one."""
        return len(self._blocked)

    def cancel_queued(self, op: CacheOperation) -> None:
        """Undo a queued ``op`` and cancel its future (nothing for an op no longer queued).
        Raises :class:`TreeError` (op untouched) when a later queued op builds on it."""
        if op.state is not OpState.QUEUED:
            return
        self.abort(op)
        op.state = OpState.CANCELLED
        self._stats.count(f"{op.kind.value}_cancelled")
        op.future.cancel()
        self.undo_blocked()

    def free(self, kv: torch.Tensor, slots: torch.Tensor, *, device: bool) -> None:
        """Return KV pages and state slots to the device pools (``device``) or the host pools."""
        tier = 0 if device else 1
        kv_pool, state_pool = self.pools[PoolName.KV][tier], self.pools[PoolName.MAMBA][tier]
        if kv.numel():
            assert kv_pool is not None
            kv_pool.free(kv)
        if slots.numel():
            assert state_pool is not None
            state_pool.free(slots)

    def abort(self, op: CacheOperation, *, failed: bool = False) -> None:
        """Undo a plan whose copy will never (or did not fully) happen; free what it allocated.
        ``failed``: the copy failed, so device data inserted below a load goes too (a queued
        load that data builds on is not cancelled: it completes instead).

        Only called when no copy into the plan's destination is in flight (before issue, or
        after a failed copy's stream position has completed)."""
        if op.plan is None:  # a tail restore or a snapshot's staging: freed by their owner
            return
        if op.kind is OpKind.LOAD:
            released = self.tree.abort_load(op.plan, drop_below=failed)
            self._loads.pop(op.plan.plan_id, None)
            self.free(released.kv_indices, released.state_slots, device=True)
        else:
            released = self.tree.abort_backup(op.plan)
            self.free(released.kv_indices, released.state_slots, device=False)
