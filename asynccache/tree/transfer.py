"""The copy protocols between tiers, driven by the controller (the tree never copies bytes):
the backup protocol, and what every plan shares (the load protocol, built on it, is in
``asynccache.tree.load``).

Backup (device → host)::

    kv, states = tree.backup_pages_needed(nodes)
    plan = tree.begin_backup(nodes, host_kv_indices, host_state_slots)   # attach + pin
    …copy plan.device_kv_indices → plan.host_kv_indices, device_state_slots → host_state_slots
    tree.finish_backup(plan)      # unpin            | tree.abort_backup(plan)

``begin_*`` attaches the destination indices to the nodes at once (ownership passes to the tree)
and pins the nodes on both tiers, so neither the source nor the destination can be evicted,
deleted or handed to another copy while the bytes move. ``abort_*`` is for copies that were
never enqueued (or failed): it detaches the destination indices and returns them to the caller.
A plan covers its nodes even if an insert splits them meanwhile (the split copies the pins to
the new upper node, and the plan walks up from its deepest node to its first page).

Primitives: :class:`TransferMixin` (plan registry and checks, ``host_gap``,
``backup_pages_needed``, ``begin/finish/abort_backup``, ``mark_archived``); :func:`plan_nodes`,
the nodes a plan covers now.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from asynccache.checks import as_int
from asynccache.errors import ConfigError
from asynccache.tree.core import TreeCore
from asynccache.tree.errors import TreeError
from asynccache.tree.node import TreeNode
from asynccache.tree.pending import _walk_up
from asynccache.tree.results import BackupPlan, LoadPlan, ReleasedIndices

__all__ = ["TransferMixin"]

_EMPTY = torch.empty(0, dtype=torch.int64)


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
    """The plan registry and checks, ``begin/finish/abort_backup``, ``host_gap``,
    ``backup_pages_needed``, ``mark_archived``."""

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
        # A copy of data computed on a load still in flight is dropped if that load fails.
        self._pending.on_backup([(n, kv, st) for n, _, kv, st in segments], self.path_to)
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
