"""The V2 pool interface between the cache and L3 storage backends.

Primitives:

- :class:`PoolName` — which pool a transfer touches (``KV`` pages, ``MAMBA`` states; open to more).
- :class:`PoolHitPolicy` — how a pool's objects must exist for a prefix to count as a hit:
  ``ALL_PAGES`` (every page of the prefix: attention KV) or ``TRAILING_PAGES`` (only the last
  ``num_trailing`` pages: a Mamba state is needed only at the last hit page).
- :class:`PoolTransfer` — one pool's part of a batch: storage keys, host indices (and, for
  host↔device copies, device indices), hit policy, and for writes whether the objects are
  *speculative*.
- :class:`PoolTransferResult` — the answer of ``batch_exists_v2``: the longest prefix of pages
  that honours every pool's policy.
- :class:`StorageBackend` — the async protocol every backend implements;
  :class:`DeletingBackend` — one that also deletes objects on request (``batch_delete_v2``:
  every built-in backend; the storage tier removes with it what was computed on a failed load).
- :func:`open_backend` / :func:`register_backend` — the URI scheme registry
  (``file:///…``, ``s3://bucket/prefix?endpoint_url=…``, ``memory://``).

Keys are the chained page hashes of the tree (hex strings); a backend maps ``(pool, key)`` to
an object name in that pool's own key space, under its namespace.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlsplit

import torch

from asynccache.errors import ConfigError

if TYPE_CHECKING:
    from asynccache.pools.base import ItemPool

__all__ = [
    "DeletingBackend",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "StorageBackend",
    "check_exists_call",
    "known_schemes",
    "longest_hit",
    "open_backend",
    "redact_reason",
    "redact_uri",
    "register_backend",
    "storage_scheme",
]


class PoolName(str, Enum):
    KV = "kv"
    MAMBA = "mamba"


class PoolHitPolicy(str, Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


def _empty_indices() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolTransfer:
    """One pool's share of a batched transfer.

    For storage calls ``keys[i]`` pairs with ``host_indices[i]``. For host↔device copies
    ``host_indices[i]`` pairs with ``device_indices[i]`` and ``keys`` may be empty.

    ``speculative`` (``batch_set_v2`` only): objects nobody has asked for yet (storage-only
    snapshots). A backend that evicts for room stores them only in room it can make without
    evicting a regular object, and evicts them before any regular object; a regular write of the
    same key, or a read that finds one, makes it regular. A backend without a capacity treats
    them as regular writes.
    """

    pool_name: PoolName
    keys: tuple[str, ...] = ()
    host_indices: torch.Tensor = field(default_factory=_empty_indices)
    device_indices: torch.Tensor = field(default_factory=_empty_indices)
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    num_trailing: int = 1
    speculative: bool = False

    def __post_init__(self) -> None:
        # The enums' plain values are accepted and made members: the backends pick pools by
        # identity (``is PoolHitPolicy.ALL_PAGES``), so a plain string would be no policy at all.
        for name, kind in (("pool_name", PoolName), ("hit_policy", PoolHitPolicy)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    raise ConfigError(f"{name} must be one of {[m.value for m in kind]}, got {value!r}") from None
        if isinstance(self.num_trailing, bool) or not isinstance(self.num_trailing, int) or self.num_trailing < 1:
            raise ConfigError(f"num_trailing must be an int >= 1, got {self.num_trailing!r}")
        for name in ("host_indices", "device_indices"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ConfigError(f"{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.speculative, bool):
            raise ConfigError(f"speculative must be True or False, got {self.speculative!r}")

    @property
    def num_items(self) -> int:
        return max(len(self.keys), self.host_indices.numel(), self.device_indices.numel())


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolTransferResult:
    """``num_hit_pages``: the longest prefix of ``keys`` that honours every pool's hit policy.

    ``exists[pool]`` tells, per key, whether that pool's object was found (for diagnostics):
    ``False`` where it is absent *or was not probed* — the search stops once the hit is known.
    """

    num_hit_pages: int
    exists: dict[PoolName, tuple[bool, ...]] = field(default_factory=dict)


def check_exists_call(num_keys: int, transfers: Sequence[PoolTransfer]) -> None:
    """``batch_exists_v2`` of keys needs at least one transfer (a pool and its hit policy): with
    none, nothing says what a hit is, and every key would be one (a :class:`ConfigError`). No
    keys and no transfers asks nothing (a backend's first use, set up ahead)."""
    if num_keys and not transfers:
        raise ConfigError(f"batch_exists_v2 of {num_keys} key(s) names no pool transfer")


def longest_hit(num_keys: int, transfers: Sequence[PoolTransfer], exists: dict[PoolName, Sequence[bool]]) -> int:
    """The deepest ``n`` ≤ ``num_keys`` such that every ALL_PAGES pool has keys ``[0, n)`` and
    every TRAILING_PAGES pool has keys ``[n - num_trailing, n)``. Shared by every backend.
    Keys without a transfer are a malformed call (:func:`check_exists_call`)."""
    check_exists_call(num_keys, transfers)
    n = num_keys
    for t in transfers:
        if t.hit_policy is PoolHitPolicy.ALL_PAGES:
            flags = exists[t.pool_name]
            k = 0
            while k < min(n, len(flags)) and flags[k]:
                k += 1
            n = k
    trailing = [t for t in transfers if t.hit_policy is PoolHitPolicy.TRAILING_PAGES]
    while n > 0:
        ok = True
        for t in trailing:
            flags = exists[t.pool_name]
            lo = max(0, n - t.num_trailing)
            if not all(flags[i] for i in range(lo, n)):
                ok = False
                break
        if ok:
            return n
        n -= 1
    return 0


@runtime_checkable
class StorageBackend(Protocol):
    """Async L3 storage. Every method may be called concurrently from the event loop.

    Contract:

    - ``register_host_pool_v2`` gives the backend the host pool whose slots ``batch_get_v2``
      writes into and ``batch_set_v2`` reads from (``page_first`` pools need no repacking).
    - ``batch_exists_v2(keys, transfers)`` answers for the page-hash ``keys`` of one prefix: each
      transfer names a pool and hit policy (its own ``keys`` are ignored); keys without any
      transfer are a malformed call (``ConfigError``).
    - ``batch_get_v2`` reads ``keys[i]`` into ``host_indices[i]`` per transfer; returns success per
      item. A missing, truncated, corrupted or foreign object is a miss (``False``), never data.
    - ``batch_set_v2`` writes ``host_indices[i]`` under ``keys[i]`` (put-if-absent: an existing
      object is success); returns success per item. Failures are ``False``, never exceptions,
      unless the call itself is malformed. A ``speculative`` transfer's objects never displace
      regular ones in a backend that evicts for room (see :class:`PoolTransfer`); one that
      finds no such room is ``False``.
    - The host slots named in a get/set must stay allocated and unwritten until the call returns.
    """

    async def register_host_pool_v2(self, pool_name: PoolName, host_pool: ItemPool) -> None: ...

    async def batch_exists_v2(self, keys: Sequence[str], transfers: Sequence[PoolTransfer]) -> PoolTransferResult: ...

    async def batch_get_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]: ...

    async def batch_set_v2(self, transfers: Sequence[PoolTransfer]) -> list[list[bool]]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class DeletingBackend(StorageBackend, Protocol):
    """A :class:`StorageBackend` that also deletes objects on request.

    - ``batch_delete_v2(keys, pool_names)`` removes, for each key, its object in each named pool
      (a key names one object per pool: its KV page in ``kv``, the state at its page in
      ``mamba``); returns per key whether they are gone — ``True`` also for an object that was
      absent, ``False`` when the delete failed and the object may still be stored (counted and
      reported like a failed write, never an exception). Bad keys, unregistered pools or keys
      without a pool raise ``ConfigError`` before any I/O; a closed backend raises
      ``BackendError``.
    - It is ordered with ``batch_set_v2`` of the same objects: it waits for the puts in flight
      when it was called (what they store is removed too), and a put called while it is in
      flight waits for it (the put stores its object anew).

    The built-in backends implement it (``storage_backends.batch_delete``); the storage tier
    uses it where a backend has it (``asynccache.stale_purge``).
    """

    async def batch_delete_v2(self, keys: Sequence[str], pool_names: Sequence[PoolName]) -> list[bool]: ...


