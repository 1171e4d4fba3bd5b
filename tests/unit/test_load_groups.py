"""How a load's layers become steps: small consecutive layers of one pool share a call and an
event, and such a group rides with a much larger step of another pool before it."""

from __future__ import annotations

from asynccache.load_steps import LOAD_GROUP_MAX_BYTES, LOAD_RIDE_RATIO, group_layers
from asynccache.storage import PoolName


def _steps(layer_ids: list[int], attention: list[int], state_bytes: int, kv_bytes: int = 64 << 20) -> list[tuple]:
    mamba = [lid for lid in layer_ids if lid not in attention]
    pools = {
        PoolName.KV: ({lid: i for i, lid in enumerate(attention)}, kv_bytes),
        PoolName.MAMBA: ({lid: i for i, lid in enumerate(mamba)}, state_bytes),
    }
    steps = group_layers(layer_ids, pools)
    return [(lids, [(name.value, first, count) for name, first, count in copies]) for lids, copies in steps]


def test_the_states_between_two_attention_layers_are_one_copy_riding_with_the_kv_before() -> None:
    steps = _steps(list(range(8)), attention=[3, 7], state_bytes=2 << 20)
    assert steps == [
        ([0, 1, 2], [("mamba", 0, 3)]),
        ([3, 4, 5, 6], [("kv", 0, 1), ("mamba", 3, 3)]),
        ([7], [("kv", 1, 1)]),
    ]


def test_a_group_rides_only_with_a_step_at_least_the_ratio_larger() -> None:
    group = 3 * (1 << 20)
    at_ratio = _steps(list(range(8)), attention=[3, 7], state_bytes=1 << 20, kv_bytes=group * LOAD_RIDE_RATIO)
    assert [lids for lids, _ in at_ratio] == [[0, 1, 2], [3, 4, 5, 6], [7]]
    below = _steps(list(range(8)), attention=[3, 7], state_bytes=1 << 20, kv_bytes=group * LOAD_RIDE_RATIO - 1)
    assert [lids for lids, _ in below] == [[0, 1, 2], [3], [4, 5, 6], [7]]
    # KV pages are large layers of their own pool: they never ride, whatever follows them.
    kv_after_kv = _steps(list(range(4)), attention=[2, 3], state_bytes=1 << 20, kv_bytes=64 << 20)
    assert [lids for lids, _ in kv_after_kv] == [[0, 1], [2], [3]]


def test_a_group_stops_at_the_byte_limit_and_large_layers_stay_alone() -> None:
    per = LOAD_GROUP_MAX_BYTES // 2
    steps = _steps(list(range(6)), attention=[5], state_bytes=per)
    assert [lids for lids, _ in steps] == [[0, 1], [2, 3], [4], [5]]
    big = _steps(list(range(4)), attention=[3], state_bytes=LOAD_GROUP_MAX_BYTES + 1)
    assert [lids for lids, _ in big] == [[0], [1], [2], [3]]
    # One group rides with a step; the next group of the same pool is a step of its own.
    after_kv = _steps(list(range(6)), attention=[0], state_bytes=per, kv_bytes=1 << 40)
    assert [lids for lids, _ in after_kv] == [[0, 1, 2], [3, 4], [5]]


def test_only_consecutive_local_layers_of_one_pool_group() -> None:
    # Layer 2 is not loaded (another stage's, or an MLP-only layer): 1 and 3 are not adjacent
    # globally but are locally; layers are grouped in the order given, by local position.
    steps = _steps([0, 1, 3, 4], attention=[4], state_bytes=1 << 20)
    assert steps == [([0, 1, 3], [("mamba", 0, 3)]), ([4], [("kv", 0, 1)])]
    # A layer with copies in both pools is a step of its own.
    pools = {PoolName.KV: ({0: 0, 1: 1}, 1), PoolName.MAMBA: ({1: 0, 2: 1}, 1)}
    assert [lids for lids, _ in group_layers([0, 1, 2], pools)] == [[0], [1], [2]]
