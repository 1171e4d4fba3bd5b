""":class:`EvictionMixin`: eviction of the hybrid radix tree — ``evict_device``, ``evict_host``,
``release_states``. (Eviction by bytes builds on it: :mod:`asynccache.tree.evict_bytes`;
allocation that evicts to make room: :mod:`asynccache.tree.alloc`.)

Device eviction, per victim (offered by the eviction policy, least valuable first):

- **demote** — the host already holds everything the device holds (``backed up``): free the
  device copy, the node stays on the host.
- **write back** — under ``write_back`` a node that is not backed up (and still worth keeping:
  it has a state or children) is handed, with its ancestors that lack a host copy, to the
  ``write_back(nodes) -> bool`` callback. The controller implements it by allocating host slots
  and calling ``begin_backup``; the backup pins the nodes, so they are *not* freed in this call
  (``EvictResult.num_pending_*``). Once ``finish_backup`` has run they are backed up and the next
  eviction demotes them. A synchronous callback that finishes the backup before returning lets
  the same call demote them. A node whose backup could not be started is dropped; when that
  leaves its parent a device leaf and more room is needed, the call goes on in another round,
  in which the parent is a victim in its turn (handed to the write-back in a smaller batch: a
  host state pool smaller than a chain's states takes the top of the chain; dropped if that
  fails too), so one call frees what it was asked for whenever eviction can.
- **drop** — otherwise (write-through modes, no host tier, dead weight): free the device copy.
  A state lost this way leaves a tombstone (KV kept, no state) at an interior node; a childless
  node without any state is deleted, and the deletion cascades up through stateless parents.

A KV victim must be a leaf of the device tier (no child holds device KV) so device KV stays
prefix-closed; states have no such constraint. Locked nodes and nodes with an in-flight copy
are never evicted. Host eviction is the same without write-back: host copies are dropped
leaf-first, so they stay a contiguous prefix from the root; a node left with no KV at all is
deleted.

**Demote to storage** (``evict_host(…, demote=callback)``): the host's counterpart of
write-back. Just before the tree drops a host victim's copy (KV or state), in the tree's own
victim order, it calls ``demote(nodes, list_key)`` with the victim last and, before it, its
ancestors not marked archived, top-down (storage keys chain from the root: a stored page is
usable only after its ancestors'). The callback writes what it wants to storage synchronously
(and may ``mark_archived``); the tree then drops the copy as usual. Only victims get the call:
nodes the cascade deletes with one are its ancestors, so they were in its ``nodes`` unless
already archived.

**Notifications** (``tree.add_evict_listener``; the eviction policy is subscribed when it
overrides ``EvictionPolicy.on_evict``): every listener gets ``(node, list_key, how)`` once
``node`` has left list ``list_key``, ``how`` an :class:`~asynccache.tree.node.EvictHow`:

- ``DEMOTE``: the tier below holds a copy (the device victim was backed up; the host victim went
  to the ``demote`` callback);
- ``WRITE_BACK``: freed after this call's write-back copied it to the host (an ancestor freed
  with a victim that was on the host already is ``DEMOTE``);
- ``DROP``: no copy was made below (a dropped state is lost unless the other tier has one);
- ``CASCADE``: deleted by the tombstone cascade that an eviction set off (reported with that
  eviction's list; the victim itself too when the cascade takes it);
- ``RELEASE``: a state freed by ``release_states`` (once per tier).

Per victim: its own list first, then, for a KV victim, its state on the same tier, which leaves
with it (on the state list, same ``how``; ``DROP`` when it could not follow a demoted device copy:
no host state pool), then the cascade. Listeners run after the frees, so ``node.alive`` and
``node.has_state`` tell what is left anywhere. Write-back victims still in flight are reported
when a later call frees them. Frees outside eviction (an aborted load dropping what used its
pages) are not reported.

**Release** (:meth:`EvictionMixin.release_states`) frees the states of chosen nodes on every
tier at once, whatever the LRU order: for states the caller knows can no longer be resumed (a
prompt end that a later turn has extended). The KV stays; a childless node left without any state
goes with the tombstone cascade, like after any state eviction.
"""

