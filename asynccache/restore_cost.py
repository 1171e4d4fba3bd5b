"""What restoring a prefix from storage costs against recomputing it: the storage tier's cost
model (:class:`RestoreCost`: read bandwidth and a position-aware prefill time), the correction
of its estimates by observed times (:class:`ReadTimeCorrection`; :class:`SplitTiming` tells a
split restore's slow side from the other), and the plan they give (:func:`plan_restore`): how
much of a stored prefix the storage tier (``asynccache.tiering``) restores whole, restores
split, or leaves to be recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from asynccache.errors import ConfigError

if TYPE_CHECKING:
    from asynccache.spec import HybridSpec

__all__ = ["ReadTimeCorrection", "RestoreCost", "SplitTiming", "plan_restore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreCost:
    """What restoring from storage costs against recomputing: the storage tier's read bandwidth
    and the engine's prefill time (both measured by the caller, e.g. in a warm-up).

    Prefill time is a forward pass's fixed cost plus a cost per token, which attention makes grow
    with the context: the token at position ``p`` costs ``1 / prefill_tokens_per_s + p ·
    prefill_s_per_context_token`` seconds, and a pass ``prefill_s_per_pass`` more (its launches
    and host work, which do not shrink with its tokens), so computing positions ``[begin, end)``
    in one pass costs :meth:`compute_s`. With both extra terms 0 (the defaults) the rate is flat.
    A prefix's head (computed from position 0) is then cheaper per token than its tail, and a
    short head costs more per token than a long one: :meth:`fit` takes the terms from cold
    prefills of two lengths (the context term) or three and more (both).

    The tier corrects the read estimate by what it observes (:class:`ReadTimeCorrection`):
    separately for reads alone (restore everything) and for reads beside the engine computing a
    head (a split restore), where both share the host's CPU."""

    read_bytes_per_s: float
    prefill_tokens_per_s: float
    prefill_s_per_context_token: float = 0.0
    prefill_s_per_pass: float = 0.0

    def __post_init__(self) -> None:
        if not (self.read_bytes_per_s > 0 and self.prefill_tokens_per_s > 0):
            raise ConfigError(
                f"RestoreCost needs positive rates, got read_bytes_per_s={self.read_bytes_per_s}, "
                f"prefill_tokens_per_s={self.prefill_tokens_per_s}"
            )
        for name in ("prefill_s_per_context_token", "prefill_s_per_pass"):
            value = getattr(self, name)
            if not (value >= 0 and value < float("inf")):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")

    def compute_s(self, begin: int, end: int) -> float:
        """Seconds to prefill positions ``[begin, end)`` in one pass after a cached prefix of
        ``begin`` tokens (0 for no position)."""
        n = end - begin
        if n <= 0:
            return 0.0
        return (
            self.prefill_s_per_pass
            + n / self.prefill_tokens_per_s
            + self.prefill_s_per_context_token * (end * end - begin * begin) / 2
        )

    @classmethod
    def fit(cls, *, read_bytes_per_s: float, prefills: Sequence[tuple[int, float]]) -> RestoreCost:
        """From cold prefills ``(tokens, seconds)`` (each from position 0, one pass): with one
        length, a flat rate; with more, least squares of ``seconds = f + n / rate + c · n² / 2``
        with ``f`` (the pass's fixed cost) only from three lengths up, every term ``>= 0`` (``rate
        > 0``): of the fits whose terms have those signs, the one with the least squared error,
        the fewer terms on a tie (a term the data would make negative is left out)."""
        points = [(float(n), float(t)) for n, t in prefills]
        if not points or any(n <= 0 or t <= 0 for n, t in points):
            raise ConfigError(f"prefills need positive (tokens, seconds) pairs, got {list(prefills)}")
        best = cls(
            read_bytes_per_s=read_bytes_per_s,
            prefill_tokens_per_s=sum(n * n for n, _ in points) / sum(n * t for n, t in points),
        )
        distinct = len({n for n, _ in points})
        if distinct < 2:
            return best

        def error(cost: RestoreCost) -> float:
            return sum((cost.compute_s(0, int(n)) - t) ** 2 for n, t in points)

        least = error(best)
        for terms in [("u", "c")] + ([("f", "u"), ("f", "u", "c")] if distinct >= 3 else []):
            sol = _least_squares(points, terms)
            if sol is None or not sol["u"] > 0 or sol.get("f", 0.0) < 0 or sol.get("c", 0.0) < 0:
                continue
            cost = cls(
                read_bytes_per_s=read_bytes_per_s,
                prefill_tokens_per_s=1 / sol["u"],
                prefill_s_per_context_token=sol.get("c", 0.0),
                prefill_s_per_pass=sol.get("f", 0.0),
            )
            e = error(cost)
            if e < least * (1 - 1e-9):
                best, least = cost, e
        return best


def _least_squares(points: Sequence[tuple[float, float]], terms: Sequence[str]) -> dict[str, float] | None:
    """Least squares of ``t ≈ Σ term · x`` over ``points`` ``(n, t)``, with ``x`` = 1 for ``f``,
    ``n`` for ``u`` and ``n² / 2`` for ``c`` (columns scaled to 1 first); ``None`` when the
    points cannot tell the terms apart."""
    basis = {"f": lambda n: 1.0, "u": lambda n: n, "c": lambda n: n * n / 2}
    a = np.array([[basis[k](n) for k in terms] for n, _ in points])
    scale = np.abs(a).max(axis=0)
    sol, _, rank, _ = np.linalg.lstsq(a / scale, np.array([t for _, t in points]), rcond=None)
    if rank < len(terms):
        return None
    return {k: float(v) for k, v in zip(terms, sol / scale, strict=True)}


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
        self.observe_ratio(elapsed_s * read_bytes_per_s / nbytes)

    def observe_ratio(self, ratio: float) -> None:
        """One observed ÷ estimated time (any estimate: a read's, or a computation's)."""
        if not ratio > 0:
            return
        self.factor = ratio if not self.samples else self.alpha * ratio + (1 - self.alpha) * self.factor
        self.samples += 1
        self.ratios.append(ratio)

    def relax(self, toward: float, *, keep: float = 0.5) -> None:
        """``factor ← toward + keep · (factor − toward)`` when the factor is above ``toward``."""
        if self.factor > toward:
            self.factor = toward + keep * (self.factor - toward)


class SplitTiming:
    """When a split restore's two sides finished, and which correction each time goes to.

    The tail's read runs from the plan (``started``) until the event loop takes its last reply
    (:meth:`landed`); the head's computation from when the engine starts on it
    (:meth:`head_started`: a request may wait for admission after its lookup; ``started`` if
    never reported) until the engine reports it done (:meth:`head_done`). A forward pass can
    hold the loop for most of its GPU time, so a tail that landed while the head computed is
    seen only when the head is done: its time then bounds the read from above and says how long
    the head took, not the read. So, once both are known:

    - the tail landed first (the head was the longer side): the head's time corrects
      ``compute`` (computing beside reads); the tail's corrects ``read`` only where it lowers it;
    - the head was done first (the engine waited for the tail): the tail's time corrects
      ``read``; the head's corrects ``compute`` only where it lowers it.

    An owner that never reports the head's end (:meth:`settle_unreported`, when the restore is
    released) gets the tail's time as a read observation, as without the head's report.
    Estimates are the cost model's, uncorrected; a tail of fewer than ``read.min_bytes`` is not
    observed (its time is mostly latency). Times are ``time.perf_counter()`` seconds; the first
    report of each counts."""

    __slots__ = (
        "_compute", "_read", "head_done_at", "head_est_s", "head_started_at", "landed_at", "settled",
        "started", "tail_bytes", "tail_est_s",
    )

    def __init__(
        self,
        *,
        read: ReadTimeCorrection,
        compute: ReadTimeCorrection,
        head_est_s: float,
        tail_est_s: float,
        tail_bytes: int,
        started: float,
    ) -> None:
        self._read, self._compute = read, compute
        self.head_est_s, self.tail_est_s, self.tail_bytes = head_est_s, tail_est_s, tail_bytes
        self.started = started
        self.head_started_at: float | None = None
        self.head_done_at: float | None = None
        self.landed_at: float | None = None
        self.settled = False

    def landed(self, now: float) -> None:
        """The tail's read is in (intact)."""
        if self.landed_at is None:
            self.landed_at = now
            self._settle()

    def head_started(self, now: float) -> None:
        """The engine starts computing the head."""
        if self.head_started_at is None and self.head_done_at is None:
            self.head_started_at = now

    def head_done(self, now: float) -> None:
        """The engine computed the head."""
        if self.head_done_at is None:
            self.head_done_at = now
            self._settle()

    def settle_unreported(self) -> None:
        """No head report came (the restore is released): the tail's time, if it landed, is a
        read observation."""
        if not self.settled and self.landed_at is not None:
            self.settled = True
            self._observe(self._read, (self.landed_at - self.started) / self.tail_est_s, bound=False, read=True)

    def _settle(self) -> None:
        if self.settled or self.head_done_at is None or self.landed_at is None:
            return
        self.settled = True
        head_from = self.started if self.head_started_at is None else self.head_started_at
        head_ratio = (self.head_done_at - head_from) / self.head_est_s
        tail_ratio = (self.landed_at - self.started) / self.tail_est_s
        tail_first = self.landed_at <= self.head_done_at
        self._observe(self._compute, head_ratio, bound=not tail_first)
        self._observe(self._read, tail_ratio, bound=tail_first, read=True)

    def _observe(self, correction: ReadTimeCorrection, ratio: float, *, bound: bool, read: bool = False) -> None:
        if read and self.tail_bytes < correction.min_bytes:
            return
        if not bound or ratio < correction.factor:
            correction.observe_ratio(ratio)


