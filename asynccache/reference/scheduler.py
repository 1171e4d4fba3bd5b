"""An asyncio scheduler that serves requests through the cache end to end.

Each step: admit waiting requests (prefix match, storage prefetch within the policy's deadline,
host → device load-back, page and slot allocation), ``start_loading()``, one batched forward
(chunked prefill + decode, continuous batching) that awaits each layer's load, greedy sampling,
then for finished requests ``tree.insert`` of their KV pages and admitted states and the
write-policy's backups (``start_writing()``).

Primitives:

- :class:`Scheduler` — its lifecycle, ``submit`` / ``generate``, and the loop: each step's batch
  (chunked prefill and decode), the seeding of working slots, and the split restores' tails.
  Admission is its base :class:`~asynccache.reference.admit.AdmitMixin`'s, the end of a request
  (finished or cancelled) its base :class:`~asynccache.reference.finish.FinishMixin`'s.
- :class:`SchedulerConfig`, :class:`RequestResult` — from :mod:`asynccache.reference.requests`.

A request whose prefix the storage tier restores split (a ``TailRestore``: the tail read from
storage while the head is computed) prefills up to the tail, waits for the read if it has not
landed yet, and goes on from the tail's end: the step that continues from there loads the
tail's KV pages and state into its own pages and working slot layer by layer, like any host
hit, beside its forward.
A failed read falls back to computing the tail. So that such a head, of whatever length,
replays CUDA graphs from its first sighting, ``SchedulerConfig.warm_up_tokens`` has the
scheduler capture the first pass of every bucket length before it serves
(:mod:`asynccache.reference.warm_up`).

Conventions (see docs/architecture.md):

- a request computes at least one token: it matches ``prompt[:-1]``;
- it owns a private working state slot holding a copy of the cached boundary state, so cached
  states are never mutated: a state loaded from the host is copied into the working slot by the
  load itself (``controller.load(match, state_to=...)``, layer by layer; the node's slot gets
  it after the step's layers); a state already on the device is copied, all layers at once,
  before the forward — or, when another request's load of this step brings it, per layer from
  that request's working slot once the forward has waited for that layer;
- snapshots at the admission policy's positions go to freshly allocated slots that ``insert``
  hands to the tree; those it wants in storage only (``storage_positions``) are archived with
  ``controller.archive_snapshots`` and their slots freed once staged.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Self

import torch

from asynccache.cache import HybridCache
from asynccache.checks import check_int
from asynccache.errors import ConfigError, SchedulerError
from asynccache.layer_counter import LayerTransferCounter
from asynccache.reference.admit import AdmitMixin
from asynccache.reference.finish import FinishMixin
from asynccache.reference.model import ForwardBatch, HybridModel, SequenceInput
from asynccache.reference.requests import (
    Phase,
    Prompt,
    Request,
    RequestResult,
    SchedulerConfig,
    prompt_token_ids,
)
from asynccache.reference.room import check_fits, no_room_error
from asynccache.reference.warm_up import warm_up_first_passes

__all__ = ["RequestResult", "Scheduler", "SchedulerConfig"]

_ids = itertools.count()

#: How long the loop polls for the end of a step's GPU work before it hands the wait to a
#: thread. A step whose launches bound it (a decode, a short prefill after a long cached prefix)
#: ends on the GPU within ~0.1 ms of its last launch, and the thread's round trip would add
#: ~0.25 ms to its TTFT (measured on an H200); a longer step costs the loop this much once.
STEP_END_POLL_S = 0.0005


class _SeedingCounter:
    """Wraps the step's counter: after a recurrent layer's load is waited for, copy each
    request's cached boundary state into its private working slot (same stream, no sync)."""

    def __init__(self, inner: LayerTransferCounter, cache: HybridCache, seeds: list[tuple[int, int]]) -> None:
        self.inner = inner
        self.pool = cache.device_mamba
        self.seeds = seeds
        self.mamba_ids = set(cache.spec.mamba_layer_ids)

    async def wait(self, layer_id: int) -> None:
        await self.inner.wait(layer_id)
        if self.seeds and layer_id in self.mamba_ids:
            items = self.pool.layer_items(layer_id)
            # Slice copies: no index tensor to move to the device (a pageable host-to-device
            # copy would make the host wait for the compute stream).
            for src, dst in self.seeds:
                items[dst : dst + 1].copy_(items[src : src + 1])


