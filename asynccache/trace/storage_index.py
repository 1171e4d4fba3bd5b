"""An accounting storage tier: the V2 backend interface with keys and bytes, no payload.

Trace replay simulates TiB-scale local disks on a laptop: :class:`AccountingStorage` keeps, per
pool, which keys are stored and how many bytes each takes, under a byte capacity with its own
eviction: least recently used first (an object is used when it is written, read, or counted in
a hit by ``batch_exists_v2``), *speculative* objects before regular ones. Speculative objects —
dense checkpoints nobody has asked for yet — only ever fill free space: they never displace a
regular object, and one that is read becomes regular. Reads and writes only move counters.

It implements :class:`asynccache.storage.StorageBackend` (so the controller's storage tier drives
it exactly as it drives a disk or an object store with a capacity: ``statistics()`` reports
``capacity_bytes``; a ``speculative`` transfer of ``batch_set_v2`` is a speculative ``put``)
and exposes the same operations synchronously
(``put``, ``contains``, ``longest_hit``) for callers outside an event loop.

Object sizes come from the registered host pools (``bytes_per_index``: one KV page or one state
across all layers), or from ``object_bytes`` given at construction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from asynccache.errors import ConfigError
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolName, PoolTransfer, PoolTransferResult, longest_hit

__all__ = ["AccountingStorage", "StorageCounters"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageCounters:
    """Snapshot of an :class:`AccountingStorage`'s traffic and occupancy."""

    used_bytes: int
    capacity_bytes: int
    num_objects: dict[str, int]
    bytes_written: dict[str, int]
    bytes_read: dict[str, int]
    num_evicted: dict[str, int]
    bytes_evicted: int