BackendFactory = Callable[..., StorageBackend]

#: scheme → "module:factory" (imported on first use) or a factory.
_REGISTRY: dict[str, str | BackendFactory] = {
    "file": "storage_backends.local_disk:open_local_disk",
    "s3": "storage_backends.object_store:open_object_store",
    "memory": "storage_backends.memory:open_memory",
}


def register_backend(scheme: str, factory: str | BackendFactory, *, replace: bool = False) -> None:
    """Register a backend for a URI scheme (``factory(uri, **options)`` returns the backend)."""
    if scheme in _REGISTRY and not replace:
        raise ConfigError(f"scheme {scheme!r} is already registered")
    _REGISTRY[scheme] = factory


def redact_uri(uri: str) -> str:
    """``uri`` for an error message: without user info, query values and fragment, where
    credentials may be (``s3://KEY:SECRET@bucket/…``, ``?secret_access_key=…``). Read as text,
    not parsed: a secret holding ``/``, ``?`` or ``#`` would end a parser's host part early, so
    everything up to the last ``@`` is left out."""
    if not isinstance(uri, str):
        return f"(a {type(uri).__name__}, not a URI)"
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "", uri
    if "@" in rest:
        before, _, after = rest.rpartition("@")
        if "?" in before:  # an @ in the query, or a secret holding "?": show the scheme alone
            return f"{scheme}{sep}…"
        rest = "…@" + after
    rest = rest.partition("#")[0]
    where, has_query, query = rest.partition("?")
    keys = [k for k, _ in parse_qsl(query, keep_blank_values=True)]
    shown = f"{scheme}{sep}{where}"
    return shown + ("?" + "&".join(f"{k}=…" for k in keys) if has_query else "")