class Scheduler(AdmitMixin, FinishMixin):
    """Serve requests with continuous batching through a :class:`HybridCache`.

    ``async with Scheduler(model, cache) as s: result = await s.generate(prompt, 32)``.
    """

    def __init__(self, model: HybridModel, cache: HybridCache, config: SchedulerConfig | None = None) -> None:
        self.model = model
        self.cache = cache
        self.spec = cache.spec
        self.config = config or SchedulerConfig()
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._failure: BaseException | None = None  # what stopped the loop
        self._closed = False
        self.num_steps = 0
        #: node state slot → the working slot of the request whose load (this step) brings it
        self._loading_slots: dict[int, int] = {}
        #: layer graphs the warm-up captured (``SchedulerConfig.warm_up_tokens``)
        self.warmed_graphs = 0

    # ---- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self.config.warm_up_tokens:
            self.warmed_graphs = await warm_up_first_passes(
                self.model, self.cache, self.config.warm_up_tokens, device_idle=self._device_idle
            )
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._task = self._tg.create_task(self._loop(), name="asynccache-scheduler")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        assert self._tg is not None and self._task is not None
        self._closed = True
        # The loop stops first: a step it is inside (a forward, a host copy, an admission) uses
        # its requests' pages and slots until it has ended, and on CUDA its kernels may still be
        # queued when it is cancelled. Only then are the requests cancelled and freed.
        self._task.cancel()
        tg, self._tg = self._tg, None
        try:
            try:
                await tg.__aexit__(None, None, None)
            except asyncio.CancelledError:
                # The caller was cancelled while the loop stopped (the group has waited for it
                # all the same): the device is still waited for and the requests freed, then
                # the cancellation goes on.
                await self._device_idle()
                raise
            await self._device_idle()
        finally:
            self._cancel_all(list(self._waiting) + list(self._running))
        if self._failure is not None and exc_type is None:
            raise SchedulerError(f"the scheduler's loop stopped: {self._failure!r}") from self._failure

    # ---- public API --------------------------------------------------------------------
    def submit(self, prompt: Prompt, max_new_tokens: int, *, salt: str = "") -> asyncio.Future[RequestResult]:
        """Queue a request; the future resolves to its :class:`RequestResult`.

        Cancelling the future cancels the request and frees everything it holds. Bad input is a
        :class:`ConfigError` before anything is queued: a prompt that is empty or holds a token
        id that is not an integer (a float, a bool, a floating-point tensor) or lies outside
        ``[0, vocab_size)``, a ``max_new_tokens`` that is not an int >= 1, a ``salt`` that is
        not a ``str``. A request the device pools could not hold even empty (its prompt and
        ``max_new_tokens`` need more KV pages than they have) is a :class:`CapacityError`, the
        error admission would fail it with, naming what it needs and what the pools hold.
        """
        tokens = prompt_token_ids(prompt, self.spec.vocab_size)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        if not isinstance(salt, str):
            raise ConfigError(f"salt must be a str, got {salt!r}")
        if self._task is None:
            raise SchedulerError("use the scheduler as `async with Scheduler(...)`")
        if self._failure is not None:
            raise SchedulerError(f"the scheduler's loop stopped: {self._failure!r}") from self._failure
        if self._closed:
            raise SchedulerError("the scheduler is closed")
        check_fits(self.cache, len(tokens), max_new_tokens)
        fut: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        req = Request(
            request_id=next(_ids),
            prompt=tokens,
            max_new_tokens=max_new_tokens,
            salt=salt,
            future=fut,
            submitted=time.perf_counter(),
        )
        fut.add_done_callback(lambda f, r=req: self._on_future_done(f, r))
        self._waiting.append(req)
        self._wakeup.set()
        return fut

    async def generate(self, prompt: Prompt, max_new_tokens: int, *, salt: str = "") -> RequestResult:
        return await self.submit(prompt, max_new_tokens, salt=salt)

    def _on_future_done(self, fut: asyncio.Future[RequestResult], req: Request) -> None:
        if fut.cancelled() and req.phase is not Phase.DONE:
            req.cancelled = True
            self._wakeup.set()

    # ---- the loop ----------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            while True:
                if not self._waiting and not self._running:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                await self._step()
                # A step may complete without suspending (CPU copies, nothing to wait for): yield
                # so submitters, cancellations and background copies run between steps.
                await asyncio.sleep(0)
        except Exception as e:  # noqa: BLE001 (any error stops the loop; it goes to the requests)
            # Fail every request rather than leave callers waiting on a dead loop, and refuse
            # new ones (submit). The error is not raised into the TaskGroup: that would cancel
            # the task that entered the scheduler, which may be awaiting one of these requests;
            # leaving the scheduler raises it instead (SchedulerError).
            self._failure = e
            for req in self._waiting + self._running:
                if not req.future.done():
                    req.future.set_exception(e)

    async def _step(self) -> None:
        self.num_steps += 1
        self._reap_cancelled()
        kv, slots = self.cache.device_kv, self.cache.device_mamba
        free_before = (kv.num_free, slots.num_free)
        if not await self._admit():
            return  # a request came or went while the step waited for lookups: the next step sees it
        if not self._running:
            if self._waiting and not await self.cache.controller.wait_idle():
                # Nothing could be admitted and no copy in flight will free memory. An attempt
                # that still freed device pages or slots (eviction made progress: what it freed
                # stays free) is tried again as it was. Otherwise a request whose cached prefix
                # needs a load is tried without it (the load's pages and slot may be what the
                # device lacks beside its own): a cache never fails a request that it could
                # serve cold. While nothing runs nothing keeps device memory that a failed
                # attempt took, so each retry follows a free (an eviction) and the retries end.
                req = self._waiting[0]
                if kv.num_free > free_before[0] or slots.num_free > free_before[1]:
                    return
                if not req.cold and self.config.use_cache:
                    req.cold = True
                    return
                self._waiting.pop(0)
                if not req.future.done():  # (it may have been cancelled meanwhile)
                    req.future.set_exception(no_room_error(self.cache, req))
            return
        ctrl = self.cache.controller
        if not await self._resume_tails():
            return  # a request came or went while every running one waited for its tail
        self._reap_cancelled()  # cancelled while this step awaited: not computed
        if not self._running:
            return
        counter = ctrl.start_loading()
        seqs, reqs = self._build_batch()
        seeds = self._seed_working_slots(reqs)
        logits = await self.model.forward(
            ForwardBatch(sequences=tuple(seqs)),
            self.cache.device_kv,
            self.cache.device_mamba,
            _SeedingCounter(counter, self.cache, seeds) if seeds else counter,  # type: ignore[arg-type]
        )
        next_ids = await self._to_host(logits.argmax(dim=-1))
        now = time.perf_counter()
        for i, (r, s) in enumerate(zip(reqs, seqs, strict=True)):
            r.num_computed = s.start + s.token_ids.numel()
            if r.num_computed < len(r.prompt):
                continue  # mid-prefill chunk
            if r.first_token_at is None:
                r.first_token_at = now
                r.first_logits = logits[i].detach().float().cpu()
            r.output.append(int(next_ids[i]))
            r.phase = Phase.DECODE
            if len(r.output) >= r.max_new_tokens:
                self._finish(r)
        ctrl.start_writing()

    def _seed_working_slots(self, reqs: list[Request]) -> list[tuple[int, int]]:
        """Copy each request's cached boundary state into its working slot, all layers in one
        copy, before the forward; returns the ``(source slot, working slot)`` seeds of requests
        whose node slot this step's load of another request brings, which the forward seeds
        layer by layer after each layer's wait, from that request's working slot."""
        pool = self.cache.device_mamba
        late = []
        for r in reqs:
            if r.seed_slot is None:
                continue
            loader = self._loading_slots.get(r.seed_slot)
            if loader is not None:
                # The node's slot is filled after the step's layers; the loading request's
                # working slot holds each layer's state from that layer's wait until its compute.
                late.append((loader, r.state_slot))
            elif pool.buffer is not None:
                pool.index_bytes(r.state_slot).copy_(pool.index_bytes(r.seed_slot))
            r.seed_slot = None
        self._loading_slots.clear()
        return late

    # ---- split restores ----------------------------------------------------------------
    async def _resume_tails(self) -> bool:
        """Apply the tail restores whose head is computed and whose read has landed; when no
        request could run otherwise, wait for the first read (so one can run afterwards), or
        for a submission or a cancellation: ``False`` then, and the step ends there (the next
        one takes the request in, or drops the cancelled one; a read that hangs until its
        timeout holds up neither)."""
        blocked = [r for r in self._running if r.tail is not None and r.num_computed >= r.tail.begin_tokens]
        if not blocked:
            return True
        for r in blocked:
            r.tail.head_computed()  # (the first report of each counts)
        if len(blocked) == len(self._running) and not any(r.tail.fetch.done() for r in blocked):
            self._wakeup.clear()
            woken = asyncio.ensure_future(self._wakeup.wait())
            try:
                await asyncio.wait({woken, *(r.tail.fetch for r in blocked)}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
            if not any(r.tail.fetch.done() for r in blocked):
                return False
        for r in blocked:
            if r.tail.fetch.done():
                self._apply_tail(r)
        return True

    def _apply_tail(self, req: Request) -> None:
        tail, req.tail = req.tail, None
        if not tail.ok:  # a failed or corrupt read: compute the tail instead
            tail.release()
            return
        page = self.spec.page_size
        assert req.kv_pages is not None
        slots = [req.state_slot]
        if tail.end_tokens in req.snapshots:  # the admission policy keeps the tail's end state
            slots.append(req.snapshots[tail.end_tokens])
        # Loaded layer by layer with this step's loads; the controller releases the tail after.
        req.tail_op = self.cache.controller.load_tail(
            tail,
            req.kv_pages[tail.begin_tokens // page : tail.end_tokens // page],
            torch.tensor(slots, dtype=torch.int64),
        )
        req.num_restored = tail.end_tokens - tail.begin_tokens
        req.num_computed = tail.end_tokens
        req.cached_by_tier["storage"] += req.num_restored

    async def _device_idle(self) -> None:
        """Wait (in a worker thread) for the work queued on the model's current CUDA stream: a
        step the loop left mid-forward may have kernels queued that still use the pages and slots
        about to be freed. Interrupted, it waits on the loop thread instead."""
        device = self.model.device
        if device.type != "cuda":
            return
        done = torch.cuda.Event(blocking=True)
        done.record(torch.cuda.current_stream(device))
        try:
            await asyncio.to_thread(done.synchronize)
        except BaseException:
            done.synchronize()
            raise

    async def _to_host(self, t: torch.Tensor) -> list[int]:
        """``t.tolist()`` without blocking the loop while the device finishes the step (storage
        reads and other coroutines keep running meanwhile): the loop polls the step's end for
        at most ``STEP_END_POLL_S``, then waits for it in a worker thread."""
        if t.device.type == "cuda":
            done = torch.cuda.Event(blocking=True)
            done.record()
            deadline = time.perf_counter() + STEP_END_POLL_S
            while not done.query():
                if time.perf_counter() >= deadline:
                    await asyncio.to_thread(done.synchronize)
                    break
        return t.tolist()

    # ---- batching ----------------------------------------------------------------------
    def _build_batch(self) -> tuple[list[SequenceInput], list[Request]]:
        seqs: list[SequenceInput] = []
        reqs: list[Request] = []
        budget = self.config.max_batch_tokens
        for r in self._running:
            stop = len(r.prompt)
            if r.tail is not None:
                if r.num_computed >= r.tail.begin_tokens:
                    continue  # waiting for its tail restore
                stop = r.tail.begin_tokens
            if r.phase is Phase.DECODE:
                ids = torch.tensor([r.output[-1]], dtype=torch.int64)
            else:
                n = min(stop - r.num_computed, self.config.chunk_size, max(budget, 1))
                ids = torch.from_numpy(r.prompt[r.num_computed : r.num_computed + n])
            budget -= ids.numel()
            start = r.num_computed
            end = start + ids.numel()
            snaps = {p: s for p, s in r.snapshots.items() if start < p <= end}
            assert r.kv_pages is not None
            seqs.append(
                SequenceInput(
                    token_ids=ids,
                    start=start,
                    kv_page_indices=r.kv_pages,
                    state_slot=r.state_slot,
                    snapshots=snaps,
                )
            )
            reqs.append(r)
            if budget <= 0:
                break
        return seqs, reqs
