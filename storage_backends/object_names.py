"""Object names and what an object of a pool holds, shared by every built-in backend.

Primitives:

- :func:`validate_key` / :func:`validate_pool_name` — strict checks of what may become part of an
  object name (lowercase hex keys, ``[a-z0-9_]`` pool names): nothing a caller passes can climb
  out of the backend's directory or prefix.
- :func:`namespace_digest` / :func:`object_relpath` — the key space
  ``{namespace-digest}/{pool}/{key[:2]}/{key}``: one space per namespace (model, page size,
  dtypes, TP shard) and per pool; a Mamba state lives under the hash of the last page it covers
  in the ``mamba`` space, a KV page under its own hash in the ``kv`` space.
- :class:`ObjectGeometry` — what one object of a pool holds (pool, dtype, layers × item bytes).
- :func:`short_repr` — a caller's value as error messages show it (at most 80 characters).

Imported by reader processes, which have no torch: pools are imported only where a geometry is
taken from one.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asynccache.errors import ConfigError

if TYPE_CHECKING:  # not at run time: a reader process imports this module without torch
    from asynccache.pools.base import ItemPool

__all__ = [
    "ObjectGeometry",
    "namespace_digest",
    "object_relpath",
    "short_repr",
    "validate_key",
    "validate_pool_name",
]

_KEY_RE = re.compile(r"[0-9a-f]{8,128}")
_POOL_RE = re.compile(r"[a-z0-9_]{1,32}")


def short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_key(key: object) -> str:
    """A storage key: 8–128 lowercase hex characters (a chained page hash). Anything else —
    separators, dots, upper case, NUL — is misuse and raises :class:`ConfigError`."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ConfigError(f"invalid storage key {short_repr(key)}: expected 8-128 lowercase hex characters")
    return key


def validate_pool_name(name: object) -> str:
    value = getattr(name, "value", name)
    if not isinstance(value, str) or _POOL_RE.fullmatch(value) is None:
        raise ConfigError(f"invalid pool name {short_repr(name)}: expected 1-32 characters of [a-z0-9_]")
    return value


def namespace_digest(namespace: str) -> bytes:
    """16-byte digest of a namespace string (``HybridSpec.namespace_id``)."""
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError("a storage backend needs a non-empty namespace (the spec's namespace_id)")
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def object_relpath(ns_digest_hex: str, pool_name: str, key: str) -> str:
    """``{namespace-digest}/{pool}/{key[:2]}/{key}`` — validated, '/'-separated."""
    pool = validate_pool_name(pool_name)
    k = validate_key(key)
    return f"{ns_digest_hex}/{pool}/{k[:2]}/{k}"


def _pool_dtype(pool: ItemPool) -> str:
    from asynccache.pools.views import KVViews, StateViews

    spec = getattr(pool, "spec", None)
    if spec is not None and isinstance(pool, KVViews):
        return str(spec.kv_dtype).removeprefix("torch.")
    if spec is not None and isinstance(pool, StateViews):
        return "+".join(f"{c.name}:{str(c.dtype).removeprefix('torch.')}" for c in spec.state_components)
    return "uint8"


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectGeometry:
    """What one object of a pool holds: ``num_layers`` items of ``item_bytes`` bytes."""

    pool_name: str
    dtype: str
    num_layers: int
    item_bytes: int

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.item_bytes

    @classmethod
    def of_pool(cls, pool_name: object, pool: ItemPool) -> ObjectGeometry:
        from asynccache.pools import base as pools

        name = validate_pool_name(pool_name)
        if not isinstance(pool, pools.ItemPool):
            raise ConfigError(f"pool {name}: expected an ItemPool, got {type(pool).__name__}")
        if not pool.materialized:
            raise ConfigError(f"pool {name}: {pool.name} is in accounting mode; storage needs its bytes")
        if pool.device.type != "cpu":
            raise ConfigError(f"pool {name}: storage reads and writes host pools, {pool.name} is on {pool.device}")
        return cls(pool_name=name, dtype=_pool_dtype(pool), num_layers=pool.num_layers, item_bytes=pool.item_bytes)
