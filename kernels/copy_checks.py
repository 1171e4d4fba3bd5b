"""Checks of an item copy, shared by the torch path and both CUDA paths (``kernels.api``,
``kernels.triton_copy``, ``kernels.dma_copy``); each raises :class:`TransferError`.

Primitives: ``PoolBufferLike`` (what a pool buffer offers, see ``kernels.api``),
``validate_copy`` (``validate_pools``: geometry and buffers; the layer range;
``validate_indices``: the index lists, ``all_distinct``), ``check_layer_range`` (a layer
copier's call), ``check_device_buffers`` (devices, pinning; ``copy_direction``),
``check_overlap`` (in-pool copies; ``shares_buffer``), ``resolve_max_ctas``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from asynccache.checks import as_int, distinct_ints
from asynccache.errors import TransferError
from kernels.plan import DEFAULT_MAX_CTAS

__all__ = [
    "PoolBufferLike",
    "all_distinct",
    "check_device_buffers",
    "check_layer_range",
    "check_overlap",
    "copy_direction",
    "layer_int",
    "resolve_max_ctas",
    "shares_buffer",
    "validate_copy",
    "validate_indices",
    "validate_pools",
]


class PoolBufferLike(Protocol):
    """A pool buffer: item ``(layer, index)`` lives at byte ``layer·layer_stride +
    index·item_stride`` of ``buffer`` (``None`` in accounting mode)."""

    buffer: torch.Tensor | None
    num_layers: int
    num_items: int
    item_bytes: int

    @property
    def layer_stride_bytes(self) -> int: ...

    @property
    def item_stride_bytes(self) -> int: ...


def validate_copy(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
) -> None:
    """Raise :class:`TransferError` for anything a launch would get wrong: the pools
    (:func:`validate_pools`), the layer range, the index lists (:func:`validate_indices`)."""
    validate_pools(src, dst)
    layer_begin, layer_end = layer_int("layer_begin", layer_begin), layer_int("layer_end", layer_end)
    if not 0 <= layer_begin <= layer_end <= src.num_layers:
        raise TransferError(f"layer range [{layer_begin}, {layer_end}) outside 0..{src.num_layers}")
    validate_indices(src, dst, src_indices, dst_indices)


def validate_pools(src: PoolBufferLike, dst: PoolBufferLike) -> None:
    """The checks of a copy that do not depend on the index lists: matching geometry, and
    buffers that are uint8, contiguous and large enough for their strides."""
    if src.item_bytes != dst.item_bytes:
        raise TransferError(f"item size mismatch: src {src.item_bytes} B, dst {dst.item_bytes} B")
    if src.num_layers != dst.num_layers:
        raise TransferError(f"layer count mismatch: src {src.num_layers}, dst {dst.num_layers}")
    if (src.buffer is None) != (dst.buffer is None):
        raise TransferError("cannot copy between a materialized pool and an accounting-mode pool")
    for name, pool in (("src", src), ("dst", dst)):
        buf = pool.buffer
        if buf is None:
            continue
        if buf.dtype != torch.uint8:
            raise TransferError(f"{name} buffer must be uint8 bytes, got {buf.dtype}")
        if not buf.is_contiguous():
            raise TransferError(f"{name} buffer must be contiguous")
        need = (pool.num_layers - 1) * pool.layer_stride_bytes + (pool.num_items - 1) * pool.item_stride_bytes
        if pool.num_layers and pool.num_items and need + pool.item_bytes > buf.numel():
            raise TransferError(f"{name} strides address past the end of its buffer")


def check_layer_range(layer: int, count: int, num_layers: int) -> tuple[int, int]:
    """A layer copier's ``(layer, count)``: ints (a float would be truncated by a kernel)
    naming layers inside ``0..num_layers - 1``, else :class:`TransferError`. Returns them as
    Python ints (a NumPy integer would reach the runtime's and Triton's arguments as such)."""
    first, n = as_int(layer), as_int(count)
    if first is None or n is None:
        raise TransferError(f"layer and count must be ints, got {layer!r}, {count!r}")
    if not (0 <= first and n >= 1 and first + n <= num_layers):
        raise TransferError(f"layers [{first}, {first + n}) outside 0..{num_layers - 1}")
    return first, n


def layer_int(name: str, value: object) -> int:
    """A layer position as a Python int, else :class:`TransferError`."""
    n = as_int(value)
    if n is None:
        raise TransferError(f"{name} must be an int, got {value!r}")
    return n


def validate_indices(
    src: PoolBufferLike, dst: PoolBufferLike, src_indices: torch.Tensor, dst_indices: torch.Tensor
) -> None:
    """The index lists of a copy: 1-D int64 CPU tensors of equal length, within their pools, the
    destination's distinct (two writes of one item would race on a GPU)."""
    for name, idx, pool in (("src", src_indices, src), ("dst", dst_indices, dst)):
        if not isinstance(idx, torch.Tensor):
            raise TransferError(f"{name}_indices must be a tensor, got {type(idx).__name__}")
        if idx.dtype != torch.int64:
            raise TransferError(f"{name}_indices must be int64, got {idx.dtype}")
        if idx.dim() != 1:
            raise TransferError(f"{name}_indices must be 1-D, got shape {tuple(idx.shape)}")
        if idx.device.type != "cpu":
            raise TransferError(f"{name}_indices must be a CPU tensor (they are range-checked before launch)")
        n = idx.numel()
        if n:
            if n <= 16:  # a few slots: Python's min/max on the list beat two numpy reductions
                values = idx.tolist()
                lo, hi = min(values), max(values)
                distinct = name == "src" or len(set(values)) == n
            else:
                array = idx.numpy()  # numpy reductions: ~1 µs here against ~3 µs through the dispatcher
                lo, hi = int(array.min()), int(array.max())
                distinct = name == "src" or all_distinct(array)
            if lo < 0 or hi >= pool.num_items:
                raise TransferError(f"{name}_indices out of range 0..{pool.num_items - 1}: min {lo}, max {hi}")
            if not distinct:
                raise TransferError("dst_indices name one item twice (two copies would write it)")
    if src_indices.numel() != dst_indices.numel():
        raise TransferError(f"index count mismatch: {src_indices.numel()} vs {dst_indices.numel()}")


