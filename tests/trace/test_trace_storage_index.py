from __future__ import annotations

import pytest

from asynccache.errors import ConfigError
from asynccache.storage import PoolHitPolicy, PoolName, PoolTransfer
from asynccache.trace.storage_index import AccountingStorage

KV, MAMBA = PoolName.KV, PoolName.MAMBA


def make_storage(capacity: int) -> AccountingStorage:
    return AccountingStorage(capacity, object_bytes={KV: 10, MAMBA: 30})


def test_lru_eviction_under_capacity() -> None:
    s = make_storage(50)
    assert s.put(KV, ["a", "b", "c"]) == [True] * 3
    s.get(KV, ["a"])  # refresh a: b is now the oldest
    s.put(MAMBA, ["x"])  # 30 more bytes: 60 > 50, evict b
    assert not s.contains(KV, "b") and s.contains(KV, "a") and s.contains(MAMBA, "x")
    c = s.counters()
    assert c.used_bytes == 50 and c.num_evicted == {"kv": 1}
    assert c.bytes_written == {"kv": 30, "mamba": 30} and c.bytes_read == {"kv": 10}
    assert s.put(MAMBA, ["too-big"] * 0) == []
    big = AccountingStorage(20, object_bytes={KV: 10, MAMBA: 30})
    assert big.put(MAMBA, ["y"]) == [False]


def test_speculative_objects_never_displace_regular_ones() -> None:
    s = make_storage(40)
    s.put(KV, ["a", "b", "c"])
    assert s.put(KV, ["spec1"], speculative=True) == [True]  # fits in the free 10 bytes
    assert s.put(KV, ["spec2"], speculative=True) == [True]  # displaces the older speculative one
    assert not s.contains(KV, "spec1")
    s.put(KV, ["d"])  # a regular write evicts the speculative object first
    assert not s.contains(KV, "spec2") and all(s.contains(KV, k) for k in "abcd")
    assert s.put(KV, ["spec3"], speculative=True) == [False]  # full of regular objects
    # A read makes a speculative object regular.
    s2 = make_storage(30)
    s2.put(KV, ["r"])
    s2.put(KV, ["s"], speculative=True)
    s2.get(KV, ["s"])
    s2.put(KV, ["t", "u"])  # room for one more: the oldest regular object goes, r — not s
    assert not s2.contains(KV, "r") and s2.contains(KV, "s")


def test_longest_hit_all_pages_and_trailing_state() -> None:
    s = make_storage(1000)
    keys = ["k0", "k1", "k2", "k3"]
    s.put(KV, keys[:3])
    s.put(MAMBA, ["k1"])
    transfers = [
        PoolTransfer(pool_name=KV, hit_policy=PoolHitPolicy.ALL_PAGES),
        PoolTransfer(pool_name=MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ]
    r = s.longest_hit(keys, transfers)
    assert r.num_hit_pages == 2  # KV for 3 pages, but the only state is after page 1
    assert r.exists[KV] == (True, True, True, False)


async def test_v2_interface_round_trip() -> None:
    s = AccountingStorage(10**6)

    class _Pool:
        bytes_per_index = 64

    await s.register_host_pool_v2(KV, _Pool())  # type: ignore[arg-type]
    await s.register_host_pool_v2(MAMBA, _Pool())  # type: ignore[arg-type]
    put = await s.batch_set_v2([PoolTransfer(pool_name=KV, keys=("a", "b")), PoolTransfer(pool_name=MAMBA, keys=("b",))])
    assert put == [[True, True], [True]]
    got = await s.batch_get_v2([PoolTransfer(pool_name=KV, keys=("a", "z"))])
    assert got == [[True, False]]
    hit = await s.batch_exists_v2(
        ["a", "b"],
        [
            PoolTransfer(pool_name=KV, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(pool_name=MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ],
    )
    assert hit.num_hit_pages == 2
    await s.aclose()


async def test_a_speculative_transfer_of_batch_set_v2_is_a_speculative_put() -> None:
    s = make_storage(40)
    assert await s.batch_set_v2([PoolTransfer(pool_name=KV, keys=("a", "b", "c"))]) == [[True] * 3]
    spec = PoolTransfer(pool_name=KV, keys=("s",), speculative=True)
    assert await s.batch_set_v2([spec]) == [[True]]  # the free room
    assert await s.batch_set_v2([PoolTransfer(pool_name=KV, keys=("t",), speculative=True)]) == [[True]]
    assert not s.contains(KV, "s")  # the older speculative object made room, no regular one
    assert await s.batch_set_v2([PoolTransfer(pool_name=KV, keys=("t",))]) == [[True]]  # now regular
    assert await s.batch_set_v2([PoolTransfer(pool_name=KV, keys=("u",), speculative=True)]) == [[False]]
    assert all(s.contains(KV, k) for k in "abct") and s.counters().num_evicted == {"kv": 1}


def test_unknown_object_size_and_bad_capacity() -> None:
    with pytest.raises(ConfigError):
        AccountingStorage(-1)
    with pytest.raises(ConfigError, match="no object size"):
        AccountingStorage(10).put(KV, ["a"])
