"""What restoring a prefix from storage costs against recomputing it: the storage tier's cost
model (:class:`RestoreCost`: read bandwidth and a position-aware prefill time) and the
correction of its read estimates by observed read times (:class:`ReadTimeCorrection`). The
storage tier (``asynccache.tiering``) plans whole, split and no restores with them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from asynccache.errors import ConfigError

__all__ = ["ReadTimeCorrection", "RestoreCost"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreCost:
    """What restoring from storage costs against recomputing: the storage tier's read bandwidth
    and the engine's prefill time (both measured by the caller, e.g. in a warm-up).

    Prefill time is linear in the tokens plus attention's share, which grows with the context:
    the token at position ``p`` costs ``1 / prefill_tokens_per_s + p · prefill_s_per_context_token``
    seconds, so computing positions ``[begin, end)`` costs :meth:`compute_s`. With
    ``prefill_s_per_context_token = 0`` (the default) the rate is flat. A prefix's head (computed
    from position 0) is then cheaper per token than its tail: :meth:`fit` takes both terms from
    cold prefills of two lengths.

    The tier corrects the read estimate by what it observes (:class:`ReadTimeCorrection`):
    separately for reads alone (restore everything) and for reads beside the engine computing a
    head (a split restore), where both share the host's CPU."""

    read_bytes_per_s: float
    prefill_tokens_per_s: float
    prefill_s_per_context_token: float = 0.0

    def __post_init__(self) -> None:
        if not (self.read_bytes_per_s > 0 and self.prefill_tokens_per_s > 0):
            raise ConfigError(
                f"RestoreCost needs positive rates, got read_bytes_per_s={self.read_bytes_per_s}, "
                f"prefill_tokens_per_s={self.prefill_tokens_per_s}"
            )
        if not self.prefill_s_per_context_token >= 0:
            raise ConfigError(
                f"prefill_s_per_context_token must be >= 0, got {self.prefill_s_per_context_token}"
            )

    def compute_s(self, begin: int, end: int) -> float:
        """Seconds to prefill positions ``[begin, end)`` after a cached prefix of ``begin`` tokens."""
        n = end - begin
        return n / self.prefill_tokens_per_s + self.prefill_s_per_context_token * (end * end - begin * begin) / 2

    @classmethod
    def fit(cls, *, read_bytes_per_s: float, prefills: Sequence[tuple[int, float]]) -> RestoreCost:
        """From cold prefills ``(tokens, seconds)`` (each from position 0): with one length, a
        flat rate; with two or more, least squares of ``seconds = n / rate + c · n² / 2`` over
        ``rate > 0, c >= 0`` (``c`` dropped when the data would make it negative)."""
        points = [(float(n), float(t)) for n, t in prefills]
        if not points or any(n <= 0 or t <= 0 for n, t in points):
            raise ConfigError(f"prefills need positive (tokens, seconds) pairs, got {list(prefills)}")
        flat = cls(
            read_bytes_per_s=read_bytes_per_s,
            prefill_tokens_per_s=sum(n * n for n, _ in points) / sum(n * t for n, t in points),
        )
        if len({n for n, _ in points}) < 2:
            return flat
        # Normal equations of t ≈ u·n + c·(n²/2).
        a11 = sum(n * n for n, _ in points)
        a12 = sum(n**3 / 2 for n, _ in points)
        a22 = sum(n**4 / 4 for n, _ in points)
        b1 = sum(n * t for n, t in points)
        b2 = sum(n * n / 2 * t for n, t in points)
        det = a11 * a22 - a12 * a12
        u, c = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if c < 0 or u <= 0:
            return flat
        return cls(read_bytes_per_s=read_bytes_per_s, prefill_tokens_per_s=1 / u, prefill_s_per_context_token=c)


class ReadTimeCorrection:
    """Observed ÷ estimated read time (``bytes / read_bytes_per_s``), a moving average of the
    last few restores (weight ``alpha`` on the newest); 1 until a read has been observed.
    Reads shorter than ``min_bytes`` are not observed (their time is mostly latency).
    ``ratios`` keeps the last ``keep`` observed ratios, newest last (for reports).

    :meth:`relax` moves the factor part of the way back toward a reference when the plans it
    makes look worse stop being tried, so that one slow observation does not rule a plan out
    for good: the plan is tried again after a few restores, and observed again."""

    def __init__(self, *, alpha: float = 0.5, min_bytes: int = 64 << 20, keep: int = 32) -> None:
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.factor = 1.0
        self.samples = 0
        self.ratios: deque[float] = deque(maxlen=keep)

    def observe(self, nbytes: int, elapsed_s: float, read_bytes_per_s: float) -> None:
        if nbytes < self.min_bytes or elapsed_s <= 0:
            return
        ratio = elapsed_s * read_bytes_per_s / nbytes
        self.factor = ratio if not self.samples else self.alpha * ratio + (1 - self.alpha) * self.factor
        self.samples += 1
        self.ratios.append(ratio)

    def relax(self, toward: float, *, keep: float = 0.5) -> None:
        """``factor ← toward + keep · (factor − toward)`` when the factor is above ``toward``."""
        if self.factor > toward:
            self.factor = toward + keep * (self.factor - toward)