def copy_direction(src: torch.Tensor, dst: torch.Tensor) -> str:
    """``"h2d"``, ``"d2h"``, ``"d2d"`` or ``"h2h"`` for two buffers."""
    s = "d" if src.device.type == "cuda" else "h"
    d = "d" if dst.device.type == "cuda" else "h"
    return f"{s}2{d}"


def check_device_buffers(src: torch.Tensor, dst: torch.Tensor, *, allow_host_only: bool = False) -> str:
    """Device rules of a CUDA copy (one GPU, host memory pinned); returns the direction.

    ``allow_host_only`` admits two host buffers (Triton's interpreter in tests)."""
    direction = copy_direction(src, dst)
    if direction == "h2h":
        if allow_host_only:
            return direction
        raise TransferError("a CUDA copy needs a CUDA buffer on one side (CPU copies go through copy_items)")
    if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
        raise TransferError(f"buffers on different GPUs: {src.device} and {dst.device}")
    for name, buf in (("src", src), ("dst", dst)):
        if buf.device.type == "cpu" and not buf.is_pinned():
            raise TransferError(
                f"{name} buffer is pageable host memory, which the GPU cannot address: allocate the host pool pinned"
            )
        if buf.device.type not in ("cpu", "cuda"):
            raise TransferError(f"{name} buffer on unsupported device {buf.device}")
    return direction


def shares_buffer(src: PoolBufferLike, dst: PoolBufferLike) -> bool:
    """Whether two materialized pools live in one buffer (then their geometries must agree:
    :class:`TransferError` otherwise)."""
    assert src.buffer is not None and dst.buffer is not None
    s, d = src.buffer, dst.buffer
    if s.untyped_storage().data_ptr() != d.untyped_storage().data_ptr():
        return False
    if s.data_ptr() != d.data_ptr():
        # Views of one allocation from different bytes: disjoint parts are separate buffers;
        # overlapping ones cannot be checked by index (item i of one is not item i of the other).
        if s.data_ptr() < d.data_ptr() + d.numel() and d.data_ptr() < s.data_ptr() + s.numel():
            raise TransferError("src and dst are overlapping views of one buffer that start at different bytes")
        return False
    if src.layer_stride_bytes != dst.layer_stride_bytes or src.item_stride_bytes != dst.item_stride_bytes:
        raise TransferError("src and dst share a buffer with different geometries")
    return True


#: Index lists up to this length are compared as Python sets (a few µs less than ``torch.isin``).
_SMALL_OVERLAP = 64


def all_distinct(array: np.ndarray | torch.Tensor) -> bool:
    """No value twice (any shape: the values are taken flat; a CPU tensor is read as NumPy).

    Integers: :func:`~asynccache.checks.distinct_ints` (no ``np.unique``, which is slow); other
    dtypes: ``np.unique``, which also decides what counts as equal (NaNs are one value)."""
    a = array if isinstance(array, np.ndarray) else np.asarray(array)
    if a.ndim != 1:
        a = a.reshape(-1)
    if a.size < 2:
        return True
    if a.dtype.kind not in "iub":
        return int(np.unique(a).size) == a.size
    return distinct_ints(a)


def check_overlap(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    shared: bool | None = None,
) -> None:
    """A copy inside one pool must not read an item it also writes (copies run in any order).
    ``shared``: what :func:`shares_buffer` returned for these pools (computed when ``None``)."""
    if not (shares_buffer(src, dst) if shared is None else shared):
        return
    if src_indices.numel() <= _SMALL_OVERLAP and dst_indices.numel() <= _SMALL_OVERLAP:
        overlap = not set(src_indices.tolist()).isdisjoint(dst_indices.tolist())
    else:
        overlap = bool(torch.isin(src_indices, dst_indices).any())
    if overlap:
        raise TransferError("src and dst are the same pool and the index lists overlap")


def resolve_max_ctas(max_ctas: int | None) -> int:
    """The CTA cap of a Triton launch (``None`` → ``DEFAULT_MAX_CTAS``); raises on a bad value."""
    cap = DEFAULT_MAX_CTAS if max_ctas is None else max_ctas
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise TransferError(f"max_ctas must be a positive int, got {max_ctas!r}")
    return cap
