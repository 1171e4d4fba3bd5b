"""Cache operations: what the controller queues, merges, launches and completes.

Primitives:

- :class:`OpState` — ``QUEUED → ISSUED → DONE`` (or ``CANCELLED`` / ``FAILED`` before issue).
- :class:`CacheOperation` — a batch of :class:`PoolTransfer` (one per pool: host indices ↔ device
  indices, as many of each; else :class:`TransferError` at construction), for loads the
  transfers that may land after every layer of the step (``deferred``), the tree plan it
  serves, a priority, and an asyncio future completed when its copy has finished on the
  device. Awaitable.
- :func:`CacheOperation.merge_ops` — concatenate the transfers of many queued operations into
  one per pool, so a scheduler step issues one launch per layer (loads) or one launch for all
  layers (writes) however many requests are involved. The operations must be of one kind.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from asynccache.errors import TransferError
from asynccache.storage import PoolName, PoolTransfer

__all__ = ["CacheOperation", "MergedTransfer", "OpKind", "OpState"]

_ids = itertools.count()


class OpKind(str, Enum):
    LOAD = "load"  # host → device
    WRITE = "write"  # device → host


class OpState(str, Enum):
    QUEUED = "queued"
    ISSUED = "issued"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class MergedTransfer:
    """All queued transfers of one pool, concatenated (index order = operation order)."""

    pool_name: PoolName
    host_indices: torch.Tensor
    device_indices: torch.Tensor

    @property
    def num_items(self) -> int:
        return self.host_indices.numel()


class CacheOperation:
    """One queued host↔device copy. ``await op`` returns once its bytes have landed.

    Owned by the controller: only the controller changes ``state``. ``plan`` is the tree's
    LoadPlan / BackupPlan the operation serves (nodes stay locked until completion).
    """

    def __init__(
        self,
        kind: OpKind,
        transfers: Sequence[PoolTransfer],
        *,
        plan: Any,
        priority: int = 0,
        loop: asyncio.AbstractEventLoop | None = None,
        deferred: Sequence[PoolTransfer] = (),
    ) -> None:
        self.op_id = next(_ids)
        self.kind = kind
        self.transfers = _by_pool(transfers, "transfers")
        #: Loads nothing in the step's forward reads (a loaded boundary state's node slot, when the
        #: caller's working slot gets the state layer by layer): copied for all layers at once,
        #: after the step's layers.
        self.deferred = _by_pool(deferred, "deferred")
        self.plan = plan
        self.priority = priority
        self.state = OpState.QUEUED
        self.future: asyncio.Future[None] = (loop or asyncio.get_running_loop()).create_future()
        self.issued_at: float | None = None

    @property
    def done(self) -> bool:
        return self.state in (OpState.DONE, OpState.CANCELLED, OpState.FAILED)

    def __await__(self) -> Generator[Any, None, None]:
        # Shield: a waiter being cancelled must not cancel the copy's bookkeeping.
        return asyncio.shield(self.future).__await__()

    def __repr__(self) -> str:
        sizes = {p.value: t.num_items for p, t in self.transfers.items()}
        return f"CacheOperation(id={self.op_id}, {self.kind.value}, {self.state.value}, items={sizes})"

    @staticmethod
    def merge_ops(ops: Sequence[CacheOperation], *, deferred: bool = False) -> dict[PoolName, MergedTransfer]:
        """One :class:`MergedTransfer` per pool over every operation in ``ops`` (in order): of
        their ``transfers``, or of their ``deferred`` transfers. :class:`TransferError` when
        ``ops`` mixes loads and writes (their indices run in opposite directions)."""
        by_pool: dict[PoolName, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for op in ops:
            if op.kind is not ops[0].kind:
                raise TransferError(f"cannot merge {ops[0].kind.value} and {op.kind.value} operations")
            for name, t in (op.deferred if deferred else op.transfers).items():
                hosts, devs = by_pool.setdefault(name, ([], []))
                hosts.append(t.host_indices)
                devs.append(t.device_indices)
        return {
            name: MergedTransfer(pool_name=name, host_indices=_cat(h), device_indices=_cat(d))
            for name, (h, d) in by_pool.items()
        }


def _by_pool(transfers: Sequence[PoolTransfer], what: str) -> dict[PoolName, PoolTransfer]:
    """``transfers`` by pool, the empty ones left out. A second transfer of one pool (it would
    replace the first) and unequal host and device index counts (a merge would pair one op's
    host pages with another's device pages) raise :class:`TransferError`."""
    by_pool: dict[PoolName, PoolTransfer] = {}
    seen: set[PoolName] = set()
    for t in transfers:
        if t.pool_name in seen:
            raise TransferError(f"{what}: two transfers of pool {t.pool_name.value} in one operation")
        seen.add(t.pool_name)
        num_host, num_device = t.host_indices.numel(), t.device_indices.numel()
        if num_host != num_device:
            raise TransferError(
                f"{what}: the {t.pool_name.value} transfer has {num_host} host indices and {num_device} device indices"
            )
        if num_host:
            by_pool[t.pool_name] = t
    return by_pool


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, without the copy when there is one part (the tensors are never
    written after they are made)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
