"""Checks of numeric options shared by the configuration, the kernels' launchers and the
storage backends: integers (not bools) and finite seconds, refused by name as ConfigError; and
:func:`distinct_ints`, the no-index-twice check the pools and the copy kernels share."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np

from asynccache.errors import ConfigError

__all__ = ["as_int", "check_int", "check_seconds", "distinct_ints"]


def as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (Python or NumPy; not a bool), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """``value`` as an ``int`` if it is an integer (Python or NumPy; not a ``bool``) of at least
    ``minimum``, else a ConfigError."""
    n = as_int(value)
    if n is None or n < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return n


def check_seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` as seconds if it is a finite positive number (or zero, with ``zero``), else a
    ConfigError."""
    seconds = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # NumPy's numbers too
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond every float: no finite number of seconds
            seconds = math.inf
    if not 0 <= seconds < math.inf or (seconds == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ConfigError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def distinct_ints(a: np.ndarray) -> bool:
    """No value twice in a 1-D integer (or bool) array. Not ``np.unique`` (~150-220 ns a value on
    NumPy 2.4): a strictly ascending list, what the allocators hand out, is settled by one
    comparison of neighbours (~1 ns a value); any other order is sorted and its neighbours
    compared (~10 ns a value). Comparisons, not ``np.diff``: a difference of two int64s can wrap
    around and look positive."""
    if bool((a[1:] > a[:-1]).all()):
        return True
    ordered = np.sort(a)
    return not bool((ordered[1:] == ordered[:-1]).any())
