"""The storage tier's lookup (``asynccache.stored_lookup.deepest_stored``) with keys it must not
restore from (computed on a failed load): it stops before the first unservable KV key, and a
state found under an unservable key does not count (a shallower one is looked for), past the
tree's pages and within them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from asynccache.storage import PoolName, PoolTransfer, PoolTransferResult, longest_hit
from asynccache.stored_lookup import UnservableKeys, deepest_stored

KEYS = [f"k{i}" for i in range(8)]


class Stored:
    """``batch_exists_v2`` over a set of (pool, key) objects; counts the calls."""

    def __init__(self, kv: Sequence[str], states: Sequence[str]) -> None:
        self.objects = {(PoolName.KV, k) for k in kv} | {(PoolName.MAMBA, k) for k in states}
        self.calls = 0

    async def batch_exists_v2(self, keys: Sequence[str], transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
        self.calls += 1
        exists = {t.pool_name: [(t.pool_name, k) in self.objects for k in keys] for t in transfers}
        return PoolTransferResult(num_hit_pages=longest_hit(len(keys), transfers, exists))


def skip(kv: Sequence[int] = (), states: Sequence[int] = ()) -> UnservableKeys:
    keys = UnservableKeys()
    keys.add([KEYS[i] for i in kv], [KEYS[i] for i in states])
    return keys


async def test_nothing_unservable_finds_the_deepest_state() -> None:
    stored = Stored(KEYS, [KEYS[3], KEYS[6]])
    assert await deepest_stored(stored, KEYS, 1, 2, skip()) == 7  # the state at page 7's end
    assert stored.calls == 1


async def test_an_unservable_state_counts_a_shallower_one() -> None:
    """The state after page 6 was computed on a failed load (its KV was not: a state-only
    dependent, or a storage-only snapshot): the lookup settles for the one after page 3."""
    stored = Stored(KEYS, [KEYS[3], KEYS[6]])
    assert await deepest_stored(stored, KEYS, 1, 2, skip(states=[6])) == 4
    assert await deepest_stored(stored, KEYS, 1, 2, skip(states=[3, 6])) == 1  # none left


async def test_an_unservable_page_cuts_the_lookup_before_it() -> None:
    stored = Stored(KEYS, [KEYS[3], KEYS[6]])
    assert await deepest_stored(stored, KEYS, 1, 2, skip(kv=[5])) == 4
    assert await deepest_stored(stored, KEYS, 1, 2, skip(kv=[2])) == 1  # nothing past the tree's pages


@pytest.mark.parametrize(("unservable", "want"), [((), 4), ((3,), 2), ((1, 3), 0)])
async def test_a_state_within_the_tree_s_pages_skips_unservable_ones(unservable: tuple[int, ...], want: int) -> None:
    """No KV past the tree's pages: a state within them, the deepest servable one."""
    stored = Stored([], [KEYS[1], KEYS[3]])
    assert await deepest_stored(stored, KEYS, 0, 5, skip(states=list(unservable))) == want
