"""What the storage tier may restore: the lookup of the deepest stored page, skipping the keys
whose objects must not be served.

Objects under some storage keys hold data computed on a load that failed: a host copy archived,
or a storage-only snapshot stored, before the failure was known (the tree reports their keys
when it undoes the load: ``tree.stale_hook``, see ``asynccache.tree.pending``). The tier never
restores from those keys until their objects are deleted (``asynccache.stale_purge``: for a
backend that cannot delete them, or whose delete failed, for its lifetime): a lookup stops
before the first page whose KV key is unservable, and a state found under an unservable key
does not count (a shallower one is looked for instead).

- :class:`UnservableKeys` — the keys (KV and state keys apart): ``add`` at the report,
  ``discard`` once their objects are deleted;
- :func:`deepest_stored` — the tier's lookup (``batch_exists_v2``) honouring them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer, StorageBackend

__all__ = ["UnservableKeys", "deepest_stored"]


class UnservableKeys:
    """Storage keys the tier never restores from: pages whose KV, and pages whose state,
    were computed on a failed load."""

    def __init__(self) -> None:
        self.kv: set[str] = set()
        self.states: set[str] = set()

    def add(self, kv_keys: Iterable[str], state_keys: Iterable[str]) -> None:
        """Never restore the KV stored under ``kv_keys`` nor a state under ``state_keys``."""
        self.kv.update(kv_keys)
        self.states.update(state_keys)

    def discard(self, kv_keys: Iterable[str], state_keys: Iterable[str]) -> None:
        """Restore from ``kv_keys`` and ``state_keys`` again (their objects were deleted)."""
        self.kv.difference_update(kv_keys)
        self.states.difference_update(state_keys)

    def kv_end(self, keys: Sequence[str], begin: int) -> int:
        """The first index from ``begin`` whose KV key is unservable (``len(keys)``: none)."""
        if self.kv:
            for i in range(begin, len(keys)):
                if keys[i] in self.kv:
                    return i
        return len(keys)


async def deepest_stored(
    backend: StorageBackend, keys: Sequence[str], start_page: int, held: int, skip: UnservableKeys
) -> int:
    """The deepest ``n > start_page`` such that storage holds the KV of pages ``[held, n)`` and
    the state at ``n`` (for ``n <= held``: the state alone), none of them under a key in
    ``skip``; else ``start_page``. The KV is looked up past the tree's pages first; a state
    within them only when that fails."""
    if held < len(keys):
        end = skip.kv_end(keys, held)
        while end > held:
            exists = await backend.batch_exists_v2(
                keys[held:end],
                [
                    PoolTransfer(pool_name=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES),
                    PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES),
                ],
            )
            n = held + exists.num_hit_pages
            if n == held:
                break
            if keys[n - 1] not in skip.states:
                return n
            end = n - 1  # the state found is not to be served: a shallower one
    end = held
    while end > start_page:
        exists = await backend.batch_exists_v2(
            keys[start_page:end], [PoolTransfer(pool_name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        )
        n = start_page + exists.num_hit_pages
        if n == start_page or keys[n - 1] not in skip.states:
            return n
        end = n - 1
    return start_page
