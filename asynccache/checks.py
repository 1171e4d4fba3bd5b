"""Checks of numeric options shared by the configuration, the kernels' launchers and the
storage backends: integers (not bools) and finite seconds, refused by name as ConfigError."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from asynccache.errors import ConfigError

__all__ = ["as_int", "check_int", "check_seconds"]


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
