"""Launcher: validation and dispatch of item copies (CPU torch path / CUDA Triton or DMA path).

A pool buffer is anything with ``buffer`` (uint8 tensor or ``None`` in accounting mode),
``num_layers``, ``num_items``, ``item_bytes``, ``layer_stride_bytes`` and ``item_stride_bytes``
(``PoolBufferLike``): item ``(layer, index)`` lives at byte ``layer·layer_stride +
index·item_stride`` of the buffer.

Primitives: ``copy_items`` (the entry point), ``layer_copier`` (the same copy, validated once
and issued layer by layer), ``PoolPair`` (the checks of two pools made once, for many such
copiers), ``select_method`` (Triton kernel or copy engines for a CUDA copy). The checks both
CUDA paths share (``validate_copy``, ``check_device_buffers``, ``check_overlap``,
``resolve_max_ctas``, …) live in ``kernels.copy_checks`` and are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from asynccache.errors import TransferError
from kernels.copy_checks import (
    PoolBufferLike,
    all_distinct,
    check_device_buffers,
    check_layer_range,
    check_overlap,
    copy_direction,
    layer_int,
    resolve_max_ctas,
    shares_buffer,
    validate_copy,
    validate_indices,
    validate_pools,
)
from kernels.plan import DMA_MIN_RUN_BYTES, dma_run_bytes

__all__ = [
    "COPY_METHODS",
    "COPY_METHOD_HELP",
    "LayerCopy",
    "PoolBufferLike",
    "PoolPair",
    "all_distinct",
    "check_device_buffers",
    "check_layer_range",
    "check_overlap",
    "copy_direction",
    "copy_items",
    "current_device",
    "layer_copier",
    "resolve_max_ctas",
    "select_method",
    "shares_buffer",
    "strided_view",
    "validate_copy",
    "validate_indices",
    "validate_pools",
]

#: The current CUDA device's index, without ``torch.cuda.current_device``'s Python layer (the
#: per-layer paths of loads ask it on every call).
current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

#: Values of ``copy_items(method=...)``: ``"auto"`` (the default) picks per call.
COPY_METHODS: tuple[str, ...] = ("auto", "triton", "dma")
#: Copy-engine variants selectable as ``method="dma:ENGINE"`` (see ``kernels.dma_copy``).
DMA_ENGINES: tuple[str, ...] = ("auto", "batch", "strided", "2d", "loop")
#: Every accepted ``method``: the copy methods and ``"dma:ENGINE"`` for each engine.
COPY_METHOD_NAMES: tuple[str, ...] = (*COPY_METHODS, *(f"dma:{e}" for e in DMA_ENGINES))
#: Those values as command-line help: ``auto | triton | dma | dma:auto | dma:batch | …``.
COPY_METHOD_HELP = " | ".join(COPY_METHOD_NAMES) + " (dma:auto is dma: the copy engines, the variant picked per copy)"


class LayerCopy(Protocol):
    """A layer-by-layer copy (:func:`layer_copier`): copies layers ``[layer, layer + count)``,
    returns the bytes copied."""

    def __call__(self, layer: int, count: int = 1) -> int: ...


def strided_view(pool: PoolBufferLike) -> torch.Tensor:
    """``[num_layers, num_items, item_bytes]`` uint8 view of a pool, whatever its layout."""
    assert pool.buffer is not None
    return pool.buffer.as_strided(
        (pool.num_layers, pool.num_items, pool.item_bytes),
        (pool.layer_stride_bytes, pool.item_stride_bytes, 1),
        pool.buffer.storage_offset(),
    )


def select_method(
    src: PoolBufferLike, dst: PoolBufferLike, *, method: str | None = None, layer_begin: int = 0, layer_end: int | None = None
) -> str:
    """``"triton"`` or ``"dma"`` for a CUDA copy; raises :class:`TransferError` for an unknown method.

    ``"triton"`` / ``"dma"`` are taken as given. ``None`` / ``"auto"``: the copy engines when one
    contiguous run of the copy (``kernels.plan.dma_run_bytes``: an item, or an item's layers
    where both pools keep them adjacent) is at least ``kernels.plan.DMA_MIN_RUN_BYTES``, the
    Triton kernel otherwise. Pure: depends on the pools' geometry only, never on the indices.
    """
    chosen = "auto" if method is None else method
    if chosen not in COPY_METHOD_NAMES:
        raise TransferError(f"unknown copy method {method!r}; known: {list(COPY_METHOD_NAMES)}")
    if chosen.startswith("dma:"):
        return "dma"
    if chosen != "auto":
        return chosen
    layer_end = src.num_layers if layer_end is None else layer_end
    run = dma_run_bytes(
        item_bytes=src.item_bytes,
        src_layer_stride_bytes=src.layer_stride_bytes,
        dst_layer_stride_bytes=dst.layer_stride_bytes,
        num_layers=layer_end - layer_begin,
    )
    return "dma" if run >= DMA_MIN_RUN_BYTES else "triton"


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
    method: str | None = None,
) -> int:
    """Copy items ``src[l, src_indices[i]] → dst[l, dst_indices[i]]`` for ``l`` in the layer range.

    On CUDA the copy is enqueued on ``stream`` (default: the current stream) and returns at
    once, by one of two paths (``method``: ``"auto"``/``None``, ``"triton"``, ``"dma"``, or
    ``"dma:ENGINE"`` with ENGINE one of ``batch``, ``strided``, ``2d``, ``loop``; :func:`select_method`):

    - ``"triton"``: one kernel launch of at most ``max_ctas`` CTAs (default
      ``kernels.plan.DEFAULT_MAX_CTAS``) reading/writing pinned host memory directly;
    - ``"dma"``: CUDA memcpys on the copy engines (``kernels.dma_copy``), no SMs, adjacent items
      merged; ``max_ctas`` is checked but unused.

    On CPU it is synchronous torch indexing: ``max_ctas`` and ``stream`` are ignored, ``method``
    is checked and does not change it. Returns the number of bytes copied (counted also in accounting mode,
    where nothing is copied). Layer positions are *local* to the pools (0 … num_layers-1).
    Everything is validated before anything is enqueued (:class:`TransferError`); destination
    indices must be distinct. A layer-by-layer copy of the same index lists is cheaper through
    :func:`layer_copier`.
    """
    # Python ints before anything uses them (a NumPy integer would reach the runtime's and
    # Triton's arguments as such).
    layer_begin = layer_int("layer_begin", layer_begin)
    layer_end = src.num_layers if layer_end is None else layer_int("layer_end", layer_end)
    if _on_cuda(src) or _on_cuda(dst):
        chosen = select_method(src, dst, method=method, layer_begin=layer_begin, layer_end=layer_end)
        resolve_max_ctas(max_ctas)
        if chosen == "dma":
            from kernels.dma_copy import launch_dma

            engine = method[4:] if method and method.startswith("dma:") else "auto"
            launch_dma(src, dst, src_indices, dst_indices, layer_begin, layer_end, stream=stream, engine=engine)
        else:
            # The launcher validates (the same checks plus device, pinning and overlap rules).
            from kernels.triton_copy import launch_copy

            launch_copy(src, dst, src_indices, dst_indices, layer_begin, layer_end, max_ctas=max_ctas, stream=stream)
        return src_indices.numel() * (layer_end - layer_begin) * src.item_bytes
    select_method(src, dst, method=method, layer_begin=layer_begin, layer_end=layer_end)
    validate_copy(src, dst, src_indices, dst_indices, layer_begin, layer_end)
    nbytes = src_indices.numel() * (layer_end - layer_begin) * src.item_bytes
    if nbytes == 0 or src.buffer is None:
        return nbytes
    check_overlap(src, dst, src_indices, dst_indices)  # the rule of the CUDA paths, here too
    assert dst.buffer is not None
    _copy_torch(src, dst, src_indices, dst_indices, layer_begin, layer_end)
    return nbytes


class PoolPair:
    """Copies from one pool to another with fixed options, checked once.

    ``PoolPair(src, dst, max_ctas=, stream=, method=)`` makes every check of a copy that does not
    depend on the index lists — geometry, buffers, devices and pinning, the stream, the method
    (:class:`TransferError`) — and chooses the path (``method``: ``"cpu"``, ``"triton"`` or
    ``"dma"``). :meth:`layer_copier` then checks only the index lists. A controller keeps one
    pair per pool and direction, so a load's host time is the index checks, the plan and the
    runtime calls.
    """

    __slots__ = ("_checked", "_shared", "dst", "engine", "max_ctas", "method", "src", "stream")

    def __init__(
        self,
        src: PoolBufferLike,
        dst: PoolBufferLike,
        *,
        max_ctas: int | None = None,
        stream: torch.cuda.Stream | None = None,
        method: str | None = None,
    ) -> None:
        if method is not None and not isinstance(method, str):
            raise TransferError(f"unknown copy method {method!r}; known: {list(COPY_METHOD_NAMES)}")
        self.src, self.dst, self.max_ctas, self.stream = src, dst, max_ctas, stream
        self.engine = method[4:] if method and method.startswith("dma:") else "auto"
        self._checked: tuple[str, torch.device] | None = None
        self._shared: bool | None = None
        if _on_cuda(src) or _on_cuda(dst):
            self.method = select_method(src, dst, method=method, layer_begin=0, layer_end=min(1, src.num_layers))
            resolve_max_ctas(max_ctas)
        else:
            select_method(src, dst, method=method)
            self.method = "cpu"
        if self.method == "dma":
            from kernels.dma_copy import check_pair

            self._checked = check_pair(src, dst, stream, self.engine)
            self._shared = shares_buffer(src, dst)
        else:
            validate_pools(src, dst)

    def layer_copier(self, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> LayerCopy:
        """:func:`layer_copier` of this pair: the index lists are checked here."""
        src, dst = self.src, self.dst
        num_layers, layer_bytes = src.num_layers, src_indices.numel() * src.item_bytes
        if self.method == "dma":
            from kernels.dma_copy import dma_layer_copier

            issue = dma_layer_copier(
                src,
                dst,
                src_indices,
                dst_indices,
                stream=self.stream,
                engine=self.engine,
                checked=self._checked,
                shared=self._shared,
            )

            def copy_dma(layer: int, count: int = 1) -> int:
                issue(layer, count)
                return layer_bytes * count

            return copy_dma
        validate_indices(src, dst, src_indices, dst_indices)
        if self.method == "cpu" and src.buffer is not None:
            check_overlap(src, dst, src_indices, dst_indices)  # the rule of the CUDA paths, here too

        if self.method == "triton":
            from kernels.triton_copy import launch_copy

            max_ctas, stream = self.max_ctas, self.stream

            def copy_triton(layer: int, count: int = 1) -> int:
                layer, count = check_layer_range(layer, count, num_layers)
                launch_copy(src, dst, src_indices, dst_indices, layer, layer + count, max_ctas=max_ctas, stream=stream)
                return layer_bytes * count

            return copy_triton

        def copy_cpu(layer: int, count: int = 1) -> int:
            layer, count = check_layer_range(layer, count, num_layers)
            if layer_bytes and src.buffer is not None:
                _copy_torch(src, dst, src_indices, dst_indices, layer, layer + count)
            return layer_bytes * count

        return copy_cpu


def layer_copier(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    max_ctas: int | None = None,
    stream: torch.cuda.Stream | None = None,
    method: str | None = None,
) -> LayerCopy:
    """A layer-by-layer :func:`copy_items` of fixed index lists: ``copy(layer, count=1)``
    copies ``src[l, src_indices[i]] → dst[l, dst_indices[i]]`` for the local layer positions
    ``l`` in ``[layer, layer + count)`` and returns the bytes, exactly as
    ``copy_items(..., layer_begin=layer, layer_end=layer + count)``.

    The copy is validated here, once (:class:`TransferError`, before anything is enqueued); a
    layer range outside the pools raises at its call. On the copy engines a range of layers is
    planned at its first call and every later call of that length issues the plan for its
    layers (``kernels.dma_copy.dma_layer_copier``): the per-layer host cost of a load is the
    runtime calls. The index tensors must not change while the copier is in use. Copies between
    the same two pools can share the checks of the pools: :class:`PoolPair`.
    """
    return PoolPair(src, dst, max_ctas=max_ctas, stream=stream, method=method).layer_copier(src_indices, dst_indices)


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
