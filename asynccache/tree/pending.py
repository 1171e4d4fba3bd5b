"""What depends on the tree's in-flight host → device loads, besides their own pins.

A load (``begin_load``) attaches device pages, or a state slot, to nodes whose bytes are still
on their way. While it is in flight these things may depend on it:

- **Readers.** The only way to reach those indices is a match made while the load is in
  flight (``pending_load``): the load's owner matched before it began, and took its lock then
  (``begin_load`` wants the match locked while room is made). So a device lock taken on a
  loading path belongs to another holder, a *reader* of each load in flight there: for a load
  of KV pages, any lock at or below the load's top node (the holder's match reads those pages);
  for a load of the boundary state alone, a lock on that very node (only a match ending there
  resumes from the state). The owner's own lock is never among them: a cancel
  (``abort_load`` without ``drop_below``) is refused only for readers.
- **Dependents** of a load that brings the boundary state alone. Such a load leaves the KV where
  it was, so the tree cannot tell from the device copies what was computed on the pending
  state: it records the nodes an ``insert`` gives device data below that state while the load
  is in flight (with their start page, so nodes split off them later are found too).
- **Copies of what was computed on it**, for a load of either kind: the host copies a backup
  begun while the load is in flight makes of device data resting on it (for a load of KV pages:
  of nodes below its nodes, and of a state an insert gave one of them; for a load of a state
  alone: of its dependents and what hangs below those that got KV), the host copies an
  ``insert_host`` restores below it meanwhile (what was computed on it may have been archived
  and evicted, then restored from storage, before its failure was known; a restore cannot tell,
  so every one below it counts), and what inserts computed
  on it meanwhile, for its storage keys: what a host copy archived to storage, or a
  storage-only snapshot, would be stored under — the KV of the pages an insert gave nodes, and
  a state at any page of its path from the load's top (for a load of a state alone: past its
  node; for a load of KV pages, conservatively, the loaded nodes' own pages too). A failed
  copy's undo drops those host copies and reports those keys (``tree.stale_hook``).
- **Retired** indices: a failed load whose nodes are still held leaves the tree at once (no
  match offers its pages again), but its pages and slots go back to the pools only once the
  locks that hold them have been released: its readers', and every lock on the loaded nodes
  themselves — the owner's among them, since a copy that fails after the step's last layer was
  issued leaves the owner computing on the pages. Until then they are the tree's: an insert
  that passes them back (a match that never got their bytes) is refused.

Readers are lock tokens (``lock`` returns one, ``unlock(node, token)`` releases that lock, the
token required): a reader leaves exactly when its own lock is released, so locks taken on the
same node after a load failed (new requests of a hot prefix) never hold its retired indices.
Each reader token maps to the records that count it, so an unlock of a lock no record counts
costs one dict lookup.

Primitives: :class:`PendingLoads` (one per tree; the tree's lock, insert and load protocol call
it), :class:`Retired`. Synchronous; mutates only its own records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asynccache.tree.node import TreeNode
from asynccache.tree.results import LoadPlan

__all__ = ["PendingLoads", "Retired"]


@dataclass(slots=True, eq=False)
class _Load:
    plan: LoadPlan
    #: a load of the boundary state alone (no KV pages)
    state_only: bool
    #: lock token → its node, of the device locks taken on the load's path since it began
    readers: dict[int, TreeNode] = field(default_factory=dict)
    #: for a load of the state alone: node given device data below the state → (its start page
    #: when recorded, whether it got KV pages rather than a state only)
    dependents: dict[TreeNode, tuple[int, bool]] = field(default_factory=dict)
    #: the highest node the load covered when last looked up (see :func:`_top`)
    top: TreeNode | None = None
    #: backups begun while in flight of data resting on the load: (node, its start page then,
    #: whether its host KV rests on the load, whether its host state does)
    backups: list[tuple[TreeNode, int, bool, bool]] = field(default_factory=list)
    #: what inserts computed on the load, for its storage keys: node → (its start page when
    #: recorded, whether the insert gave it KV pages)
    computed: dict[TreeNode, tuple[int, bool]] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Retired:
    """Device indices of a failed load, detached from the tree and held for its ``readers``
    (lock token → its node, of the locks that may still read them); freed when none is left."""

    kv_indices: torch.Tensor
    state_slots: torch.Tensor
    readers: dict[int, TreeNode]


def _top(plan: LoadPlan) -> TreeNode | None:
    """The highest node a load covers now (nodes split off its first one included)."""
    node = plan._last
    if node is None:
        return None
    while node.parent is not None and node.parent.parent is not None and node.parent.start_page >= plan._top_page:
        node = node.parent
    return node


def _current_top(rec: _Load) -> TreeNode | None:
    """The highest node ``rec``'s load covers now (looked up again after a split of it)."""
    top = rec.top
    # Loaded nodes are pinned (never deleted), and a split of the top moves its start down.
    if top is None or top.start_page != rec.plan._top_page:
        rec.top = top = _top(rec.plan)
    return top


