"""SortedWindow: the last N values in arrival and sorted order, and NumPy's quantile exactly."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.errors import ConfigError
from asynccache.policy.window import SortedWindow

values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(
    maxlen=st.integers(1, 40),
    xs=st.lists(st.one_of(values, st.sampled_from([0.0, 1.0, 2.5])), max_size=120),
    qs=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
)
def test_window_and_quantiles_agree_with_a_deque_and_numpy(maxlen: int, xs: list[float], qs: list[float]) -> None:
    window = SortedWindow(maxlen)
    model: deque[float] = deque(maxlen=maxlen)
    for x in xs:
        window.append(x)
        model.append(x)
        assert list(window) == list(model) and len(window) == len(model)
        assert window.sorted_values() == sorted(model)
        for q in [*qs, 0.95, 0.5, 0.0, 1.0]:
            assert window.quantile(q) == float(np.quantile(np.asarray(model), q))


def test_a_full_window_of_ages_gives_the_adaptive_horizon_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    window = SortedWindow(4096)
    model: deque[float] = deque(maxlen=4096)
    for x in rng.exponential(100.0, 10_000):
        window.append(float(x))
        model.append(float(x))
    assert window.quantile(0.95) == float(np.quantile(np.asarray(model), 0.95))


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        SortedWindow(0)
    with pytest.raises(ConfigError, match="empty"):
        SortedWindow(3).quantile(0.5)
    w = SortedWindow(3)
    w.append(1.0)
    with pytest.raises(ConfigError):
        w.quantile(1.5)
