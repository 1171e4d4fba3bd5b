"""Free-list allocator of pool indices.

``alloc(n)`` hands out ``n`` distinct indices as an int64 CPU tensor, or ``None`` when fewer than
``n`` are free (never a partial allocation). ``free(indices)`` returns them; freeing an index that
is not allocated (double free) or outside the pool raises :class:`AllocationError`. Plain
synchronous code: call it from the event-loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from asynccache.checks import as_int, distinct_ints
from asynccache.errors import AllocationError, CapacityError, ConfigError
from asynccache.pools.memory import available_host_bytes

__all__ = ["IndexAllocator"]

#: Frees of at most this many indices check them as a Python list (:meth:`IndexAllocator._free_short`).
_SHORT = 16
#: Host bytes an index costs the allocator (a Python int in the free list and a flag: ~41
#: measured), and the size from which that is checked against the memory available.
BYTES_PER_INDEX = 48
_CHECKED_FROM = 1 << 20


class IndexAllocator:
    """Allocator of indices ``0 … size-1`` (lowest indices handed out first after a reset)."""

    def __init__(self, size: int, *, name: str = "pool") -> None:
        n = as_int(size)  # NumPy integers too; a float or a bool would size some other pool
        if n is None or n < 0:
            raise ConfigError(f"{name}: allocator size must be an int >= 0, got {size!r}")
        if n >= _CHECKED_FROM:
            # Pools in accounting mode (no buffers) can be sized far beyond memory: their
            # bookkeeping is what must fit.
            need, available = n * BYTES_PER_INDEX, available_host_bytes()
            if available is not None and need > available:
                raise CapacityError(
                    f"{name}: {n} indices need ~{need} bytes of bookkeeping, only {available} bytes of host memory "
                    "are available"
                )
        self.name = name
        self.size = size = n
        # Stack: the end of the list is handed out first, so keep it in descending order.
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._allocated = np.zeros(size, dtype=np.bool_)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free indices (int64 tensor), or ``None`` if fewer than ``n`` are free."""
        if type(n) is not int:  # the common case costs one type check
            count = as_int(n)  # NumPy integers too; True would allocate one, 2.0 fail in slicing
            if count is None:
                raise ConfigError(f"{self.name}: cannot allocate {n!r} indices (not an integer)")
            n = count
        if n < 0:
            raise ConfigError(f"{self.name}: cannot allocate {n} indices")
        if n > len(self._free):
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        taken = self._free[-n:]
        del self._free[-n:]
        # Ascending: runs of consecutive indices stay together whatever order they were freed
        # in, so a copy into (or out of) them takes few calls (``kernels.dma_copy``).
        lo, hi = min(taken), max(taken)
        if hi - lo == n - 1:  # n distinct indices spanning n values: exactly lo … hi
            arr = np.arange(lo, hi + 1, dtype=np.int64)
            self._allocated[lo : hi + 1] = True
        else:
            taken.sort()
            arr = np.asarray(taken, dtype=np.int64)
            self._allocated[arr] = True
        return torch.from_numpy(arr)

    def free(self, indices: torch.Tensor | Iterable[int]) -> None:
        """Return ``indices`` to the pool. Raises on double free or foreign indices (nothing freed)."""
        if (
            type(indices) is torch.Tensor
            and indices.is_cpu
            and indices.dtype == torch.int64
            and indices.ndim == 1
            and indices.numel() <= _SHORT
        ):
            # A few indices (a state slot, a node's pages): the same checks on a Python list,
            # without a dozen NumPy calls.
            self._free_short(indices.tolist())
            return
        arr = _as_numpy(indices)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.size:
            bad = arr[(arr < 0) | (arr >= self.size)][:4].tolist()
            raise AllocationError(f"{self.name}: indices {bad} are outside 0..{self.size - 1}")
        if not distinct_ints(arr):
            raise AllocationError(f"{self.name}: free() got duplicate indices")
        if not self._allocated[arr].all():
            bad = arr[~self._allocated[arr]][:4].tolist()
            raise AllocationError(f"{self.name}: double free of indices {bad}")
        self._allocated[arr] = False
        self._free.extend(arr[::-1].tolist())

    def _free_short(self, values: list[int]) -> None:
        """:meth:`free` of a short list of ints: the same checks, errors and order of the free
        stack as the array path."""
        if not values:
            return
        size = self.size
        if min(values) < 0 or max(values) >= size:
            bad = [v for v in values if v < 0 or v >= size][:4]
            raise AllocationError(f"{self.name}: indices {bad} are outside 0..{size - 1}")
        if len(set(values)) != len(values):
            raise AllocationError(f"{self.name}: free() got duplicate indices")
        allocated = self._allocated
        if not all(allocated[v] for v in values):
            bad = [v for v in values if not allocated[v]][:4]
            raise AllocationError(f"{self.name}: double free of indices {bad}")
        for v in values:
            allocated[v] = False
        self._free.extend(reversed(values))

    def is_allocated(self, index: int) -> bool:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < self.size:
            raise AllocationError(f"{self.name}: index {index!r} is outside 0..{self.size - 1}")
        return bool(self._allocated[index])

    def allocated_indices(self) -> np.ndarray:
        """Every index currently handed out (for integrity checks)."""
        return np.flatnonzero(self._allocated)


def _as_numpy(indices: torch.Tensor | Iterable[int]) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        # A float or bool tensor would be truncated to some other index: reject it.
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise AllocationError(f"indices must be an integer tensor, got {indices.dtype}")
        if indices.ndim == 0:  # a scalar, as for ints: free(t[None]) or free([i]) was meant
            raise AllocationError(
                f"indices must be a tensor or a sequence of indices, got a 0-d tensor ({indices.item()!r})"
            )
        return indices.detach().to("cpu", torch.int64).numpy().reshape(-1)
    if isinstance(indices, np.ndarray) and indices.ndim == 0:  # a scalar, as for a 0-d tensor
        raise AllocationError(f"indices must be an array or a sequence of indices, got a 0-d array ({indices!r})")
    try:
        items = indices if isinstance(indices, np.ndarray) else list(indices)
    except TypeError:  # a scalar (free([i]) was meant)
        raise AllocationError(f"indices must be a tensor or a sequence of indices, got {indices!r}") from None
    if isinstance(items, list) and any(isinstance(v, (bool, np.bool_)) for v in items):
        raise AllocationError(f"indices must be integers, got a bool among {items!r}")  # True would free 1
    arr = np.asarray(items)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    # As for tensors: a float (or bool) would be truncated to some other index.
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise AllocationError(f"indices must be integers, got {arr.dtype}")
    return arr.astype(np.int64).reshape(-1)
