"""Waiting for the loads a matched prefix depends on: the part of
:class:`~asynccache.controller.HybridCacheController` that hands a match with ``pending_load``
the operations bringing its data. A base of the controller, not used on its own.

A load's operation is reachable from the nodes it fills: the tree names the loads in flight that
write into a match (``tree.pending_loads(match)``: the KV pages of a node of its usable prefix,
or the state at its end), and the controller keeps, for each of its loads in flight, the
operation carrying it (``TreeOps.load_of``).

- :class:`LoadWaitMixin` — ``pending_ops(match)``, ``wait_loaded(match)``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from asynccache.errors import ConfigError, StaleMatchError, TreeError
from asynccache.ops import CacheOperation, OpState
from asynccache.tree.results import MatchResult

if TYPE_CHECKING:
    from asynccache.tree import HybridRadixTree
    from asynccache.tree_ops import TreeOps

__all__ = ["LoadWaitMixin"]


class LoadWaitMixin:
    """The controller's waits for pending loads (see the module docstring)."""

    # Set by HybridCacheController's constructor.
    tree: HybridRadixTree
    _ops: TreeOps

    def pending_ops(self, match: MatchResult) -> list[CacheOperation]:
        """The operations of the loads in flight now that write into ``match``'s usable prefix
        (queued, issued, or failed with their undo still waiting), in the tree's plan order. A
        failed one whose undo nothing blocks any more (the lock that did was released) is undone
        first, and is not among them.
        :class:`TreeError` for such a load that this controller does not carry (a plan begun on
        the tree directly: nothing here can complete it). ``match`` not a
        :class:`~asynccache.tree.MatchResult`: :class:`ConfigError`."""
        if not isinstance(match, MatchResult):
            raise ConfigError(f"pending_ops needs a MatchResult (tree.match_prefix), got {type(match).__name__}")
        self._ops.undo_blocked()
        ops: list[CacheOperation] = []
        for plan in self.tree.pending_loads(match):
            op = self._ops.load_of(plan)
            if op is None:
                raise TreeError(f"load plan {plan.plan_id} writes into the match, but no operation of this controller carries it")
            ops.append(op)
        return ops

    async def wait_loaded(self, match: MatchResult) -> None:
        """Wait until every load in flight that writes into ``match``'s usable prefix has landed
        (``match.pending_load``: another request's load of those pages or of the state at its
        end, or the caller's own); returns at once when none does. Afterwards the device pages
        and the device state the match reported hold their bytes.

        Keep the match locked meanwhile (``tree.lock(match.last_node)``, taken after the match):
        that lock makes the caller a reader of those loads, so cancelling one of them is refused
        (it is issued and completes instead) and a failed one keeps its pages and slot out of
        the pools until the lock is released. A queued load lands once a later
        :meth:`start_loading` issues it: this wait never issues anything (the step that queued
        the load does), so a caller waiting for its own queued load starts loading first.

        Raises :class:`StaleMatchError` when the match no longer holds: a load it waited for
        failed or was cancelled (its pages and state never arrived), or the match's pages left
        the device; unlock the match and match the prompt again. :class:`TreeError` for a load
        this controller does not carry, :class:`ConfigError` for a ``match`` that is not a
        :class:`~asynccache.tree.MatchResult`. Cancelling the waiter leaves the loads alone.
        """
        if not isinstance(match, MatchResult):
            raise ConfigError(f"wait_loaded needs a MatchResult (tree.match_prefix), got {type(match).__name__}")
        while True:
            ops = self.pending_ops(match)
            if not ops:
                break
            failed = next((op for op in ops if op.done), None)  # its plan still waits for its undo
            if failed is None:
                await asyncio.wait([op.future for op in ops])
                failed = next((op for op in ops if op.state is not OpState.DONE), None)
            if failed is not None:
                cause = None if failed.future.cancelled() else failed.future.exception()
                raise StaleMatchError(
                    f"{failed!r}, a load into the matched prefix, did not land: match again"
                ) from cause
        if not self.tree.match_is_current(match):
            raise StaleMatchError("the matched prefix's device pages or state are gone: match again")
