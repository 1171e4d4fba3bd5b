"""The exists search of a storage backend: ``batch_exists_v2``.

Primitives:

- :class:`ExistsSearchMixin` — ``batch_exists_v2``: the longest prefix of a request's keys
  whose objects exist as every pool's hit policy asks, found by probing keys window by window
  (``probe_window`` keys per round, one ``_object_sizes`` call per pool and window).

Search order: ALL_PAGES pools (attention KV) are probed from the first key upwards until their
first miss; TRAILING_PAGES pools (Mamba states, needed only at the last hit page) are probed
downwards from there, first only the deepest keys their policy needs (a prefix stored whole has
its state there), then window by window. Keys beyond the search are not probed. An object whose
size cannot be that of a valid object is invalid: a miss, counted, and removed before the call
returns. A probe that fails fails every key of its window (counted and reported per key).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from asynccache.errors import BackendError, ObjectFormatError
from asynccache.storage import (
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
    check_exists_call,
    longest_hit,
)
from storage_backends.backend_core import BackendCore, pool_value
from storage_backends.object_format import ObjectGeometry, validate_key
from storage_backends.reporting import BatchReport

__all__ = ["ExistsSearchMixin"]


class ExistsSearchMixin(BackendCore):
    """``batch_exists_v2`` of :class:`~storage_backends.base.ObjectBackend`."""

    #: keys probed per round of the exists search
    probe_window: int = 32

    async def batch_exists_v2(self, keys: Sequence[str], transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose objects exist as every transfer's hit policy
        asks. ALL_PAGES pools are probed window by window up to their first miss; TRAILING_PAGES
        pools downwards from there (first only the keys their policy needs there, then window
        by window). ``exists`` flags are ``False`` for keys not probed."""
        check_exists_call(len(keys), transfers)
        for key in keys:
            validate_key(key)
        pool_names = [pool_value(t.pool_name) for t in transfers]
        for name in pool_names:
            self._geometry(name)
        with self._call():
            return await self._search(keys, transfers, pool_names)

    async def _search(
        self, keys: Sequence[str], transfers: Sequence[PoolTransfer], pool_names: list[str]
    ) -> PoolTransferResult:
        n = len(keys)
        flags: dict[str, list[bool]] = {name: [False] * n for name in pool_names}
        if not await self._ensure_ready("batch_exists_v2", n):
            return PoolTransferResult(num_hit_pages=0, exists={t.pool_name: (False,) * n for t in transfers})
        report = BatchReport(self, "batch_exists_v2", 0)

        async def probe(names: Iterable[str], lo: int, hi: int) -> None:
            async with asyncio.TaskGroup() as tg:
                for name in set(names):
                    tg.create_task(self._probe(name, keys, lo, hi, flags[name], report))

        all_pages = [nm for nm, t in zip(pool_names, transfers) if t.hit_policy is PoolHitPolicy.ALL_PAGES]
        trailing = [(nm, t.num_trailing) for nm, t in zip(pool_names, transfers) if t.hit_policy is PoolHitPolicy.TRAILING_PAGES]
        n_all, lo = n, 0
        while all_pages and lo < n:
            hi = min(n, lo + self.probe_window)
            await probe(all_pages, lo, hi)
            first_miss = min(next((i for i in range(lo, hi) if not flags[nm][i]), hi) for nm in all_pages)
            if first_miss < hi:
                n_all = first_miss
                break
            lo = hi
        m, probed_lo = n_all, n_all
        span = max((num for _, num in trailing), default=0)
        while trailing and m > 0:
            need_lo = max(0, m - span)
            if need_lo < probed_lo:
                # The deepest keys alone first (a prefix stored whole has its state there), then
                # window by window downwards.
                step = span if probed_lo == n_all else self.probe_window
                new_lo = max(0, min(need_lo, probed_lo - step))
                await probe([nm for nm, _ in trailing], new_lo, probed_lo)
                probed_lo = new_lo
            if all(all(flags[nm][max(0, m - num) : m]) for nm, num in trailing):
                break
            m -= 1
        report.emit()
        exists = {t.pool_name: flags[nm] for nm, t in zip(pool_names, transfers)}
        num_hit = longest_hit(n, transfers, exists)
        return PoolTransferResult(num_hit_pages=num_hit, exists={p: tuple(f) for p, f in exists.items()})

    async def _probe(
        self, pool_name: str, keys: Sequence[str], lo: int, hi: int, out: list[bool], report: BatchReport
    ) -> None:
        _, geometry = self._geometry(pool_name)
        names = [self.object_name(pool_name, keys[i]) for i in range(lo, hi)]
        report.num_items += len(names)
        with self._checking() as puts_before:
            try:
                if self._closed:  # closing: no more probes
                    raise self._closed_error()
                async with asyncio.timeout(self.timeout_s):
                    sizes = await self._object_sizes(names)
            except (BackendError, OSError, TimeoutError) as e:
                self._count_failure(e, count=len(names))
                report.fail(names[0], e, count=len(names))
                return
            await self._sized(geometry, keys, lo, names, sizes, out, report, puts_before)

    async def _sized(
        self,
        geometry: ObjectGeometry,
        keys: Sequence[str],
        lo: int,
        names: list[str],
        sizes: Sequence[int | None],
        out: list[bool],
        report: BatchReport,
        puts_before: int,
    ) -> None:
        """A probe's sizes: present objects of a valid size are hits; the others are removed
        unless a put came for them since the probe began (``_still_invalid``)."""
        invalid: list[str] = []
        for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
            if size is None:
                continue
            if self.codec.valid_size(geometry, keys[lo + i], size):
                out[lo + i] = True
            else:
                invalid.append(name)
                report.corrupt(name, ObjectFormatError(f"object of {size} bytes (truncated or foreign)"))
        self._counts["num_corrupt"] += len(invalid)
        invalid = self._still_invalid(invalid, puts_before)
        if invalid:
            await self._remove(invalid, report, background=False)
