"""Launcher: validation and dispatch of item copies (CPU torch path / CUDA Triton path).

A pool buffer is anything with ``buffer`` (uint8 tensor or ``None`` in accounting mode),
``num_layers``, ``num_items``, ``item_bytes``, ``layer_stride_bytes`` and ``item_stride_bytes``:
item ``(layer, index)`` lives at byte ``layer·layer_stride + index·item_stride`` of the buffer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from asynccache.errors import TransferError

__all__ = ["PoolBufferLike", "copy_items", "validate_copy", "strided_view"]


class PoolBufferLike(Protocol):
    buffer: torch.Tensor | None
    num_layers: int
    num_items: int
    item_bytes: int

    @property
    def layer_stride_bytes(self) -> int: ...

    @property
    def item_stride_bytes(self) -> int: ...


def strided_view(pool: PoolBufferLike) -> torch.Tensor:
    """``[num_layers, num_items, item_bytes]`` uint8 view of a pool, whatever its layout."""
    assert pool.buffer is not None
    return pool.buffer.as_strided(
        (pool.num_layers, pool.num_items, pool.item_bytes),
        (pool.layer_stride_bytes, pool.item_stride_bytes, 1),
        pool.buffer.storage_offset(),
    )


def validate_copy(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
) -> None:
    """Raise :class:`TransferError` for anything a launch would get wrong."""
    if src.item_bytes != dst.item_bytes:
        raise TransferError(f"item size mismatch: src {src.item_bytes} B, dst {dst.item_bytes} B")
    if src.num_layers != dst.num_layers:
        raise TransferError(f"layer count mismatch: src {src.num_layers}, dst {dst.num_layers}")
    if not 0 <= layer_begin <= layer_end <= src.num_layers:
        raise TransferError(f"layer range [{layer_begin}, {layer_end}) outside 0..{src.num_layers}")
    for name, idx, pool in (("src", src_indices, src), ("dst", dst_indices, dst)):
        if not isinstance(idx, torch.Tensor):
            raise TransferError(f"{name}_indices must be a tensor, got {type(idx).__name__}")
        if idx.dtype != torch.int64:
            raise TransferError(f"{name}_indices must be int64, got {idx.dtype}")
        if idx.dim() != 1:
            raise TransferError(f"{name}_indices must be 1-D, got shape {tuple(idx.shape)}")
        if idx.device.type != "cpu":
            raise TransferError(f"{name}_indices must be a CPU tensor (they are range-checked before launch)")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= pool.num_items):
            raise TransferError(
                f"{name}_indices out of range 0..{pool.num_items - 1}: min {int(idx.min())}, max {int(idx.max())}"
            )
    if src_indices.numel() != dst_indices.numel():
        raise TransferError(f"index count mismatch: {src_indices.numel()} vs {dst_indices.numel()}")
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


def copy_items(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer_begin: int = 0,
    layer_end: int | None = None,
    max_ctas: int | None = None,
    stream: torch.cuda.Stream | None = None,
) -> int:
    """Copy items ``src[l, src_indices[i]] → dst[l, dst_indices[i]]`` for ``l`` in the layer range.

    One call is one launch on CUDA (on ``stream``, default the current stream; at most
    ``max_ctas`` CTAs, default ``kernels.plan.DEFAULT_MAX_CTAS``); on CPU it is synchronous
    torch indexing and ``max_ctas``/``stream`` are ignored. Returns the number of bytes copied (counted also in accounting mode, where
    nothing is copied). Layer positions are *local* to the pools (0 … num_layers-1).
    """
    layer_end = src.num_layers if layer_end is None else layer_end
    if _on_cuda(src) or _on_cuda(dst):
        # The launcher validates (the same checks plus device, pinning and overlap rules).
        from kernels.triton_copy import launch_copy

        launch_copy(src, dst, src_indices, dst_indices, layer_begin, layer_end, max_ctas=max_ctas, stream=stream)
        return src_indices.numel() * (layer_end - layer_begin) * src.item_bytes
    validate_copy(src, dst, src_indices, dst_indices, layer_begin, layer_end)
    nbytes = src_indices.numel() * (layer_end - layer_begin) * src.item_bytes
    if nbytes == 0 or src.buffer is None:
        return nbytes
    assert dst.buffer is not None
    _copy_torch(src, dst, src_indices, dst_indices, layer_begin, layer_end)
    return nbytes


def _on_cuda(pool: PoolBufferLike) -> bool:
    return pool.buffer is not None and pool.buffer.device.type == "cuda"


def _copy_torch(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
) -> None:
    """The production CPU path: one gather and one scatter through torch indexing."""
    s = strided_view(src)[layer_begin:layer_end]
    d = strided_view(dst)[layer_begin:layer_end]
    d[:, dst_indices] = s[:, src_indices]
