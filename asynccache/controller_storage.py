"""The storage tier's part of :class:`~asynccache.controller.HybridCacheController`: starting,
waiting for and abandoning storage prefetches, loading their split restores, and archiving
storage-only snapshots. A base of the controller, not used on its own; the work is done by
``asynccache.prefetch`` (prefetches and the loads of their split restores), ``asynccache.tiering``
(the storage tier) and ``asynccache.snapshots`` (storage-only snapshots).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asynccache.errors import ConfigError
from asynccache.ops import CacheOperation
from asynccache.prefetch import Prefetcher
from asynccache.storage import PoolName

if TYPE_CHECKING:
    from asynccache.snapshots import SnapshotArchive
    from asynccache.spec import HybridSpec
    from asynccache.tiering import StorageTier

__all__ = ["StorageTierMixin"]


class StorageTierMixin:
    """The controller's storage-tier API (see the module docstring)."""

    # Set by HybridCacheController's constructor.
    spec: HybridSpec
    tiering: StorageTier | None  # set on entry when a backend is configured
    _prefetcher: Prefetcher
    _load_queue: list[CacheOperation]
    _write_queue: list[CacheOperation]
    pools: dict[PoolName, tuple[Any, Any]]

    if TYPE_CHECKING:

        def _require_started(self) -> asyncio.TaskGroup: ...

    def prefetch(
        self, tokens: Sequence[int], match: Any, *, salt: str | None = None, allow_tail: bool = False
    ) -> asyncio.Task[Any] | None:
        """Start fetching from storage what ``tokens`` miss past ``match``; None without a backend
        or when ``match`` already covers every full page of ``tokens``.

        What is fetched lands in the match's tenant (``match.salt``, whose keys it reads);
        ``salt``, if given, must be that one (:class:`ConfigError` otherwise: another tenant's
        tree would get this tenant's data).

        The prefetch runs in the controller's TaskGroup; wait for it with :meth:`wait_prefetch`,
        which stops waiting at the prefetch policy's deadline but never cancels the fetch (its
        data still lands on host for later requests). ``allow_tail``: the caller takes a
        :class:`~asynccache.prefetch.TailRestore` in the result (and releases it, also when it
        stopped waiting: see :meth:`wait_prefetch`).
        """
        tg = self._require_started()
        if salt is not None and salt != match.salt:
            raise ConfigError(
                f"prefetch for tenant {salt!r} of a match made for tenant {match.salt!r}: pass the match's salt"
            )
        if self.tiering is None or len(match.page_hashes) * self.spec.page_size <= match.num_tokens:
            return None
        return self._prefetcher.start(tg, self.tiering, tokens, match, allow_tail=allow_tail)

    def load_tail(self, tail: Any, device_pages: torch.Tensor, state_slots: torch.Tensor) -> CacheOperation:
        """Queue the load of a landed :class:`~asynccache.prefetch.TailRestore` into
        ``device_pages`` (one per tail page, in order) and each of ``state_slots`` (the tail's end
        state), for the next :meth:`start_loading`: it is copied layer by layer with the step's
        other loads, so the forward computes layer ``l`` while later layers are still copied.

        The controller takes the tail over and releases it once the copy has finished (or, if
        cancelled or failed, once no copy from it is in flight). The device pages and slots stay
        the caller's. Raises :class:`ConfigError` for a tail that is not landed intact or is
        released, and for page or slot lists that do not fit the tail or the device pools (before
        queueing: a bad list would fail the whole step's merged copy).
        """
        self._require_started()
        op = self._prefetcher.tail_load_op(
            tail,
            device_pages,
            state_slots,
            num_pages=self.pools[PoolName.KV][0].num_items,
            num_slots=self.pools[PoolName.MAMBA][0].num_items,
        )
        self._load_queue.append(op)
        return op

    async def wait_prefetch(self, task: asyncio.Task[Any], num_tokens: int, *, elapsed_s: float = 0.0) -> Any | None:
        """The prefetch's result if it finished within the policy's deadline, else None (its
        split restore, if any, is then released when it lands). ``elapsed_s``: how long the
        caller has already let it run — a scheduler that computes other requests meanwhile and
        asks again later (see :meth:`prefetch_overdue`); the deadline counts from its start."""
        return await self._prefetcher.wait(task, num_tokens, elapsed_s=elapsed_s)

    async def wait_prefetch_probed(
        self, task: asyncio.Task[Any], num_tokens: int, *, elapsed_s: float = 0.0, at_most_s: float | None = None
    ) -> None:
        """Wait until the prefetch has probed storage — a few lookups: it then reads what it
        restores, or it has ended — at most until the policy's deadline and ``at_most_s``. A
        scheduler with other requests to compute waits this long, never for the read."""
        await self._prefetcher.wait_probed(task, num_tokens, elapsed_s=elapsed_s, at_most_s=at_most_s)

    def prefetch_overdue(self, num_tokens: int, elapsed_s: float) -> bool:
        """Whether a prefetch of ``num_tokens`` running for ``elapsed_s`` has passed the
        policy's deadline (never under ``wait_complete``)."""
        return self.prefetch_time_left(num_tokens, elapsed_s) == 0.0

    def prefetch_time_left(self, num_tokens: int, elapsed_s: float) -> float | None:
        """Seconds a prefetch of ``num_tokens`` running for ``elapsed_s`` may still be waited
        for (None: no limit, under ``wait_complete``; 0: its deadline has passed)."""
        return self._prefetcher.time_left(num_tokens, elapsed_s)

    def abandon_prefetch(self, task: asyncio.Task[Any]) -> None:
        """The caller will not wait for ``task`` (its request is gone): the split restore it
        may bring is released when it lands. Its fetched pages still land on host."""
        self._prefetcher.abandon(task)

    def archive_snapshots(
        self, node: Any, snapshots: Mapping[int, int], *, evict_host: bool = False, priority: int = 0
    ) -> SnapshotArchive | None:
        """Archive storage-only snapshots ``{position: device_slot}`` on ``node``'s path as
        speculative objects, with the path's KV, for :meth:`prefetch` to find; their staging is
        queued for the next :meth:`start_writing`. The caller's slots are read until
        ``archive.staged`` is done. ``None`` for no snapshots or no free host room;
        :class:`ConfigError` without a storage tier or for bad input (:mod:`asynccache.snapshots`)."""
        self._require_started()
        if self.tiering is None:
            raise ConfigError("archive_snapshots needs a storage tier (the controller has no backend)")
        archive = self.tiering.snapshots.start(node, snapshots, evict_host=evict_host, priority=priority)
        if archive is not None:
            self._write_queue.append(archive.op)
        return archive
