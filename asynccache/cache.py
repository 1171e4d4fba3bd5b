"""HybridCache: pools, tree, controller and storage backend built from a spec and a config.

The one object a serving engine holds::

    async with HybridCache.build(spec, config, device="cuda") as cache:
        match = cache.tree.match_prefix(tokens[:-1])
        op = cache.controller.load(match)
        counter = cache.controller.start_loading()
        ...
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, Self

import torch

from asynccache.checks import as_int
from asynccache.config import HybridCacheConfig
from asynccache.controller import HybridCacheController
from asynccache.errors import ConfigError, SharedMemoryError
from asynccache.pools import DeviceKVPool, DeviceMambaPool, HostKVPool, MambaPoolHost
from asynccache.pools.memory import check_host_bytes
from asynccache.spec import HybridSpec
from asynccache.storage import StorageBackend, open_backend, storage_scheme

__all__ = ["HybridCache", "effective_storage_options"]

log = logging.getLogger("asynccache.cache")


def effective_storage_options(
    config: HybridCacheConfig, device: str | torch.device, *, materialize: bool = True
) -> dict[str, Any]:
    """The options the storage backend is opened with: ``config.storage_options``, and reader
    processes for a local disk on a CUDA device.

    There a serving loop's forward pass holds the interpreter lock for much of its time, and the
    disk's worker threads read slower beside it than children with interpreters of their own
    (split restores of a 32k-token prefix 19–38 % faster in the same run on H200 machines:
    docs/benchmarks.md, Long-prefix TTFT). So a ``file://`` tier that leaves ``read_processes``
    unset reads in ``max_concurrency`` children (at most one per usable core) when the cache is
    on CUDA with real host pools (Linux, plain objects: no ``compression``), and then reads
    with ``O_DIRECT`` where the filesystem allows (``direct_io=None``) unless ``direct_io`` is
    set — but a range the page cache holds whole through it. In the same runs on H200
    machines (docs/benchmarks.md, runs BB–BD) restores of a 32k-token prefix the page cache
    had dropped ran 3–4 % faster split and 9–19 % faster whole; multi-turn hits on objects
    written a round before took 2–8 % longer (without the page-cache check, 39–71 %).
    ``read_processes=0`` keeps the threads; on CPU the threads stay the default.
    """
    options = dict(config.storage_options)
    if (
        "read_processes" not in options
        and config.storage_uri is not None
        and storage_scheme(config.storage_uri) == "file"
        and torch.device(device).type == "cuda"
        and materialize
        and config.has_host_tier
        and sys.platform.startswith("linux")
        and options.get("compression", "none") == "none"
    ):
        from storage_backends.base import usable_cores
        from storage_backends.local_disk import LocalDiskBackend

        wanted = options.get("max_concurrency") or LocalDiskBackend.default_max_concurrency
        depth = as_int(wanted)  # a NumPy integer too; anything else is the backend's to refuse
        # an I/O depth set high (max_concurrency=64) is not worth as many interpreters
        options["read_processes"] = wanted if depth is None else max(1, min(depth, usable_cores()))
        # past the page cache for the ranges it does not hold whole, where the filesystem allows
        options.setdefault("direct_io", None)
    return options


def _check_layer_kinds(spec: HybridSpec, config: HybridCacheConfig, *, storage: bool) -> None:
    """Refuse tiers a spec with one kind of layer cannot use (a :class:`ConfigError`): a host
    tier keeps prefixes by their KV pages, which a spec without attention layers has none of;
    the storage tier archives a prefix with its recurrent state, and would store nothing for
    a spec without recurrent layers."""
    if not spec.attention_layer_ids and config.has_host_tier:
        raise ConfigError(
            f"spec {spec.model_id!r} has no attention layers: the host tier keeps prefixes by their "
            "KV pages, so it needs them (set host_kv_bytes and host_state_bytes to 0)"
        )
    if not spec.mamba_layer_ids and storage:
        raise ConfigError(
            f"spec {spec.model_id!r} has no recurrent layers: the storage tier archives a prefix "
            "with its recurrent state and would store nothing (leave the storage tier out)"
        )


def host_memory_sizes(spec: HybridSpec, config: HybridCacheConfig, device: str | torch.device) -> dict[str, int]:
    """The host memory a materialized cache's pools take, by config field: the host pools (whole
    items), and on a CPU device the device pools too. A cache checks them together against what
    the host has (:func:`check_host_bytes`) before any is made: a pageable or shared buffer
    commits no memory until written, so each checked alone would pass."""
    sizes: dict[str, int] = {}
    try:
        on_cpu = torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        on_cpu = False  # not a device: the pools say so
    if on_cpu:
        sizes["device_kv_pages"] = config.device_kv_pages * spec.kv_page_bytes
        sizes["device_state_slots"] = config.device_state_slots * spec.state_bytes
    for what, size, unit in (
        ("host_kv_bytes", config.host_kv_bytes, spec.kv_page_bytes),
        ("host_state_bytes", config.host_state_bytes, spec.state_bytes),
    ):
        if size > 0 and unit > 0:
            sizes[what] = size - size % unit
    return {what: n for what, n in sizes.items() if n > 0}


def _check_device_pools(spec: HybridSpec, config: HybridCacheConfig) -> None:
    """Refuse device pools no request fits in (a :class:`ConfigError` naming the field). Every
    request takes device KV pages, by which the tree indexes its prefix, and a device state slot
    to compute in, whatever the spec's layers: without attention layers the pages hold no
    bytes, without recurrent layers the slots hold none, but both are still taken. With either
    pool empty the cache was built and every request then failed with a ``CapacityError``."""
    if config.device_kv_pages == 0:
        why = "" if spec.attention_layer_ids else " (of no bytes without attention layers: they index the prefix)"
        raise ConfigError(
            f"device_kv_pages must be >= 1 for spec {spec.model_id!r}, got 0: every request takes device KV "
            f"pages{why}, so none could be served"
        )
    if config.device_state_slots == 0:
        why = "" if spec.mamba_layer_ids else " (of no bytes without recurrent layers)"
        raise ConfigError(
            f"device_state_slots must be >= 1 for spec {spec.model_id!r}, got 0: every request takes a device "
            f"state slot to compute in{why}, so none could be served"
        )


class HybridCache:
    """Pools (device, and host when the config sizes them), tree, controller and storage
    backend, made from ``spec`` and ``config`` on ``device``.

    A spec with one kind of layer takes the tiers it can use: without attention layers, no host
    tier; without recurrent layers, no storage tier (:class:`ConfigError`). Every spec needs at
    least one device KV page and one device state slot (``ConfigError`` naming the field).

    ``admission`` / ``eviction``: the tree's policies, instances of ``AdmissionPolicy`` /
    ``EvictionPolicy`` (default ``EndsAdmission`` / ``LRUEviction``); anything else (a name, a
    policy class rather than an instance) is a :class:`ConfigError`. ``backend``: a storage
    backend to use instead of opening ``config.storage_uri``. ``materialize=False``: accounting
    mode (pools without buffers). ``clock``: the tree's time source, a callable returning
    seconds (``last_access``, and the ``now`` eviction policies see; default
    ``time.monotonic``), e.g. a trace's simulated clock; not callable: :class:`ConfigError`, as
    is a ``spec`` or ``config`` of another type.
    """

    def __init__(
        self,
        spec: HybridSpec,
        config: HybridCacheConfig,
        *,
        device: str | torch.device = "cpu",
        admission: Any = None,
        eviction: Any = None,
        backend: StorageBackend | None = None,
        materialize: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        from asynccache.policy import (
            AdmissionPolicy,
            EndsAdmission,
            EvictionPolicy,
            LRUEviction,
            WritePolicy,
        )
        from asynccache.tree import HybridRadixTree

        if not isinstance(spec, HybridSpec):
            raise ConfigError(
                f"spec must be a HybridSpec (HybridSpec.preset, HybridSpec.from_hf_config), got {type(spec).__name__}"
            )
        if not isinstance(config, HybridCacheConfig):
            raise ConfigError(f"config must be a HybridCacheConfig, got {type(config).__name__}")
        if clock is not None and not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        for name, policy, base in (("admission", admission, AdmissionPolicy), ("eviction", eviction, EvictionPolicy)):
            if policy is not None and not isinstance(policy, base):
                got = f"the class {policy.__name__}" if isinstance(policy, type) else repr(policy)
                raise ConfigError(f"{name} must be an instance of {base.__name__} (or None for the default), got {got}")
        _check_device_pools(spec, config)
        _check_layer_kinds(spec, config, storage=backend is not None or config.storage_uri is not None)
        if materialize:
            check_host_bytes(host_memory_sizes(spec, config, device))
        self.spec = spec
        self.config = config
        self.device_kv = DeviceKVPool(spec, config.device_kv_pages, device=device, materialize=materialize)
        self.device_mamba = DeviceMambaPool(spec, config.device_state_slots, device=device, materialize=materialize)
        #: the options the storage backend is opened with (see :func:`effective_storage_options`);
        #: the config's own when the caller hands a backend in
        self.storage_options: Mapping[str, Any] = (
            effective_storage_options(config, device, materialize=materialize)
            if backend is None
            else dict(config.storage_options)
        )
        # a storage tier that reads in other processes needs host pools they can map
        shared = bool(self.storage_options.get("read_processes")) and materialize
        try:
            self.host_kv, self.host_mamba = self._host_pools(shared, materialize=materialize)
        except SharedMemoryError as e:
            if "read_processes" in config.storage_options:  # the caller's demand
                raise
            # reader processes chosen here, not by the caller: fall back to the reader threads
            log.warning("host pools in shared memory unavailable (%s): the storage tier reads with threads", e)
            self.storage_options = {**self.storage_options, "read_processes": 0}
            self.host_kv, self.host_mamba = self._host_pools(False, materialize=materialize)
        if backend is not None or config.storage_uri is not None:
            # The storage tier is fed from the host tier and loads into it: without host pages
            # or host state slots it would be opened and never used.
            missing = [
                name
                for name, pool, item_bytes in (
                    ("host_kv_bytes", self.host_kv, spec.kv_page_bytes),
                    ("host_state_bytes", self.host_mamba, spec.state_bytes),
                )
                if item_bytes > 0 and pool is None
            ]
            if missing:
                raise ConfigError(f"a storage tier needs a host tier to feed it: set {' and '.join(missing)}")
        if backend is None and config.storage_uri is not None:
            backend = open_backend(config.storage_uri, namespace=spec.namespace_id, **self.storage_options)
        self.tree = HybridRadixTree(
            spec,
            device_kv=self.device_kv,
            device_mamba=self.device_mamba,
            host_kv=self.host_kv,
            host_mamba=self.host_mamba,
            admission=admission or EndsAdmission(),
            eviction=eviction or LRUEviction(),
            write_policy=WritePolicy.parse(config.write_policy),
            clock=clock,
        )
        self.controller = HybridCacheController(
            self.tree,
            device_kv=self.device_kv,
            device_mamba=self.device_mamba,
            host_kv=self.host_kv,
            host_mamba=self.host_mamba,
            config=config,
            backend=backend,
        )
        self.tree.write_back = self.controller.write_back

    def _host_pools(self, shared: bool, *, materialize: bool) -> tuple[HostKVPool | None, MambaPoolHost | None]:
        config, spec = self.config, self.spec
        for size, unit, what in (
            (config.host_kv_bytes, spec.kv_page_bytes, "host_kv_bytes"),
            (config.host_state_bytes, spec.state_bytes, "host_state_bytes"),
        ):
            if 0 < size < unit:  # a pool of no items would still count as a tier
                raise ConfigError(f"{what} ({size}) does not hold one item ({unit} bytes)")
        # (their memory is checked with the device pools', before any is made: host_memory_sizes)

        def pool(cls: type[HostKVPool | MambaPoolHost], size: int) -> Any:
            if size <= 0:
                return None
            return cls(
                spec, size_bytes=size, layout=config.host_layout, pin=config.pin_host_memory,
                materialize=materialize, shared=shared,
            )  # fmt: skip

        return pool(HostKVPool, config.host_kv_bytes), pool(MambaPoolHost, config.host_state_bytes)

    @classmethod
    def build(cls, spec: HybridSpec, config: HybridCacheConfig, **kwargs: Any) -> HybridCache:
        return cls(spec, config, **kwargs)

    async def __aenter__(self) -> Self:
        await self.controller.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.controller.aclose()

    def flush_device(self) -> None:
        """Evict everything evictable from the device tier (demoting what has a host copy).
        Under ``write_back`` the eviction backs nodes up through the controller, so the cache
        must be entered (``async with``): :class:`ClosedError` otherwise."""
        self.tree.evict_device(num_kv_pages=self.device_kv.num_items, num_states=self.device_mamba.num_items)

    def flush_host(self) -> None:
        """Drop everything evictable from the host tier (what is archived stays in storage)."""
        if self.host_kv is not None or self.host_mamba is not None:
            self.tree.evict_host(
                num_kv_pages=self.host_kv.num_items if self.host_kv else 0,
                num_states=self.host_mamba.num_items if self.host_mamba else 0,
            )
