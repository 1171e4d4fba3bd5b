"""A sliding window of the last ``maxlen`` observations, kept sorted, with NumPy's quantile.

Policies that learn a quantile of recent observations (``AdaptiveAdmission``'s reuse horizon)
recompute it after many observations: sorting or partitioning the whole window each time costs
O(window) per observation. :class:`SortedWindow` keeps the window in arrival order (to know
which value leaves) and in sorted order (an O(log n) search and an O(n) memmove of a list per
observation), so a quantile is two reads and one interpolation: the value ``np.quantile`` gives
with its default ``"linear"`` method, to the last bit.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterator

from asynccache.errors import ConfigError

__all__ = ["SortedWindow"]


class SortedWindow:
    """The last ``maxlen`` floats appended, in arrival order and sorted (module docstring)."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ConfigError(f"maxlen must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self._arrival: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._arrival)

    def __iter__(self) -> Iterator[float]:
        """The values in arrival order, oldest first."""
        return iter(self._arrival)

    def append(self, value: float) -> None:
        """Add ``value``; the oldest value leaves once the window is full."""
        value = float(value)
        if len(self._arrival) == self.maxlen:
            old = self._arrival.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._arrival.append(value)
        bisect.insort_right(self._sorted, value)

    def sorted_values(self) -> list[float]:
        """The values in ascending order (a copy)."""
        return list(self._sorted)

    def quantile(self, q: float) -> float:
        """``float(np.quantile(values, q))`` (method ``"linear"``) for a ``q`` in [0, 1]: the
        same virtual index ``(n − 1) · q``, neighbours and interpolation (NumPy's ``_lerp``)."""
        n = len(self._sorted)
        if not n:
            raise ConfigError("quantile of an empty window")
        if not 0.0 <= q <= 1.0:
            raise ConfigError(f"q must be in [0, 1], got {q}")
        virtual = (n - 1) * q
        lo = math.floor(virtual)
        gamma = virtual - lo
        a = self._sorted[min(lo, n - 1)]
        b = self._sorted[min(lo + 1, n - 1)]
        diff = b - a
        return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma
