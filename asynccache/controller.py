"""HybridCacheController: the only asyncio orchestrator of the cache.

The tree decides what moves; the controller moves it without blocking the event loop:

- ``load(match)`` allocates device pages / a state slot (evicting device memory through the tree),
  attaches them to the match's host-only nodes (``tree.begin_load``) and queues the copy. The
  next ``start_loading()`` merges every queued load into one transfer per pool, validates and
  plans it once per pool (a ``kernels.PoolPair`` per pool, whose checks of the pools are made
  at the first load; its ``layer_copier``) and enqueues **one copy call per layer** (per pool) on the
  load stream, in layer order — consecutive small layers of one pool (a few recurrent layers'
  states) as one launch — setting the step's :class:`LayerTransferCounter` layer by layer; the
  forward ``await``s each layer.
- ``write(nodes)`` allocates host pages / slots (evicting host memory through the tree) and
  queues a device → host backup; ``start_writing()`` issues every queued write as **one launch
  for all layers** per pool on the write stream, after waiting on the compute stream.
- Completion is bridged from CUDA events to asyncio futures (``asynccache.completion``); only
  then are nodes unlocked (``finish_load`` / ``finish_backup``) and, for backups, archived to
  the storage tier in the background (``asynccache.tiering``). A load whose copy failed at
  issue leaves the tree at once, its memory held until then (``TreeOps.fail_issued``).

Background work lives in one ``TaskGroup``: use ``async with HybridCacheController(...)``.
Without CUDA the same code runs on CPU tensors: copies are synchronous, events complete at once.

The controller holds the queues, the copy streams, the completion queues and the ``TaskGroup``,
and is the API; its parts are ``asynccache.controller_lifecycle`` (entering, ``wait_idle``,
``aclose``), ``asynccache.tree_ops`` (operations made from the tree's plans,
completed, undone), ``asynccache.copy_issue`` (a step's copies issued on the streams),
``asynccache.load_steps`` (a load's layers grouped into steps), ``asynccache.load_wait``
(``wait_loaded``: a match waits for the loads in flight into its prefix, another request's
included), and ``asynccache.controller_storage`` (its storage-tier API: ``prefetch`` and its waits,
``load_tail``, ``archive_snapshots``, over ``asynccache.prefetch``, ``asynccache.tiering`` and
``asynccache.snapshots``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asynccache.completion import CompletionQueue
from asynccache.config import HybridCacheConfig
from asynccache.controller_lifecycle import ControllerLifecycleMixin
from asynccache.controller_storage import StorageTierMixin
from asynccache.copy_issue import LoadIssuer, WriteIssuer
from asynccache.errors import ConfigError, TreeError
from asynccache.layer_counter import LayerTransferCounter
from asynccache.load_wait import LoadWaitMixin
from asynccache.ops import CacheOperation, OpKind, OpState
from asynccache.pools.base import ItemPool
from asynccache.prefetch import Prefetcher
from asynccache.stats import ControllerStats, StatsRecorder
from asynccache.storage import PoolName, StorageBackend
from asynccache.streams import CudaEventLike
from asynccache.tree.node import Tier
from asynccache.tree.results import MatchResult
from asynccache.tree_ops import TreeOps
from kernels import LayerCopy, PoolPair, copy_items

if TYPE_CHECKING:
    from asynccache.tree import HybridRadixTree

__all__ = ["HybridCacheController"]


class HybridCacheController(ControllerLifecycleMixin, LoadWaitMixin, StorageTierMixin):
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
        self._ops = TreeOps(tree, self.pools, self._stats)
        self._loads = LoadIssuer(
            self.pools,
            failed_at_issue=self._ops.fail_issued,
            device=self.device,
            stream=self._load_stream,
            config=config,
            stats=self._stats,
            finish=functools.partial(self._finish_ops, completion=self._load_completion),
        )
        self._writes = WriteIssuer(
            self.pools,
            device=self.device,
            stream=self._write_stream,
            config=config,
            stats=self._stats,
            finish=functools.partial(self._finish_ops, completion=self._write_completion),
        )
        self._tg: asyncio.TaskGroup | None = None
        self._closing: asyncio.Future[None] | None = None
        self._backend_closing: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loaders: set[asyncio.Task[None]] = set()
        self._prefetcher = Prefetcher(tree, config, self._stats)
        #: The copy function of backups, and the copier factory of layer-by-layer loads,
        #: ``layer_copier(pair, host_indices, device_indices)`` (replaceable in tests to count
        #: calls or inject failures).
        self.copy: Callable[..., int] = copy_items
        self.layer_copier: Callable[[PoolPair, torch.Tensor, torch.Tensor], LayerCopy] = PoolPair.layer_copier
        self.tiering: Any = None  # set in __aenter__ when a backend is configured

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

        The caller that keeps the prefix locked for its own use locks ``match.last_node`` before
        this call: locks taken on the loaded nodes afterwards are other requests' (readers that
        reached the load through ``match.pending_load``, see :meth:`wait_loaded` and
        :meth:`cancel`). A match that is ``pending_load`` itself (another load brings part of
        its prefix) queues only what no load brings yet; wait for the rest with
        :meth:`wait_loaded`.
        """
        if not isinstance(match, MatchResult):
            raise ConfigError(f"load needs a MatchResult (tree.match_prefix), got {type(match).__name__}")
        self._require_started()  # a load queued after close would never be issued
        loop = asyncio.get_running_loop()
        if state_to and (not match.needs_load or match.state_tier is not Tier.HOST):
            raise ConfigError("state_to needs a match whose boundary state is loaded from the host")
        if not match.needs_load:
            op = CacheOperation(OpKind.LOAD, (), plan=None, priority=priority, loop=loop)
            op.state = OpState.DONE
            op.future.set_result(None)
            return op
        op = self._ops.load_op(match, priority=priority, state_to=state_to, loop=loop)
        if op is not None:
            self._load_queue.append(op)
        return op

    def start_loading(self) -> LayerTransferCounter:
        """Issue every queued load (merged per pool, one copy call per layer) for this step.

        Returns the step's counter once the first layers are enqueued (here, on the loop thread,
        within ``copy_issue.LOAD_ENQUEUE_BUDGET_S`` of host time, so the copy engines start before the
        forward does); a worker thread enqueues the layers left in order, running ahead of the
        forward, and the counter is set layer by layer. The caller's current stream is first
        ordered after the deferred copies of earlier steps (``load(state_to=)``): what a step's
        forward may read is ready for it, whether or not its own counter waits.
        """
        self._require_started()
        self._loads.order_after_deferred()
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
        # enqueue enqueues the first layers before it returns the coroutine the task runs.
        coro = self._loads.enqueue(ops, merged, deferred, layer_ids, counter, self.layer_copier)
        # A task of its own, outside the task group: the ops are issued and their first layers
        # enqueued, so it must run to its end and complete them (give their pages back, resolve
        # their waiters) even when a failed background task makes the group cancel its tasks —
        # possibly before their first step — or take no new one. It never raises an Exception
        # (a failed step fails its ops); ``wait_idle`` and ``aclose`` wait for it.
        task = asyncio.get_running_loop().create_task(coro, name="asynccache-load")
        self._loaders.add(task)
        task.add_done_callback(self._loaders.discard)
        return counter

    # ---- writes (device → host) --------------------------------------------------------
    def write(self, nodes: Sequence[Any], *, priority: int = 0) -> CacheOperation | None:
        """Queue a device → host backup of ``nodes``; ``None`` when the host has no room."""
        if not isinstance(nodes, Sequence) or isinstance(nodes, (str, bytes)):
            raise ConfigError(f"write needs a sequence of tree nodes, got {type(nodes).__name__}")
        self._require_started()  # a backup queued after close would never be issued
        loop = asyncio.get_running_loop()
        op = self._ops.write_op(nodes, priority=priority, loop=loop)
        if op is not None:
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
        self._writes.issue(ops, merged, self.copy)
        return len(ops)

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
        if error is not None:
            # Failed at issue: the loads' nodes stop offering what never arrived at once; what
            # they allocated and read stays held until the copies enqueued before the failure
            # have run (``event``).
            self._ops.fail_issued(ops)

        # `merged` (the merged transfers) is captured so its index tensors live until the copy
        # has completed.
        def done(sync_error: BaseException | None) -> None:
            del_merged = merged  # noqa: F841 - keeps the index tensors alive until here
            # A copy that issued fine can still fail on the stream (the event's synchronize
            # raised: a CUDA fault); its ops are undone like those of a failed issue.
            self._ops.complete_step(ops, error if error is not None else sync_error, tiering=self.tiering)

        completion.submit(event, done)

    def _free(self, kv: torch.Tensor, slots: torch.Tensor, *, device: bool) -> None:
        """Return pages and slots to the device or host pools (the reference scheduler's too)."""
        self._ops.free(kv, slots, device=device)

    def write_back(self, nodes: Sequence[Any]) -> bool:
        """The tree's write-back callback (``write_back`` policy): back ``nodes`` up now."""
        op = self.write(nodes, priority=1)
        if op is None:
            return False
        self.start_writing()
        return True

    def cancel(self, op: CacheOperation) -> bool:
        """Cancel a queued operation (frees what it allocated, unlocks its nodes).

        ``False`` when it cannot be: an issued copy cannot be recalled, and a queued one that
        others depend on stays queued — a later queued operation building on it (nodes inserted
        below its own), data computed on what it brings, or another request that locked its
        nodes after it was queued (a reader, see :meth:`wait_loaded`); either completes
        normally.
        """
        if op.state is not OpState.QUEUED:
            return False
        try:
            self._ops.cancel_queued(op)
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
