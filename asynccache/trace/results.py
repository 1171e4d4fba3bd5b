"""Named results of a trace replay: budgets, hits by tier, compute saved, traffic, evictions.

- :class:`TierBudget` — bytes per tier (device, host, storage); parsed from ``"32GiB"`` style sizes
  by :func:`parse_size`.
- :class:`ReplayResult` — one policy combination under one budget over one trace.
- :func:`results_to_json` — the ``--json`` document: ``{"bound": float, "results": [...]}``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asynccache.errors import ConfigError

__all__ = ["TIERS", "ReplayResult", "TierBudget", "format_size", "parse_size", "results_to_json"]

TIERS = ("device", "host", "storage")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"128GiB"`` → 137438953472; ``"8TiB"``, ``"1.5g"``, ``"0"`` and plain ints work too."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must be >= 0, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot parse size {text!r} (examples: 512GiB, 8TiB, 32g, 0)")
    exact = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if exact != int(exact):  # "0.4" (bytes) would silently become 0: a tier that vanishes
        raise ConfigError(f"size {text!r} is not a whole number of bytes")
    return int(exact)


def format_size(nbytes: int) -> str:
    """Binary units, shortest exact-ish form: 137438953472 → ``"128GiB"``."""
    if nbytes == 0:
        return "0"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


@dataclass(frozen=True, slots=True, kw_only=True)
class TierBudget:
    """Cache bytes per tier. ``host == 0`` or ``storage == 0`` means the tier is absent."""

    device: int
    host: int = 0
    storage: int = 0

    def __post_init__(self) -> None:
        for name in TIERS:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} budget must be >= 0")
        if self.device <= 0:
            raise ConfigError("the device tier needs a positive budget")

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "storage": self.storage}

    @property
    def label(self) -> str:
        parts = [f"dev {format_size(self.device)}", f"host {format_size(self.host)}"]
        if self.storage:
            parts.append(f"disk {format_size(self.storage)}")
        return " + ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    """Figures of one replay. Token counts are prompt tokens; FLOPs are prefill FLOPs.

    ``bytes_moved``: ``h2d``; ``d2h``, every device → host copy (backups, and the staging of
    storage-only snapshots); ``d2h_kv`` / ``d2h_state``, the backups' alone; with a storage tier
    ``storage_write`` / ``storage_read``. ``evictions``: indices the byte budgets freed
    (``device_kv``, ``device_state``; ``host_kv``, ``host_state`` with a host tier), states lost
    with them (``device_lost_states``, ``host_lost_states``), enforcements that left the tier
    over its budget, all that was left being locked (``device_stuck``, ``host_stuck``), states
    released as superseded (``released_states``) and, with a storage tier, storage objects
    evicted (``storage_objects``).
    """

    admission: str
    eviction: str
    write_policy: str
    budget: TierBudget
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_tokens_by_tier: dict[str, int]
    bound_hit_rate: float
    flops_total: float
    flops_saved: float
    bytes_moved: dict[str, int]
    evictions: dict[str, int]
    peak_bytes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def policy(self) -> str:
        return f"{self.admission} + {self.eviction}"

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def fraction_of_bound(self) -> float:
        return self.hit_rate / self.bound_hit_rate if self.bound_hit_rate else 0.0

    def hit_rate_by_tier(self) -> dict[str, float]:
        p = max(self.prompt_tokens, 1)
        return {t: self.hit_tokens_by_tier.get(t, 0) / p for t in TIERS}

    def to_json(self) -> dict[str, Any]:
        return {
            "admission": self.admission,
            "eviction": self.eviction,
            "write_policy": self.write_policy,
            "budget_bytes": self.budget.as_dict(),
            "hit_rate": self.hit_rate,
            "fraction_of_bound": self.fraction_of_bound,
            "flops_saved": self.flops_saved,
            "flops_total": self.flops_total,
            "hit_rate_by_tier": self.hit_rate_by_tier(),
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "num_requests": self.num_requests,
            "bytes_moved": dict(self.bytes_moved),
            "evictions": dict(self.evictions),
            "peak_bytes": dict(self.peak_bytes),
            "extra": dict(self.extra),
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, bound: float) -> ReplayResult:
        """Inverse of :meth:`to_json` (for re-plotting saved runs); ``ConfigError`` naming the
        first field that is missing or of the wrong type."""
        if not isinstance(obj, dict):
            raise ConfigError(f"a result must be an object, got {type(obj).__name__}")
        prompt_tokens = _field(obj, "prompt_tokens", _is_count, "an integer >= 0")
        by_tier = _field(obj, "hit_rate_by_tier", _is_reals, "an object of numbers")
        budget = _field(obj, "budget_bytes", _is_budget, "an object of integers >= 0 (device, host, storage)")
        return cls(
            admission=_field(obj, "admission", _is_str, "a string"),
            eviction=_field(obj, "eviction", _is_str, "a string"),
            write_policy=_field(obj, "write_policy", _is_str, "a string", ""),
            budget=TierBudget(**budget),
            num_requests=_field(obj, "num_requests", _is_count, "an integer >= 0"),
            prompt_tokens=prompt_tokens,
            hit_tokens=_field(obj, "hit_tokens", _is_count, "an integer >= 0"),
            hit_tokens_by_tier={t: round(v * prompt_tokens) for t, v in by_tier.items()},
            bound_hit_rate=bound,
            flops_total=_field(obj, "flops_total", _is_real, "a finite number"),
            flops_saved=_field(obj, "flops_saved", _is_real, "a finite number"),
            bytes_moved=_field(obj, "bytes_moved", _is_counts, "an object of integers >= 0"),
            evictions=_field(obj, "evictions", _is_counts, "an object of integers >= 0"),
            peak_bytes=_field(obj, "peak_bytes", _is_counts, "an object of integers >= 0", {}),
            extra=_field(obj, "extra", lambda v: isinstance(v, dict), "an object", {}),
            wall_s=_field(obj, "wall_s", _is_real, "a finite number", 0.0),
        )


_REQUIRED: Any = object()


def _field(obj: dict[str, Any], key: str, ok: Callable[[Any], bool], what: str, default: Any = _REQUIRED) -> Any:
    if key not in obj:
        if default is _REQUIRED:
            raise ConfigError(f"result field {key!r} is missing")
        return default
    value = obj[key]
    if not ok(value):
        raise ConfigError(f"result field {key!r} must be {what}, got {value!r}")
    return value


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _is_count(x) for k, x in v.items())


def _is_budget(v: Any) -> bool:
    return _is_counts(v) and "device" in v and set(v) <= set(TIERS)


def _is_reals(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _is_real(x) for k, x in v.items())


def results_to_json(bound: float, results: Sequence[ReplayResult], **meta: Any) -> dict[str, Any]:
    """``{"bound": float, "results": [...], **meta}`` with one entry per result (see to_json)."""
    doc: dict[str, Any] = {"bound": bound, "results": [r.to_json() for r in results]}
    doc.update(meta)
    return doc

