"""HybridCacheController: the only asyncio orchestrator of the cache.

The tree decides what moves; the controller moves it without blocking the event loop:

- ``load(match)`` allocates device pages / a state slot (evicting device memory through the tree),
  attaches them to the match's host-only nodes (``tree.begin_load``) and queues the copy. The
  next ``start_loading()`` merges every queued load into one transfer per pool, validates and
  plans it once per pool (a ``kernels.PoolPair`` per pool, whose checks of the pools are made
  at the first load; its ``layer_copier``) and enqueues **one launch per layer** on the
  load stream, in layer order — consecutive small layers of one pool (a few recurrent layers'
  states) as one launch — setting the step's :class:`LayerTransferCounter` layer by layer; the
  forward ``await``s each layer.
- ``write(nodes)`` allocates host pages / slots (evicting host memory through the tree) and
  queues a device → host backup; ``start_writing()`` issues every queued write as **one launch
  for all layers** per pool on the write stream, after waiting on the compute stream.
- Completion is bridged from CUDA events to asyncio futures (``asynccache.completion``); only
  then are nodes unlocked (``finish_load`` / ``finish_backup``) and, for backups, archived to
  the storage tier in the background (``asynccache.tiering``).

Background work lives in one ``TaskGroup``: use ``async with HybridCacheController(...)``.
Without CUDA the same code runs on CPU tensors: copies are synchronous, events complete at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asynccache.completion import CompletionQueue, drop_done
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError, TransferError, TreeError
from asynccache.layer_counter import LayerTransferCounter
from asynccache.ops import CacheOperation, MergedTransfer, OpKind, OpState
from asynccache.pools.base import ItemPool
from asynccache.stats import ControllerStats, StatsRecorder
from asynccache.storage import PoolName, PoolTransfer, StorageBackend
from asynccache.streams import (
    CudaEventLike,
    current_device,
    current_stream,
    make_wait,
    order_after,
    record_on,
)
from asynccache.tree.node import Tier
from kernels import LayerCopy, PoolPair, copy_items

if TYPE_CHECKING:
    from asynccache.tree import HybridRadixTree

__all__ = ["HybridCacheController"]

#: Host time a step's load may spend on the loop thread (in ``start_loading``, before the forward
#: starts) enqueueing layers in order; a worker thread takes the layers left when it runs out.
#: Copies that are cheap to issue (a cached per-layer plan of a few strided memcpys: tens of
#: microseconds a layer) are then all enqueued before the forward, and no thread contends with
#: the forward — CPU-bound at small chunks — for the GIL. Costly ones (thousands of scattered
#: pages per layer) start on the loop and continue on the worker, running ahead of the forward.
LOAD_ENQUEUE_BUDGET_S = 0.002
#: Consecutive layers of one pool are loaded as one copy (one call, one CUDA event) while their
#: bytes stay within this: ~0.15 ms of PCIe Gen5 — the states of a few recurrent layers of one
#: request between two attention layers — so a group costs its first layer little latency and
#: halves the host time of issuing a hybrid model's load.
LOAD_GROUP_MAX_BYTES = 8 << 20
#: Such a group rides with the step before it — one event and one wait of the forward fewer —
#: when that step copies another pool and at least this many times the group's bytes (the
#: states after an attention layer ride with its KV, delaying that layer by ~0.1 ms of copy).
LOAD_RIDE_RATIO = 8

log = logging.getLogger(__name__)


def _release_late_tail(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        tail = getattr(task.result(), "tail", None)
        if tail is not None:
            tail.release()


#: A step's copy: (pool, copier, first local layer, number of layers).
_StepCopy = tuple[PoolName, "LayerCopy", int, int]
#: One step of a load: the global layer ids it makes ready (one CUDA event), and its copies.
_LoadStep = tuple[list[int], list[_StepCopy]]
#: A step as :func:`_group_layers` plans it: the layer ids, and (pool, first local layer, layers).
_StepPlan = tuple[list[int], list[tuple[PoolName, int, int]]]


def _group_layers(layer_ids: Sequence[int], pools: dict[PoolName, tuple[dict[int, int], int]]) -> list[_StepPlan]:
    """The load's steps in layer order. Consecutive layers of one pool whose local positions
    follow on are grouped — one call and one event for the group — while the group's bytes stay
    within ``LOAD_GROUP_MAX_BYTES``, so a group is ready a few tens of microseconds after its
    first layer could have been. A group then rides with the step before it (one event for
    both) when that step copies another pool and at least ``LOAD_RIDE_RATIO`` times the bytes:
    its layers are ready exactly when they were, and the step's own layers at most
    1/``LOAD_RIDE_RATIO`` later. ``pools[pool] = (global → local layer, bytes a layer)``."""
    steps: list[_StepPlan] = []
    sizes: list[int] = []  # bytes of each step
    for lid in layer_ids:
        copies = [(name, index[lid], 1) for name, (index, _) in pools.items() if lid in index]
        if len(copies) == 1 and steps:
            name, li, _ = copies[0]
            layer_bytes = pools[name][1]
            prev_lids, prev = steps[-1]
            if len(prev) == 1:
                p_name, p_first, p_count = prev[0]
                if p_name == name and p_first + p_count == li and sizes[-1] + layer_bytes <= LOAD_GROUP_MAX_BYTES:
                    prev[0] = (name, p_first, p_count + 1)
                    prev_lids.append(lid)
                    sizes[-1] += layer_bytes
                    continue
        steps.append(([lid], copies))
        sizes.append(sum(pools[name][1] for name, *_ in copies))
    ridden: list[_StepPlan] = []
    ridden_sizes: list[int] = []
    for (lids, copies), size in zip(steps, sizes, strict=True):
        if (
            ridden
            and len(copies) == 1
            and size <= LOAD_GROUP_MAX_BYTES
            and size * LOAD_RIDE_RATIO <= ridden_sizes[-1]
            and all(name is not copies[0][0] for name, *_ in ridden[-1][1])
        ):
            ridden[-1][0].extend(lids)
            ridden[-1][1].extend(copies)
            ridden_sizes[-1] += size
            continue
        ridden.append((lids, copies))
        ridden_sizes.append(size)
    return ridden


def _slot_tensor(slot: int | None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64) if slot is None else torch.tensor([slot], dtype=torch.int64)


class HybridCacheController:
    """Moves KV pages and Mamba states between device and host (and storage).

    Call from the event-loop thread only. ``load``/``write`` are synchronous (they only queue);
    ``start_loading``/``start_writing`` issue the queued copies once per scheduler step.
    """

    def __init__(
        self,
        tree: HybridRadixTree,
        *,
        device_kv: ItemPool,
        device_mamba: ItemPool,
        host_kv: ItemPool | None,
        host_mamba: ItemPool | None,
        config: HybridCacheConfig,
        backend: StorageBackend | None = None,
    ) -> None:
        self.tree = tree
        self.spec = tree.spec
        self.config = config
        self.backend = backend
        self.pools: dict[PoolName, tuple[ItemPool, ItemPool | None]] = {
            PoolName.KV: (device_kv, host_kv),
            PoolName.MAMBA: (device_mamba, host_mamba),
        }
        self.device = device_kv.device
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._load_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._write_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._load_queue: list[CacheOperation] = []
        self._write_queue: list[CacheOperation] = []
        self._load_completion = CompletionQueue("load")
        self._write_completion = CompletionQueue("write")
        self._stats = StatsRecorder()
        self._tg: asyncio.TaskGroup | None = None
        self._closing: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loaders: set[asyncio.Task[None]] = set()
        #: storage lookups in flight (each holds its match's node locked until it ends)
        self._prefetches: set[asyncio.Task[Any]] = set()
        #: The copy function of backups, and the copier factory of layer-by-layer loads,
        #: ``layer_copier(pair, host_indices, device_indices)`` (replaceable in tests to count
        #: calls or inject failures).
        self.copy: Callable[..., int] = copy_items
        self.layer_copier: Callable[[PoolPair, torch.Tensor, torch.Tensor], LayerCopy] = PoolPair.layer_copier
        self._load_pairs: dict[PoolName, PoolPair] = {}  # checked at the first load
        self._step_plans: dict[tuple[Any, ...], list[_StepPlan]] = {}  # _group_layers by load shape
        self._deferred_events: list[CudaEventLike] = []  # ordered before the next step's stream
        self.tiering: Any = None  # set in __aenter__ when a backend is configured

    # ---- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> HybridCacheController:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        if self._cuda:
            self._tasks = [
                self._tg.create_task(self._load_completion.run(), name="asynccache-load-completion"),
                self._tg.create_task(self._write_completion.run(), name="asynccache-write-completion"),
            ]
        if self.backend is not None:
            from asynccache.tiering import StorageTier

            self.tiering = StorageTier(self, self.backend, self._tg)
            try:  # registering may start the backend's reader processes: a failed entry stops them
                await self.tiering.register()
            except BaseException:
                await self.aclose()
                raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel queued operations, finish in-flight copies and backups, then stop background
        tasks and close the backend. Idempotent; concurrent calls wait for the first."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        if self._tg is None:
            return
        self._closing = asyncio.get_running_loop().create_future()
        try:
            # Newest first: a queued operation may hang below an older one in the tree. One
            # that others build on cannot be cancelled: it is issued and completes instead.
            for op in reversed(self._load_queue + self._write_queue):
                self.cancel(op)
            if self._load_queue:
                self.start_loading()
            if self._write_queue:
                self.start_writing()
            if self._loaders:
                await asyncio.gather(*self._loaders, return_exceptions=True)
            await self._load_completion.drain()
            await self._write_completion.drain()
            if self.tiering is not None:
                await self.tiering.drain()
        finally:
            for t in self._tasks:
                t.cancel()
            tg, self._tg = self._tg, None
            try:
                await tg.__aexit__(None, None, None)
            finally:
                if self.backend is not None:
                    await self.backend.aclose()
                self._closing.set_result(None)

    def _require_started(self) -> asyncio.TaskGroup:
        if self._tg is None:
            raise RuntimeError("use the controller as `async with HybridCacheController(...)`")
        return self._tg

    # ---- loads (host → device) ---------------------------------------------------------
    def load(self, match: Any, *, priority: int = 0, state_to: Sequence[int] = ()) -> CacheOperation | None:
        """Queue the host → device load a match needs; ``None`` when the device has no room.

        ``state_to``: device state slots of the caller (a request's working slot) that receive the
        boundary state too: they get it layer by layer with the step's loads, so the forward need
        not seed them, and the node's own slot gets it after the step's last layer, all layers
        in one copy (ready for the forwards of later steps: the next :meth:`start_loading` orders
        the caller's stream after it; ``await op`` covers it too). Only for a match whose state
        is on the host only (``ValueError`` otherwise). The slots stay the caller's: a failed or
        cancelled load never frees them. A match that needs nothing returns an already
        completed operation.
        """
        self._require_started()  # a load queued after close would never be issued
        loop = asyncio.get_running_loop()
        if state_to and (not match.needs_load or match.state_tier is not Tier.HOST):
            raise ValueError("state_to needs a match whose boundary state is loaded from the host")
        if not match.needs_load:
            op = CacheOperation(OpKind.LOAD, (), plan=None, priority=priority, loop=loop)
            op.state = OpState.DONE
            op.future.set_result(None)
            return op
        # Pin the match while allocating: eviction must not take the prefix we are loading.
        self.tree.lock(match.last_node)
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
                self._free(alloc.kv_indices, alloc.state_slots, device=True)
            raise
        finally:
            self.tree.unlock(match.last_node)
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
        self._load_queue.append(op)
        return op

    def start_loading(self) -> LayerTransferCounter:
        """Issue every queued load (merged per pool, one launch per layer) for this step.

        Returns the step's counter once the first layers are enqueued (here, on the loop thread,
        within ``LOAD_ENQUEUE_BUDGET_S`` of host time, so the copy engines start before the
        forward does); a worker thread enqueues the layers left in order, running ahead of the
        forward, and the counter is set layer by layer. The caller's current stream is first
        ordered after the deferred copies of earlier steps (``load(state_to=)``): what a step's
        forward may read is ready for it, whether or not its own counter waits.
        """
        tg = self._require_started()
        if self._deferred_events:
            handle = current_stream(self.device.index)[1]
            for event in self._deferred_events:
                make_wait(handle, event)
            self._deferred_events.clear()
        ops = [op for op in self._load_queue if op.state is OpState.QUEUED]
        self._load_queue.clear()
        if not ops:
            return LayerTransferCounter.completed()
        ops.sort(key=lambda op: -op.priority)
        merged = CacheOperation.merge_ops(ops)
        deferred = CacheOperation.merge_ops(ops, deferred=True)
        layer_ids = sorted({lid for name in merged for lid in self.pools[name][0].layer_ids})
        counter = LayerTransferCounter(layer_ids)
        for op in ops:
            op.state = OpState.ISSUED
            op.issued_at = time.perf_counter()
        self._stats.queue_depth("load", len(ops))
        # _enqueue_loads enqueues the first layers before it returns the coroutine the task runs.
        coro = self._enqueue_loads(ops, merged, deferred, layer_ids, counter)
        task = tg.create_task(coro, name="asynccache-load")
        self._loaders.add(task)
        task.add_done_callback(self._loaders.discard)
        return counter

    def _enqueue_loads(
        self,
        ops: list[CacheOperation],
        merged: dict[PoolName, MergedTransfer],
        deferred: dict[PoolName, MergedTransfer],
        layer_ids: Sequence[int],
        counter: LayerTransferCounter,
    ) -> Coroutine[Any, Any, None]:
        """Enqueue the step's loads layer by layer: now, on the loop thread, while the host time
        spent stays within ``LOAD_ENQUEUE_BUDGET_S`` (at least one layer), then the rest from a
        worker thread started now. The returned coroutine waits for the worker and completes the
        operations.

        Issuing a layer's copies costs host time (planning, driver calls that release the GIL);
        doing it on the loop thread in lock-step with the forward would leave the GPU idle
        between layers. The worker runs ahead of the forward, enqueuing every layer back to back
        on the load stream, and marks each layer on the loop as soon as it is enqueued. The
        worker is never abandoned: a cancelled caller still waits for it, so no copy is enqueued
        into memory that a failure path has already freed.

        The ``deferred`` copies (all layers at once) follow the last layer's: after its event
        when the loop thread issues them (the next ``start_loading`` orders the caller's stream
        after theirs), before it when the worker does.
        """
        loop = asyncio.get_running_loop()
        stream = self._load_stream
        issued: dict[PoolName, list[int]] = {name: [0, 0] for name in [*merged, *deferred]}  # bytes, launches
        last: list[CudaEventLike | None] = [None]  # the event after the latest step
        handle = None if stream is None else stream.cuda_stream
        steps: list[_LoadStep] = []
        after: list[_StepCopy] = []

        def copier(name: PoolName, m: MergedTransfer) -> LayerCopy:
            dev, host = self.pools[name]
            assert host is not None
            return self.layer_copier(self._pair(name, host, dev), m.host_indices, m.device_indices)

        def plan() -> None:
            """Validate each pool's transfer once (and plan it on the copy engines): one copier
            per pool; then the steps, each a layer or a group of layers (``_group_layers``)."""
            copiers = {name: copier(name, m) for name, m in merged.items()}
            for lids, copies in self._step_plan(layer_ids, merged):
                steps.append((lids, [(name, copiers[name], li, count) for name, li, count in copies]))
            after.extend((name, copier(name, m), 0, self.pools[name][0].num_layers) for name, m in deferred.items())

        def issue_step(copies: list[_StepCopy]) -> None:
            for name, copy, li, count in copies:
                total = issued[name]
                total[0] += copy(li, count)
                total[1] += 1
            if handle is not None:
                last[0] = record_on(handle)

        def on_device() -> contextlib.AbstractContextManager[Any]:
            """The load's device made current for the runtime calls, unless it already is."""
            if stream is None or current_device() == self.device.index:
                return contextlib.nullcontext()
            return torch.cuda.device(self.device)

        def issue(begin: int, *, yield_gil: bool, budget_s: float | None = None) -> int:
            """Enqueue ``steps[begin:]`` in order; returns where it stopped (early once
            ``budget_s`` of host time is spent, after at least one layer)."""
            start = time.perf_counter()
            with on_device():
                for k in range(begin, len(steps)):
                    if budget_s is not None and k > begin and time.perf_counter() - start > budget_s:
                        return k
                    lids, copies = steps[k]
                    issue_step(copies)
                    if yield_gil:
                        for lid in lids:
                            loop.call_soon_threadsafe(counter.mark_enqueued, lid, last[0])
                        time.sleep(0)  # let the loop thread take the GIL between steps
                    else:
                        for lid in lids:
                            counter.mark_enqueued(lid, last[0])
            return len(steps)

        # The first layers are enqueued here, on the loop thread: the forward waits for them at
        # once, and a worker handoff would only add its latency. The worker takes what the budget
        # leaves — nothing when nothing is copied (accounting-mode pools).
        accounting = all(self.pools[name][0].buffer is None for name in merged)
        worker: asyncio.Future[Any]
        try:
            if stream is not None:
                with on_device():
                    # Freshly allocated device pages may still be read by earlier compute.
                    order_after(stream.cuda_stream, current_stream(self.device.index)[1])
            plan()
            done = issue(0, yield_gil=False, budget_s=None if accounting else LOAD_ENQUEUE_BUDGET_S)
            if done == len(steps):
                if after:
                    with on_device():
                        issue_step(after)
                    if last[0] is not None:
                        self._deferred_events.append(last[0])
                worker = loop.create_future()
                worker.set_result(None)
            else:
                steps[-1][1].extend(after)  # the worker's last step carries them
                worker = loop.run_in_executor(None, functools.partial(issue, done, yield_gil=True))
        except Exception as e:
            worker = loop.create_future()
            worker.set_exception(e)
        return self._complete_loads(ops, (merged, deferred), counter, worker, issued, last)

    def _step_plan(self, layer_ids: Sequence[int], merged: dict[PoolName, MergedTransfer]) -> list[_StepPlan]:
        """:func:`_group_layers` for a load of this shape (which pools, how many items each),
        kept: a step's plan depends on nothing else."""
        key = (tuple(layer_ids), tuple((name, m.host_indices.numel()) for name, m in merged.items()))
        plan = self._step_plans.get(key)
        if plan is None:
            pools = {
                name: (self.pools[name][0]._layer_index, m.host_indices.numel() * self.pools[name][0].item_bytes)
                for name, m in merged.items()
            }
            if len(self._step_plans) >= 256:
                self._step_plans.clear()
            plan = self._step_plans[key] = _group_layers(layer_ids, pools)
        return plan

    def _pair(self, key: PoolName, src: ItemPool, dst: ItemPool) -> PoolPair:
        """The :class:`PoolPair` of a pool's loads (host → device; its checks made at the first
        load)."""
        pair = self._load_pairs.get(key)
        if pair is None:
            pair = self._load_pairs[key] = PoolPair(
                src, dst, max_ctas=self.config.max_ctas, stream=self._load_stream, method=self.config.copy_method
            )
        return pair

    async def _complete_loads(
        self,
        ops: list[CacheOperation],
        merged: object,
        counter: LayerTransferCounter,
        worker: asyncio.Future[Any],
        issued: dict[PoolName, list[int]],
        last: list[CudaEventLike | None],
    ) -> None:
        """Wait for the load worker (never abandoning it), then account and complete ``ops``."""
        error: BaseException | None = None
        try:
            await asyncio.shield(worker)
        except asyncio.CancelledError as e:
            error = e
            with contextlib.suppress(Exception):
                await worker  # let the worker finish enqueuing before anything is released
        except Exception as e:
            error = e
        for name, (nbytes, launches) in issued.items():
            self._stats.bytes_moved("h2d", name, nbytes)
            self._stats.count(f"h2d_launches_{name.value}", launches)
        if error is not None:
            counter.fail(error)
            self._finish_ops(ops, merged, last[0], self._load_completion, error=error)
            if isinstance(error, Exception):
                log.warning("load of %d operation(s) failed: %s", len(ops), error)
                return
            raise error
        self._stats.count("load_ops", len(ops))
        self._finish_ops(ops, merged, last[0], self._load_completion, error=None)

    # ---- writes (device → host) --------------------------------------------------------
    def write(self, nodes: Sequence[Any], *, priority: int = 0) -> CacheOperation | None:
        """Queue a device → host backup of ``nodes``; ``None`` when the host has no room."""
        self._require_started()  # a backup queued after close would never be issued
        loop = asyncio.get_running_loop()
        self.tree.check_alive(nodes)
        num_pages, num_states = self.tree.backup_pages_needed(nodes)
        # Pin the nodes on both tiers while making room: host eviction must neither delete them
        # nor drop the host copies of their ancestors (host copies stay contiguous).
        for node in nodes:
            self.tree.lock(node)
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
                self._free(alloc.kv_indices, alloc.state_slots, device=False)
            raise
        finally:
            for node in nodes:
                self.tree.unlock(node)
                self.tree.unlock_host(node)
        op = CacheOperation(
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
        self._write_queue.append(op)
        return op

    def start_writing(self) -> int:
        """Issue every queued write: one launch for all layers per pool. Returns ops issued."""
        self._require_started()
        ops = [op for op in self._write_queue if op.state is OpState.QUEUED]
        self._write_queue.clear()
        if not ops:
            return 0
        merged = CacheOperation.merge_ops(ops)
        for op in ops:
            op.state = OpState.ISSUED
            op.issued_at = time.perf_counter()
        self._stats.queue_depth("write", len(ops))
        stream = self._write_stream
        event: torch.cuda.Event | None = None
        try:
            if stream is not None:
                # D2H copies read what the compute stream wrote.
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for name, m in merged.items():
                    dev, host = self.pools[name]
                    assert host is not None
                    nbytes = self.copy(
                        dev,
                        host,
                        m.device_indices,
                        m.host_indices,
                        max_ctas=self.config.max_ctas,
                        stream=stream,
                        method=self.config.copy_method,
                    )
                    self._stats.bytes_moved("d2h", name, nbytes)
                    self._stats.count(f"d2h_launches_{name.value}")
                if stream is not None:
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
        except Exception as e:
            if stream is not None:
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
            self._finish_ops(ops, merged, event, self._write_completion, error=e)
            log.warning("write of %d operation(s) failed: %s", len(ops), e)
            return len(ops)
        self._stats.count("write_ops", len(ops))
        self._finish_ops(ops, merged, event, self._write_completion, error=None)
        return len(ops)

    async def wait_idle(self) -> bool:
        """Wait until no copy and no storage lookup is in flight; True if anything was (memory
        may have been freed, and nodes a lookup held locked may be evictable again)."""
        busy = False
        while self._loaders or self._prefetches or self._load_completion.depth or self._write_completion.depth:
            busy = True
            for tasks in (self._loaders, self._prefetches):
                drop_done(tasks)  # a finished one leaves by its callback a loop pass later
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            await self._load_completion.wait_idle()
            await self._write_completion.wait_idle()
        return busy

    # ---- storage tier ------------------------------------------------------------------
    def prefetch(
        self, tokens: Sequence[int], match: Any, *, salt: str = "", allow_tail: bool = False
    ) -> asyncio.Task[Any] | None:
        """Start fetching from storage what ``tokens`` miss past ``match``; None without a backend
        or when ``match`` already covers every full page of ``tokens``.

        The prefetch runs in the controller's TaskGroup; wait for it with :meth:`wait_prefetch`,
        which stops waiting at the prefetch policy's deadline but never cancels the fetch (its
        data still lands on host for later requests). ``allow_tail``: the caller takes a
        :class:`~asynccache.tiering.TailRestore` in the result (and releases it, also when it
        stopped waiting: see :meth:`wait_prefetch`).
        """
        tg = self._require_started()
        if self.tiering is None or len(match.page_hashes) * self.spec.page_size <= match.num_tokens:
            return None
        # The match's node must outlive the fetch: the task starts later, and storage lookups
        # take a while, during which other requests evict.
        node = match.last_node
        self.tree.lock(node)
        self.tree.lock_host(node)

        def unlock(_: asyncio.Task[Any]) -> None:
            self.tree.unlock(node)
            self.tree.unlock_host(node)

        task = tg.create_task(
            self.tiering.prefetch(tokens, match, salt=salt, allow_tail=allow_tail), name="asynccache-prefetch"
        )
        task.add_done_callback(unlock)
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)
        return task

    def load_tail(self, tail: Any, device_pages: torch.Tensor, state_slots: torch.Tensor) -> CacheOperation:
        """Queue the load of a landed :class:`~asynccache.tiering.TailRestore` into
        ``device_pages`` (one per tail page, in order) and each of ``state_slots`` (the tail's end
        state), for the next :meth:`start_loading`: it is copied layer by layer with the step's
        other loads, so the forward computes layer ``l`` while later layers are still copied.

        The controller takes the tail over and releases it once the copy has finished (or, if
        cancelled or failed, once no copy from it is in flight). The device pages and slots stay
        the caller's. Raises :class:`ConfigError` for page or slot lists that do not fit the tail
        (before queueing: a bad list would fail the whole step's merged copy).
        """
        self._require_started()
        for what, t, n in (("device_pages", device_pages, tail.host_kv.numel()), ("state_slots", state_slots, None)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                raise ConfigError(f"load_tail: {what} must be a 1-D int64 tensor")
            if (n is not None and t.numel() != n) or (n is None and t.numel() < 1):
                raise ConfigError(f"load_tail: {what} holds {t.numel()} indices, the tail needs {n or 'at least 1'}")
        loop = asyncio.get_running_loop()
        op = CacheOperation(
            OpKind.LOAD,
            (
                PoolTransfer(pool_name=PoolName.KV, host_indices=tail.host_kv, device_indices=device_pages),
                PoolTransfer(
                    pool_name=PoolName.MAMBA,
                    host_indices=tail.host_slot.repeat(state_slots.numel()),
                    device_indices=state_slots,
                ),
            ),
            plan=None,
            loop=loop,
        )
        op.future.add_done_callback(lambda _: tail.release())
        self._load_queue.append(op)
        return op

    async def wait_prefetch(self, task: asyncio.Task[Any], num_tokens: int) -> Any | None:
        """The prefetch's result if it finished within the policy's deadline, else None."""
        timeout = self.config.prefetch_timeout_s(num_tokens)
        try:
            if timeout == 0.0 and not task.done():
                await asyncio.sleep(0)
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            # The waiter is gone (its request was cancelled): nobody takes a split restore.
            task.add_done_callback(_release_late_tail)
            raise
        if task not in done:
            self._stats.count("prefetch_deadline_passed")
            # Nobody takes a split restore that arrives after the deadline: release it then.
            task.add_done_callback(_release_late_tail)
            return None
        return task.result()

    # ---- completion, cancellation ------------------------------------------------------
    def _finish_ops(
        self,
        ops: list[CacheOperation],
        merged: object,
        event: CudaEventLike | None,
        completion: CompletionQueue,
        *,
        error: BaseException | None,
    ) -> None:
        # `merged` (the merged transfers) is captured so its index tensors live until the copy
        # has completed.
        def done() -> None:
            del_merged = merged  # noqa: F841 - keeps the index tensors alive until here
            # A failed step is undone newest first: a later op's nodes may hang below an
            # earlier op's.
            for op in ops if error is None else reversed(ops):
                self._complete(op, error)

        completion.submit(event, done)

    def _complete(self, op: CacheOperation, error: BaseException | None) -> None:
        if error is None:
            if op.kind is OpKind.LOAD:
                if op.plan is not None:  # None: a tail restore (see load_tail), not a tree load
                    self.tree.finish_load(op.plan)
            else:
                self.tree.finish_backup(op.plan)
                if self.tiering is not None:
                    self.tiering.on_host_write(op.plan)
            op.state = OpState.DONE
            if op.issued_at is not None:
                self._stats.latency(op.kind.value, time.perf_counter() - op.issued_at)
            if not op.future.done():
                op.future.set_result(None)
            return
        try:
            self._abort(op, failed=True)
        except TreeError as e:  # never leave the op unresolved: its waiter must hear of it
            log.error("could not undo the failed %r: %s", op, e)
        op.state = OpState.FAILED
        self._stats.count(f"{op.kind.value}_failed")
        if not op.future.done():
            op.future.set_exception(TransferError(f"{op!r} failed: {error}"))
            op.future.exception()  # mark retrieved: a failed op nobody awaits is not an error

    def _free(self, kv: torch.Tensor, slots: torch.Tensor, *, device: bool) -> None:
        tier = 0 if device else 1
        kv_pool, state_pool = self.pools[PoolName.KV][tier], self.pools[PoolName.MAMBA][tier]
        if kv.numel():
            assert kv_pool is not None
            kv_pool.free(kv)
        if slots.numel():
            assert state_pool is not None
            state_pool.free(slots)

    def _abort(self, op: CacheOperation, *, failed: bool = False) -> None:
        """Undo a plan whose copy will never (or did not fully) happen; free what it allocated.
        ``failed``: the copy failed, so device data inserted below a load goes too (a queued
        load that data builds on is not cancelled: it completes instead).

        Only called when no copy into the plan's destination is in flight (before issue, or
        after a failed copy's stream position has completed)."""
        if op.kind is OpKind.LOAD:
            if op.plan is None:  # a tail restore: its pages and slots are the caller's
                return
            released = self.tree.abort_load(op.plan, drop_below=failed)
            self._free(released.kv_indices, released.state_slots, device=True)
        else:
            released = self.tree.abort_backup(op.plan)
            self._free(released.kv_indices, released.state_slots, device=False)

    def write_back(self, nodes: Sequence[Any]) -> bool:
        """The tree's write-back callback (``write_back`` policy): back ``nodes`` up now."""
        op = self.write(nodes, priority=1)
        if op is None:
            return False
        self.start_writing()
        return True

    def _cancel_queued(self, op: CacheOperation) -> None:
        if op.state is not OpState.QUEUED:
            return
        self._abort(op)
        op.state = OpState.CANCELLED
        self._stats.count(f"{op.kind.value}_cancelled")
        op.future.cancel()

    def cancel(self, op: CacheOperation) -> bool:
        """Cancel a queued operation (frees what it allocated, unlocks its nodes).

        ``False`` when it cannot be: an issued copy cannot be recalled, and a queued one that a
        later queued operation builds on (nodes inserted below its own) stays queued; either
        completes normally.
        """
        if op.state is not OpState.QUEUED:
            return False
        try:
            self._cancel_queued(op)
        except TreeError:
            return False
        queue = self._load_queue if op.kind is OpKind.LOAD else self._write_queue
        with contextlib.suppress(ValueError):
            queue.remove(op)
        return True

    # ---- introspection -----------------------------------------------------------------
    def statistics(self) -> ControllerStats:
        return self._stats.snapshot(
            load_queue=len(self._load_queue),
            write_queue=len(self._write_queue),
            load_in_flight=self._load_completion.depth,
            write_in_flight=self._write_completion.depth,
            completion=(self._load_completion, self._write_completion),
        )
