"""``HybridCache(clock=…)``: the tree's time source (a trace replay's simulated clock, say)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from asynccache.cache import HybridCache
from asynccache.config import HybridCacheConfig
from asynccache.errors import ConfigError
from asynccache.spec import HybridSpec

SPEC = HybridSpec.preset("tiny", page_size=4)
CONFIG = HybridCacheConfig(device_kv_pages=8, device_state_slots=4)


class TraceClock:
    """Seconds of a simulated run: each reading is one second later."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_cache_s_clock_times_the_tree_s_accesses() -> None:
    clock = TraceClock(1000.0)
    cache = HybridCache(SPEC, CONFIG, clock=clock)
    assert cache.tree.clock is clock
    tokens = list(range(1, 9))
    alloc = cache.tree.alloc_device(2, 1)
    assert alloc is not None
    res = cache.tree.insert(tokens, alloc.kv_indices, states={8: alloc.state_slot})
    assert res.last_node.last_access == clock.now == 1001.0
    cache.tree.match_prefix(tokens)
    assert res.last_node.last_access == clock.now == 1002.0


def test_without_a_clock_the_tree_uses_monotonic_time() -> None:
    assert HybridCache(SPEC, CONFIG).tree.clock is time.monotonic


@pytest.mark.parametrize("clock", [5.0, "monotonic", [time.monotonic]])
def test_a_clock_that_cannot_be_called_is_refused(clock: Any) -> None:
    with pytest.raises(ConfigError, match="clock must be a callable"):
        HybridCache(SPEC, CONFIG, clock=clock)
