"""asynccache.checks: integers (Python or NumPy, never bools) and finite seconds, refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asynccache.checks import check_int, check_seconds
from asynccache.errors import ConfigError


@pytest.mark.parametrize("value", [np.int64(4), np.int32(4), np.uint16(4), 4])
def test_check_int_takes_numpy_integers_as_python_ints(value: object) -> None:
    n = check_int("max_ctas", value, minimum=1)
    assert n == 4 and type(n) is int


@pytest.mark.parametrize("value", [True, 2.0, "2", np.float64(2.0), np.int64(0)])
def test_check_int_refuses_what_is_not_an_int_of_the_minimum(value: object) -> None:
    with pytest.raises(ConfigError, match="max_ctas must be an int >= 1"):
        check_int("max_ctas", value, minimum=1)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(10**400, id="int-beyond-float"),
        pytest.param(-(10**400), id="negative-int-beyond-float"),
        math.inf,
        math.nan,
        -1.0,
        0,
        True,
    ],
)
def test_check_seconds_refuses_what_is_not_a_finite_positive_number(value: object) -> None:
    with pytest.raises(ConfigError, match="timeout_s must be a finite number of seconds > 0"):
        check_seconds("timeout_s", value)


def test_check_seconds_takes_ints_and_floats() -> None:
    assert check_seconds("timeout_s", 10**6) == 1e6
    assert check_seconds("timeout_s", 0, zero=True) == 0.0
    assert check_seconds("timeout_s", np.float64(0.5)) == 0.5


def test_check_seconds_takes_numpy_numbers_of_any_width() -> None:
    assert check_seconds("timeout_s", np.float32(1.5)) == 1.5
    assert check_seconds("timeout_s", np.int32(2)) == 2.0
    with pytest.raises(ConfigError, match="timeout_s"):
        check_seconds("timeout_s", np.bool_(True))
