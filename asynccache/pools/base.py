"""Byte-item pools: the storage shape shared by every KV and Mamba pool.

A pool holds ``num_items`` items (KV pages or state slots) for each of ``num_layers`` cached
layers; one *item* is ``item_bytes`` contiguous bytes (one page of one attention layer: K then V;
or one state of one recurrent layer: its components, each 16-byte aligned). Two layouts::

    layer_first  [layer][index][bytes]          the device order; a layer's items are contiguous
                 ┌──────── layer 0 ────────┐┌──────── layer 1 ────────┐
                 │ item0 │ item1 │ … │ itemN││ item0 │ item1 │ … │ itemN│

    page_first   [index][layer][bytes]          one item across all layers is contiguous,
                 ┌──────── index 0 ────────┐┌──────── index 1 ────────┐  so one page or state
                 │ L0 │ L1 │ … │ Lk        ││ L0 │ L1 │ … │ Lk        │  is one storage object

Either way ``address(layer, index) = base + layer·layer_stride + index·item_stride`` (bytes),
which is all the copy kernels need. Typed tensors (K/V caches, state components) are views of the
byte buffer. With ``materialize=False`` a pool keeps only its allocator (accounting mode for
trace replay at TiB scale); the code path is otherwise the same.
"""

from __future__ import annotations

from enum import Enum

import torch

from asynccache.checks import as_int
from asynccache.errors import ConfigError
from asynccache.pools.allocator import IndexAllocator
from asynccache.pools.memory import SharedHostMemory, allocate_bytes

__all__ = ["ItemPool", "PoolLayout", "check_size"]


def check_size(what: str, argument: str, value: object) -> int:
    """``value`` (a pool's size argument) as an int >= 0, NumPy integers taken as ints; else a
    ConfigError naming ``argument`` (a float would fail deep in torch, a bool size 0 or 1)."""
    n = as_int(value)
    if n is None:
        raise ConfigError(f"{what}: {argument} must be an int, got {value!r}")
    if n < 0:
        raise ConfigError(f"{what}: {argument} must be >= 0, got {value!r}")
    return n


class PoolLayout(str, Enum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"

    @classmethod
    def parse(cls, value: str | PoolLayout) -> PoolLayout:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown layout {value!r}; known: {[m.value for m in cls]}") from None


class ItemPool:
    """``num_layers × num_items`` byte items with an allocator over the item indices."""

    def __init__(
        self,
        *,
        name: str,
        layer_ids: tuple[int, ...],
        num_items: int,
        item_bytes: int,
        layout: PoolLayout | str = PoolLayout.LAYER_FIRST,
        device: str | torch.device = "cpu",
        pin: bool | None = None,
        materialize: bool = True,
        shared: bool = False,
    ) -> None:
        num_items = check_size(name, "num_items", num_items)
        item_bytes = check_size(name, "item_bytes", item_bytes)
        if item_bytes <= 0 and layer_ids:
            raise ConfigError(f"{name}: item_bytes must be positive, got {item_bytes}")
        self.name = name
        self.layer_ids = tuple(layer_ids)
        self._layer_index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.num_layers = len(self.layer_ids)
        self.num_items = num_items
        self.item_bytes = item_bytes
        self.layout = PoolLayout.parse(layout)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"{name}: not a device: {device!r} ({e})") from None
        if self.device.type not in ("cpu", "cuda"):
            # (copies to or from another type, "meta" say, would be no-ops counted as done)
            raise ConfigError(f"{name}: device {self.device} is neither a CPU nor a CUDA device")
        if self.device.type == "cuda" and not _cuda_device_present(self.device):
            # accounting mode too: the controller makes its CUDA streams on that device
            raise ConfigError(f"{name}: device {self.device} is not available here")
        self.buffer: torch.Tensor | None = None
        self.pinned = False
        #: the shared memory the buffer lives in (``shared=True``: other processes map it)
        self.shared_memory: SharedHostMemory | None = None
        if materialize:
            nbytes = self.num_layers * num_items * item_bytes
            flat, self.pinned, self.shared_memory = allocate_bytes(
                nbytes, device=self.device, pin=pin, what=name, shared=shared
            )
            if self.layout is PoolLayout.LAYER_FIRST:
                self.buffer = flat.view(self.num_layers, num_items, item_bytes)
            else:
                self.buffer = flat.view(num_items, self.num_layers, item_bytes)
        # After the memory (whose size is checked against what the machine has): the free
        # list of a pool too large would itself exhaust memory first.
        self.allocator = IndexAllocator(num_items, name=name)

    # ---- geometry ----------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        return self.num_layers * self.num_items * self.item_bytes

    @property
    def bytes_per_index(self) -> int:
        """Bytes of one item across all layers (one page or one state)."""
        return self.num_layers * self.item_bytes

    @property
    def layer_stride_bytes(self) -> int:
        return self.num_items * self.item_bytes if self.layout is PoolLayout.LAYER_FIRST else self.item_bytes

    @property
    def item_stride_bytes(self) -> int:
        return self.item_bytes if self.layout is PoolLayout.LAYER_FIRST else self.num_layers * self.item_bytes

    @property
    def materialized(self) -> bool:
        return self.buffer is not None

    def layer_index(self, layer_id: int) -> int:
        """Position of a global layer id in this pool (KeyError-free: raises ConfigError)."""
        try:
            return self._layer_index[layer_id]
        except KeyError:
            raise ConfigError(f"{self.name}: layer {layer_id} is not in this pool {self.layer_ids}") from None

    def layer_items(self, layer_id: int) -> torch.Tensor:
        """``[num_items, item_bytes]`` uint8 view of one layer (strided for page_first)."""
        buf = self._require_buffer()
        li = self.layer_index(layer_id)
        return buf[li] if self.layout is PoolLayout.LAYER_FIRST else buf[:, li]

    def index_bytes(self, index: int) -> torch.Tensor:
        """``[num_layers, item_bytes]`` uint8 view of one index (contiguous for page_first);
        :class:`ConfigError` for an index outside ``0..num_items - 1`` (a negative one would
        count from the end)."""
        buf = self._require_buffer()
        i = as_int(index)
        if i is None or not 0 <= i < self.num_items:
            raise ConfigError(f"{self.name}: index {index!r} outside 0..{self.num_items - 1}")
        index = i
        return buf[:, index] if self.layout is PoolLayout.LAYER_FIRST else buf[index]

    def _require_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            raise ConfigError(f"{self.name}: pool is in accounting mode (materialize=False)")
        return self.buffer

    # ---- allocation --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` item indices, or ``None`` when there is no room (nothing taken)."""
        return self.allocator.alloc(n)

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, layers={self.num_layers}, items={self.num_items}, "
            f"item_bytes={self.item_bytes}, layout={self.layout.value}, device={self.device}, "
            f"pinned={self.pinned}, materialized={self.materialized})"
        )


def _cuda_device_present(device: torch.device) -> bool:
    if not torch.cuda.is_available():
        return False
    return device.index is None or 0 <= device.index < torch.cuda.device_count()
