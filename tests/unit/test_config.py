"""HybridCacheConfig and the host pools it sizes: values that make no sense are refused, by name,
as ConfigError; a pool too large for the machine is a CapacityError before anything big is built."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import CapacityError, ConfigError
from asynccache.pools import base as pool_base
from asynccache.pools.host import HostKVPool
from asynccache.spec import HybridSpec

SPEC = HybridSpec.preset("tiny", page_size=4)
BASE = {"device_kv_pages": 8, "device_state_slots": 4}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"device_kv_pages": 2.5}, "device_kv_pages"),
        ({"device_state_slots": True}, "device_state_slots"),
        ({"host_kv_bytes": float("nan")}, "host_kv_bytes"),
        ({"host_state_bytes": 1e6}, "host_state_bytes"),
        ({"host_kv_bytes": -1}, "host_kv_bytes"),
        ({"max_backups_in_flight": 2.5}, "max_backups_in_flight"),  # a semaphore of 2.5 never blocks
        ({"max_ctas": 2.5}, "max_ctas"),
        ({"max_ctas": True}, "max_ctas"),
        ({"prefetch_timeout_base_s": float("nan")}, "prefetch_timeout_base_s"),  # NaN: never wait
        ({"prefetch_timeout_per_1k_tokens_s": float("inf")}, "prefetch_timeout_per_1k_tokens_s"),
        ({"prefetch_policy": "bogus"}, "prefetch_policy"),
    ],
)
def test_values_that_make_no_sense_are_refused_by_name(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        HybridCacheConfig(**(BASE | change))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"write_policy": "write_through_selectve:2"}, "unknown write policy"),
        ({"write_policy": "write_through_selective:0"}, "hit_threshold"),
        ({"write_policy": None}, "unknown write policy"),
        ({"pin_host_memory": "no"}, "pin_host_memory"),  # truthy: it demanded pinned memory
        ({"pin_host_memory": 0}, "pin_host_memory"),
    ],
)
def test_write_policy_and_pinning_are_checked_with_the_config(change: dict[str, Any], message: str) -> None:
    """Refused where the config is made, not later where a cache is built from it."""
    with pytest.raises(ConfigError, match=message):
        HybridCacheConfig(**(BASE | change))


def test_a_cache_needs_a_spec_and_a_config() -> None:
    config = HybridCacheConfig(**BASE)
    with pytest.raises(ConfigError, match="spec must be a HybridSpec"):
        HybridCache("tiny", config)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="config must be a HybridCacheConfig"):
        HybridCache(SPEC, dict(BASE))  # type: ignore[arg-type]


def test_numpy_integers_are_taken_as_ints() -> None:
    cfg = HybridCacheConfig(device_kv_pages=np.int64(8), device_state_slots=np.int32(4), max_ctas=np.int64(16))
    assert (cfg.device_kv_pages, cfg.device_state_slots, cfg.max_ctas) == (8, 4, 16)
    assert all(type(v) is int for v in (cfg.device_kv_pages, cfg.device_state_slots, cfg.max_ctas))


def test_a_host_budget_of_less_than_one_item_is_refused() -> None:
    """A pool of no pages would still count as a host tier (and let host states be built)."""
    too_small = HybridCacheConfig(**BASE, host_kv_bytes=SPEC.kv_page_bytes - 1, host_state_bytes=4 * SPEC.state_bytes)
    with pytest.raises(ConfigError, match="host_kv_bytes"):
        HybridCache(SPEC, too_small)
    no_state = HybridCacheConfig(**BASE, host_kv_bytes=4 * SPEC.kv_page_bytes, host_state_bytes=SPEC.state_bytes - 1)
    with pytest.raises(ConfigError, match="host_state_bytes"):
        HybridCache(SPEC, no_state)


def test_a_pool_too_large_for_the_machine_fails_before_its_free_list_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCACHE_HOST_LIMIT_BYTES", str(1 << 20))

    def no_free_list(*args: object, **kwargs: object) -> None:
        raise AssertionError("the free list was built before the size was checked")

    monkeypatch.setattr(pool_base, "IndexAllocator", no_free_list)
    with pytest.raises(CapacityError, match="available"):
        HostKVPool(SPEC, num_pages=(64 << 20) // SPEC.kv_page_bytes, pin=False)


def test_host_pools_too_large_together_are_refused_before_either_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pageable and shared buffers commit nothing until written: each pool alone fits what the
    machine has, both together do not, and neither is allocated."""
    kv_bytes, state_bytes = 6 * SPEC.kv_page_bytes, 6 * SPEC.state_bytes
    monkeypatch.setenv("ASYNCCACHE_HOST_LIMIT_BYTES", str(kv_bytes + state_bytes - 1))
    made: list[str] = []
    real = pool_base.allocate_bytes

    def recorded(nbytes: int, **kwargs: Any) -> Any:
        made.append(kwargs["what"])
        return real(nbytes, **kwargs)

    monkeypatch.setattr(pool_base, "allocate_bytes", recorded)
    config = HybridCacheConfig(**BASE, host_kv_bytes=kv_bytes, host_state_bytes=state_bytes, pin_host_memory=False)
    with pytest.raises(CapacityError, match=f"host_kv_bytes {kv_bytes} \\+ host_state_bytes {state_bytes}"):
        HybridCache(SPEC, config)
    assert made == []  # on a CPU cache the device pools are host memory too: checked with them
    # Either alone fits.
    HostKVPool(SPEC, size_bytes=kv_bytes, pin=False)
    cache = HybridCache(SPEC, HybridCacheConfig(**BASE, host_kv_bytes=kv_bytes, pin_host_memory=False))
    assert cache.host_kv is not None and cache.host_kv.size_bytes == kv_bytes


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAEXAMPLE:wJalrSECRETKEY@[my-bucket/prefix",  # does not parse
        "s3a://AKIAEXAMPLE:wJalrSECRETKEY@my-bucket/prefix",  # an unknown scheme (Hadoop's spelling)
        "s3a://my-bucket/prefix?secret_access_key=wJalrSECRETKEY",
    ],
)
def test_a_bad_storage_uri_is_a_config_error_that_does_not_show_its_secret(uri: str) -> None:
    from asynccache.storage import open_backend

    config = {**BASE, "host_kv_bytes": 64 * SPEC.kv_page_bytes, "host_state_bytes": 4 * SPEC.state_bytes}
    with pytest.raises(ConfigError) as refused:
        HybridCache(SPEC, HybridCacheConfig(**config, storage_uri=uri))
    assert "SECRET" not in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        open_backend(uri, namespace="n")
    assert "SECRET" not in str(refused.value)


