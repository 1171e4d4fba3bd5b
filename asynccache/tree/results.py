"""Named results of the tree's operations (frozen dataclasses; index tensors are int64 CPU).

- :class:`MatchResult` — ``match_prefix``: the usable prefix and where its pieces live.
- :class:`InsertResult` — ``insert`` / ``insert_host``.
- :class:`EvictResult` — ``evict_device`` / ``evict_host`` / ``evict_bytes``.
- :class:`LoadPlan`, :class:`BackupPlan` — an in-flight host→device load or device→host backup;
  the controller copies ``src → dst`` index pairs and hands the plan back to ``finish_*``.
- :class:`Allocation` — indices from ``alloc_device`` / ``alloc_host`` (owned by the caller).
- :class:`ReleasedIndices` — what an aborted plan hands back to the caller to free.
- :class:`TreeStats` — counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asynccache.tree.node import Tier, TreeNode

__all__ = [
    "Allocation",
    "BackupPlan",
    "EvictResult",
    "InsertResult",
    "LoadPlan",
    "MatchResult",
    "ReleasedIndices",
    "TreeStats",
]


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchResult:
    """The reusable prefix of a prompt.

    - ``num_tokens``: usable prefix, cut back to the deepest node boundary whose state exists on
      any tier (0 = miss). Only pages fully inside the prompt count.
    - ``last_node``: the node ending at ``num_tokens`` (a root on a miss).
    - ``device_kv_indices``: device pages for ``[0, num_device_tokens)``, usable now (unless
      ``pending_load``).
    - ``num_host_tokens``: tokens of the usable prefix whose KV is on the host only
      (``num_device_tokens + num_host_tokens == num_tokens``).
    - ``state_tier``: where the state at ``num_tokens`` lives (``DEVICE`` preferred), ``None`` on
      a miss. ``needs_load``: host KV or a host-only state must be loaded first.
    - ``load_nodes``: the nodes ``begin_load`` will fill, top-down.
    - ``pending_load``: a load in flight writes into the usable prefix (the KV of a node of it,
      or the state at its end); wait for it (``HybridCacheController.wait_loaded``; the tree's
      ``pending_loads(match)`` names the loads) before reading those pages or that state.
    - ``num_matched_tokens``: tokens whose KV the tree holds on any tier, state or not (≥
      ``num_tokens``; where the prompt branches off the tree).
    - ``matched_node``: the node holding the last of those pages (``last_node`` or below it; a
      node the prompt branches off inside, when it does): locking it keeps the KV of all
      ``num_matched_tokens`` (``None`` only in a result built by hand: read ``last_node``).
    - ``backup_nodes``: nodes the write policy wants backed up now (selective write-through),
      top-down, ancestors first.
    - ``page_hashes``: hex chained hashes of every full page of the prompt (lazy).
    """

    num_tokens: int
    last_node: TreeNode
    device_kv_indices: torch.Tensor = field(default_factory=_empty)
    num_device_tokens: int = 0
    num_host_tokens: int = 0
    state_tier: Tier | None = None
    needs_load: bool = False
    load_nodes: tuple[TreeNode, ...] = ()
    pending_load: bool = False
    num_matched_tokens: int = 0
    matched_node: TreeNode | None = None
    backup_nodes: tuple[TreeNode, ...] = ()
    page_hashes: Sequence[str] = ()
    salt: str = ""

    @property
    def num_load_kv_pages(self) -> int:
        """Device pages ``begin_load`` needs."""
        return self.num_host_tokens // self.last_node.page_size

    @property
    def num_load_states(self) -> int:
        """Device state slots ``begin_load`` needs (0 or 1)."""
        return int(self.state_tier is Tier.HOST)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertResult:
    """``last_node`` ends at the last full page inserted. ``num_new_pages``: pages whose
    indices the tree kept (new nodes, or nodes that lacked this tier); ``num_duplicate_pages``:
    pages already cached, whose indices were freed (an index equal to the node's own is neither
    freed nor counted). ``num_new_states`` kept,
    ``num_freed_states`` freed (duplicates or refused by admission). ``backup_nodes``: what the
    write policy wants backed up now, top-down."""

    last_node: TreeNode
    num_new_pages: int = 0
    num_duplicate_pages: int = 0
    num_new_states: int = 0
    num_freed_states: int = 0
    backup_nodes: tuple[TreeNode, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictResult:
    """What one eviction call freed on ``tier``.

    ``num_kv_pages`` / ``num_states``: indices of ``tier`` released to the pools (demoted or
    dropped, including what the tombstone cascade deleted). ``num_pending_kv_pages`` /
    ``num_pending_states``: handed to the write-back callback and still in flight; they become
    evictable once the backup finishes (evict again then). ``num_written_back_nodes``: nodes
    passed to the callback (ancestors included; one that KV eviction hands over again, in a
    smaller batch after a batch that could not be backed up, counts once).
    ``num_lost_states``: states dropped with no copy on any tier. ``num_deleted_nodes``: nodes
    removed from the tree.
    """

    tier: Tier
    num_kv_pages: int = 0
    num_states: int = 0
    num_pending_kv_pages: int = 0
    num_pending_states: int = 0
    num_written_back_nodes: int = 0
    num_lost_states: int = 0
    num_deleted_nodes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan:
    """A host→device load: copy ``host_kv_indices[i] → device_kv_indices[i]`` and
    ``host_state_slot → device_state_slot``. The nodes stay locked (device and host) until
    ``finish_load`` or ``abort_load``. ``plan_id`` names it while it is in flight (the controller
    finds the operation that carries it by it)."""

    plan_id: int
    nodes: tuple[TreeNode, ...]
    host_kv_indices: torch.Tensor = field(default_factory=_empty)
    device_kv_indices: torch.Tensor = field(default_factory=_empty)
    host_state_slot: int | None = None
    device_state_slot: int | None = None
    # Private: the plan covers the path from _last up to page _top_page (splits included).
    _last: TreeNode | None = field(default=None, repr=False, compare=False)
    _top_page: int = field(default=0, repr=False, compare=False)

    @property
    def num_kv_pages(self) -> int:
        return int(self.device_kv_indices.numel())

    @property
    def num_states(self) -> int:
        return int(self.device_state_slot is not None)

    @property
    def host_state_slots(self) -> torch.Tensor:
        return _slots(self.host_state_slot)

    @property
    def device_state_slots(self) -> torch.Tensor:
        return _slots(self.device_state_slot)


def _slots(slot: int | None) -> torch.Tensor:
    return _empty() if slot is None else torch.tensor([slot], dtype=torch.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class BackupPlan:
    """A device→host backup: copy ``device_kv_indices[i] → host_kv_indices[i]`` and
    ``device_state_slots[i] → host_state_slots[i]``. The nodes stay locked (device and host)
    until ``finish_backup`` or ``abort_backup``."""

    plan_id: int
    nodes: tuple[TreeNode, ...]
    device_kv_indices: torch.Tensor = field(default_factory=_empty)
    host_kv_indices: torch.Tensor = field(default_factory=_empty)
    device_state_slots: torch.Tensor = field(default_factory=_empty)
    host_state_slots: torch.Tensor = field(default_factory=_empty)
    # Private: (node, start page at begin, got host KV, got host state) per node.
    _segments: tuple[tuple[TreeNode, int, bool, bool], ...] = field(default=(), repr=False, compare=False)

    @property
    def num_kv_pages(self) -> int:
        return int(self.host_kv_indices.numel())

    @property
    def num_states(self) -> int:
        return int(self.host_state_slots.numel())


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """Indices handed out by ``alloc_device`` / ``alloc_host``; the caller owns them."""

    kv_indices: torch.Tensor = field(default_factory=_empty)
    state_slots: torch.Tensor = field(default_factory=_empty)

    @property
    def state_slot(self) -> int | None:
        """The single state slot, or ``None`` when none was asked for."""
        if self.state_slots.numel() == 0:
            return None
        assert self.state_slots.numel() == 1, "more than one state slot; use state_slots"
        return int(self.state_slots[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleasedIndices:
    """Indices an aborted plan detached from the tree; the caller owns (frees) them again."""

    kv_indices: torch.Tensor = field(default_factory=_empty)
    state_slots: torch.Tensor = field(default_factory=_empty)


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeStats:
    """Counters of the tree (maintained incrementally, O(1) to read)."""

    num_nodes: int
    device_kv_pages: int
    host_kv_pages: int
    device_states: int
    host_states: int
    device_locked_pages: int
    host_locked_pages: int
    num_active_plans: int

    @property
    def device_unlocked_pages(self) -> int:
        """Device pages of unlocked nodes: an upper bound of what eviction can free."""
        return self.device_kv_pages - self.device_locked_pages

    @property
    def host_unlocked_pages(self) -> int:
        return self.host_kv_pages - self.host_locked_pages
