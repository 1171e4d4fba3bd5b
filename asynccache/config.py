"""HybridCacheConfig: every knob of the cache in one frozen dataclass.

Sizes are in items (device) or bytes (host); KV and state host pools are sized independently.
The storage tier is opened from ``storage_uri`` (``file:///…``, ``s3://…``, ``memory://``) with
``storage_options`` (the backend's keyword options, e.g. ``{"direct_io": True}`` for
``file://``; the namespace is the spec's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from asynccache.checks import as_int, check_int, check_seconds
from asynccache.errors import ConfigError
from asynccache.pools.base import PoolLayout

__all__ = ["HybridCacheConfig", "PrefetchPolicy"]


class PrefetchPolicy(str, Enum):
    """How long a request waits for a storage prefetch before it is scheduled.

    ``best_effort``: use whatever has landed when the scheduler asks (never wait);
    ``wait_complete``: wait for the whole prefetch; ``timeout``: wait up to
    ``prefetch_timeout_base_s + prefetch_timeout_per_1k_tokens_s × tokens / 1000``.
    """

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


def _check_count(name: str, value: object, minimum: int) -> int:
    """An integer of at least ``minimum`` (NumPy integers taken as ints), else a ConfigError."""
    n = as_int(value)
    return check_int(name, value if n is None else n, minimum=minimum)


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridCacheConfig:
    device_kv_pages: int
    device_state_slots: int
    host_kv_bytes: int = 0
    host_state_bytes: int = 0
    host_layout: PoolLayout = PoolLayout.PAGE_FIRST
    write_policy: str = "write_through"  # write_through | write_through_selective[:N hits] | write_back
    max_ctas: int | None = 8
    copy_method: str = "auto"  # auto | triton | dma | dma:auto (= dma) | dma:batch | dma:strided | dma:2d | dma:loop (kernels.copy_items)
    storage_uri: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    prefetch_timeout_base_s: float = 0.5
    prefetch_timeout_per_1k_tokens_s: float = 0.05
    max_backups_in_flight: int = 4
    pin_host_memory: bool | None = None

    def __post_init__(self) -> None:
        # Counts and sizes are ints (not bools, not floats: a float reached the allocators as a
        # bare TypeError, and a fractional backup limit made the semaphore never block).
        for name, minimum in (
            ("device_kv_pages", 0),
            ("device_state_slots", 0),
            ("host_kv_bytes", 0),
            ("host_state_bytes", 0),
            ("max_backups_in_flight", 1),
        ):
            object.__setattr__(self, name, _check_count(name, getattr(self, name), minimum))
        if self.max_ctas is not None:
            object.__setattr__(self, "max_ctas", _check_count("max_ctas", self.max_ctas, 1))
        from kernels.api import COPY_METHOD_NAMES

        if self.copy_method not in COPY_METHOD_NAMES:
            raise ConfigError(f"unknown copy_method {self.copy_method!r}; known: {list(COPY_METHOD_NAMES)}")
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s"):
            check_seconds(name, getattr(self, name), zero=True)
        if not isinstance(self.storage_options, Mapping) or not all(
            isinstance(k, str) and k.isidentifier() for k in self.storage_options
        ):
            raise ConfigError(f"storage_options must map option names to values, got {self.storage_options!r}")
        if "namespace" in self.storage_options:
            raise ConfigError("storage_options: the namespace is the spec's (namespace_id), not an option")
        object.__setattr__(self, "storage_options", MappingProxyType(dict(self.storage_options)))
        if self.storage_uri is not None:
            from asynccache.storage import storage_scheme

            storage_scheme(self.storage_uri)  # a URI that does not parse is refused here, redacted
        object.__setattr__(self, "host_layout", PoolLayout.parse(self.host_layout))
        from asynccache.policy.write import WritePolicy

        WritePolicy.parse(self.write_policy)  # refused here, not when a cache is built from the config
        if self.pin_host_memory is not None and not isinstance(self.pin_host_memory, bool):
            # a truthy "no" or 0.0 would otherwise demand pinned memory, or skip it, by accident
            pin = self.pin_host_memory
            raise ConfigError(f"pin_host_memory must be None (pin when possible), True or False, got {pin!r}")
        try:
            object.__setattr__(self, "prefetch_policy", PrefetchPolicy(self.prefetch_policy))
        except ValueError:
            known = [p.value for p in PrefetchPolicy]
            raise ConfigError(f"unknown prefetch_policy {self.prefetch_policy!r}; known: {known}") from None

    @property
    def has_host_tier(self) -> bool:
        return self.host_kv_bytes > 0 or self.host_state_bytes > 0

    def prefetch_timeout_s(self, num_tokens: int) -> float | None:
        """Seconds a request may wait for its prefetch (None = no limit, 0 = do not wait)."""
        if self.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
            return None
        if self.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
            return 0.0
        return self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_tokens_s * num_tokens / 1000