@pytest.mark.parametrize("host", [{"host_kv_bytes": 0}, {"host_state_bytes": 0}])
def test_a_storage_tier_without_a_host_tier_for_kv_and_states_is_refused(host: dict[str, int]) -> None:
    """The storage tier writes from and reads into host pools: without one of them it would be
    opened and never used."""
    sizes = {"host_kv_bytes": 64 * SPEC.kv_page_bytes, "host_state_bytes": 4 * SPEC.state_bytes} | host
    with pytest.raises(ConfigError, match=f"needs a host tier to feed it: set {next(iter(host))}$"):
        HybridCache(SPEC, HybridCacheConfig(**BASE, **sizes, storage_uri="memory://x"))


def _one_kind(kind: str) -> HybridSpec:
    from asynccache.spec import PRESETS

    types = {"attention": "full_attention", "recurrent": "linear_attention"}[kind]
    return HybridSpec.from_hf_config({**PRESETS["tiny"], "layer_types": [types] * 4}, page_size=4)


def test_tiers_a_spec_with_one_kind_of_layer_cannot_use_are_refused() -> None:
    """Attention only: the storage tier archives prefixes with their recurrent state and stored
    nothing (a storage mode of hit rate 0). Recurrent only: a host tier keeps prefixes by their
    KV pages (0 bytes), and was refused for a host state pool without a host KV pool."""
    attention, recurrent = _one_kind("attention"), _one_kind("recurrent")
    host = {"host_kv_bytes": 64 * attention.kv_page_bytes}
    with pytest.raises(ConfigError, match="no recurrent layers: the storage tier"):
        HybridCache(attention, HybridCacheConfig(**BASE, **host, storage_uri="memory://one_kind"))
    HybridCache(attention, HybridCacheConfig(**BASE, **host))  # a host tier it can use
    for sizes in ({"host_state_bytes": 4 * recurrent.state_bytes}, {"host_kv_bytes": 1 << 20}):
        with pytest.raises(ConfigError, match="no attention layers: the host tier"):
            HybridCache(recurrent, HybridCacheConfig(**BASE, **sizes), materialize=False)
    HybridCache(recurrent, HybridCacheConfig(**BASE))  # the device tier only


@pytest.mark.parametrize("kind", ["hybrid", "attention", "recurrent"])
@pytest.mark.parametrize("field", ["device_kv_pages", "device_state_slots"])
def test_an_empty_device_pool_is_refused_when_the_cache_is_built(kind: str, field: str) -> None:
    """Every request takes device KV pages (the tree's index of its prefix, bytes or not) and a
    device state slot to compute in, whatever the spec's layers: a cache with either pool empty
    was built, and then every request failed with a CapacityError."""
    spec = SPEC if kind == "hybrid" else _one_kind(kind)
    for materialize in (True, False):  # accounting mode serves no request either
        with pytest.raises(ConfigError, match=f"^{field} must be >= 1 for spec .*got 0"):
            HybridCache(spec, HybridCacheConfig(**(BASE | {field: 0})), materialize=materialize)
    HybridCache(spec, HybridCacheConfig(**(BASE | {field: 1})))


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYXq7ZpKEY@bucket/prefix",  # "/" in it
        "s3://AKIAIOSFODNN7EXAMPLE:wJalr#Xq7ZpKEY@bucket/prefix",
        "s3://AKIAIOSFODNN7EXAMPLE:wJalr?Xq7ZpKEY@bucket/prefix",
        "file://AKIAIOSFODNN7EXAMPLE:wJalr/Xq7ZpKEY@/tmp/cache",
        "s3a://bucket/prefix?endpoint_url=http://AKIAIOSFODNN7EXAMPLE:Xq7ZpKEY@host:9000",
    ],
)
def test_no_error_about_a_storage_uri_shows_its_credentials(uri: str) -> None:
    """A secret may hold "/", "#" or "?", which end a URL parser's host part early."""
    from asynccache.storage import open_backend, redact_uri

    for shown in (redact_uri(uri), _refusal(lambda: open_backend(uri, namespace="n"))):
        assert "Xq7ZpKEY" not in shown and "AKIAIOSFODNN7EXAMPLE" not in shown


def _refusal(call: Any) -> str:
    try:
        call()
    except ConfigError as e:
        return str(e)
    raise AssertionError("not refused")


def test_a_numpy_io_depth_still_caps_the_reader_processes_at_the_cores() -> None:
    from asynccache.cache import effective_storage_options
    from storage_backends.base import usable_cores

    config = HybridCacheConfig(
        **BASE, host_kv_bytes=64 * SPEC.kv_page_bytes, host_state_bytes=4 * SPEC.state_bytes,
        storage_uri="file:///tmp/x", storage_options={"max_concurrency": np.int64(64)},
    )  # fmt: skip
    got = effective_storage_options(config, "cuda")["read_processes"]
    assert type(got) is int and got == min(64, usable_cores())
