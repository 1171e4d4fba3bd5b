"""The steps of a scheduler step's load: which layers each copy call covers, and which layers
one CUDA event makes ready.

The controller merges a step's queued loads into one transfer per pool and issues them layer by
layer (``asynccache.copy_issue``); a step here is a layer, or a group of layers, issued as one
set of copy calls followed by one event the forward waits on:

- :data:`LOAD_GROUP_MAX_BYTES` — how many bytes consecutive layers of one pool copied as one
  call may hold;
- :data:`LOAD_RIDE_RATIO` — when such a group shares the event of the step before it;
- :data:`StepPlan` — one step: its global layer ids and its ``(pool, first local layer,
  layers)`` copies;
- :func:`group_layers` — the steps of a load, in layer order;
- :class:`StepPlans` — :func:`group_layers` kept per load shape (a step's plan depends on
  nothing else).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asynccache.ops import MergedTransfer
from asynccache.pools.base import ItemPool
from asynccache.storage import PoolName

__all__ = ["LOAD_GROUP_MAX_BYTES", "LOAD_RIDE_RATIO", "StepPlan", "StepPlans", "group_layers"]

#: Consecutive layers of one pool are loaded as one copy (one call, one CUDA event) while their
#: bytes stay within this: ~0.15 ms of PCIe Gen5 — the states of a few recurrent layers of one
#: request between two attention layers — so a group costs its first layer little latency and
#: halves the host time of issuing a hybrid model's load.
LOAD_GROUP_MAX_BYTES = 8 << 20
#: Such a group rides with the step before it — one event and one wait of the forward fewer —
#: when that step copies another pool and at least this many times the group's bytes (the
#: states after an attention layer ride with its KV, delaying that layer by ~0.1 ms of copy).
LOAD_RIDE_RATIO = 8

#: A step as :func:`group_layers` plans it: the layer ids, and (pool, first local layer, layers).
StepPlan = tuple[list[int], list[tuple[PoolName, int, int]]]


def group_layers(layer_ids: Sequence[int], pools: dict[PoolName, tuple[dict[int, int], int]]) -> list[StepPlan]:
    """The load's steps in layer order. Consecutive layers of one pool whose local positions
    follow on are grouped — one call and one event for the group — while the group's bytes stay
    within ``LOAD_GROUP_MAX_BYTES``, so a group is ready a few tens of microseconds after its
    first layer could have been. A group then rides with the step before it (one event for
    both) when that step copies another pool and at least ``LOAD_RIDE_RATIO`` times the bytes:
    its layers are ready exactly when they were, and the step's own layers at most
    1/``LOAD_RIDE_RATIO`` later. ``pools[pool] = (global → local layer, bytes a layer)``."""
    steps: list[StepPlan] = []
    sizes: list[int] = []  # bytes of each step
    for lid in layer_ids:
        copies = [(name, index[lid], 1) for name, (index, _) in pools.items() if lid in index]
        if len(copies) == 1 and steps:
            name, li, _ = copies[0]
            layer_bytes = pools[name][1]
            prev_lids, prev = steps[-1]
            if len(prev) == 1:
                p_name, p_first, p_count = prev[0]
                if p_name == name and p_first + p_count == li and sizes[-1] + layer_bytes <= LOAD_GROUP_MAX_BYTES:
                    prev[0] = (name, p_first, p_count + 1)
                    prev_lids.append(lid)
                    sizes[-1] += layer_bytes
                    continue
        steps.append(([lid], copies))
        sizes.append(sum(pools[name][1] for name, *_ in copies))
    ridden: list[StepPlan] = []
    ridden_sizes: list[int] = []
    for (lids, copies), size in zip(steps, sizes, strict=True):
        if (
            ridden
            and len(copies) == 1
            and size <= LOAD_GROUP_MAX_BYTES
            and size * LOAD_RIDE_RATIO <= ridden_sizes[-1]
            and all(name is not copies[0][0] for name, *_ in ridden[-1][1])
        ):
            ridden[-1][0].extend(lids)
            ridden[-1][1].extend(copies)
            ridden_sizes[-1] += size
            continue
        ridden.append((lids, copies))
        ridden_sizes.append(size)
    return ridden


class StepPlans:
    """:func:`group_layers` for each load shape (which pools, how many items each), kept: a
    step's plan depends on nothing else. At most 256 shapes are kept (then all are dropped)."""

    def __init__(self, pools: dict[PoolName, tuple[ItemPool, ItemPool | None]]) -> None:
        self._pools = pools  # the controller's (device, host) pools, by name
        self._plans: dict[tuple[Any, ...], list[StepPlan]] = {}

    def get(self, layer_ids: Sequence[int], merged: dict[PoolName, MergedTransfer]) -> list[StepPlan]:
        """The steps of a load of ``merged`` (one transfer per pool) over ``layer_ids``."""
        key = (tuple(layer_ids), tuple((name, m.host_indices.numel()) for name, m in merged.items()))
        plan = self._plans.get(key)
        if plan is None:
            pools = {
                name: (self._pools[name][0]._layer_index, m.host_indices.numel() * self._pools[name][0].item_bytes)
                for name, m in merged.items()
            }
            if len(self._plans) >= 256:
                self._plans.clear()
            plan = self._plans[key] = group_layers(layer_ids, pools)
        return plan
