"""The load protocol (host → device), driven by the controller (the tree never copies bytes).

::

    plan = tree.begin_load(match, device_kv_indices, device_state_slot)   # attach + pin
    …copy plan.host_kv_indices → plan.device_kv_indices (per layer), host_state_slot → device_state_slot
    tree.finish_load(plan)        # unpin            | tree.abort_load(plan)   # detach: never issued, or failed

``begin_load`` attaches the destination indices to the nodes at once (ownership passes to the
tree) and pins them on both tiers, so neither the host source nor the device destination can be
evicted, deleted or handed to another copy while the bytes move. A match that reaches data being
loaded reports ``pending_load``; :meth:`LoadMixin.pending_loads` names the loads it waits for and
:meth:`LoadMixin.match_is_current` says afterwards whether what it reported is still there.
Whoever locks a loading path meanwhile reads what the load brings, and what an insert computes
on it, with the host copies backups make of that, depends on it (``asynccache.tree.pending``):
``abort_load`` answers to each.

Primitives: :class:`LoadMixin` — ``begin_load``, ``finish_load``, ``abort_load``,
``pending_loads``, ``match_is_current``. The backup protocol and the plans' shared checks are in
``asynccache.tree.transfer``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asynccache.checks import as_int
from asynccache.errors import ConfigError
from asynccache.tree.errors import TreeError
from asynccache.tree.node import Tier, TreeNode
from asynccache.tree.results import LoadPlan, MatchResult, ReleasedIndices
from asynccache.tree.transfer import TransferMixin, _subtree, _walk_up

__all__ = ["LoadMixin"]

_EMPTY = torch.empty(0, dtype=torch.int64)


def _host_in_use(tops: Sequence[TreeNode], states: Sequence[TreeNode], segment: Sequence[TreeNode]) -> TreeNode | None:
    """A node whose host copy :meth:`LoadMixin._drop_host_copies` would drop (or delete) while
    someone uses it: pinned on the host (a copy from or into it, an archive reading it, a
    caller's ``lock_host``), or locked on the device while that copy is all it holds. A loaded
    node (of ``segment``) is pinned once by the load itself, which the undo releases."""
    for top in tops:
        for d in _subtree(top):
            if d.host_kv is not None and (d.host_lock or d.loading or (d.device_kv is None and d.device_lock)):
                return d
    loaded = {n.node_id for n in segment}
    return next((n for n in states if n.host_lock > (n.node_id in loaded)), None)


class LoadMixin(TransferMixin):
    """The load protocol on top of the backup protocol (see the module docstring)."""

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
        while making room. A caller that keeps the prefix locked for its own use takes that lock
        before the load begins: locks taken on the loaded nodes later are other requests'
        (readers, see :meth:`abort_load`). Raises :class:`TreeError` for a stale match and
        ``ConfigError`` for wrong index counts (nothing changes then; the caller keeps the
        indices).
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
        self._pending.begin(plan)
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
        self._pending.end(plan)
        if plan._last is not None:
            for n in list(_walk_up(plan._last, plan._top_page)):
                self._pin(n, -1, loading=True)

    def abort_load(self, plan: LoadPlan, *, drop_below: bool = False) -> ReleasedIndices:
        """Undo :meth:`begin_load` of a plan whose copies were never enqueued, or failed: detach
        the device indices and unpin; returns the indices the caller frees. Nothing changes when
        it raises :class:`TreeError`, which it does when:

        - another in-flight copy covers the loaded nodes;
        - device data was computed on what the load brings (for a load of KV pages: device
          data below the loaded nodes; for a load of the boundary state alone: what inserts gave
          device pages or states below that state while the load was in flight), or a backup
          begun meanwhile copied such data to the host, or an ``insert_host`` restored host
          copies below the loaded nodes meanwhile (they may be such data, archived and evicted
          before the failure was known) — unless ``drop_below`` (the copy failed:
          that data would be served after pages or a state the copy never filled), then that
          data loses its device copy too (a node that only got a state there loses the state),
          and those host copies go (with the host copies below them; a node left without KV on
          any tier goes too), and only a node of it in use (locked, or in a copy: a backup still
          writing such a host copy included) makes it raise; ``stale_hook`` then hears the
          storage keys such data would have been archived under (see
          ``asynccache.tree.pending``), and the nodes left holding one of those keys are no
          longer marked archived;
        - without ``drop_below`` (a cancel), other requests read what the load brings: locks
          taken on the loaded nodes since it began (the owner's was taken before). The load
          must complete for them.

        With ``drop_below``, while such readers or any lock taken on the loaded nodes themselves
        are held — the owner's included: it locked its match before the load began, and may
        have computed on the pages already (a copy that fails after the step's last layer was
        issued leaves the forward running) and pass them back in its insert — the nodes lose
        the failed copy at once (no match offers it again) but its pages and slot, and a state
        attached to the loaded nodes meanwhile, stay the tree's until the last of those locks is
        released (``unlock`` frees them then), and the indices returned are empty.
        """
        self._check_plan(plan)
        released = ReleasedIndices(kv_indices=plan.device_kv_indices, state_slots=plan.device_state_slots)
        last = plan._last
        if last is None:
            del self._plans[plan.plan_id]
            return released
        segment = list(_walk_up(last, plan._top_page))
        self._check_no_overlap(plan, segment)
        loaded_kv = plan.num_kv_pages > 0
        below, states_below = self._built_on(plan, segment)
        host_tops, host_states = self._copies_built_on(plan)
        built = [*below, *states_below, *host_tops, *host_states]
        if built and not drop_below:
            what = "pages" if loaded_kv else "state"
            raise TreeError(f"cannot abort load {plan.plan_id}: {built[0]} already uses the loaded {what}")
        busy = next((d for d in (*below, *states_below) if d.device_lock or d.host_lock or d.loading), None)
        if busy is None:
            busy = _host_in_use(host_tops, host_states, segment)
        if busy is not None:
            raise TreeError(f"cannot abort load {plan.plan_id}: {busy} uses what it loads and is in use")
        none: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        report = drop_below and self.stale_hook is not None
        stale_keys = self._pending.computed_keys(plan) if report else none
        reported = [n for n, _ in self._pending.computed_pieces(plan)] if report else []
        readers = self._pending.readers(plan)
        if readers and not drop_below:
            raise TreeError(
                f"cannot abort load {plan.plan_id}: {len(readers)} lock(s) taken on its nodes since it "
                "began may read what it brings"
            )
        if drop_below:
            # A failed copy: the locks on the loaded nodes themselves hold its indices too. The
            # owner's, taken before the load began, is no reader of it, but its holder computes
            # on those pages (a forward that passed every layer's wait before the copy after the
            # last layer failed) and passes them back in its insert.
            for n in segment:
                for token in n.lock_tokens or ():
                    readers.setdefault(token, n)
        del self._plans[plan.plan_id]
        self._pending.end(plan)
        for n in segment:
            self._pin(n, -1, loading=True)
        meanwhile: list[int] = []
        for n in segment:
            if n.device_state is not None:
                if n is last and n.device_state == plan.device_state_slot:
                    self._clear_device_state(n)
                elif loaded_kv:
                    # A state an insert attached meanwhile: tree-owned, and it cannot outlive the KV.
                    meanwhile.append(self._clear_device_state(n))
            if loaded_kv:
                self._clear_device_kv(n)
        if readers:
            # Held, not freed: the copy never landed, so the pages cannot stay in the tree as
            # valid, but a holder of those locks (a reader, the owner) may have launched a read
            # of them already or pass them back (an insert of its match's pages); freed now,
            # they could go to another request and be written under that read, or be owned
            # twice. They leave the tree at once (a new match loads the prefix afresh) and
            # return to the pools when those locks are released.
            slots = released.state_slots
            if meanwhile:
                slots = torch.cat([slots, torch.tensor(meanwhile, dtype=torch.int64)])
            self._pending.retire(released.kv_indices, slots, readers)
            released = ReleasedIndices()
        elif meanwhile:
            self.device_mamba.free(torch.tensor(meanwhile, dtype=torch.int64))
        for n in states_below:
            if n.alive and n.device_state is not None:
                self._free_device_state(n)
        # Once the loaded pages are detached (a cascade must not free them: the caller does),
        # deepest first: a node dropped whole is a leaf by then.
        for d in reversed(below):
            if d.alive:
                self._drop_device(d)  # type: ignore[attr-defined]  (the eviction mixin's)
        for n in (*states_below, last):
            if n.alive:
                self._cascade(n)
        self._drop_host_copies(host_tops, host_states)
        for n in reported:
            # What storage holds under its keys may go (the tier may delete it): not archived.
            n.archived = False
        if (stale_keys[0] or stale_keys[1]) and self.stale_hook is not None:
            self.stale_hook(*stale_keys)
        return released

    def _copies_built_on(self, plan: LoadPlan) -> tuple[list[TreeNode], list[TreeNode]]:
        """Host copies that backups made of device data computed on ``plan`` while it was in
        flight, and those ``insert_host`` restored below it meanwhile: the highest nodes whose
        host copies go with every host copy below them (an ancestor's subtree first, nested
        ones left out), and nodes whose host state alone goes."""
        tops: list[TreeNode] = []
        states: list[TreeNode] = []
        for node, start, kv, state in self._pending.backups(plan):
            if not node.alive:
                continue
            if kv:
                top = list(_walk_up(node, start))[-1]  # pages split off it since count too
                if top.host_kv is not None:
                    tops.append(top)
            elif state and node.host_state is not None:
                states.append(node)
        kept: list[TreeNode] = []
        seen: set[int] = set()
        for top in sorted(tops, key=lambda n: n.start_page):
            if top.node_id not in seen:
                kept.append(top)
                seen.update(d.node_id for d in _subtree(top))
        return kept, [n for n in dict.fromkeys(states) if n.node_id not in seen]

    def _drop_host_copies(self, tops: Sequence[TreeNode], states: Sequence[TreeNode]) -> None:
        """Drop the host copies :meth:`_copies_built_on` found (checked not in use): deepest
        first, a node left without KV on any tier deleted, then the tombstone cascade. What
        stays on the device is no longer in storage either (``archived`` cleared)."""
        for top in tops:
            for d in reversed(_subtree(top)):
                if not d.alive or d.host_kv is None:
                    continue
                if d.device_kv is None:
                    assert not d.children, f"{d} has children but no device KV"
                    parent = d.parent
                    assert parent is not None
                    self._delete(d)
                    self._cascade(parent)
                    continue
                if d.host_state is not None:
                    self._free_host_state(d)
                self._free_host_kv(d)
                d.archived = False
                self._cascade(d)
        for n in states:
            if n.alive and n.host_state is not None:
                self._free_host_state(n)
                n.archived = False
                self._cascade(n)

    def _built_on(self, plan: LoadPlan, segment: Sequence[TreeNode]) -> tuple[list[TreeNode], list[TreeNode]]:
        """Device data computed on what ``plan`` brings: nodes whose device copy goes with a
        failed load (parents before children), and nodes whose device state alone goes."""
        below: list[TreeNode] = []
        if plan.num_kv_pages:
            # Nothing below host-only KV was on the device when the load began: all of it is.
            ids = {n.node_id for n in segment}
            for n in segment:
                for c in n.children.values():
                    if c.device_kv is not None and c.node_id not in ids:
                        below.extend(d for d in _subtree(c) if d.device_kv is not None)
            return below, []
        tops: list[TreeNode] = []
        states: list[TreeNode] = []
        for node, start, got_kv in self._pending.dependents(plan):
            if not node.alive:
                continue
            if got_kv:
                top = list(_walk_up(node, start))[-1]  # pages split off it since count too
                if top.device_kv is not None:
                    tops.append(top)
            elif node.device_state is not None:
                states.append(node)
        seen: set[int] = set()
        for top in sorted(tops, key=lambda n: n.start_page):  # an ancestor's subtree first
            if top.node_id not in seen:
                for d in _subtree(top):
                    if d.device_kv is not None and d.node_id not in seen:
                        seen.add(d.node_id)
                        below.append(d)
        return below, [n for n in states if n.node_id not in seen]

    # ---- waiting for loads ------------------------------------------------------------------------
    def pending_loads(self, match: MatchResult) -> tuple[LoadPlan, ...]:
        """The loads in flight now that write into ``match``'s usable prefix: the KV pages of a
        node of its path, or the state at its end (``match.pending_load`` said there were some
        when it was made). Empty for a miss and for a match whose node was deleted."""
        last = match.last_node
        if last.parent is None or not last.alive:
            return ()
        return self._pending.covering(self.path_to(last), last)

    def match_is_current(self, match: MatchResult) -> bool:
        """Whether what ``match`` reported on the device is still there: its node alive, its
        ``device_kv_indices`` still the pages of its prefix, and a state on the device at its
        end when it reported one there. False once a load it waited for failed or was cancelled
        (its pages left the nodes), or its pages were evicted; the indices may also have come
        back through a later load or insert, whose bytes are then right. Pair with
        :meth:`pending_loads` (a load still in flight has not landed)."""
        last = match.last_node
        if last.parent is None:
            return True
        if not last.alive:
            return False
        want = match.device_kv_indices
        num_pages = int(want.numel())
        parts: list[torch.Tensor] = []
        have = 0
        for n in self.path_to(last):
            if have >= num_pages:
                break
            if n.device_kv is None:
                return False
            parts.append(n.device_kv)
            have += n.num_pages
        if have != num_pages or (parts and not torch.equal(torch.cat(parts), want)):
            return False
        return match.state_tier is not Tier.DEVICE or last.device_state is not None
