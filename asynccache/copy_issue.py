"""Issuing a scheduler step's merged copies on the controller's copy streams, and handing
them to completion.

Loads (host → device) go layer by layer, ahead of the forward. Issuing a layer's copies costs
host time (planning, driver calls that release the GIL); doing it on the loop thread in
lock-step with the forward would leave the GPU idle between layers. So the first steps
(``asynccache.load_steps``) are enqueued at once on the loop thread within a budget of host
time, and a worker thread enqueues the rest back to back, each layer marked on the step's
:class:`LayerTransferCounter` as soon as it is enqueued, with the event recorded after it.
Writes (device → host backups) go as one launch for all layers per pool, after the compute
stream.

- :data:`LOAD_ENQUEUE_BUDGET_S` — the loop thread's host time for a step's first layers;
- :class:`LoadIssuer` — one per controller: the load stream's :class:`PoolPair` per pool
  (checked at the first load) and the kept step plans; ``enqueue`` a step's loads (its
  coroutine waits for the worker, accounts the bytes and completes the operations), and
  ``order_after_deferred``: the caller's stream after the deferred copies of earlier steps;
- :class:`WriteIssuer` — one per controller: ``issue`` a step's writes on the write stream.

Both complete operations through the controller's ``finish(ops, merged, event, error=)``: once
``event`` has fired (its completion queue), keeping ``merged`` — the index tensors the copies
read — alive until then. Call from the event-loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from asynccache.config import HybridCacheConfig
from asynccache.layer_counter import LayerTransferCounter
from asynccache.load_steps import StepPlans
from asynccache.ops import CacheOperation, MergedTransfer
from asynccache.pools.base import ItemPool
from asynccache.stats import StatsRecorder
from asynccache.storage import PoolName
from asynccache.streams import (
    CudaEventLike,
    current_device,
    current_stream,
    make_wait,
    order_after,
    record_on,
)
from kernels import LayerCopy, PoolPair

__all__ = ["LOAD_ENQUEUE_BUDGET_S", "LoadIssuer", "WriteIssuer"]

log = logging.getLogger("asynccache.controller")  # what befalls the controller's operations

#: Host time a step's load may spend on the loop thread (in ``start_loading``, before the forward
#: starts) enqueueing layers in order; a worker thread takes the layers left when it runs out.
#: Copies that are cheap to issue (a cached per-layer plan of a few strided memcpys: tens of
#: microseconds a layer) are then all enqueued before the forward, and no thread contends with
#: the forward — CPU-bound at small chunks — for the GIL. Costly ones (thousands of scattered
#: pages per layer) start on the loop and continue on the worker, running ahead of the forward.
LOAD_ENQUEUE_BUDGET_S = 0.002

#: A step's copy: (pool, copier, first local layer, number of layers).
_StepCopy = tuple[PoolName, "LayerCopy", int, int]
#: One step of a load: the global layer ids it makes ready (one CUDA event), and its copies.
_LoadStep = tuple[list[int], list[_StepCopy]]


class _Issuer:
    """What both directions' issuers hold: the controller's pools, the device and the copy
    stream, the config, the statistics, and ``finish`` (to the direction's completion queue)."""

    def __init__(
        self,
        pools: dict[PoolName, tuple[ItemPool, ItemPool | None]],
        *,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        config: HybridCacheConfig,
        stats: StatsRecorder,
        finish: Callable[..., None],
    ) -> None:
        self.pools = pools  # the controller's (device, host) pools, by name
        self.device = device
        self.stream = stream
        self.config = config
        self._stats = stats
        self._finish = finish


class LoadIssuer(_Issuer):
    """Enqueues a step's merged loads (host → device) on the load stream, layer by layer.

    Call from the event-loop thread only (the worker thread it starts enqueues a step's layers
    left, and marks them on the counter through the loop).
    """

    def __init__(
        self,
        pools: dict[PoolName, tuple[ItemPool, ItemPool | None]],
        *,
        failed_at_issue: Callable[[Sequence[CacheOperation]], None] | None = None,
        **common: Any,
    ) -> None:
        super().__init__(pools, **common)
        #: told on the loop of a step's operations whose copies failed at issue on the worker,
        #: in the same turn as the marks of the layers enqueued before the failure (so no step
        #: sees those marks before it): the controller's ``TreeOps.fail_issued``
        self._failed_at_issue = failed_at_issue
        self._pairs: dict[PoolName, PoolPair] = {}  # checked at the first load
        self._step_plans = StepPlans(pools)
        self._deferred_events: list[CudaEventLike] = []  # ordered before the next step's stream

    def order_after_deferred(self) -> None:
        """Order the caller's current stream after the deferred copies of earlier steps
        (``load(state_to=)``): what a step's forward may read is ready for it, whether or not
        its own counter waits."""
        if self._deferred_events:
            handle = current_stream(self.device.index)[1]
            for event in self._deferred_events:
                make_wait(handle, event)
            self._deferred_events.clear()

    def enqueue(
        self,
        ops: list[CacheOperation],
        merged: dict[PoolName, MergedTransfer],
        deferred: dict[PoolName, MergedTransfer],
        layer_ids: Sequence[int],
        counter: LayerTransferCounter,
        layer_copier: Callable[[PoolPair, torch.Tensor, torch.Tensor], LayerCopy],
    ) -> Coroutine[Any, Any, None]:
        """Enqueue the step's loads layer by layer: now, on the loop thread, while the host time
        spent stays within ``LOAD_ENQUEUE_BUDGET_S`` (at least one layer), then the rest from a
        worker thread started now. The returned coroutine waits for the worker and completes the
        operations. ``layer_copier(pair, host_indices, device_indices)`` makes each pool's copier.

        The worker runs ahead of the forward, enqueuing every layer back to back on the load
        stream, and marks each layer on the loop as soon as it is enqueued. The worker is never
        abandoned: a cancelled caller still waits for it, so no copy is enqueued into memory
        that a failure path has already freed.

        The ``deferred`` copies (all layers at once) follow the last layer's: after its event
        when the loop thread issues them (the next ``start_loading`` orders the caller's stream
        after theirs), before it when the worker does (the forward's wait for the last layer
        orders it after them). Either way every layer is marked before they are issued, so a
        deferred copy that raises leaves the forward intact: the step's operations fail with it
        (the counter fails only when a layer was left unmarked).
        """
        loop = asyncio.get_running_loop()
        stream = self.stream
        issued: dict[PoolName, list[int]] = {name: [0, 0] for name in [*merged, *deferred]}  # bytes, launches
        last: list[CudaEventLike | None] = [None]  # the event after the latest step
        handle = None if stream is None else stream.cuda_stream
        steps: list[_LoadStep] = []
        after: list[_StepCopy] = []

        def copier(name: PoolName, m: MergedTransfer) -> LayerCopy:
            dev, host = self.pools[name]
            assert host is not None
            return layer_copier(self._pair(name, host, dev), m.host_indices, m.device_indices)

        def plan() -> None:
            """Validate each pool's transfer once (and plan it on the copy engines): one copier
            per pool; then the steps, each a layer or a group of layers (``group_layers``)."""
            copiers = {name: copier(name, m) for name, m in merged.items()}
            for lids, copies in self._step_plans.get(layer_ids, merged):
                steps.append((lids, [(name, copiers[name], li, count) for name, li, count in copies]))
            after.extend((name, copier(name, m), 0, self.pools[name][0].num_layers) for name, m in deferred.items())

        def run(copies: Sequence[_StepCopy]) -> None:
            for name, copy, li, count in copies:
                total = issued[name]
                total[0] += copy(li, count)
                total[1] += 1

        def issue_step(copies: Sequence[_StepCopy], then: Sequence[_StepCopy] = ()) -> Exception | None:
            """Enqueue ``copies``, then ``then`` (deferred copies), and record the event after
            them. A failing copy of ``copies`` raises; the error of a failing one of ``then`` is
            returned, so that the step's layers, whose copies are all enqueued, are marked
            before it fails the operations."""
            try:
                run(copies)
                try:
                    run(then)
                except Exception as e:  # noqa: BLE001 — raised by the caller once the layers are marked
                    return e
                return None
            finally:
                # Also after a failing copy: the step's earlier copies are enqueued, and nothing
                # may be freed before they ran (completion waits for this event).
                if handle is not None:
                    last[0] = record_on(handle)

        def on_device() -> contextlib.AbstractContextManager[Any]:
            """The load's device made current for the runtime calls, unless it already is."""
            if stream is None or current_device() == self.device.index:
                return contextlib.nullcontext()
            return torch.cuda.device(self.device)

        def issue(begin: int, *, yield_gil: bool, budget_s: float | None = None) -> int:
            """Enqueue ``steps[begin:]`` in order; returns where it stopped (early once
            ``budget_s`` of host time is spent, after at least one layer). The worker
            (``yield_gil``) issues the deferred copies with the last step, before its event,
            and raises their error once that step's layers are marked — with the loop told of
            the failure in the same turn as those marks."""
            start = time.perf_counter()
            with on_device():
                for k in range(begin, len(steps)):
                    if budget_s is not None and k > begin and time.perf_counter() - start > budget_s:
                        return k
                    lids, copies = steps[k]
                    failed = issue_step(copies, after if yield_gil and k == len(steps) - 1 else ())
                    if yield_gil:
                        for lid in lids:
                            loop.call_soon_threadsafe(counter.mark_enqueued, lid, last[0])
                        if failed is not None:
                            if self._failed_at_issue is not None:
                                loop.call_soon_threadsafe(self._failed_at_issue, ops)
                            raise failed
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
                        failed = issue_step([], after)
                    if last[0] is not None:
                        # Also after a failure: what the copies that ran wrote is ordered too.
                        self._deferred_events.append(last[0])
                    if failed is not None:
                        raise failed
                worker = loop.create_future()
                worker.set_result(None)
            else:  # the worker's last step carries the deferred copies
                worker = loop.run_in_executor(None, functools.partial(issue, done, yield_gil=True))
        except Exception as e:  # noqa: BLE001 — handed to the waiters through the worker future
            worker = loop.create_future()
            worker.set_exception(e)
        return self._complete(ops, (merged, deferred), counter, worker, issued, last)

    def _pair(self, key: PoolName, src: ItemPool, dst: ItemPool) -> PoolPair:
        """The :class:`PoolPair` of a pool's loads (host → device; its checks made at the first
        load)."""
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = PoolPair(
                src, dst, max_ctas=self.config.max_ctas, stream=self.stream, method=self.config.copy_method
            )
        return pair

    async def _complete(
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
        except Exception as e:  # noqa: BLE001 — the ops fail with it (and the counter, a layer unmarked)
            error = e
        for name, (nbytes, launches) in issued.items():
            self._stats.bytes_moved("h2d", name, nbytes)
            self._stats.count(f"h2d_launches_{name.value}", launches)
        if error is not None:
            if not all(counter.is_enqueued(lid) for lid in counter.layer_ids):
                # A layer left unmarked: its waiters fail. A step whose layers are all marked
                # failed in its deferred copies, after them: the forward reads only copies that
                # were enqueued, and goes on (the operations fail below).
                counter.fail(error)
            self._finish(ops, merged, last[0], error=error)
            if isinstance(error, Exception):
                log.warning("load of %d operation(s) failed: %s", len(ops), error)
                return
            raise error
        self._stats.count("load_ops", len(ops))
        self._finish(ops, merged, last[0], error=None)


class WriteIssuer(_Issuer):
    """Issues a step's merged writes (device → host) on the write stream: one launch for all
    layers per pool."""

    def issue(
        self, ops: list[CacheOperation], merged: dict[PoolName, MergedTransfer], copy: Callable[..., int]
    ) -> None:
        """Copy ``merged`` (the issued ``ops``' transfers) with ``copy`` (``kernels.copy_items``'s
        signature) and hand ``ops`` to completion, failed if a copy raised."""
        stream = self.stream
        event: torch.cuda.Event | None = None
        try:
            if stream is not None:
                # D2H copies read what the compute stream wrote.
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for name, m in merged.items():
                    dev, host = self.pools[name]
                    assert host is not None
                    nbytes = copy(
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
        except Exception as e:  # noqa: BLE001 — the operations finish with the error; the caller sees it
            if stream is not None:
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
            self._finish(ops, merged, event, error=e)
            log.warning("write of %d operation(s) failed: %s", len(ops), e)
            return
        self._stats.count("write_ops", len(ops))
        self._finish(ops, merged, event, error=None)
