"""What depends on the tree's in-flight host → device loads, besides their own pins.

A load (``begin_load``) attaches device pages, or a state slot, to nodes whose bytes are still
on their way. While it is in flight three things may depend on it:

- **Readers.** The only way to reach those indices is a match made while the load is in
  flight (``pending_load``): the load's owner matched before it began, and took its lock then
  (``begin_load`` wants the match locked while room is made). So a device lock taken on a
  loading path belongs to another holder, a *reader* of each load in flight there: for a load
  of KV pages, any lock at or below the load's top node (the holder's match reads those pages);
  for a load of the boundary state alone, a lock on that very node (only a match ending there
  resumes from the state). The owner's own lock is never among them; ``abort_load`` compares
  against them.
- **Dependents** of a load that brings the boundary state alone. Such a load leaves the KV where
  it was, so the tree cannot tell from the device copies what was computed on the pending
  state: it records the nodes an ``insert`` gives device data below that state while the load
  is in flight (with their start page, so nodes split off them later are found too).
- **Retired** indices: a failed load whose readers still hold its nodes leaves the tree at once
  (no match offers its pages again), but its pages and slots go back to the pools only once
  those readers have released their locks.

An unlock cannot say whose lock it releases, so a reader count is capped at the locks left on
its node: an upper bound (a reader that leaves while an older lock on the same node stays is
counted until that one goes too). Too many readers is the safe side: a cancel refused lets the
load complete, and retired indices are held a little longer.

Primitives: :class:`PendingLoads` (one per tree; the tree's lock, insert and load protocol call
it), :class:`Retired`. Synchronous; mutates only its own records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from asynccache.tree.node import TreeNode
from asynccache.tree.results import LoadPlan

__all__ = ["PendingLoads", "Retired"]


@dataclass(slots=True)
class _Load:
    plan: LoadPlan
    #: locked node → device locks taken on it since the load began (an upper bound of those held)
    readers: dict[TreeNode, int] = field(default_factory=dict)
    #: for a load of the state alone: node given device data below the state → (its start page
    #: when recorded, whether it got KV pages rather than a state only)
    dependents: dict[TreeNode, tuple[int, bool]] = field(default_factory=dict)


@dataclass(slots=True)
class Retired:
    """Device indices of a failed load, detached from the tree and held for its ``readers``
    (locked node → locks that may still read them); freed when none is left."""

    kv_indices: torch.Tensor
    state_slots: torch.Tensor
    readers: dict[TreeNode, int]


def _top(plan: LoadPlan) -> TreeNode | None:
    """The highest node a load covers now (nodes split off its first one included)."""
    node = plan._last
    if node is None:
        return None
    while node.parent is not None and node.parent.parent is not None and node.parent.start_page >= plan._top_page:
        node = node.parent
    return node


def _reaches(plan: LoadPlan, path_ids: set[int], end: TreeNode) -> bool:
    """Whether a match (or a lock) whose path is ``path_ids``, ending at ``end``, reads what
    ``plan`` brings."""
    if plan._last is None:
        return False
    if plan.num_kv_pages == 0:  # the boundary state alone: read by what resumes from it
        return end is plan._last
    top = _top(plan)
    return top is not None and top.node_id in path_ids


def _cap(readers: dict[TreeNode, int], node: TreeNode) -> None:
    count = readers.get(node)
    if count is not None and count > node.num_locks:
        if node.num_locks:
            readers[node] = node.num_locks
        else:
            del readers[node]


class PendingLoads:
    """Readers, dependents and retired indices of a tree's loads (see the module docstring)."""

    def __init__(self) -> None:
        self._loads: dict[int, _Load] = {}
        self._retired: list[Retired] = []

    @property
    def active(self) -> bool:
        """Whether anything listens to locks and unlocks (a load in flight or retired indices)."""
        return bool(self._loads) or bool(self._retired)

    # ---- the load protocol ----------------------------------------------------------------
    def begin(self, plan: LoadPlan) -> None:
        """``plan`` is in flight (a plan with nodes)."""
        self._loads[plan.plan_id] = _Load(plan)

    def end(self, plan: LoadPlan) -> None:
        """``plan`` finished or was aborted: forget its readers and dependents."""
        self._loads.pop(plan.plan_id, None)

    def num_readers(self, plan: LoadPlan) -> int:
        rec = self._loads.get(plan.plan_id)
        return sum(rec.readers.values()) if rec is not None else 0

    def readers(self, plan: LoadPlan) -> dict[TreeNode, int]:
        """A copy of ``plan``'s reader counts."""
        rec = self._loads.get(plan.plan_id)
        return dict(rec.readers) if rec is not None else {}

    def covering(self, path: Sequence[TreeNode], end: TreeNode) -> tuple[LoadPlan, ...]:
        """The loads in flight that write into a usable prefix ``path`` (top-down) ending at
        ``end``: the KV pages of one of its nodes, or the state at ``end``."""
        if not self._loads:
            return ()
        ids = {n.node_id for n in path}
        return tuple(rec.plan for rec in self._loads.values() if _reaches(rec.plan, ids, end))

    # ---- locks ------------------------------------------------------------------------------
    def on_lock(self, node: TreeNode, path: Sequence[TreeNode]) -> None:
        """``lock(node)`` happened on ``path`` (top-down, ``node`` last), which runs through a
        loading node: count it as a reader of each load it reaches."""
        ids = {n.node_id for n in path}
        for rec in self._loads.values():
            if _reaches(rec.plan, ids, node):
                rec.readers[node] = rec.readers.get(node, 0) + 1

    def on_unlock(self, node: TreeNode) -> list[Retired]:
        """``unlock(node)`` happened (``node.num_locks`` already lowered): cap the counts of
        ``node``; return the retired records no reader holds any more (forgotten here; the
        caller frees their indices)."""
        for rec in self._loads.values():
            _cap(rec.readers, node)
        if not self._retired:
            return []
        freed: list[Retired] = []
        for r in self._retired:
            _cap(r.readers, node)
            if not r.readers:
                freed.append(r)
        if freed:
            self._retired = [r for r in self._retired if r.readers]
        return freed

    # ---- inserts ----------------------------------------------------------------------------
    def on_insert(self, path: Sequence[TreeNode], fresh_kv: Iterable[TreeNode], fresh_states: Iterable[TreeNode]) -> None:
        """An insert along ``path`` (top-down) gave device pages to ``fresh_kv`` and device
        states to ``fresh_states``: record those below a pending state as its dependents."""
        if not self._loads:
            return
        kv_nodes, state_nodes = set(fresh_kv), set(fresh_states)
        for rec in self._loads.values():
            last = rec.plan._last
            if rec.plan.num_kv_pages or last is None:
                continue
            below = next((i + 1 for i, n in enumerate(path) if n is last), None)
            if below is None:
                continue
            for n in path[below:]:
                got_kv = n in kv_nodes
                if got_kv or n in state_nodes:
                    start, kv = rec.dependents.get(n, (n.start_page, False))
                    rec.dependents[n] = (min(start, n.start_page), kv or got_kv)

    def dependents(self, plan: LoadPlan) -> list[tuple[TreeNode, int, bool]]:
        """``(node, start page when recorded, got KV)`` of ``plan``'s dependents."""
        rec = self._loads.get(plan.plan_id)
        return [] if rec is None else [(n, start, kv) for n, (start, kv) in rec.dependents.items()]

    # ---- retired indices --------------------------------------------------------------------
    def retire(self, kv_indices: torch.Tensor, state_slots: torch.Tensor, readers: dict[TreeNode, int]) -> None:
        """Hold device indices a failed load detached until ``readers`` have released them."""
        self._retired.append(Retired(kv_indices=kv_indices, state_slots=state_slots, readers=dict(readers)))

    @property
    def retired(self) -> tuple[Retired, ...]:
        return tuple(self._retired)

    def reader_counts(self) -> Iterator[tuple[int, TreeNode, int]]:
        """``(plan id or -1 for retired indices, node, count)`` of every reader (integrity)."""
        for plan_id, rec in self._loads.items():
            for node, count in rec.readers.items():
                yield plan_id, node, count
        for r in self._retired:
            for node, count in r.readers.items():
                yield -1, node, count

    @property
    def plan_ids(self) -> frozenset[int]:
        return frozenset(self._loads)