class AccountingStorage:
    """Keys and bytes of a storage tier of ``capacity_bytes`` (see the module docstring)."""

    def __init__(self, capacity_bytes: int, *, object_bytes: Mapping[PoolName, int] | None = None) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._object_bytes: dict[PoolName, int] = dict(object_bytes or {})
        # Two recency orders, (pool, key) -> bytes: speculative objects are evicted first.
        self._regular: OrderedDict[tuple[PoolName, str], int] = OrderedDict()
        self._speculative: OrderedDict[tuple[PoolName, str], int] = OrderedDict()
        self.used_bytes = 0
        self.speculative_bytes = 0  # of used_bytes
        self._written: dict[PoolName, int] = {}
        self._read: dict[PoolName, int] = {}
        self._evicted: dict[PoolName, int] = {}
        self._bytes_evicted = 0

    # ---- synchronous core --------------------------------------------------------------
    def object_bytes(self, pool: PoolName) -> int:
        try:
            return self._object_bytes[pool]
        except KeyError:
            raise ConfigError(f"no object size known for pool {pool.value!r}: register its host pool") from None

    def set_object_bytes(self, pool: PoolName, nbytes: int) -> None:
        if nbytes <= 0:
            raise ConfigError(f"object size must be positive, got {nbytes}")
        self._object_bytes[pool] = nbytes

    def contains(self, pool: PoolName, key: str) -> bool:
        k = (pool, key)
        return k in self._regular or k in self._speculative

    def _promote(self, k: tuple[PoolName, str]) -> int | None:
        """Refresh ``k`` (a speculative object becomes regular); its size, or None if absent."""
        size = self._regular.get(k)
        if size is not None:
            self._regular.move_to_end(k)
            return size
        size = self._speculative.pop(k, None)
        if size is not None:
            self.speculative_bytes -= size
            self._regular[k] = size
        return size

    def put(self, pool: PoolName, keys: Sequence[str], *, speculative: bool = False) -> list[bool]:
        """Store ``keys`` (put-if-absent; an existing key is refreshed, and a regular put makes a
        speculative object regular). ``speculative``: evicted before any regular object, never
        displaces one. False for a key that cannot fit."""
        size = self.object_bytes(pool)
        ok: list[bool] = []
        for key in keys:
            k = (pool, key)
            if k in self._regular:
                self._regular.move_to_end(k)
                ok.append(True)
                continue
            if k in self._speculative:
                if speculative:
                    self._speculative.move_to_end(k)
                else:
                    self._promote(k)
                ok.append(True)
                continue
            if not self._make_room(size, speculative=speculative):
                ok.append(False)
                continue
            (self._speculative if speculative else self._regular)[k] = size
            self.used_bytes += size
            if speculative:
                self.speculative_bytes += size
            self._written[pool] = self._written.get(pool, 0) + size
            ok.append(True)
        return ok

    def get(self, pool: PoolName, keys: Sequence[str]) -> list[bool]:
        """Read ``keys``: True (counted, refreshed, made regular) for each stored one."""
        ok: list[bool] = []
        for key in keys:
            size = self._promote((pool, key))
            if size is None:
                ok.append(False)
                continue
            self._read[pool] = self._read.get(pool, 0) + size
            ok.append(True)
        return ok

    def longest_hit(self, keys: Sequence[str], transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
        """``batch_exists_v2`` without the event loop; the objects of the hit are refreshed."""
        exists = {t.pool_name: tuple(self.contains(t.pool_name, k) for k in keys) for t in transfers}
        n = longest_hit(len(keys), transfers, exists)
        if n:
            for t in transfers:
                lo = 0 if t.hit_policy.value == "all_pages" else max(0, n - t.num_trailing)
                for key in keys[lo:n]:
                    self._promote((t.pool_name, key))
        return PoolTransferResult(num_hit_pages=n, exists={p: tuple(v) for p, v in exists.items()})

    def _make_room(self, size: int, *, speculative: bool) -> bool:
        """Evict (speculative objects first, then regular ones unless ``speculative``) until
        ``size`` more bytes fit; False (nothing evicted beyond need) when they cannot."""
        if size > self.capacity_bytes:
            return False
        while self.used_bytes + size > self.capacity_bytes:
            if self._speculative:
                (pool, _), old = self._speculative.popitem(last=False)
                self.speculative_bytes -= old
            elif self._regular and not speculative:
                (pool, _), old = self._regular.popitem(last=False)
            else:
                return False
            self.used_bytes -= old
            self._evicted[pool] = self._evicted.get(pool, 0) + 1
            self._bytes_evicted += old
        return True

    def displaced(self, objects: Sequence[tuple[PoolName, str]]) -> list[tuple[PoolName, str]]:
        """The regular objects a put of ``objects`` (regular) would evict, in the order it
        would evict them; empty when their new bytes fit in free room and in the room that
        speculative objects give up first. The objects among ``objects`` already stored are
        left out (a put refreshes them). Nothing changes."""
        need = self.used_bytes - self.capacity_bytes - self.speculative_bytes
        for pool, key in objects:
            if not self.contains(pool, key):
                need += self.object_bytes(pool)
        out: list[tuple[PoolName, str]] = []
        if need <= 0:
            return out
        mine = set(objects)
        for k, size in self._regular.items():
            if k in mine:
                continue
            out.append(k)
            need -= size
            if need <= 0:
                break
        return out

    def objects(self) -> tuple[list[tuple[PoolName, str]], list[tuple[PoolName, str]]]:
        """The stored objects, regular and speculative, each least recently used first (the
        order they would be evicted in)."""
        return list(self._regular), list(self._speculative)

    def written_bytes(self, pool: PoolName) -> int:
        """Bytes written to ``pool`` so far (O(1))."""
        return self._written.get(pool, 0)

    def read_bytes(self, pool: PoolName) -> int:
        """Bytes read from ``pool`` so far (O(1))."""
        return self._read.get(pool, 0)

    def counters(self) -> StorageCounters:
        num: dict[str, int] = {}
        for objects in (self._regular, self._speculative):
            for pool, _ in objects:
                num[pool.value] = num.get(pool.value, 0) + 1
        return StorageCounters(
            used_bytes=self.used_bytes,
            capacity_bytes=self.capacity_bytes,
            num_objects=num,
            bytes_written={p.value: v for p, v in self._written.items()},
            bytes_read={p.value: v for p, v in self._read.items()},
            num_evicted={p.value: v for p, v in self._evicted.items()},
            bytes_evicted=self._bytes_evicted,
        )

    def statistics(self) -> StorageCounters:
        """As the real backends' ``statistics()``: the ``capacity_bytes`` it reports tells the
        controller's storage tier that this backend evicts for room, so that the tier never
        trusts an archive flag for what may have been dropped (:mod:`asynccache.tiering`)."""
        return self.counters()

    # ---- StorageBackend (V2) -----------------------------------------------------------
    async def register_host_pool_v2(self, pool_name: PoolName, host_pool: ItemPool) -> None:
        self.set_object_bytes(pool_name, host_pool.bytes_per_index)

    async def batch_exists_v2(self, keys: Sequence[str], transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
        return self.longest_hit(keys, transfers)

    async def batch_get_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        return [self.get(t.pool_name, t.keys) for t in transfers]

    async def batch_set_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]:
        return [self.put(t.pool_name, t.keys, speculative=t.speculative) for t in transfers]

    async def aclose(self) -> None:
        return None
