"""The copy protocols between tiers, driven by the controller (the tree never copies bytes).

Load (host → device)::

    plan = tree.begin_load(match, device_kv_indices, device_state_slot)   # attach + pin
    …copy plan.host_kv_indices → plan.device_kv_indices (per layer), host_state_slot → device_state_slot
    tree.finish_load(plan)        # unpin            | tree.abort_load(plan)   # detach, before any copy

Backup (device → host)::

    kv, states = tree.backup_pages_needed(nodes)
    plan = tree.begin_backup(nodes, host_kv_indices, host_state_slots)   # attach + pin
    …copy plan.device_kv_indices → plan.host_kv_indices, device_state_slots → host_state_slots
    tree.finish_backup(plan)      # unpin            | tree.abort_backup(plan)

``begin_*`` attaches the destination indices to the nodes at once (ownership passes to the tree)
and pins the nodes on both tiers, so neither the source nor the destination can be evicted,
deleted or handed to another copy while the bytes move. A match that reaches data being loaded
reports ``pending_load``. ``abort_*`` is for copies that were never enqueued: it detaches the
destination indices and returns them to the caller. A plan covers its nodes even if an insert
splits them meanwhile (the split copies the pins to the new upper node, and the plan walks up
from its deepest node to its first page).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import torch

from asynccache.checks import as_int
from asynccache.errors import ConfigError
from asynccache.tree.core import TreeCore
from asynccache.tree.errors import TreeError
from asynccache.tree.node import Tier, TreeNode
from asynccache.tree.results import BackupPlan, LoadPlan, MatchResult, ReleasedIndices

__all__ = ["TransferMixin"]

_EMPTY = torch.empty(0, dtype=torch.int64)


def _walk_up(node: TreeNode, top_page: int) -> Iterator[TreeNode]:
    """``node`` and its ancestors that start at or below page ``top_page`` (deepest first)."""
    n: TreeNode | None = node
    while n is not None and n.parent is not None and n.start_page >= top_page:
        yield n
        n = n.parent


def _subtree(node: TreeNode) -> list[TreeNode]:
    """``node`` and every node below it, parents before their children."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def plan_nodes(plan: LoadPlan | BackupPlan) -> list[TreeNode]:
    """The nodes an in-flight plan covers now (nodes split since ``begin_*`` included)."""
    if isinstance(plan, LoadPlan):
        return [] if plan._last is None else list(_walk_up(plan._last, plan._top_page))
    return [n for node, top, _, _ in plan._segments for n in _walk_up(node, top)]


