"""Controller statistics: bytes and operations per direction and pool, queue depths, latency."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asynccache.storage import PoolName

if TYPE_CHECKING:
    from asynccache.completion import CompletionQueue

__all__ = ["ControllerStats", "StatsRecorder"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerStats:
    """A snapshot. ``bytes`` is keyed ``"h2d:kv"``, ``"d2h:mamba"`` …; ``counts`` holds operation
    counts (``load_ops``, ``write_ops``, ``h2d_launches_kv`` …, failures, cancellations)."""

    bytes: dict[str, int]
    counts: dict[str, int]
    load_queue: int
    write_queue: int
    load_in_flight: int
    write_in_flight: int
    max_queue_depth: dict[str, int]
    mean_latency_s: dict[str, float]
    max_latency_s: dict[str, float]
    completion_latency_s: dict[str, float] = field(default_factory=dict)

    def bytes_total(self, direction: str) -> int:
        return sum(v for k, v in self.bytes.items() if k.startswith(direction + ":"))


class StatsRecorder:
    def __init__(self) -> None:
        self._bytes: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._max_depth: Counter[str] = Counter()
        self._lat_sum: defaultdict[str, float] = defaultdict(float)
        self._lat_n: Counter[str] = Counter()
        self._lat_max: defaultdict[str, float] = defaultdict(float)

    def bytes_moved(self, direction: str, pool: PoolName, nbytes: int) -> None:
        self._bytes[f"{direction}:{pool.value}"] += nbytes

    def count(self, what: str, n: int = 1) -> None:
        self._counts[what] += n

    def queue_depth(self, what: str, depth: int) -> None:
        self._max_depth[what] = max(self._max_depth[what], depth)

    def latency(self, what: str, seconds: float) -> None:
        self._lat_sum[what] += seconds
        self._lat_n[what] += 1
        self._lat_max[what] = max(self._lat_max[what], seconds)

    def snapshot(
        self,
        *,
        load_queue: int,
        write_queue: int,
        load_in_flight: int,
        write_in_flight: int,
        completion: Sequence[CompletionQueue] = (),
    ) -> ControllerStats:
        return ControllerStats(
            bytes=dict(self._bytes),
            counts=dict(self._counts),
            load_queue=load_queue,
            write_queue=write_queue,
            load_in_flight=load_in_flight,
            write_in_flight=write_in_flight,
            max_queue_depth=dict(self._max_depth),
            mean_latency_s={k: self._lat_sum[k] / n for k, n in self._lat_n.items() if n},
            max_latency_s=dict(self._lat_max),
            completion_latency_s={
                q.name: (q.total_latency_s / q.num_completed if q.num_completed else 0.0) for q in completion
            },
        )
