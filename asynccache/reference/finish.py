"""The end of the reference scheduler's requests (see ``asynccache.reference.scheduler``).

Primitives:

- :class:`FinishMixin` — a finished request: ``tree.insert`` of its full pages and the states
  the admission policy kept, the pages and slots the insert did not take freed, its lock
  released, the write policy's backups and the archive of its storage-only snapshots
  (``controller.archive_snapshots``; their slots freed once staged) queued, and its
  :class:`~asynccache.reference.requests.RequestResult` set; a cancelled request: everything it
  holds freed (after a load that can no longer be cancelled has completed), running ones newest
  first. A base of :class:`~asynccache.reference.scheduler.Scheduler`; not used on its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from asynccache.reference.requests import Phase, Request, RequestResult, SchedulerConfig

if TYPE_CHECKING:
    from asynccache.cache import HybridCache
    from asynccache.spec import HybridSpec

__all__ = ["FinishMixin"]


class FinishMixin:
    """The end of the requests of :class:`~asynccache.reference.scheduler.Scheduler` (see the
    module docstring); not used on its own."""

    # Set by Scheduler's constructor.
    cache: HybridCache
    spec: HybridSpec
    config: SchedulerConfig
    _waiting: list[Request]
    _running: list[Request]
    _loading_slots: dict[int, int]

    # ---- completion --------------------------------------------------------------------
    def _finish(self, req: Request) -> None:
        tree, page = self.cache.tree, self.spec.page_size
        tokens = np.concatenate((req.prompt, np.asarray(req.output[:-1], dtype=np.int64)))
        full = len(tokens) // page
        assert req.kv_pages is not None and req.own_pages is not None
        inserted = {p: s for p, s in req.snapshots.items() if p <= full * page}
        states = {p: s for p, s in inserted.items() if p not in req.storage_only}
        result = None
        if self.config.use_cache:
            result = tree.insert(tokens[: full * page], req.kv_pages[:full], states=states, salt=req.salt)
            # Pages past the last full page and snapshot slots the insert did not cover are ours.
            n_prefix = req.num_cached // page
            tail = req.own_pages[max(0, full - n_prefix) :]
            leftover = [s for p, s in req.snapshots.items() if p not in states]
        else:
            tail = req.own_pages
            leftover = list(req.snapshots.values())
        if tail.numel():
            self.cache.device_kv.free(tail)
        if req.locked_node is not None:
            tree.unlock(req.locked_node, req.lock_token)
            req.locked_node = req.lock_token = None
        if result is not None and result.backup_nodes:
            self.cache.controller.write(result.backup_nodes)
        archived = {p: s for p, s in inserted.items() if p in req.storage_only}
        archive = None
        if result is not None and archived:
            # Queued after the backup: the path's KV is read from the host copies it makes.
            archive = self.cache.controller.archive_snapshots(result.last_node, archived)
        if archive is not None:
            # Their slots stay ours, read until the staging copy is done.
            held = torch.tensor(list(archived.values()), dtype=torch.int64)
            archive.staged.add_done_callback(lambda _: self.cache.device_mamba.free(held))
            leftover = [s for s in leftover if s not in archived.values()]
        self.cache.device_mamba.free(torch.tensor(leftover + [req.state_slot], dtype=torch.int64))
        req.phase = Phase.DONE
        self._running.remove(req)
        now = time.perf_counter()
        assert req.first_token_at is not None and req.first_logits is not None
        if not req.future.done():
            req.future.set_result(
                RequestResult(
                    request_id=req.request_id,
                    prompt_tokens=len(req.prompt),
                    cached_tokens=req.num_cached + req.num_restored,
                    cached_by_tier=dict(req.cached_by_tier),
                    output_ids=list(req.output),
                    ttft_s=req.first_token_at - req.submitted,
                    latency_s=now - req.submitted,
                    first_logits=req.first_logits,
                )
            )

    def _reap_cancelled(self) -> None:
        self._cancel_all([r for r in self._waiting + self._running if r.cancelled])

    def _cancel_all(self, reqs: list[Request]) -> None:
        """Cancel ``reqs``, the running ones newest first: a queued load may build on an older
        request's (a shared prefix), and the older one cannot be cancelled while it does."""
        running = [r for r in reversed(self._running) if r in reqs]
        for req in [r for r in reqs if r not in running] + running:
            self._cancel(req)

    def _cancel(self, req: Request) -> None:
        """Free everything a request holds (between steps, or on leaving once the loop has
        stopped: no forward is using it). Its loads (its prefix's, its tail restore's), if still
        queued, are cancelled; one that cannot be (issued, or built on by another) copies into
        the request's pages and slots, so they are freed once it has completed."""
        if req in self._waiting:
            self._waiting.remove(req)
        if req.lookup is not None:  # its storage lookup runs on; nobody takes what it brings
            self.cache.controller.abandon_prefetch(req.lookup)
            req.lookup = None
        if req.lookup_tail is not None:
            req.lookup_tail.release()
            req.lookup_tail = None
        if req in self._running:
            self._running.remove(req)
            own = req.own_pages
            slots = torch.tensor([*req.snapshots.values(), req.state_slot], dtype=torch.int64)

            def free(_: object = None) -> None:
                if own is not None and own.numel():
                    self.cache.device_kv.free(own)
                self.cache.device_mamba.free(slots)

            # Its loads (the prefix's, a tail restore's) write into its pages and slots: freed
            # once every one of them is cancelled or has completed.
            ops = [op for op in (req.load_op, req.tail_op) if op is not None]
            req.load_op = req.tail_op = None
            pending = [op.future for op in ops if not (op.future.done() or self.cache.controller.cancel(op))]
            if pending:
                asyncio.gather(*pending, return_exceptions=True).add_done_callback(free)
            else:
                free()
            if req.locked_node is not None:
                self.cache.tree.unlock(req.locked_node, req.lock_token)
        if req.tail is not None:
            req.tail.release()
            req.tail = None
        req.phase = Phase.DONE
        if not req.future.done():
            req.future.cancel()
