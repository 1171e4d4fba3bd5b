"""Host pools: pinned (or, without an accelerator, pageable) mirrors of the device pools.

``HostKVPool`` and ``MambaPoolHost`` are sized independently, in bytes (``size_bytes``), in items
(``num_pages`` / ``num_slots``) or as a ratio of a device pool (``ratio`` × its items). Layout
``layer_first`` mirrors the device; ``page_first`` keeps one page / state contiguous across layers
so it is one storage object with no repacking (see ``asynccache.pools.base`` for the diagrams).
With ``shared=True`` the buffer is shared memory that other processes can map (the local disk's
reader processes, ``read_processes``; see ``asynccache.pools.memory``).
"""

from __future__ import annotations

import math
import numbers

from asynccache.errors import ConfigError
from asynccache.pools.base import ItemPool, PoolLayout, check_size
from asynccache.pools.views import KVViews, StateViews
from asynccache.spec import HybridSpec

__all__ = ["HostKVPool", "MambaPoolHost", "resolve_num_items"]


def resolve_num_items(
    *,
    what: str,
    bytes_per_index: int,
    size_bytes: int | None,
    num_items: int | None,
    ratio: float | None,
    device_pool: ItemPool | None,
    num_items_name: str = "num_items",
) -> int:
    """Exactly one of size_bytes / num_items / ratio (with device_pool) sets the item count."""
    given = [x is not None for x in (size_bytes, num_items, ratio)]
    if sum(given) != 1:
        raise ConfigError(f"{what}: give exactly one of size_bytes, {num_items_name}, ratio")
    if num_items is not None:
        return check_size(what, num_items_name, num_items)
    if size_bytes is not None:
        size_bytes = check_size(what, "size_bytes", size_bytes)
        if bytes_per_index <= 0:
            # A pool without layers has zero-byte items: any byte budget would mean unbounded items.
            raise ConfigError(f"{what}: the pool has no layers, so size_bytes cannot size it; give {num_items_name}")
        return size_bytes // bytes_per_index
    if (
        device_pool is None
        or not isinstance(ratio, numbers.Real)
        or isinstance(ratio, bool)
        or not 0 < ratio < math.inf
    ):
        raise ConfigError(f"{what}: ratio needs a finite positive value and the device pool, got {ratio!r}")
    # Rounded to the nearest whole item first, so that a ratio like 2.3 of 100 items is 230,
    # not the 229 that float arithmetic (229.99999999999997) would truncate to.
    return math.floor(round(device_pool.num_items * ratio, 6))


def _host_pool_init(
    pool: ItemPool,
    *,
    name: str,
    layer_ids: tuple[int, ...],
    item_bytes: int,
    bytes_per_index: int,
    count: int | None,
    count_name: str,
    size_bytes: int | None,
    ratio: float | None,
    device_pool: ItemPool | None,
    layout: PoolLayout | str,
    pin: bool | None,
    materialize: bool,
    shared: bool,
) -> None:
    n = resolve_num_items(
        what=name,
        bytes_per_index=bytes_per_index,
        size_bytes=size_bytes,
        num_items=count,
        ratio=ratio,
        device_pool=device_pool,
        num_items_name=count_name,
    )
    ItemPool.__init__(
        pool,
        name=name,
        layer_ids=layer_ids,
        num_items=n,
        item_bytes=item_bytes,
        layout=layout,
        device="cpu",
        pin=pin,
        materialize=materialize,
        shared=shared,
    )


class HostKVPool(KVViews, ItemPool):
    def __init__(
        self,
        spec: HybridSpec,
        *,
        size_bytes: int | None = None,
        num_pages: int | None = None,
        ratio: float | None = None,
        device_pool: ItemPool | None = None,
        layout: PoolLayout | str = PoolLayout.PAGE_FIRST,
        pin: bool | None = None,
        materialize: bool = True,
        shared: bool = False,
    ) -> None:
        self.spec = spec
        _host_pool_init(
            self,
            name="host_kv",
            layer_ids=spec.attention_layer_ids,
            item_bytes=spec.kv_item_bytes,
            bytes_per_index=spec.kv_page_bytes,
            count=num_pages,
            count_name="num_pages",
            size_bytes=size_bytes,
            ratio=ratio,
            device_pool=device_pool,
            layout=layout,
            pin=pin,
            materialize=materialize,
            shared=shared,
        )


class MambaPoolHost(StateViews, ItemPool):
    def __init__(
        self,
        spec: HybridSpec,
        *,
        size_bytes: int | None = None,
        num_slots: int | None = None,
        ratio: float | None = None,
        device_pool: ItemPool | None = None,
        layout: PoolLayout | str = PoolLayout.PAGE_FIRST,
        pin: bool | None = None,
        materialize: bool = True,
        shared: bool = False,
    ) -> None:
        self.spec = spec
        _host_pool_init(
            self,
            name="host_mamba",
            layer_ids=spec.mamba_layer_ids,
            item_bytes=max(spec.state_item_bytes, 1),
            bytes_per_index=spec.state_bytes,
            count=num_slots,
            count_name="num_slots",
            size_bytes=size_bytes,
            ratio=ratio,
            device_pool=device_pool,
            layout=layout,
            pin=pin,
            materialize=materialize,
            shared=shared,
        )