def _reaches(rec: _Load, path_ids: set[int], end: TreeNode) -> bool:
    """Whether a match (or a lock) whose path is ``path_ids``, ending at ``end``, reads what
    ``rec``'s load brings."""
    if rec.state_only:  # read by what resumes from that state
        return end is rec.plan._last
    top = _current_top(rec)
    return top is not None and top.node_id in path_ids


def _walk_up(node: TreeNode, top_page: int) -> Iterator[TreeNode]:
    """``node`` and its ancestors that start at or below page ``top_page`` (deepest first)."""
    n: TreeNode | None = node
    while n is not None and n.parent is not None and n.start_page >= top_page:
        yield n
        n = n.parent


def _footprint(rec: _Load) -> tuple[frozenset[int], frozenset[int]]:
    """The nodes data resting on ``rec``'s load hangs from, by id: for a load of KV pages, its
    loaded nodes twice (data below them was computed on their pages; a state given to one of
    them meanwhile rests on them too); for a load of a state alone, the pieces of its
    dependents that got KV pages (data below them rests on it), and every piece of its
    dependents (their own data does)."""
    last = rec.plan._last
    if last is None:
        return frozenset(), frozenset()
    if not rec.state_only:
        loaded = frozenset(n.node_id for n in _walk_up(last, rec.plan._top_page))
        return loaded, loaded
    below: set[int] = set()
    own: set[int] = set()
    for dep, (start, got_kv) in rec.dependents.items():
        if dep.alive:
            ids = {p.node_id for p in _walk_up(dep, start)}
            own |= ids
            if got_kv:
                below |= ids
    return frozenset(below), frozenset(own)


def _rests_on(
    rec: _Load, footprint: tuple[frozenset[int], frozenset[int]], node: TreeNode, path: Sequence[TreeNode]
) -> tuple[bool, bool]:
    """Whether the device KV, and the device state, of ``node`` (``path``: top-down, ending at
    it) rest on ``rec``'s load (were computed while it was in flight, on what it brings);
    ``footprint``: :func:`_footprint` of ``rec``."""
    below, own = footprint
    if (rec.state_only or node.node_id not in own) and any(n.node_id in below for n in path[:-1]):
        # Below a loaded node (any of them, a branch off an upper one included: on the device
        # only since the load began), or below what was computed on the pending state.
        return True, True
    if not rec.state_only:
        return False, node.node_id in own  # a state given to a loaded node meanwhile
    return node.node_id in below, node.node_id in own