from __future__ import annotations

from collections.abc import Iterable

from asynccache.checks import check_int
from asynccache.errors import ConfigError
from asynccache.policy.ranked import evictable_check
from asynccache.tree.core import DemoteFn, TreeCore, WriteBackFn
from asynccache.tree.node import EvictHow, Tier, TreeNode
from asynccache.tree.results import EvictResult

__all__ = ["EvictionMixin"]

#: The device-KV rule the ranked eviction orders use too (one definition for both).
_DEVICE_KV_EVICTABLE = evictable_check("device_kv")


class EvictionMixin(TreeCore):
    """``evict_device``, ``evict_host``, ``release_states``."""

    # ---- device ------------------------------------------------------------------------------
    def evict_device(
        self, num_kv_pages: int = 0, num_states: int = 0, *, write_back: WriteBackFn | None = None
    ) -> EvictResult:
        """Free at least ``num_kv_pages`` device pages and ``num_states`` device state slots if
        possible (see the module docstring for how). Mutates the tree and frees indices to the
        device pools.

        Under the ``write_back`` policy, victims without a complete host copy go to the
        ``write_back`` callback (``write_back`` overrides ``tree.write_back`` for this call),
        which allocates host slots and calls ``begin_backup``. Their device copies are freed only
        once the backup has finished: if it is still in flight when the callback returns, they
        are reported as ``num_pending_*`` and the next eviction after ``finish_backup`` demotes
        them; if it could not start, they are dropped.
        """
        num_kv_pages = check_int("num_kv_pages", num_kv_pages, minimum=0)
        num_states = check_int("num_states", num_states, minimum=0)
        callback = write_back if write_back is not None else self.write_back
        if not (self.write_policy.writes_back_on_evict and self.host_kv is not None):
            callback = None
        elif callback is None:
            raise ConfigError("the write_back policy needs a write_back callback to evict device data")
        pages0, states0 = self._device_pages, self._device_states
        lost0, deleted0 = self._lost_states, self._deleted_nodes
        pending_pages = pending_states = written = 0
        if num_kv_pages:
            pending_pages, pending_states, written = self._evict_device_kv(num_kv_pages, callback)
        need_states = num_states - (states0 - self._device_states) - pending_states
        if need_states > 0:
            more_states, more_written = self._evict_device_states(need_states, callback)
            pending_states += more_states
            written += more_written
        return EvictResult(
            tier=Tier.DEVICE,
            num_kv_pages=pages0 - self._device_pages,
            num_states=states0 - self._device_states,
            num_pending_kv_pages=pending_pages,
            num_pending_states=pending_states,
            num_written_back_nodes=written,
            num_lost_states=self._lost_states - lost0,
            num_deleted_nodes=self._deleted_nodes - deleted0,
        )

    def _device_kv_evictable(self, node: TreeNode) -> bool:
        # (without a host copy the node is deleted, which a host pin forbids)
        return _DEVICE_KV_EVICTABLE(node)

    def _evict_device_kv(self, need: int, callback: WriteBackFn | None) -> tuple[int, int, int]:
        """Free ``need`` device pages (pending write-backs count), in rounds: a round whose
        write-back could not save a victim drops it, and the parents left as device leaves by
        that drop are the next round's candidates (handed to the write-back in a smaller batch,
        dropped in their turn if that fails too). Each further round follows a drop, so the
        rounds end. Returns the pages and states left pending and the number of nodes handed
        to the write-back (each once)."""
        pages0 = self._device_pages
        pending_pages = pending_states = 0
        handed: set[TreeNode] = set()
        while True:
            missing = need - (pages0 - self._device_pages) - pending_pages
            more_pages, more_states, dropped = self._evict_device_kv_round(missing, callback, handed)
            pending_pages += more_pages
            pending_states += more_states
            if not dropped or pages0 - self._device_pages + pending_pages >= need:
                return pending_pages, pending_states, len(handed)

    def _evict_device_kv_round(
        self, need: int, callback: WriteBackFn | None, handed_so_far: set[TreeNode]
    ) -> tuple[int, int, bool]:
        """One scan of the device KV list for ``need`` pages, then one write-back of its victims
        (the nodes handed to it are added to ``handed_so_far``). Returns the pages and states
        left pending, and whether a victim was dropped after the write-back (its backup did not
        start)."""
        pages0 = self._device_pages
        victims: list[TreeNode] = []
        pending = 0
        deferred: set[TreeNode] = set()  # offered while a child still held device KV

        def enough() -> bool:
            return pages0 - self._device_pages + pending >= need

        for offered in self.eviction.candidates(self.device_kv_lru, now=self.clock()):
            node: TreeNode | None = offered
            while node is not None and not enough():
                if not self._device_kv_evictable(node):
                    if node.device_kv is not None and node.num_device_children:
                        deferred.add(node)
                    break
                parent = node.parent
                if self._backed_up(node):
                    # (backed up by an earlier round's write-back of this call: WRITE_BACK)
                    self._demote_device(node, EvictHow.WRITE_BACK if node in handed_so_far else EvictHow.DEMOTE)
                elif callback is not None and (node.has_state or node.children):
                    victims.append(node)
                    pending += node.num_pages
                    break
                else:
                    self._drop_device(node, EvictHow.DROP)
                # The parent may be a device leaf now: if the policy already offered it (it
                # ranks below this node), take it at once rather than leave it behind.
                node = parent if parent in deferred else None
                deferred.discard(parent)  # type: ignore[arg-type]
            if enough():
                break
        if not victims:
            return 0, 0, False
        handed_so_far |= self._call_write_back(victims, callback)  # type: ignore[arg-type]
        pending_pages = pending_states = 0
        dropped = False
        for node in victims:
            if not node.alive or node.device_kv is None:
                continue
            if not self._device_kv_evictable(node):
                pending_pages += node.num_pages
                pending_states += int(node.device_state is not None)
                continue
            parent = node.parent
            if self._backed_up(node):
                self._demote_device(node, EvictHow.WRITE_BACK)
            else:
                # Its backup did not start (the host had no room for the whole batch, say):
                # the parent this leaves a device leaf is a candidate of the next round.
                self._drop_device(node, EvictHow.DROP)
                dropped = True
            # A synchronous write-back backed the ancestors up too: those that are device
            # leaves now go as well while more room is needed. One that was backed up before
            # (not handed to a write-back of this call) is a plain demotion.
            while (
                parent is not None
                and pages0 - self._device_pages < need
                and self._device_kv_evictable(parent)
                and self._backed_up(parent)
            ):
                node, parent = parent, parent.parent
                self._demote_device(node, EvictHow.WRITE_BACK if node in handed_so_far else EvictHow.DEMOTE)
        return pending_pages, pending_states, dropped

    def _evict_device_states(self, need: int, callback: WriteBackFn | None) -> tuple[int, int]:
        states0 = self._device_states
        victims: list[TreeNode] = []
        for node in self.eviction.candidates(self.device_state_lru, now=self.clock()):
            if states0 - self._device_states + len(victims) >= need:
                break
            if node.device_state is None or node.device_lock or node.loading:
                continue
            if node.host_state is not None:
                self._free_device_state(node)
                self._notify_evict(node, "device_state", EvictHow.DEMOTE)
            elif callback is not None and self.host_mamba is not None:
                victims.append(node)
            else:
                self._drop_device_state(node)
        if not victims:
            return 0, 0
        written = len(self._call_write_back(victims, callback))  # type: ignore[arg-type]
        pending = 0
        for node in victims:
            if not node.alive or node.device_state is None:
                continue
            if node.device_lock == 0 and node.loading == 0:
                if node.host_state is not None:
                    self._free_device_state(node)
                    self._notify_evict(node, "device_state", EvictHow.WRITE_BACK)
                else:
                    self._drop_device_state(node)
            else:
                pending += 1
        return pending, written

    def _call_write_back(self, victims: list[TreeNode], callback: WriteBackFn) -> set[TreeNode]:
        """Hand ``victims`` with their ancestors that lack a host copy to ``callback``; returns
        the nodes handed over."""
        nodes = self._with_ancestors(victims)
        callback(nodes)
        return set(nodes)

    def _demote_device(self, node: TreeNode, how: EvictHow) -> None:
        """Free the device copy of a backed-up node (its state too)."""
        state_how: EvictHow | None = None
        if node.device_state is not None:
            state_how = how
            if node.host_state is None:  # no host state pool: the state cannot follow
                self._lost_states += 1
                state_how = EvictHow.DROP
            self._free_device_state(node)
        self._free_device_kv(node)
        self._notify_evict(node, "device_kv", how)
        if state_how is not None:
            self._notify_evict(node, "device_state", state_how)
        self._cascade(node, "device_kv")

    def _drop_device(self, node: TreeNode, how: EvictHow | None = None) -> None:
        """Free the device copy of a node that is not (fully) backed up. ``how``: report it to
        the eviction listeners (an eviction); ``None`` for other frees (an aborted load)."""
        key = "device_kv" if how is not None else None
        had_state = node.device_state is not None
        if had_state:
            if node.host_state is None:
                self._lost_states += 1
            self._free_device_state(node)
        self._free_device_kv(node)
        parent = node.parent
        assert parent is not None
        deleted = node.host_kv is None
        if deleted:
            # No KV left on any tier: the node goes (it is a leaf: children would need its KV).
            self._delete(node)
        if how is not None:
            self._notify_evict(node, "device_kv", how)
            if had_state:
                self._notify_evict(node, "device_state", EvictHow.DROP)
        self._cascade(parent if deleted else node, key)

    def _drop_device_state(self, node: TreeNode) -> None:
        self._lost_states += 1
        self._free_device_state(node)
        self._notify_evict(node, "device_state", EvictHow.DROP)
        self._cascade(node, "device_state")

    # ---- host --------------------------------------------------------------------------------
    def evict_host(
        self,
        num_kv_pages: int = 0,
        num_states: int = 0,
        *,
        archived_only: bool = False,
        demote: DemoteFn | None = None,
    ) -> EvictResult:
        """Free at least ``num_kv_pages`` host pages and ``num_states`` host state slots if
        possible. A host-only node that loses its copy is deleted (with the cascade above it); a
        node also on the device just loses its host copy. ``archived_only`` restricts eviction
        to nodes marked archived (their bytes are in storage). ``demote``: called with each
        victim (after its ancestors not archived yet) just before its host copy is dropped, in
        the tree's victim order, to write it to storage (see the module docstring). Mutates the
        tree and frees indices to the host pools (and to the device pools when the cascade
        deletes nodes).
        """
        num_kv_pages = check_int("num_kv_pages", num_kv_pages, minimum=0)
        num_states = check_int("num_states", num_states, minimum=0)
        pages0, states0 = self._host_pages, self._host_states
        lost0, deleted0 = self._lost_states, self._deleted_nodes
        if self.host_kv is not None:
            if num_kv_pages:
                self._evict_host_kv(num_kv_pages, archived_only, demote)
            need_states = num_states - (states0 - self._host_states)
            if need_states > 0 and self.host_mamba is not None:
                self._evict_host_states(need_states, archived_only, demote)
        return EvictResult(
            tier=Tier.HOST,
            num_kv_pages=pages0 - self._host_pages,
            num_states=states0 - self._host_states,
            num_lost_states=self._lost_states - lost0,
            num_deleted_nodes=self._deleted_nodes - deleted0,
        )

    def _demote_path(self, node: TreeNode) -> list[TreeNode]:
        """What ``demote`` gets for victim ``node``: its ancestors not archived, then ``node``."""
        nodes = [n for n in self.path_to(node) if not n.archived and n is not node]
        nodes.append(node)
        return nodes

    def _evict_host_kv(self, need: int, archived_only: bool, demote: DemoteFn | None) -> None:
        pages0 = self._host_pages
        how = EvictHow.DEMOTE if demote is not None else EvictHow.DROP
        deferred: set[TreeNode] = set()  # offered while a child still held host KV
        for offered in self.eviction.candidates(self.host_kv_lru, now=self.clock()):
            node: TreeNode | None = offered
            while node is not None and pages0 - self._host_pages < need:
                if node.host_kv is None or node.host_lock or (archived_only and not node.archived):
                    break
                if node.num_host_children:
                    deferred.add(node)
                    break
                parent = node.parent
                assert parent is not None
                if node.device_kv is None and (node.device_lock or node.loading):
                    break
                if demote is not None:
                    demote(self._demote_path(node), "host_kv")
                had_state = node.host_state is not None
                if node.device_kv is None:
                    assert not node.children
                    self._delete(node)
                else:
                    if had_state:
                        if node.device_state is None:
                            self._lost_states += 1
                        self._free_host_state(node)
                    self._free_host_kv(node)
                self._notify_evict(node, "host_kv", how)
                if had_state:
                    self._notify_evict(node, "host_state", how)
                self._cascade(parent if not node.alive else node, "host_kv")
                # As for the device: a parent offered earlier may be a host leaf now.
                node = parent if parent in deferred else None
                deferred.discard(parent)
            if pages0 - self._host_pages >= need:
                break

    def _evict_host_states(self, need: int, archived_only: bool, demote: DemoteFn | None) -> None:
        states0 = self._host_states
        how = EvictHow.DEMOTE if demote is not None else EvictHow.DROP
        for node in self.eviction.candidates(self.host_state_lru, now=self.clock()):
            if states0 - self._host_states >= need:
                break
            if node.host_state is None or node.host_lock:
                continue
            if archived_only and not node.archived:
                continue
            if demote is not None:
                demote(self._demote_path(node), "host_state")
            if node.device_state is None:
                self._lost_states += 1
            self._free_host_state(node)
            self._notify_evict(node, "host_state", how)
            self._cascade(node, "host_state")

    # ---- release -----------------------------------------------------------------------------
    def release_states(self, nodes: Iterable[TreeNode]) -> EvictResult:
        """Free the device and host states of ``nodes`` (KV stays), skipping roots, deleted
        nodes and nodes pinned on the tier (locked or loading). A childless node left without a
        state is deleted with the tombstone cascade. Mutates the tree and frees slots (and, for
        cascaded nodes, pages) to the pools; the result counts what was freed on both tiers
        (``tier`` is ``DEVICE``)."""
        pages0 = self._device_pages + self._host_pages
        states0 = self._device_states + self._host_states
        lost0, deleted0 = self._lost_states, self._deleted_nodes
        for node in nodes:
            if node.parent is None or not node.alive or not node.has_state:
                continue
            freed: str | None = None  # the last list a state left
            if node.device_state is not None and node.device_lock == 0 and node.loading == 0:
                self._free_device_state(node)
                freed = "device_state"
                self._notify_evict(node, freed, EvictHow.RELEASE)
            if node.host_state is not None and node.host_lock == 0:
                self._free_host_state(node)
                freed = "host_state"
                self._notify_evict(node, freed, EvictHow.RELEASE)
            if freed is not None and not node.has_state:
                self._lost_states += 1
                self._cascade(node, freed)
        return EvictResult(
            tier=Tier.DEVICE,
            num_kv_pages=pages0 - self._device_pages - self._host_pages,
            num_states=states0 - self._device_states - self._host_states,
            num_lost_states=self._lost_states - lost0,
            num_deleted_nodes=self._deleted_nodes - deleted0,
        )
