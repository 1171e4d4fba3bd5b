"""Byte-item pools: typed views over the byte buffer, layouts, host sizing, memory checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asynccache import (
    AllocationError,
    CapacityError,
    ConfigError,
    HybridSpec,
    PinningError,
    StateComponent,
)
from asynccache.pools import (
    DeviceKVPool,
    DeviceMambaPool,
    HostKVPool,
    ItemPool,
    MambaPoolHost,
    PoolLayout,
    pinning_available,
)

LIMIT_ENV = "ASYNCCACHE_HOST_LIMIT_BYTES"


def make_spec(**overrides: object) -> HybridSpec:
    """5 layers: attention on 1 and 4, recurrent on 0 and 2 (3 is MLP only); odd component sizes."""
    fields: dict[str, object] = {
        "model_id": "toy",
        "num_layers": 5,
        "attention_layer_ids": (1, 4),
        "mamba_layer_ids": (0, 2),
        "num_kv_heads": 2,
        "head_dim": 8,
        "kv_dtype": torch.float16,
        "page_size": 4,
        "state_components": (
            StateComponent(name="conv", shape=(5, 3), dtype=torch.bfloat16),  # 30 bytes at 0
            StateComponent(name="ssm", shape=(2, 3, 4), dtype=torch.float32),  # 96 bytes at 32
        ),
    }
    fields.update(overrides)
    return HybridSpec(**fields)  # type: ignore[arg-type]


def zeroed(pool: ItemPool) -> ItemPool:
    assert pool.buffer is not None
    pool.buffer.zero_()
    return pool


def flat_bytes(pool: ItemPool) -> torch.Tensor:
    assert pool.buffer is not None
    return pool.buffer.view(-1)


def item_address(pool: ItemPool, layer_id: int, index: int) -> int:
    return pool.layer_index(layer_id) * pool.layer_stride_bytes + index * pool.item_stride_bytes


# ---- geometry ------------------------------------------------------------------------------------


def test_device_kv_pool_geometry_on_cpu() -> None:
    spec = make_spec()
    pool = DeviceKVPool(spec, 6)
    assert pool.device.type == "cpu"
    assert pool.layout is PoolLayout.LAYER_FIRST
    assert pool.layer_ids == (1, 4)
    assert pool.item_bytes == spec.kv_item_bytes == 2 * 4 * 2 * 8 * 2
    assert pool.bytes_per_index == spec.kv_page_bytes
    assert pool.size_bytes == 6 * spec.kv_page_bytes
    assert pool.buffer is not None and pool.buffer.shape == (2, 6, spec.kv_item_bytes)
    assert pool.buffer.dtype == torch.uint8
    assert not pool.pinned
    assert pool.num_free == 6


def test_device_mamba_pool_geometry() -> None:
    spec = make_spec()
    pool = DeviceMambaPool(spec, 3)
    assert pool.layer_ids == (0, 2)
    assert pool.item_bytes == spec.state_item_bytes == 128
    assert pool.size_bytes == 3 * spec.state_bytes
    assert pool.buffer is not None and pool.buffer.shape == (2, 3, 128)


def test_layer_index_maps_global_ids_to_local_positions() -> None:
    pool = DeviceKVPool(make_spec(), 2)
    assert pool.layer_index(1) == 0
    assert pool.layer_index(4) == 1


@pytest.mark.parametrize("layer_id", [0, 2, 3, 99])
def test_layer_index_of_a_foreign_layer_raises(layer_id: int) -> None:
    pool = DeviceKVPool(make_spec(), 2)
    with pytest.raises(ConfigError, match=f"layer {layer_id}"):
        pool.layer_index(layer_id)
    with pytest.raises(ConfigError):
        pool.kv_cache(layer_id)


def test_state_of_an_attention_layer_raises() -> None:
    pool = DeviceMambaPool(make_spec(), 2)
    with pytest.raises(ConfigError, match="layer 1"):
        pool.state(1)


def test_unknown_layout_raises() -> None:
    with pytest.raises(ConfigError, match="diagonal"):
        HostKVPool(make_spec(), num_pages=2, layout="diagonal")


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pool_kind", ["kv", "mamba"])
def test_layer_items_and_index_bytes_follow_the_strided_formula(layout: str, pool_kind: str) -> None:
    spec = make_spec()
    pool: ItemPool
    if pool_kind == "kv":
        pool = HostKVPool(spec, num_pages=5, layout=layout)
    else:
        pool = MambaPoolHost(spec, num_slots=5, layout=layout)
    base = flat_bytes(pool).data_ptr()
    if layout == "layer_first":
        assert (pool.layer_stride_bytes, pool.item_stride_bytes) == (5 * pool.item_bytes, pool.item_bytes)
    else:
        assert (pool.layer_stride_bytes, pool.item_stride_bytes) == (pool.item_bytes, 2 * pool.item_bytes)
    for layer_id in pool.layer_ids:
        items = pool.layer_items(layer_id)
        assert items.shape == (5, pool.item_bytes)
        for index in range(5):
            addr = item_address(pool, layer_id, index)
            assert items[index].data_ptr() - base == addr
            assert pool.index_bytes(index)[pool.layer_index(layer_id)].data_ptr() - base == addr
    # The contiguous axis is the one the layout promises.
    assert pool.layer_items(pool.layer_ids[0]).is_contiguous() == (layout == "layer_first")
    assert pool.index_bytes(3).is_contiguous() == (layout == "page_first")


@pytest.mark.parametrize("index", [-1, 3, 2.0, True])
def test_index_bytes_of_an_index_outside_the_pool_is_refused(index: object) -> None:
    """-1 would be the last item, 3 an IndexError from torch, 2.0 and True not indices."""
    pool = zeroed(HostKVPool(make_spec(), num_pages=3))
    with pytest.raises(ConfigError, match="outside 0..2"):
        pool.index_bytes(index)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_writes_through_index_bytes_are_seen_by_layer_items(layout: str) -> None:
    pool = zeroed(HostKVPool(make_spec(), num_pages=3, layout=layout))
    pool.index_bytes(2)[1].fill_(7)  # local layer 1 = global layer 4
    assert bool((pool.layer_items(4)[2] == 7).all())
    assert int(pool.layer_items(4)[:2].count_nonzero()) == 0
    assert int(pool.layer_items(1).count_nonzero()) == 0
    assert int(flat_bytes(pool).count_nonzero()) == pool.item_bytes


# ---- typed views -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_kv_cache_views_share_memory_with_the_bytes(layout: str) -> None:
    spec = make_spec()
    pool = zeroed(
        DeviceKVPool(spec, 4) if layout == "layer_first" else HostKVPool(spec, num_pages=4, layout=layout)
    )
    k, v = pool.kv_cache(4)
    assert k.shape == v.shape == (4, spec.page_size, spec.num_kv_heads, spec.head_dim)
    assert k.dtype == v.dtype == torch.float16
    values = torch.arange(spec.page_size * spec.num_kv_heads * spec.head_dim, dtype=torch.float16).view(k.shape[1:])
    k[2] = values
    v[2] = -values
    half = spec.kv_item_bytes // 2
    item = pool.layer_items(4)[2]
    assert torch.equal(item[:half].view(torch.float16).view(values.shape), values)
    assert torch.equal(item[half:].view(torch.float16).view(values.shape), -values)
    addr = item_address(pool, 4, 2)
    assert torch.equal(flat_bytes(pool)[addr : addr + half], values.view(-1).view(torch.uint8))
    # Nothing outside item (layer 4, page 2) changed.
    rest = flat_bytes(pool).clone()
    rest[addr : addr + spec.kv_item_bytes] = 0
    assert int(rest.count_nonzero()) == 0


def test_kv_cache_views_of_two_layers_do_not_overlap() -> None:
    pool = zeroed(DeviceKVPool(make_spec(), 2))
    k1, _ = pool.kv_cache(1)
    k4, v4 = pool.kv_cache(4)
    k1.fill_(1.0)
    assert int(k4.count_nonzero()) == 0 and int(v4.count_nonzero()) == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_state_views_land_at_their_offsets(layout: str) -> None:
    spec = make_spec()
    pool = zeroed(
        DeviceMambaPool(spec, 3) if layout == "layer_first" else MambaPoolHost(spec, num_slots=3, layout=layout)
    )
    views = pool.state(2)
    assert set(views) == {"conv", "ssm"}
    assert views["conv"].shape == (3, 5, 3) and views["conv"].dtype == torch.bfloat16
    assert views["ssm"].shape == (3, 2, 3, 4) and views["ssm"].dtype == torch.float32
    conv = torch.arange(15, dtype=torch.bfloat16).view(5, 3) + 1
    ssm = torch.arange(24, dtype=torch.float32).view(2, 3, 4) + 0.5
    views["conv"][1] = conv
    views["ssm"][1] = ssm
    conv_off, ssm_off = spec.state_component_offsets
    assert (conv_off, ssm_off) == (0, 32)
    item = pool.layer_items(2)[1]
    assert torch.equal(item[conv_off : conv_off + 30], conv.view(-1).view(torch.uint8))
    assert torch.equal(item[ssm_off : ssm_off + 96], ssm.view(-1).view(torch.uint8))
    assert int(item[30:32].count_nonzero()) == 0  # alignment padding untouched
    # other slots and the other layer untouched
    assert int(pool.layer_items(2)[0].count_nonzero()) == 0
    assert int(pool.layer_items(2)[2].count_nonzero()) == 0
    assert int(pool.layer_items(0).count_nonzero()) == 0


def test_state_views_of_a_real_config_have_the_spec_shapes() -> None:
    spec = HybridSpec.preset("tiny", page_size=4)
    pool = DeviceMambaPool(spec, 2)
    views = pool.state(spec.mamba_layer_ids[-1])
    for comp in spec.state_components:
        assert views[comp.name].shape == (2, *comp.shape)
        assert views[comp.name].dtype == comp.dtype


# ---- allocation through the pool ---------------------------------------------------------------------


def test_pool_alloc_is_all_or_nothing_and_free_is_strict() -> None:
    pool = DeviceKVPool(make_spec(), 4)
    got = pool.alloc(3)
    assert got is not None and got.dtype == torch.int64 and got.device.type == "cpu"
    assert pool.alloc(2) is None
    assert pool.num_free == 1
    pool.free(got)
    with pytest.raises(AllocationError):
        pool.free(got)
    assert pool.num_free == 4


# ---- host pool sizing ----------------------------------------------------------------------------------


def test_host_kv_sized_in_bytes_rounds_down_to_whole_pages() -> None:
    spec = make_spec()
    pool = HostKVPool(spec, size_bytes=10 * spec.kv_page_bytes + spec.kv_page_bytes - 1)
    assert pool.num_items == 10
    assert pool.layout is PoolLayout.PAGE_FIRST
    assert pool.size_bytes == 10 * spec.kv_page_bytes


def test_host_mamba_sized_in_bytes() -> None:
    spec = make_spec()
    pool = MambaPoolHost(spec, size_bytes=7 * spec.state_bytes + 5)
    assert pool.num_items == 7
    assert pool.item_bytes == spec.state_item_bytes


def test_host_pools_sized_by_count() -> None:
    spec = make_spec()
    assert HostKVPool(spec, num_pages=9).num_items == 9
    assert MambaPoolHost(spec, num_slots=4).num_items == 4


def test_host_pools_sized_by_ratio_of_the_device_pool() -> None:
    spec = make_spec()
    kv = HostKVPool(spec, ratio=2.5, device_pool=DeviceKVPool(spec, 4))
    assert kv.num_items == 10
    mamba = MambaPoolHost(spec, ratio=3, device_pool=DeviceMambaPool(spec, 2), layout="layer_first")
    assert mamba.num_items == 6
    assert mamba.layout is PoolLayout.LAYER_FIRST


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"size_bytes": 4096, "num_pages": 2},
        {"num_pages": 2, "ratio": 1.0},
        {"size_bytes": 4096, "ratio": 1.0},
    ],
)
def test_host_kv_needs_exactly_one_size(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="exactly one of size_bytes, num_pages, ratio"):
        HostKVPool(make_spec(), **kwargs)  # type: ignore[arg-type]


def test_host_mamba_needs_exactly_one_size() -> None:
    with pytest.raises(ConfigError, match="exactly one of size_bytes, num_slots, ratio"):
        MambaPoolHost(make_spec(), num_slots=2, size_bytes=1 << 20)


def test_a_ratio_sizes_to_the_nearest_whole_item_not_below_it() -> None:
    spec = make_spec()
    device = DeviceKVPool(spec, 100)
    # 2.3 × 100 is 229.99999999999997 in floating point, 0.29 × 100 is 28.999999999999996.
    assert HostKVPool(spec, ratio=2.3, device_pool=device).num_items == 230
    assert HostKVPool(spec, ratio=0.29, device_pool=device).num_items == 29
    assert HostKVPool(spec, ratio=0.255, device_pool=device).num_items == 25  # a real fraction still rounds down


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": 2.0},
        {"ratio": 0.0, "device_pool": "device"},
        {"ratio": -1.0, "device_pool": "device"},
        {"ratio": float("nan"), "device_pool": "device"},
        {"ratio": float("inf"), "device_pool": "device"},
    ],
)
def test_ratio_needs_a_positive_value_and_the_device_pool(kwargs: dict[str, object]) -> None:
    spec = make_spec()
    if kwargs.get("device_pool") == "device":
        kwargs = {**kwargs, "device_pool": DeviceKVPool(spec, 2)}
    with pytest.raises(ConfigError, match="ratio"):
        HostKVPool(spec, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"num_pages": -1}, {"size_bytes": -1}])
def test_negative_sizes_raise(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="must be >= 0"):
        HostKVPool(make_spec(), **kwargs)


@pytest.mark.parametrize("bad", [2.5, 3.0, True, "3"])
@pytest.mark.parametrize(
    ("make", "argument"),
    [
        pytest.param(lambda spec, v: HostKVPool(spec, size_bytes=v), "size_bytes", id="host_kv-size_bytes"),
        pytest.param(lambda spec, v: HostKVPool(spec, num_pages=v), "num_pages", id="host_kv-num_pages"),
        pytest.param(
            lambda spec, v: HostKVPool(spec, num_pages=v, materialize=False), "num_pages", id="host_kv-accounting"
        ),
        pytest.param(lambda spec, v: MambaPoolHost(spec, size_bytes=v), "size_bytes", id="host_mamba-size_bytes"),
        pytest.param(lambda spec, v: MambaPoolHost(spec, num_slots=v), "num_slots", id="host_mamba-num_slots"),
        pytest.param(lambda spec, v: DeviceKVPool(spec, v), "num_pages", id="device_kv"),
        pytest.param(lambda spec, v: DeviceMambaPool(spec, v), "num_slots", id="device_mamba"),
        pytest.param(
            lambda spec, v: ItemPool(name="x", layer_ids=(0,), num_items=v, item_bytes=4), "num_items", id="num_items"
        ),
        pytest.param(
            lambda spec, v: ItemPool(name="x", layer_ids=(0,), num_items=2, item_bytes=v), "item_bytes", id="item_bytes"
        ),
    ],
)
def test_sizes_that_are_not_integers_are_refused_by_name(make: Any, argument: str, bad: object) -> None:
    """A float would fail deep in torch (or be truncated), and ``True`` size a pool of 0 or 1."""
    with pytest.raises(ConfigError, match=argument):
        make(make_spec(), bad)


def test_numpy_integer_sizes_are_taken_as_ints() -> None:
    import numpy as np

    spec = make_spec()
    pools = (
        HostKVPool(spec, size_bytes=np.int64(3 * spec.kv_page_bytes)),
        MambaPoolHost(spec, num_slots=np.int32(3)),
        DeviceKVPool(spec, np.int64(3)),
        DeviceMambaPool(spec, np.uint8(3)),
    )
    assert all(type(p.num_items) is int and p.num_items == 3 for p in pools)
    assert all(type(p.size_bytes) is int for p in pools)


def test_size_bytes_cannot_size_a_pool_without_layers() -> None:
    spec = make_spec(attention_layer_ids=())  # no attention: KV items are zero bytes
    with pytest.raises(ConfigError, match="num_pages"):
        HostKVPool(spec, size_bytes=1 << 20)
    assert HostKVPool(spec, num_pages=3).num_items == 3


# ---- memory: capacity and pinning ----------------------------------------------------------------------


def test_size_over_available_host_memory_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec()
    monkeypatch.setenv(LIMIT_ENV, str(4 * spec.kv_page_bytes))
    assert HostKVPool(spec, num_pages=4).num_items == 4
    with pytest.raises(CapacityError, match=str(5 * spec.kv_page_bytes)):
        HostKVPool(spec, num_pages=5)
    with pytest.raises(CapacityError, match="host_mamba"):
        MambaPoolHost(spec, size_bytes=1 << 30)


@pytest.mark.parametrize("value", ["1GiB", "1e9", "-1"])
def test_a_host_limit_that_is_not_a_number_of_bytes_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(LIMIT_ENV, value)
    with pytest.raises(ConfigError, match=LIMIT_ENV):
        HostKVPool(make_spec(), num_pages=1)


def test_device_pools_on_cpu_obey_the_host_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec()
    monkeypatch.setenv(LIMIT_ENV, "1024")
    with pytest.raises(CapacityError, match="device_mamba"):
        DeviceMambaPool(spec, 100)


def test_accounting_mode_skips_the_memory_check(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec()
    monkeypatch.setenv(LIMIT_ENV, "1024")
    pool = HostKVPool(spec, num_pages=100_000, materialize=False)
    assert pool.size_bytes == 100_000 * spec.kv_page_bytes
    assert not pool.materialized


@pytest.mark.skipif(pinning_available(), reason="this machine can pin memory")
def test_demanding_pinned_memory_without_an_accelerator_raises() -> None:
    with pytest.raises(PinningError, match="host_kv"):
        HostKVPool(make_spec(), num_pages=2, pin=True)
    with pytest.raises(PinningError, match="host_mamba"):
        MambaPoolHost(make_spec(), num_slots=2, pin=True)


def test_pin_none_pins_only_where_possible() -> None:
    pool = HostKVPool(make_spec(), num_pages=2, pin=None)
    assert pool.pinned == pinning_available()
    assert pool.buffer is not None and pool.buffer.is_pinned() == pool.pinned


def test_pin_false_is_pageable() -> None:
    pool = MambaPoolHost(make_spec(), num_slots=2, pin=False)
    assert not pool.pinned
    assert pool.buffer is not None and not pool.buffer.is_pinned()


# ---- accounting mode -----------------------------------------------------------------------------------


def test_unmaterialized_pools_keep_only_the_allocator() -> None:
    spec = make_spec()
    pools: list[ItemPool] = [
        DeviceKVPool(spec, 8, materialize=False),
        DeviceMambaPool(spec, 8, materialize=False),
        HostKVPool(spec, num_pages=8, materialize=False),
        MambaPoolHost(spec, num_slots=8, materialize=False),
    ]
    for pool in pools:
        assert pool.buffer is None
        assert not pool.materialized and not pool.pinned
        assert pool.size_bytes == 8 * pool.bytes_per_index
        with pytest.raises(ConfigError, match="materialize=False"):
            pool.layer_items(pool.layer_ids[0])
        with pytest.raises(ConfigError, match="materialize=False"):
            pool.index_bytes(0)
        got = pool.alloc(8)
        assert got is not None and pool.alloc(1) is None
        pool.free(got)
        assert pool.num_free == 8
    kv, mamba = pools[0], pools[1]
    assert isinstance(kv, DeviceKVPool) and isinstance(mamba, DeviceMambaPool)
    with pytest.raises(ConfigError):
        kv.kv_cache(1)
    with pytest.raises(ConfigError):
        mamba.state(0)


def test_repr_names_the_pool() -> None:
    text = repr(HostKVPool(make_spec(), num_pages=2, layout="layer_first"))
    assert "HostKVPool" in text and "host_kv" in text and "layer_first" in text


def test_empty_pool() -> None:
    pool = DeviceKVPool(make_spec(), 0)
    assert pool.size_bytes == 0
    assert pool.alloc(1) is None
    k, _ = pool.kv_cache(1)
    assert k.shape[0] == 0


@pytest.mark.parametrize("device", ["nonsense", "cuda:97"])
def test_a_device_that_is_not_there_is_a_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match="device"):
        DeviceKVPool(make_spec(), 2, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_pool_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not available"):
        DeviceKVPool(make_spec(), 2, device="cuda")
