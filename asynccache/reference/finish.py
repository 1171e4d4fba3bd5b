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

from asynccache.errors import StaleMatchError
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
        """Hand a finished request's pages and kept states to the tree, free the rest, release
        its lock, queue its backups and storage-only archive, and set its result.

        What the tree (or a queued archive) has taken stops being the request's at once: its
        page list, snapshots and working slot are cut down as they go, so that an error raised
        on the way (stopping the loop, whose requests are then cancelled) frees only what it
        still holds. An insert refused with :class:`StaleMatchError` (its prefix holds pages or
        a state of a load that failed once the forward had passed its layer waits: its own
        load, whose copy into the node's slot after the step's last layer failed, or another
        request's that its match reached) changes nothing: the request frees its own pages and
        slots, and its unlock gives the failed load's indices back once no other lock holds
        them. Its output stands: a forward that completed read only copies that were issued."""
        tree, page = self.cache.tree, self.spec.page_size
        tokens = np.concatenate((req.prompt, np.asarray(req.output[:-1], dtype=np.int64)))
        full = len(tokens) // page
        assert req.kv_pages is not None and req.own_pages is not None
        inserted = {p: s for p, s in req.snapshots.items() if p <= full * page}
        states = {p: s for p, s in inserted.items() if p not in req.storage_only}
        archived = {p: s for p, s in inserted.items() if p in req.storage_only}
        result = None
        if self.config.use_cache:
            try:
                result = tree.insert(tokens[: full * page], req.kv_pages[:full], states=states, salt=req.salt)
            except StaleMatchError:
                pass  # nothing inserted: everything the request allocated is freed below
        if result is not None:
            # The tree owns the inserted pages and states now; pages past the last full page
            # and snapshot slots the insert did not cover are ours.
            n_prefix = req.num_cached // page
            req.own_pages = req.own_pages[max(0, full - n_prefix) :]
            req.snapshots = {p: s for p, s in req.snapshots.items() if p not in states}
        tail, req.own_pages = req.own_pages, None
        if tail.numel():
            self.cache.device_kv.free(tail)
        if req.locked_node is not None:
            node, token = req.locked_node, req.lock_token
            req.locked_node = req.lock_token = None
            tree.unlock(node, token)
        if result is not None and result.backup_nodes:
            self.cache.controller.write(result.backup_nodes)
        archive = None
        if result is not None and archived:
            # Queued after the backup: the path's KV is read from the host copies it makes.
            archive = self.cache.controller.archive_snapshots(result.last_node, archived)
        if archive is not None:
            # Their slots stay ours, read until the staging copy is done.
            held = torch.tensor(list(archived.values()), dtype=torch.int64)
            archive.staged.add_done_callback(lambda _: self.cache.device_mamba.free(held))
            req.snapshots = {p: s for p, s in req.snapshots.items() if p not in archived}
        slots, req.state_slot = [*req.snapshots.values(), req.state_slot], -1
        req.snapshots = {}
        self.cache.device_mamba.free(torch.tensor(slots, dtype=torch.int64))
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
        stopped: no forward is using it) — only what it still holds: a request whose
        :meth:`_finish` raised has handed its inserted pages and states to the tree, and freed
        some of the rest (``own_pages`` None, ``state_slot`` -1, its lock released). Its loads
        (its prefix's, its tail restore's), if still queued, are cancelled; one that cannot be
        (issued, or built on by another) copies into the request's pages and slots, so they are
        freed once it has completed."""
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
            own, req.own_pages = req.own_pages, None
            held = [*req.snapshots.values(), *([req.state_slot] if req.state_slot >= 0 else [])]
            req.snapshots, req.state_slot = {}, -1
            slots = torch.tensor(held, dtype=torch.int64)

            def free(_: object = None) -> None:
                if own is not None and own.numel():
                    self.cache.device_kv.free(own)
                if slots.numel():
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
                node, token = req.locked_node, req.lock_token
                req.locked_node = req.lock_token = None
                self.cache.tree.unlock(node, token)
        if req.tail is not None:
            req.tail.release()
            req.tail = None
        req.phase = Phase.DONE
        if not req.future.done():
            req.future.cancel()
