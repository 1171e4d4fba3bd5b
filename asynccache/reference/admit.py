"""Admission of the reference scheduler's waiting requests (see ``asynccache.reference.scheduler``).

Primitives:

- :class:`AdmitMixin` — admits waiting requests, oldest first, while fewer than ``max_running``
  run: the prefix match (of ``prompt[:-1]``), the storage prefetch within the policy's deadline
  (the tail of a split restore kept for later), the match pinned on both tiers while room is
  made, then the working and snapshot slots, the host → device load and the request's own pages.
  Without room everything is undone and the request waits. The storage lookups of the requests
  the device could take start side by side; with nothing running the step waits for them (one
  batched prefill) until a submission or a cancellation, otherwise at most ``lookup_wait_s`` for
  the next request's probe — a restore's read goes on while the running requests compute. A
  cancelled request is never admitted (nor computed: the step drops one cancelled after its
  admission before its forward). The tokens a hit found count on the tier they came from:
  on storage only what its own lookup brought. The lookups of requests further
  back start while requests run and none of the former reads, as long as what they may bring
  fits in ``lookahead_host_fraction`` of the host KV pool (docs/architecture.md). A base of
  :class:`~asynccache.reference.scheduler.Scheduler`; not used on its own.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch

from asynccache.reference.requests import (
    Phase,
    Request,
    SchedulerConfig,
    device_pages_needed,
)
from asynccache.reference.room import fits_beside, load_states
from asynccache.tree import Tier

if TYPE_CHECKING:
    from asynccache.cache import HybridCache
    from asynccache.spec import HybridSpec

__all__ = ["AdmitMixin"]


def _path_device_pages(node: Any) -> torch.Tensor:
    """Device KV pages of every node from the root to ``node``, in token order."""
    parts = []
    while node is not None and node.parent is not None:
        assert node.device_kv is not None, "a matched prefix node has no device pages"
        parts.append(node.device_kv)
        node = node.parent
    parts.reverse()
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _cached_by_tier(num_cached: int, num_loaded: int, stored: range) -> dict[str, int]:
    """A hit's ``num_cached`` tokens by the tier they came from: the positions ``stored`` (within
    them) from storage, which the request's lookup brought; of the others, those among the last
    ``num_loaded`` (which a host load brings) from the host, the rest from the device."""
    loaded = range(num_cached - num_loaded, num_cached)
    both = range(max(loaded.start, stored.start), min(loaded.stop, stored.stop))
    host = len(loaded) - len(both)
    return {"device": num_cached - host - len(stored), "host": host, "storage": len(stored)}


def _loaded_tokens(tree: Any, match: Any, num_cached: int, page: int) -> int:
    """How many of the last of a match's ``num_cached`` tokens a host load brings: the host-only
    part of the match (all of it when its boundary state is on the host only), and what a load
    still in flight writes into its prefix (``tree.pending_loads``): another request's, queued
    before this match was made (earlier in the same step, say), whose pages the match reports
    on the device though they are still being filled (all of it when that load brings the
    match's boundary state)."""
    if match.state_tier is Tier.HOST:
        return num_cached
    loaded = match.num_host_tokens
    if match.pending_load:
        for plan in tree.pending_loads(match):
            end = plan.nodes[-1]  # a split keeps the load's last node the lower part: its end stays
            if plan.num_states and end is match.last_node:
                return num_cached
            loaded = max(loaded, num_cached - (end.end_tokens - plan.num_kv_pages * page))
    return min(loaded, num_cached)


class AdmitMixin:
    """The admission of :class:`~asynccache.reference.scheduler.Scheduler` (see the module
    docstring); not used on its own."""

    # Set by Scheduler's constructor.
    cache: HybridCache
    spec: HybridSpec
    config: SchedulerConfig
    _waiting: list[Request]
    _running: list[Request]
    _loading_slots: dict[int, int]
    _wakeup: asyncio.Event

    if TYPE_CHECKING:

        def _cancel(self, req: Request) -> None: ...

    # ---- admission ---------------------------------------------------------------------
    async def _admit(self) -> bool:
        """Admit the waiting requests the device has room for, oldest first (see the module
        docstring). False when, with nothing running, a submission or a cancellation came while
        the step waited for their lookups, or a request moved up past a cancelled one before
        its lookup was waited for: the step ends there, and the next one drops the cancelled
        request (its lookup abandoned) and waits for the lookups of those in its place."""
        room = max(0, self.config.max_running - len(self._running))
        window = self._waiting[:room]
        now = asyncio.get_running_loop().time()
        for req in window:
            if req.lookahead_pages:  # its lookup started ahead of room: the deadline counts from now
                req.lookahead_pages = 0
                req.lookup_started = now
            self._start_lookup(req)
        if self._running and not any(r.lookup is not None and not r.lookup.done() for r in window):
            # Reads ahead overlap the running requests' steps; they never compete with the
            # reads of the requests next in line (with nothing running, those are the step's).
            self._start_lookups_ahead(self._waiting[room:])
        if window and not self._running and not await self._lookups_of(window):
            return False
        while self._waiting and len(self._running) < self.config.max_running:
            req = self._waiting[0]
            if not self._running and req not in window:
                return False  # moved up past a cancelled one: the next step waits for its lookup
            if not await self._lookup_over(req):
                return True  # its storage lookup reads on while the running requests compute
            if req.cancelled:  # cancelled while this loop awaited: dropped, never computed
                self._cancel(req)
                continue
            if not self._try_admit(req):
                return True
            self._waiting.pop(0)
            self._running.append(req)
        return True

    def _start_lookup(self, req: Request, match: Any = None) -> None:
        """Start ``req``'s storage lookup if it has had none (one per request: one that waits
        for room does not repeat it); ``match``: the tree's match of its prompt, if at hand."""
        if req.storage_tokens is not None:
            return
        req.storage_tokens = 0
        ctrl = self.cache.controller
        if not self.config.use_cache or ctrl.tiering is None:
            return
        key = req.prompt[:-1]
        if match is None:
            match = self.cache.tree.match_prefix(key, salt=req.salt)
        req.lookup = ctrl.prefetch(key, match, salt=req.salt, allow_tail=True)
        req.lookup_from, req.lookup_started = match.num_tokens, asyncio.get_running_loop().time()

    def _start_lookups_ahead(self, queue: list[Request]) -> None:
        """Start the storage lookups of the waiting requests beyond the device's room, in
        arrival order, while the host pages they may bring (the prompt's full pages past the
        tree's match; the lookups ahead not yet admitted count too) fit in
        ``lookahead_host_fraction`` of the host KV pool. What they bring waits on the host for
        their admission, so the reads go on while the requests ahead of them run (the caller
        starts them only while requests run and no lookup of the room's requests reads)."""
        host, share = self.cache.host_kv, self.config.lookahead_host_fraction
        if not queue or host is None or not share or not self.config.use_cache or self.cache.controller.tiering is None:
            return
        budget = int(share * host.num_items) - sum(r.lookahead_pages for r in queue)
        for req in queue:
            if req.storage_tokens is not None:
                continue
            match = self.cache.tree.match_prefix(req.prompt[:-1], salt=req.salt)
            pages = max(0, len(match.page_hashes) - match.num_tokens // self.spec.page_size)
            if pages > budget:
                return  # in arrival order: a later request does not pass this one
            self._start_lookup(req, match)
            if req.lookup is not None:
                req.lookahead_pages = pages
                budget -= pages

    async def _lookups_of(self, reqs: list[Request]) -> bool:
        """With nothing running, wait for the lookups of the requests the device can take now
        (they read side by side) up to the policy's deadline, so they start together — one
        batched prefill — rather than one a step. False when a submission or a cancellation
        comes first (a cancelled request's lookup, unbounded under ``wait_complete``, holds up
        nobody): the caller ends the step."""
        loop = asyncio.get_running_loop()
        ctrl, now = self.cache.controller, loop.time()
        pending = {r.lookup for r in reqs if r.lookup is not None and not r.lookup.done()}
        if not pending:
            return True
        limits = [ctrl.prefetch_time_left(len(r.prompt) - 1, now - r.lookup_started) for r in reqs if r.lookup in pending]
        deadline = None if None in limits else now + max(t for t in limits if t is not None)
        self._wakeup.clear()
        woken = asyncio.ensure_future(self._wakeup.wait())
        try:
            while pending and not woken.done():
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                done, _ = await asyncio.wait({woken, *pending}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break  # the deadline
                pending -= done
            return not woken.done()
        finally:
            woken.cancel()

    async def _lookup_over(self, req: Request) -> bool:
        """True once ``req``'s storage lookup is over — its result taken within the prefetch
        policy's deadline, counted from the lookup's start — or when it has none. False while
        it reads and other requests are running: the loop computes them meanwhile instead of
        waiting (a lookup that restores a prefix reads for tens of milliseconds and more), and
        asks again at the next step. With nothing running it waits here."""
        ctrl = self.cache.controller
        key = req.prompt[:-1]
        loop = asyncio.get_running_loop()
        task = req.lookup
        if task is None:
            return True
        elapsed = loop.time() - req.lookup_started
        if not task.done() and self._running and not ctrl.prefetch_overdue(len(key), elapsed):
            # A miss or a split restore ends with its probe (a few file lookups): wait that
            # long (up to ``lookup_wait_s``), so the request joins this step; a whole
            # restore's read goes on meanwhile.
            await ctrl.wait_prefetch_probed(task, len(key), elapsed_s=elapsed, at_most_s=self.config.lookup_wait_s)
            elapsed = loop.time() - req.lookup_started
            if not task.done() and not ctrl.prefetch_overdue(len(key), elapsed):
                return False
        req.lookup = None  # taken from here on (a cancellation meanwhile abandons it in the wait)
        res = await ctrl.wait_prefetch(task, len(key), elapsed_s=elapsed)
        req.lookup_tail = res.tail if res is not None else None
        # What it restored past the tree's match at its start; not what the tree gained meanwhile
        # from other requests. A split restore's tail counts once applied.
        req.storage_tokens = max(0, res.num_tokens - req.lookup_from) if res is not None else 0
        return True

    def _try_admit(self, req: Request) -> bool:
        tree = self.cache.tree
        key = req.prompt[:-1]
        match = tree.match_prefix(key, salt=req.salt) if self.config.use_cache and not req.cold else None
        tail, req.lookup_tail = req.lookup_tail, None
        if req.cold and tail is not None:
            tail.release()  # computed cold: what its lookup brought is not used
            tail = None
        if tail is not None and match is not None and tail.begin_tokens <= match.num_tokens:
            tail.release()  # the tree caught up meanwhile (another request restored it)
            tail = None
        num_cached = match.num_tokens if match is not None else 0
        if self._running and not fits_beside(self.cache, self._running, req, match):
            if tail is not None:
                tail.release()  # as when an allocation finds no room
            return False  # eviction could not make the room: it would only empty the cache
        # What the lookup brought, as far as the match still holds it (eviction may have taken
        # some since).
        stored = range(req.lookup_from, min(req.lookup_from + (req.storage_tokens or 0), num_cached))
        if match is None:
            return self._allocate(req, None, num_cached, tail, stored)
        # Pin the match on both tiers while making room: under write_back, allocating device
        # slots writes device states back to the host, which may evict host copies — the
        # match's own included, unless it is locked there too. The device lock stays only
        # when it became the request's: not when there is no room, nothing was cached, or the
        # allocation raised.
        node = match.last_node
        token = tree.lock(node)
        tree.lock_host(node)
        try:
            return self._allocate(req, match, num_cached, tail, stored)
        except BaseException:
            req.locked_node = None
            raise
        finally:
            tree.unlock_host(node)
            if req.locked_node is node:
                req.lock_token = token
            else:
                tree.unlock(node, token)

    def _allocate(self, req: Request, match: Any, num_cached: int, tail: Any, stored: range) -> bool:
        """Allocate a matched request's slots and pages and queue its load (``match`` locked on
        the device by the caller, which releases the lock unless ``req.locked_node`` took it);
        False, with everything else undone, when there is no room; when it raises, nothing it
        took stays taken either. ``stored``: the positions of the match its lookup brought."""
        tree, ctrl, page = self.cache.tree, self.cache.controller, self.spec.page_size
        # Pages for every position this request will compute: [num_cached, total_len - 1).
        num_pages_total = device_pages_needed(req.total_len, page)
        snap_positions = self._snapshot_positions(req, num_cached, tail, match)
        storage_only = self._storage_only_positions(req, num_cached, tail, snap_positions, match)
        snap_positions = sorted(snap_positions + storage_only)
        # The load of a boundary state from the host takes a slot too (the node's), after these.
        num_load_states = load_states(match)
        if 1 + len(snap_positions) + num_load_states > self.cache.device_mamba.num_items:
            # More than the device holds: never all of them (and asking would evict for nothing).
            room = self.cache.device_mamba.num_items - 1 - num_load_states
            snap_positions = self._fewer_snapshots(snap_positions, tail, room)
            storage_only = [p for p in storage_only if p in snap_positions]
        # The working and snapshot slots first, then the load's pages, then the request's own:
        # the load's pages come off the free list in one piece (one copy a layer) when they
        # were freed together.
        slot_alloc = tree.alloc_device(0, 1 + len(snap_positions))
        if slot_alloc is None and snap_positions and not self._running:
            # Snapshots are states kept for later requests, not what this one needs to run. With
            # nothing running no slot will come back by waiting: as many as the slots the
            # failed allocation left (it evicted what it could).
            room = self.cache.device_mamba.num_free - 1 - num_load_states
            snap_positions = self._fewer_snapshots(snap_positions, tail, room)
            storage_only = [p for p in storage_only if p in snap_positions]
            slot_alloc = tree.alloc_device(0, 1 + len(snap_positions))
        op = page_alloc = None
        state_to: tuple[int, ...] = ()
        by_tier = {"device": 0, "host": 0, "storage": 0}
        try:
            if slot_alloc is not None:
                if match is not None and match.needs_load:
                    # A boundary state loaded from the host lands in the working slot too (with
                    # the node's copy): nothing to seed from the node's slot then.
                    if match.state_tier is Tier.HOST:
                        state_to = (int(slot_alloc.state_slots[0]),)
                    op = ctrl.load(match, state_to=state_to)
                if op is not None or match is None or not match.needs_load:
                    page_alloc = tree.alloc_device(num_pages_total - num_cached // page, 0)
            if page_alloc is None:  # no room
                self._undo_allocation(req, slot_alloc, None, op, tail)
                return False
            assert slot_alloc is not None
            own, slots = page_alloc.kv_indices, slot_alloc.state_slots
            if match is not None and num_cached:
                node = match.last_node
                prefix_pages = _path_device_pages(node)  # every page of the prefix, on device after the load
                assert prefix_pages.numel() == num_cached // page
                assert node.device_state is not None
                if state_to:
                    self._loading_slots[node.device_state] = state_to[0]
                else:
                    req.seed_slot = node.device_state
                req.kv_pages = torch.cat([prefix_pages, own])
                # A hit that needed any host load (KV pages, or only the boundary state; its own
                # or one in flight for another request) counts on the host tier; what the
                # request's lookup brought counts on storage.
                by_tier = _cached_by_tier(num_cached, _loaded_tokens(tree, match, num_cached, page), stored)
                req.locked_node = node
            else:
                req.kv_pages = own
        except BaseException:
            # Nothing of a failed admission stays taken (the caller releases the match's lock).
            self._undo_allocation(req, slot_alloc, page_alloc, op, tail)
            raise
        req.own_pages = own
        req.load_op = op
        req.state_slot = int(slots[0])
        req.snapshots = dict(zip(snap_positions, (int(s) for s in slots[1:]), strict=True))
        req.storage_only = frozenset(storage_only)
        req.num_cached = req.num_computed = num_cached
        req.cached_by_tier = by_tier
        req.tail = tail
        if tail is not None:
            tail.head_started()
        req.phase = Phase.PREFILL
        return True

    def _undo_allocation(self, req: Request, slot_alloc: Any, page_alloc: Any, op: Any, tail: Any) -> None:
        """Give back what :meth:`_allocate` took when it finds no room or raises: the queued load,
        the slots and pages, the tail restore, and the request's view of them."""
        ctrl = self.cache.controller
        if op is not None:
            ctrl.cancel(op)
        for alloc in (page_alloc, slot_alloc):
            if alloc is not None:
                ctrl._free(alloc.kv_indices, alloc.state_slots, device=True)
        if slot_alloc is not None and len(slot_alloc.state_slots):
            working = int(slot_alloc.state_slots[0])
            for slot in [s for s, w in self._loading_slots.items() if w == working]:
                del self._loading_slots[slot]
        if tail is not None:
            tail.release()
        req.seed_slot = None
        req.kv_pages = req.own_pages = None

    def _snapshot_positions(self, req: Request, num_cached: int, tail: Any, match: Any) -> list[int]:
        """Page-aligned positions the admission policy keeps, past the cached prefix (and not
        inside a tail restore: only its end, whose state the restore brings); ``match`` (the
        request's, None without one) places a branch point. None without the cache."""
        if not self.config.use_cache:
            return []
        computed_len = req.total_len - 1  # the last sampled token is never computed
        positions = self.cache.tree.admission.state_positions(
            len(req.prompt), total_len=computed_len, page_size=self.spec.page_size, match=match
        )
        return self._computed_here(positions, num_cached, computed_len, tail)

    def _storage_only_positions(self, req: Request, num_cached: int, tail: Any, kept: list[int], match: Any) -> list[int]:
        """Positions the admission policy wants in storage only (``storage_positions``, where it
        has one and there is a storage tier), past the cached prefix and not kept by the tree:
        archived with ``controller.archive_snapshots`` when the request finishes."""
        storage_positions = getattr(self.cache.tree.admission, "storage_positions", None)
        if storage_positions is None or not self.config.use_cache or self.cache.controller.tiering is None:
            return []
        positions = set(storage_positions(len(req.prompt), page_size=self.spec.page_size, match=match)) - set(kept)
        return self._computed_here(positions, num_cached, req.total_len - 1, tail)

    @staticmethod
    def _fewer_snapshots(snapshots: list[int], tail: Any, room: int) -> list[int]:
        """``snapshots`` (sorted) cut to ``room`` slots (the device's besides the working one).
        Kept first: the deepest (the prompt's or the output's end) and a tail restore's end
        (its state arrives with the restore), then the deeper the sooner."""
        if room <= 0:
            return []
        first = [p for p in (snapshots[-1], tail.end_tokens if tail is not None else None) if p in snapshots]
        rest = [p for p in reversed(snapshots) if p not in first]
        return sorted(dict.fromkeys([*first, *rest][:room]))

    @staticmethod
    def _computed_here(positions: Any, num_cached: int, computed_len: int, tail: Any) -> list[int]:
        skipped = range(tail.begin_tokens + 1, tail.end_tokens) if tail is not None else range(0)
        return sorted(p for p in positions if num_cached < p <= computed_len and p not in skipped)