class TransferMixin(TreeCore):
    """``begin/finish/abort_load``, ``begin/finish/abort_backup``, ``backup_pages_needed``,
    ``mark_archived``."""

    def _register(self, plan: LoadPlan | BackupPlan) -> None:
        self._plans[plan.plan_id] = plan

    def _next_id_for_plan(self) -> int:
        self._next_plan_id += 1
        return self._next_plan_id

    def _check_plan(self, plan: LoadPlan | BackupPlan) -> None:
        if self._plans.get(plan.plan_id) is not plan:
            raise TreeError(f"plan {plan.plan_id} is not in flight (finished, aborted or foreign)")

    def _check_no_overlap(self, plan: LoadPlan | BackupPlan, nodes: Sequence[TreeNode]) -> None:
        """An abort may not detach data another in-flight copy reads or writes (rare; O(plans))."""
        ids = {n.node_id for n in nodes}
        for other in self._plans.values():
            if other is plan:
                continue
            for n in plan_nodes(other):
                if n.node_id in ids:
                    raise TreeError(f"cannot abort plan {plan.plan_id}: plan {other.plan_id} also covers {n}")

    # ---- load ---------------------------------------------------------------------------------
    def begin_load(
        self,
        match: MatchResult,
        device_kv_indices: torch.Tensor | Sequence[int],
        device_state_slot: int | None = None,
    ) -> LoadPlan:
        """Attach freshly allocated device pages (``match.num_load_kv_pages`` of them) and, when
        the state at ``match.num_tokens`` is on the host only, ``device_state_slot`` to the
        host-only part of the match; pin those nodes and return the copy to perform.

        The match must still describe the tree: keep ``match.last_node`` locked on both tiers
        (``lock`` and ``lock_host``: making device room may demote to the host and evict there)
        while making room. Raises :class:`TreeError` for a stale match and ``ConfigError`` for
        wrong index counts (nothing changes then; the caller keeps the indices).
        """
        last = match.last_node
        if last.parent is None:
            self._check_indices_count(device_kv_indices, 0, device_state_slot, False)
            plan = LoadPlan(plan_id=self._next_id_for_plan(), nodes=())
            self._register(plan)
            return plan
        if not last.alive:
            raise TreeError(f"stale match: {last} was deleted")
        path = self.path_to(last)
        i = len(path)
        while i and path[i - 1].device_kv is None:
            i -= 1
        host_part = path[i:]
        need_pages = sum(n.num_pages for n in host_part)
        need_state = last.device_state is None
        if need_state and last.host_state is None:
            raise TreeError(f"stale match: {last} has no state any more")
        if need_pages * self.page_size != match.num_host_tokens or need_state != (match.state_tier is Tier.HOST):
            raise TreeError(
                f"stale match: it asked for {match.num_host_tokens} host tokens and state tier {match.state_tier}, "
                f"the tree now needs {need_pages} pages and {'a' if need_state else 'no'} state"
            )
        kv = self._check_indices_count(device_kv_indices, need_pages, device_state_slot, need_state)
        if not need_pages and not need_state:
            plan = LoadPlan(plan_id=self._next_id_for_plan(), nodes=())
            self._register(plan)
            return plan
        off = 0
        for n in host_part:
            assert n.host_kv is not None, f"{n} holds no KV on any tier"
            self._set_device_kv(n, kv[off : off + n.num_pages])
            off += n.num_pages
        # The nodes' host indices are never written after they are set: one node's is used as is.
        parts = [n.host_kv for n in host_part]
        host_kv = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else _EMPTY  # type: ignore[misc]
        host_state = None
        if need_state:
            assert device_state_slot is not None
            host_state = last.host_state
            self._set_device_state(last, int(device_state_slot))
        segment = host_part if host_part else [last]
        for n in reversed(segment):
            self._pin(n, 1, loading=True)
            self._touch(n)  # deepest first: ancestors stay more recent than descendants
        plan = LoadPlan(
            plan_id=self._next_id_for_plan(),
            nodes=tuple(segment),
            host_kv_indices=host_kv,
            device_kv_indices=kv,
            host_state_slot=host_state,
            device_state_slot=None if device_state_slot is None else int(device_state_slot),
            _last=last,
            _top_page=segment[0].start_page,
        )
        self._register(plan)
        return plan

    def _check_indices_count(
        self, indices: torch.Tensor | Sequence[int], num_pages: int, slot: int | None, need_state: bool
    ) -> torch.Tensor:
        kv = self._check_indices(indices, num_pages, "device_kv_indices", self.device_kv)
        if need_state != (slot is not None):
            raise ConfigError(
                "device_state_slot is required exactly when the state is on the host only "
                f"(needed: {need_state}, given: {slot})"
            )
        if slot is not None:
            value = as_int(slot)
            if value is None or not 0 <= value < self.device_mamba.num_items:
                raise ConfigError(
                    f"device_state_slot must be an integer in {self.device_mamba.name}'s "
                    f"0..{self.device_mamba.num_items - 1}, got {slot!r}"
                )
        return kv

    def finish_load(self, plan: LoadPlan) -> None:
        """The copies of ``plan`` completed: unpin its nodes."""
        self._check_plan(plan)
        del self._plans[plan.plan_id]
        if plan._last is not None:
            for n in list(_walk_up(plan._last, plan._top_page)):
                self._pin(n, -1, loading=True)

    def abort_load(self, plan: LoadPlan, *, drop_below: bool = False) -> ReleasedIndices:
        """Undo :meth:`begin_load` of a plan whose copies were never enqueued, or failed: detach
        the device indices (returned; the caller frees them) and unpin. Device data inserted
        below the loaded nodes meanwhile (computed on top of the prefix) makes it raise
        :class:`TreeError` — unless ``drop_below`` (the copy failed: that data would be served
        after pages it never filled), then it loses its device copy too, and only a node of it
        in use (locked, or in a copy) makes it raise. It also raises when another in-flight
        copy covers the loaded nodes. Nothing changes when it raises."""
        self._check_plan(plan)
        released = ReleasedIndices(kv_indices=plan.device_kv_indices, state_slots=plan.device_state_slots)
        last = plan._last
        if last is None:
            del self._plans[plan.plan_id]
            return released
        segment = list(_walk_up(last, plan._top_page))
        self._check_no_overlap(plan, segment)
        loaded_kv = plan.num_kv_pages > 0
        below: list[TreeNode] = []
        if loaded_kv:
            ids = {n.node_id for n in segment}
            for n in segment:
                for c in n.children.values():
                    if c.device_kv is not None and c.node_id not in ids:
                        below.extend(d for d in _subtree(c) if d.device_kv is not None)
            if below and not drop_below:
                raise TreeError(f"cannot abort load {plan.plan_id}: {below[0]} already uses the loaded pages")
            busy = next((d for d in below if d.device_lock or d.host_lock or d.loading), None)
            if busy is not None:
                raise TreeError(f"cannot abort load {plan.plan_id}: {busy} uses the loaded pages and is in use")
        del self._plans[plan.plan_id]
        for n in segment:
            self._pin(n, -1, loading=True)
        for n in segment:
            if n.device_state is not None:
                if n is last and n.device_state == plan.device_state_slot:
                    self._clear_device_state(n)
                elif loaded_kv:
                    # A state an insert attached meanwhile: tree-owned, and it cannot outlive the KV.
                    self._free_device_state(n)
            if loaded_kv:
                self._clear_device_kv(n)
        # Once the loaded pages are detached (a cascade must not free them: the caller does),
        # deepest first: a node dropped whole is a leaf by then.
        for d in reversed(below):
            if d.alive:
                self._drop_device(d)  # type: ignore[attr-defined]  (the eviction mixin's)
        if last.alive:
            self._cascade(last)
        return released

    # ---- backup -------------------------------------------------------------------------------
    def host_gap(self, node: TreeNode, num_pages: int) -> list[TreeNode]:
        """The nodes of the path to ``node`` within its first ``num_pages`` pages that have no
        host copy, top-down: backed up (:meth:`begin_backup`), they give those pages host copies
        (e.g. for :meth:`insert_host` with ``start_page=num_pages``). A node without a host copy
        that straddles page ``num_pages`` is split there first, so no page past it is copied.
        Keep ``node`` locked on both tiers until the backup has begun."""
        self._check_alive(node)
        path = self.path_to(node)
        if as_int(num_pages) is None or not 0 <= num_pages <= (path[-1].end_page if path else 0):
            raise ConfigError(f"num_pages={num_pages} outside the path to {node}")
        gap = [n for n in path if n.start_page < num_pages and n.host_kv is None]
        if gap and gap[-1].end_page > num_pages:
            gap[-1] = self._split(gap[-1], num_pages - gap[-1].start_page)
        return gap

    def backup_pages_needed(self, nodes: Sequence[TreeNode]) -> tuple[int, int]:
        """(host KV pages, host state slots) that :meth:`begin_backup` of ``nodes`` needs."""
        kv = states = 0
        for n in nodes:
            if n.host_kv is None:
                kv += n.num_pages
            if self.host_mamba is not None and n.device_state is not None and n.host_state is None:
                states += 1
        return kv, states

    def begin_backup(
        self,
        nodes: Sequence[TreeNode],
        host_kv_indices: torch.Tensor | Sequence[int],
        host_state_slots: torch.Tensor | Sequence[int] | None = None,
    ) -> BackupPlan:
        """Attach host indices to ``nodes`` (in order: KV pages to nodes without a host copy,
        state slots to nodes whose device state has no host copy), pin them and return the
        copy to perform. Host copies stay a contiguous prefix: a node's parent must already have
        a host copy or come earlier in ``nodes``. Nodes needing nothing are skipped. Raises
        ``ConfigError`` / :class:`TreeError` without changing anything."""
        if self.host_kv is None:
            raise ConfigError("begin_backup needs a host tier")
        seen: set[int] = set()
        will_have: set[int] = set()
        work: list[tuple[TreeNode, bool, bool]] = []
        for n in nodes:
            if n.parent is None or not n.alive:
                raise TreeError(f"cannot back up {n}")
            if n.node_id in seen:
                raise ConfigError(f"{n} appears twice in a backup")
            seen.add(n.node_id)
            need_kv = n.host_kv is None
            need_state = self.host_mamba is not None and n.device_state is not None and n.host_state is None
            if need_kv:
                p = n.parent
                if p.parent is not None and p.host_kv is None and p.node_id not in will_have:
                    raise TreeError(f"host copies must stay contiguous: back up the parent of {n} first")
                will_have.add(n.node_id)
            if need_kv or need_state:
                work.append((n, need_kv, need_state))
        num_kv = sum(n.num_pages for n, k, _ in work if k)
        num_states = sum(1 for _, _, s in work if s)
        host_kv = self._check_indices(host_kv_indices, num_kv, "host_kv_indices", self.host_kv)
        slots = self._check_indices(
            _EMPTY if host_state_slots is None else host_state_slots, num_states, "host_state_slots", self.host_mamba
        )
        dev_kv: list[torch.Tensor] = []
        dev_states: list[int] = []
        off = si = 0
        segments: list[tuple[TreeNode, int, bool, bool]] = []
        for n, need_kv, need_state in work:
            if need_kv:
                assert n.device_kv is not None, f"{n} holds no KV on any tier"
                dev_kv.append(n.device_kv)
                self._set_host_kv(n, host_kv[off : off + n.num_pages])
                off += n.num_pages
            if need_state:
                assert n.device_state is not None
                dev_states.append(n.device_state)
                self._set_host_state(n, int(slots[si]))
                si += 1
            self._pin(n, 1, loading=False)
            segments.append((n, n.start_page, need_kv, need_state))
        for n, _, _ in reversed(work):
            self._touch(n)  # deepest first: ancestors stay more recent than descendants
        plan = BackupPlan(
            plan_id=self._next_id_for_plan(),
            nodes=tuple(n for n, _, _ in work),
            device_kv_indices=torch.cat(dev_kv) if dev_kv else _EMPTY,
            host_kv_indices=host_kv,
            device_state_slots=torch.tensor(dev_states, dtype=torch.int64),
            host_state_slots=slots,
            _segments=tuple(segments),
        )
        self._register(plan)
        return plan

    def finish_backup(self, plan: BackupPlan) -> None:
        """The copies of ``plan`` completed: unpin its nodes (now backed up)."""
        self._check_plan(plan)
        del self._plans[plan.plan_id]
        for node, top, _, _ in plan._segments:
            for n in list(_walk_up(node, top)):
                self._pin(n, -1, loading=False)

    def abort_backup(self, plan: BackupPlan) -> ReleasedIndices:
        """Undo :meth:`begin_backup` of a plan whose copies were never enqueued: detach the host
        indices (returned; the caller frees them) and unpin. A host state that a later backup gave
        one of the nodes whose host KV this plan brings is detached (and returned) too. Raises
        :class:`TreeError` when a later backup already hangs below these nodes or another
        in-flight copy covers them (abort or finish that one first; nothing changes)."""
        self._check_plan(plan)
        self._check_no_overlap(plan, plan_nodes(plan))
        kv_nodes = [n for node, top, kv, _ in plan._segments if kv for n in _walk_up(node, top)]
        ids = {n.node_id for n in kv_nodes}
        for n in kv_nodes:
            for c in n.children.values():
                if c.host_kv is not None and c.node_id not in ids:
                    raise TreeError(f"cannot abort backup {plan.plan_id}: {c} has a host copy below it")
        # A host state that another (finished) backup gave a node whose host KV this one brings
        # goes with that KV: a host state is only ever resumable over host KV.
        own_states = {node.node_id for node, _, _, state in plan._segments if state}
        orphans = [n for n in kv_nodes if n.host_state is not None and n.node_id not in own_states]
        own_pins = Counter(n.node_id for node, top, _, _ in plan._segments for n in _walk_up(node, top))
        for n in orphans:
            if n.host_lock > own_pins[n.node_id]:  # someone besides this plan holds the host data
                raise TreeError(f"cannot abort backup {plan.plan_id}: the host state of {n} is in use")
        del self._plans[plan.plan_id]
        for node, top, kv, state in plan._segments:
            walked = list(_walk_up(node, top))
            for n in walked:
                self._pin(n, -1, loading=False)
            if state:
                self._clear_host_state(node)
            if kv:
                for n in walked:
                    self._clear_host_kv(n)
        orphan_slots = [self._clear_host_state(n) for n in orphans]
        states = plan.host_state_slots
        if orphan_slots:
            states = torch.cat([states, torch.tensor(orphan_slots, dtype=torch.int64)])
        return ReleasedIndices(kv_indices=plan.host_kv_indices, state_slots=states)

    # ---- storage --------------------------------------------------------------------------------
    def mark_archived(self, node: TreeNode) -> None:
        """Record that ``node``'s pages (and state, if it has one) are stored in L3, so host
        eviction may drop them (``evict_host(archived_only=True)``)."""
        self._check_alive(node)
        if node.parent is not None:
            node.archived = True