def redact_reason(error: BaseException) -> str:
    """A URL parser's error for a message about a URI: without the quoted text it echoes (a
    query field or port that may be part of a credential)."""
    return re.sub(r"(['\"]).*?\1", "…", str(error))


def storage_scheme(uri: object) -> str:
    """The scheme of a storage URI, or :class:`ConfigError` naming what is wrong with it (the
    URI redacted: it may carry credentials)."""
    if not isinstance(uri, str):
        raise ConfigError(f"a storage URI is a string, got {type(uri).__name__}")
    try:
        scheme = urlsplit(uri).scheme
    except ValueError as e:
        raise ConfigError(f"malformed storage URI {redact_uri(uri)}: {redact_reason(e)}") from None
    if not scheme:
        raise ConfigError(f"storage URI {redact_uri(uri)} has no scheme; known schemes: {known_schemes()}")
    return scheme


def known_schemes() -> list[str]:
    return sorted(_REGISTRY)


def open_backend(uri: str, /, **options: Any) -> StorageBackend:
    """Open the backend for ``uri``; options go to the backend's factory (namespace, limits…)."""
    scheme = storage_scheme(uri)
    factory = _REGISTRY.get(scheme)
    if factory is None:
        raise ConfigError(
            f"unknown storage scheme {scheme!r} in {redact_uri(uri)}; known schemes: {known_schemes()}"
        )
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
    try:
        return factory(uri, **options)
    except TypeError as e:
        if "unexpected keyword argument" in str(e) or "multiple values for argument" in str(e):
            raise ConfigError(f"storage {redact_uri(uri)}: an option the backend does not take ({e})") from None
        if "required keyword-only argument" in str(e):
            raise ConfigError(f"storage {redact_uri(uri)}: an option the backend needs is missing ({e})") from None
        raise
