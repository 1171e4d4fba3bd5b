"""Storage admission: which completed host writes a storage tier that evicts takes.

Every completed device → host write is archived to storage with its path (write-through to
storage: :mod:`asynccache.host_archive`, and trace replay's own tier). With a disk that holds a
small part of the working set, an archive may displace stored paths worth more than itself.
:class:`ArchiveAdmission` skips such an archive, by one rule:

    when writing the path would make the backend evict a regular object, compare the
    candidate's chance of return with that of the coldest stored state the write would
    displace (the first state in the backend's own eviction order among the objects it would
    evict for the path's new bytes); write only if the candidate's is at least as high.

- *What would be displaced* is the backend's answer (``displaced(objects)``: the regular
  objects a put of ``objects`` would evict, in the order it evicts them; empty when the new
  bytes fit in free room or in room speculative objects give up). Only
  :class:`~asynccache.trace.storage_index.AccountingStorage` answers; with any other backend
  every archive is written.
- *Chance of return* is the eviction policy's: ``reuse_estimate()`` gives a frozen
  ``p(turn, age)`` (:class:`~asynccache.policy.reuse.ReuseEviction`: the chance that a prompt end
  of conversation turn ``turn``, unused for ``age`` seconds, comes back within the learnt
  horizon) and ``turn_of(node)`` a node's turn. A policy without them (LRU, cost-aware,
  utility) leaves every archive written.
- The candidate is valued by its turn and ``last_access``; a stored state by the turn and
  ``last_access`` its node had when it was last archived (kept here, by state key; a state
  written only as an ancestor of an archived node, or as a snapshot, has no record and is not
  compared). Both at the same ``now`` (the owner's clock; trace replay's, which reading does
  not advance).

So a disk with room (or whose evictions take only speculative objects) takes everything, as
before; a tight one keeps the paths most likely to come back. The estimate is taken when the
host write completes (:meth:`ticket`: the policy's rates, the node's turn and last access) and
used when the archive is written (:meth:`admit`), so the synchronous replay engine, which
archives at once, and the controller, which archives later in the same step, decide alike even
when the policy re-learns its rates or a match touches the node in between.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asynccache.storage import PoolName

if TYPE_CHECKING:
    from asynccache.tree.node import TreeNode

__all__ = ["ArchiveAdmission", "ReturnEstimate", "Ticket"]

#: The fewest records kept before the first sweep of evicted states.
_SWEEP_MIN = 1024

#: ``p(turn, age)``: the chance of a return within the policy's horizon (a frozen estimate).
ReturnEstimate = Callable[[int, float], float]


@dataclass(frozen=True, slots=True)
class Ticket:
    """A candidate as it stood when its host write completed: the policy's estimate then, and
    the node's turn and last access."""

    estimate: ReturnEstimate
    turn: int
    last_access: float


class ArchiveAdmission:
    """The storage admission rule of an archiving tier (see the module docstring).
    ``eviction``: the tree's eviction policy; ``now``: the time chances are taken at."""

    def __init__(self, eviction: Any, now: Callable[[], float]) -> None:
        self._estimate: Callable[[], ReturnEstimate] | None = getattr(eviction, "reuse_estimate", None)
        self._turn_of: Callable[[TreeNode], int] | None = getattr(eviction, "turn_of", None)
        self.now = now
        #: state key → (turn, last_access) of the node last archived with its state there
        self._stored: dict[str, tuple[int, float]] = {}
        #: records kept past this are swept of the states the backend no longer holds
        self._sweep_at = _SWEEP_MIN
        self.num_admitted = 0  # archives that displaced a recorded state
        self.num_skipped = 0

    @property
    def active(self) -> bool:
        """Whether the policy gives a chance of return (else every archive is written)."""
        return self._estimate is not None and self._turn_of is not None

    def ticket(self, node: TreeNode) -> Ticket | None:
        """``node`` as it stands now, its host write just completed (None: admit its archive)."""
        if self._estimate is None or self._turn_of is None:
            return None
        return Ticket(self._estimate(), self._turn_of(node), node.last_access)

    @staticmethod
    def objects(node: TreeNode, path: Sequence[TreeNode]) -> list[tuple[PoolName, str]]:
        """What an archive of ``node`` writes, as far as the rule counts it: its path's KV
        pages and its own state. (The states of the path's other nodes on the host are written
        too, but which ancestors hold one when the archive runs depends on when it runs: the
        controller writes later in the step than the synchronous replay engine.)"""
        return [(PoolName.KV, h) for n in path for h in n.page_hashes] + [(PoolName.MAMBA, node.page_hashes[-1])]

    def admit(self, node: TreeNode, path: Sequence[TreeNode], backend: Any, ticket: Ticket | None) -> bool:
        """Whether to write ``node``'s archive (``path``: root's child down to ``node``) to
        ``backend``, by ``ticket`` (:meth:`ticket`, taken when its host write completed)."""
        displaced = getattr(backend, "displaced", None)
        if ticket is None or displaced is None:
            return True
        victims = displaced(self.objects(node, path))
        if not victims:
            return True
        coldest = next((self._stored[k] for p, k in victims if p is PoolName.MAMBA and k in self._stored), None)
        if coldest is None:  # only KV (or states never archived as a node's own) would go
            return True
        now = self.now()
        mine = ticket.estimate(ticket.turn, max(now - ticket.last_access, 0.0))
        theirs = ticket.estimate(coldest[0], max(now - coldest[1], 0.0))
        if mine >= theirs:
            self.num_admitted += 1
            return True
        self.num_skipped += 1
        return False

    def written(self, node: TreeNode, ticket: Ticket | None, backend: Any) -> None:
        """Record the state an archive of ``node`` wrote to ``backend`` (after :meth:`admit`
        let it). The records of states ``backend`` has evicted since are dropped once the
        records have doubled since the last sweep, so they stay within twice what it holds."""
        if ticket is None or getattr(backend, "displaced", None) is None:
            return  # no rule for this backend: nothing to compare with later
        self._stored[node.page_hashes[-1]] = (ticket.turn, ticket.last_access)
        if len(self._stored) > self._sweep_at:
            contains = getattr(backend, "contains", None)
            if contains is not None:
                self._stored = {k: v for k, v in self._stored.items() if contains(PoolName.MAMBA, k)}
            self._sweep_at = max(_SWEEP_MIN, 2 * len(self._stored))

    @property
    def num_records(self) -> int:
        """States recorded as archived (some of them evicted since the last sweep)."""
        return len(self._stored)

    def counts(self) -> dict[str, int]:
        """Archives that would displace an archived state: written, skipped."""
        return {"admitted_over_victim": self.num_admitted, "skipped": self.num_skipped}