def plan_restore(
    cost: RestoreCost,
    spec: HybridSpec,
    *,
    start_page: int,
    first_page: int,
    end_page: int,
    num_tokens: int,
    allow_tail: bool,
    read_factor: float = 1.0,
    tail_read_factor: float = 1.0,
    head_compute_factor: float = 1.0,
) -> tuple[int, int, bool]:
    """``(begin, end, split_possible)``: the pages to restore of a prefix of ``num_tokens`` tokens
    whose first ``start_page`` pages (and the state there) are cached, storage holding the KV of
    pages ``[first_page, end_page)`` and the state at ``end_page`` (``start_page <= first_page``:
    the cache holds the KV of the pages before ``first_page``). ``(start, start)`` recomputes,
    ``(start, end)`` restores everything (reads pages ``[first_page, end)`` and the state),
    ``start < begin < end`` computes the head ``[start, begin)`` while reading the tail
    ``[begin, end)`` and the state at ``end`` (a tail starts at ``first_page`` or later: storage
    need not hold the pages before). ``split_possible``: a tail was a candidate.

    Reading ``p`` pages and the state costs ``(p·kv_page_bytes + state_bytes) / read_bw``, the
    bandwidth divided by ``read_factor`` for whole restores and by ``tail_read_factor`` for tails
    read beside a head's computation (:class:`ReadTimeCorrection`); computing positions
    ``[a, b)`` costs :meth:`RestoreCost.compute_s`, times ``head_compute_factor`` for a head
    computed beside a tail's reads. Restoring first and computing after costs
    the sum, which is concave in the depth (reading is linear in it, and a token costs more to
    compute the deeper it sits), so among such splits only the two ends can win: everything or
    nothing. Recomputing is always a candidate, so restoring is never chosen when estimated
    slower. A tail restore overlaps the two and costs the max; the best head balances them
    (computing grows with the head and reading shrinks, so the crossing is found by bisection).
    """
    page, kvb, sb = spec.page_size, spec.kv_page_bytes, spec.state_bytes
    start, n = start_page, end_page
    bw_all = cost.read_bytes_per_s / read_factor
    bw_tail = cost.read_bytes_per_s / tail_read_factor
    rest_s = cost.compute_s(n * page, num_tokens)  # computed after the stored prefix in every plan

    def head_s(begin: int) -> float:
        return cost.compute_s(start * page, begin * page) * head_compute_factor

    def tail_s(begin: int) -> float:
        return ((n - begin) * kvb + sb) / bw_tail

    def plan_cost(begin: int, end: int) -> float:
        if end == start:
            return cost.compute_s(start * page, num_tokens)
        if begin == start:  # restore everything: the pages the cache lacks, and the state
            return ((end - min(first_page, end)) * kvb + sb) / bw_all + rest_s
        return max(head_s(begin), tail_s(begin)) + rest_s

    plans = [(start, start), (start, n)]
    low = max(start + 1, first_page)  # the first page a tail may begin at
    if allow_tail and low < n:
        # The last head b in [low, n) whose computation is not longer than the tail's read
        # (``low`` itself when even that head takes longer).
        lo, hi = low - 1, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if head_s(mid) <= tail_s(mid):
                lo = mid
            else:
                hi = mid
        for cand in {lo, lo + 1}:
            if low <= cand < n:
                plans.append((cand, n))
    best = min(plans, key=lambda p: (plan_cost(*p), -p[1], p[0]))
    return best[0], best[1], len(plans) > 2