class PendingLoads:
    """Readers, dependents and retired indices of a tree's loads (see the module docstring)."""

    def __init__(self) -> None:
        self._loads: dict[int, _Load] = {}
        self._retired: list[Retired] = []
        #: lock token → the records (loads in flight, retired indices) that count it as a reader
        self._reader_of: dict[int, list[_Load | Retired]] = {}

    @property
    def has_readers(self) -> bool:
        """Whether an unlock may release a reader (some lock is a reader)."""
        return bool(self._reader_of)

    def _add_reader(self, rec: _Load | Retired, token: int, node: TreeNode) -> None:
        if token not in rec.readers:
            self._reader_of.setdefault(token, []).append(rec)
        rec.readers[token] = node

    def _forget_readers(self, rec: _Load | Retired) -> None:
        for token in rec.readers:
            recs = [r for r in self._reader_of[token] if r is not rec]
            if recs:
                self._reader_of[token] = recs
            else:
                del self._reader_of[token]

    # ---- the load protocol ----------------------------------------------------------------
    def begin(self, plan: LoadPlan) -> None:
        """``plan`` is in flight (a plan with nodes)."""
        self._loads[plan.plan_id] = _Load(plan, state_only=plan.num_kv_pages == 0)

    def end(self, plan: LoadPlan) -> None:
        """``plan`` finished or was aborted: forget its readers and dependents."""
        rec = self._loads.pop(plan.plan_id, None)
        if rec is not None:
            self._forget_readers(rec)

    def readers(self, plan: LoadPlan) -> dict[int, TreeNode]:
        """A copy of ``plan``'s readers (lock token → its node)."""
        rec = self._loads.get(plan.plan_id)
        return dict(rec.readers) if rec is not None else {}

    def covering(self, path: Sequence[TreeNode], end: TreeNode) -> tuple[LoadPlan, ...]:
        """The loads in flight that write into a usable prefix ``path`` (top-down) ending at
        ``end``: the KV pages of one of its nodes, or the state at ``end``."""
        if not self._loads:
            return ()
        ids = {n.node_id for n in path}
        return tuple(rec.plan for rec in self._loads.values() if _reaches(rec, ids, end))

    # ---- locks ------------------------------------------------------------------------------
    def on_lock(self, node: TreeNode, path: Sequence[TreeNode], token: int) -> None:
        """``lock(node)`` returned ``token`` on ``path`` (top-down, ``node`` last), which runs
        through a loading node: count it as a reader of each load it reaches."""
        ids = {n.node_id for n in path}
        for rec in self._loads.values():
            if _reaches(rec, ids, node):
                self._add_reader(rec, token, node)

    def on_unlock(self, token: int) -> list[Retired]:
        """The lock ``token`` was released: it reads nothing any more. Returns the retired
        records no reader holds any more (forgotten here; the caller frees their indices). One
        lookup for a lock no record counts."""
        recs = self._reader_of.pop(token, None)
        if recs is None:
            return []
        freed: list[Retired] = []
        for rec in recs:
            del rec.readers[token]
            if isinstance(rec, Retired) and not rec.readers:
                freed.append(rec)
        if freed:
            self._retired = [r for r in self._retired if r.readers]
        return freed

    # ---- inserts and backups -------------------------------------------------------------------
    def on_insert(self, path: Sequence[TreeNode], fresh_kv: Iterable[TreeNode], fresh_states: Iterable[TreeNode]) -> None:
        """An insert along ``path`` (top-down) gave device pages to ``fresh_kv`` and device
        states to ``fresh_states``: record those below a pending state as its dependents, and
        for a load of either kind the storage keys of what it computed past the load's top (a
        load of a state alone: past its node)."""
        if not self._loads:
            return
        kv_nodes, state_nodes = set(fresh_kv), set(fresh_states)
        for rec in self._loads.values():
            last = rec.plan._last
            if last is None:
                continue
            top = last if rec.state_only else _current_top(rec)
            at = next((i for i, n in enumerate(path) if n is top), None)
            if at is None:
                continue
            below = at + 1 if rec.state_only else at
            for n in path[below:]:
                got_kv = n in kv_nodes
                start, kv = rec.computed.get(n, (n.start_page, False))
                rec.computed[n] = (min(start, n.start_page), kv or got_kv)
                if rec.state_only and (got_kv or n in state_nodes):
                    start, kv = rec.dependents.get(n, (n.start_page, False))
                    rec.dependents[n] = (min(start, n.start_page), kv or got_kv)

    def on_backup(self, segments: Sequence[tuple[TreeNode, bool, bool]], path_of: Any) -> None:
        """A backup began of ``segments`` (node, whether its KV is copied, whether its state
        is): record, for each load in flight, those copies of data resting on it.
        ``path_of(node)``: the node's path, top-down."""
        if not self._loads:
            return
        feet = [(rec, _footprint(rec)) for rec in self._loads.values()]
        for node, copies_kv, copies_state in segments:
            path = path_of(node)
            for rec, footprint in feet:
                kv, state = _rests_on(rec, footprint, node, path)
                kv, state = kv and copies_kv, state and copies_state
                if kv or state:
                    rec.backups.append((node, node.start_page, kv, state))

    def on_restore(
        self, path: Sequence[TreeNode], fresh_kv: Iterable[TreeNode], fresh_states: Iterable[TreeNode]
    ) -> None:
        """``insert_host`` along ``path`` (top-down) gave host pages to ``fresh_kv`` and host
        states to ``fresh_states``: record, for each load in flight, those host copies that may
        rest on it, as a backup's. Restored from storage, they may be what was computed on the
        load, backed up, archived and evicted while it is still in flight (stored before its
        failure was known), and nothing tells when they were computed: every one below a loaded
        node counts (for a load of a state alone, below that state), and a host state given to
        a loaded node."""
        kv_nodes, state_nodes = set(fresh_kv), set(fresh_states)
        if not self._loads or not (kv_nodes or state_nodes):
            return
        for rec in self._loads.values():
            last = rec.plan._last
            if last is None:
                continue
            loaded = {last.node_id} if rec.state_only else _footprint(rec)[0]
            below = False
            for n in path:
                kv = below and n in kv_nodes
                state = n in state_nodes and (below or (not rec.state_only and n.node_id in loaded))
                if kv or state:
                    rec.backups.append((n, n.start_page, kv, state))
                below = below or n.node_id in loaded

    def backups(self, plan: LoadPlan) -> list[tuple[TreeNode, int, bool, bool]]:
        """The backups of data resting on ``plan`` (see ``_Load.backups``)."""
        rec = self._loads.get(plan.plan_id)
        return [] if rec is None else list(rec.backups)

    def computed_pieces(self, plan: LoadPlan) -> list[tuple[TreeNode, bool]]:
        """The nodes inserts computed on ``plan`` (see ``on_insert``), the pieces split off
        them since included, each with whether it got KV pages; deleted ones too."""
        rec = self._loads.get(plan.plan_id)
        computed = [] if rec is None else rec.computed.items()
        return [(piece, got_kv) for node, (start, got_kv) in computed for piece in _walk_up(node, start)]

    def computed_keys(self, plan: LoadPlan) -> tuple[frozenset[str], frozenset[str]]:
        """The storage keys of what inserts computed on ``plan`` (see ``on_insert``): (KV
        keys, state keys). Hashed now, not at each insert (a load rarely fails); a node deleted
        or split since is hashed all the same (its key and parents stay)."""
        kv: set[str] = set()
        states: set[str] = set()
        for piece, got_kv in self.computed_pieces(plan):
            keys = piece.page_hashes
            states.update(keys)
            if got_kv:
                kv.update(keys)
        return frozenset(kv), frozenset(states)

    def dependents(self, plan: LoadPlan) -> list[tuple[TreeNode, int, bool]]:
        """``(node, start page when recorded, got KV)`` of ``plan``'s dependents."""
        rec = self._loads.get(plan.plan_id)
        return [] if rec is None else [(n, start, kv) for n, (start, kv) in rec.dependents.items()]

    # ---- retired indices --------------------------------------------------------------------
    def retire(self, kv_indices: torch.Tensor, state_slots: torch.Tensor, readers: dict[int, TreeNode]) -> None:
        """Hold device indices a failed load detached until the locks ``readers`` (token → its
        node) have been released."""
        rec = Retired(kv_indices=kv_indices, state_slots=state_slots, readers={})
        for token, node in readers.items():
            self._add_reader(rec, token, node)
        self._retired.append(rec)

    @property
    def retired(self) -> tuple[Retired, ...]:
        return tuple(self._retired)

    def retired_among(self, kv_indices: torch.Tensor, state_slots: Iterable[int]) -> tuple[list[int], list[int]]:
        """The retired device pages among ``kv_indices`` and the retired slots among
        ``state_slots`` (both empty at once when nothing is retired)."""
        if not self._retired:
            return [], []
        kv = torch.cat([r.kv_indices for r in self._retired])
        slots = {int(s) for r in self._retired for s in r.state_slots.tolist()}
        pages = kv_indices[torch.isin(kv_indices, kv)].tolist() if kv.numel() else []
        return pages, [int(s) for s in state_slots if int(s) in slots]

    def reader_locks(self) -> Iterator[tuple[int, int, TreeNode]]:
        """``(plan id or -1 for retired indices, lock token, its node)`` of every reader
        (integrity)."""
        for plan_id, rec in self._loads.items():
            for token, node in rec.readers.items():
                yield plan_id, token, node
        for r in self._retired:
            for token, node in r.readers.items():
                yield -1, token, node

    def index_matches(self) -> bool:
        """Whether the token → records index lists exactly the records counting each reader
        (integrity)."""
        want: dict[int, list[int]] = {}
        for rec in (*self._loads.values(), *self._retired):
            for token in rec.readers:
                want.setdefault(token, []).append(id(rec))
        have = {token: sorted(id(r) for r in recs) for token, recs in self._reader_of.items()}
        return have == {token: sorted(ids) for token, ids in want.items()}

    @property
    def plan_ids(self) -> frozenset[int]:
        return frozenset(self._loads)
