"""Item copies on the GPU's copy engines (DMA): CUDA runtime memcpys, no SMs.

Primitives:

- ``launch_dma(src, dst, src_indices, dst_indices, layer_begin, layer_end, *, stream=, engine=)
  -> DmaLaunch | None`` — validate, plan, enqueue.
- ``dma_layer_copier(src, dst, src_indices, dst_indices, *, stream=, engine=) -> issue(layer,
  count=1)`` — validate and plan once, then enqueue a layer (or a few) per call (a
  layer-by-layer load).
- ``check_pair(src, dst, stream, engine) -> (direction, device)`` — the checks that do not
  depend on the index lists, made once for many copiers (``kernels.api.PoolPair``).
- ``DMA_ENGINES`` — ``"auto"``, ``"batch"``, ``"strided"``, ``"2d"``, ``"loop"``.

A copy is checked here, planned by ``kernels.dma_plan`` (``plan_segments``,
``plan_strided_runs``, ``progression_rows``: byte ranges, adjacent items merged) and issued by
``kernels.dma_engines`` (the engine choice, ``batch_check``, the runtime calls over
``kernels.cudart``); their public names are importable from here too.

Host memory must be pinned (as for the Triton path), so every memcpy is asynchronous; the
index tensors are read during the call only and may change right after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asynccache.errors import TransferError
from kernels.api import DMA_ENGINES, current_device
from kernels.copy_checks import (
    PoolBufferLike,
    check_device_buffers,
    check_layer_range,
    check_overlap,
    validate_copy,
    validate_indices,
    validate_pools,
)
from kernels.cudart import cuda_runtime
from kernels.dma_engines import DmaLaunch, _issue, _plan, batch_check
from kernels.dma_plan import (
    MAX_2D_PITCH,
    STRIDED_MIN_GAIN,
    CopySegments,
    StridedRuns,
    plan_segments,
    plan_strided_runs,
    progression_rows,
)

__all__ = [
    "DMA_ENGINES",
    "MAX_2D_PITCH",
    "STRIDED_MIN_GAIN",
    "CopySegments",
    "DmaLaunch",
    "StridedRuns",
    "batch_check",
    "check_pair",
    "dma_layer_copier",
    "launch_dma",
    "plan_segments",
    "plan_strided_runs",
    "progression_rows",
]


def launch_dma(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int = 0,
    layer_end: int | None = None,
    *,
    stream: torch.cuda.Stream | None = None,
    engine: str = "auto",
) -> DmaLaunch | None:
    """Enqueue ``src[l, src_indices[i]] → dst[l, dst_indices[i]]`` for ``l`` in the layer range
    as memcpys on ``stream`` (default: the current stream of the CUDA buffer's device).

    Checks everything before enqueueing (``kernels.copy_checks``: geometry, indices, pinned host
    memory, one GPU, in-pool overlap; the stream's type and device; the engine) and raises
    :class:`TransferError`, also for a failing runtime call (named CUDA error). Returns ``None``
    when there is nothing to copy. Asynchronous: the caller orders later work on the stream.
    The first ``batch`` use on a device runs :func:`batch_check` (one stream synchronisation).
    """
    layer_end = src.num_layers if layer_end is None else layer_end
    direction, device = _validate(src, dst, src_indices, dst_indices, layer_begin, layer_end, stream, engine)
    prepared = _plan(src, dst, src_indices, dst_indices, layer_begin, layer_end, engine, direction, device)
    if prepared is None:
        return None
    return _issue(prepared, src, dst, src_indices, dst_indices, layer_begin, layer_end - layer_begin, stream)


def dma_layer_copier(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None = None,
    engine: str = "auto",
    checked: tuple[str, torch.device] | None = None,
    shared: bool | None = None,
) -> Callable[..., DmaLaunch | None]:
    """A layer-by-layer copy of fixed index lists: ``issue(layer, count=1)`` enqueues
    ``src[l, src_indices[i]] → dst[l, dst_indices[i]]`` for ``l`` in ``[layer, layer + count)``
    like :func:`launch_dma`, and returns its :class:`DmaLaunch` (``None`` when there is nothing
    to copy).

    Everything is checked here, once — only the index lists (and the in-pool overlap rule) when
    ``checked`` is what :func:`check_pair` returned for these pools, stream and engine (and
    ``shared`` what ``kernels.copy_checks.shares_buffer`` returned for them, if given). A range
    of ``count`` layers is planned at the first call with that count; later calls issue that
    plan with the two base addresses moved by the layer strides. For the ``strided`` and
    ``loop`` engines on an explicit stream, such a call makes nothing but the runtime calls: a
    few microseconds of host time. The copier keeps the index tensors and the stream alive; the
    tensors must not change while it is in use.
    """
    num_layers = src.num_layers
    if checked is None:
        checked = check_pair(src, dst, stream, engine)
    validate_indices(src, dst, src_indices, dst_indices)
    if src_indices.numel() and num_layers:
        check_overlap(src, dst, src_indices, dst_indices, shared=shared)
    # ``issue`` plans ranges from the index tensors and the stream, so the copier keeps them
    # alive (the raw stream handle and the plans' offsets stay valid).
    issuers: dict[int, Callable[[int], DmaLaunch | None]] = {}

    def issue(layer: int, count: int = 1) -> DmaLaunch | None:
        layer, count = check_layer_range(layer, count, num_layers)
        issuer = issuers.get(count)
        if issuer is None:
            issuer = issuers[count] = _range_issuer(src, dst, src_indices, dst_indices, count, stream, engine, checked)
        return issuer(layer)

    return issue


def _range_issuer(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    count: int,
    stream: torch.cuda.Stream | None,
    engine: str,
    checked: tuple[str, torch.device],
) -> Callable[[int], DmaLaunch | None]:
    """Plan the copy of layers ``[0, count)`` (validated: ``checked`` is what :func:`check_pair`
    returned); the function returned issues it for ``[layer, layer + count)`` (the caller checks
    the range)."""
    prepared = _plan(src, dst, src_indices, dst_indices, 0, count, engine, *checked)
    if prepared is None:
        return lambda layer: None
    if prepared.engine not in ("strided", "loop") or stream is None:

        def general(layer: int) -> DmaLaunch:
            shift = (layer * src.layer_stride_bytes, layer * dst.layer_stride_bytes)
            return _issue(prepared, src, dst, src_indices, dst_indices, layer, count, stream, shift=shift)

        return general
    assert src.buffer is not None and dst.buffer is not None and prepared.device.index is not None
    rt, handle, rows, index = cuda_runtime(), stream.cuda_stream, prepared.run_rows, prepared.device.index
    src_base, dst_base = src.buffer.data_ptr(), dst.buffer.data_ptr()
    src_stride, dst_stride = src.layer_stride_bytes, dst.layer_stride_bytes
    launch = DmaLaunch(
        direction=prepared.direction,
        engine=prepared.engine,
        num_copies=prepared.num_copies,
        num_calls=len(rows),
        num_bytes=prepared.num_bytes,
    )

    memcpy_rows = rt.memcpy_rows

    def issue(layer: int) -> DmaLaunch:
        s, d = src_base + layer * src_stride, dst_base + layer * dst_stride
        if current_device() == index:
            memcpy_rows(rows, s, d, handle)
        else:
            with torch.cuda.device(index):
                memcpy_rows(rows, s, d, handle)
        return launch

    return issue


def _check_stream(stream: torch.cuda.Stream | None, device: torch.device) -> None:
    if stream is not None:
        if not isinstance(stream, torch.cuda.Stream):
            raise TransferError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        if stream.device != device:
            raise TransferError(f"stream on {stream.device}, buffers on {device}")


def check_pair(
    src: PoolBufferLike, dst: PoolBufferLike, stream: torch.cuda.Stream | None, engine: str
) -> tuple[str, torch.device]:
    """The checks of a copy-engine copy that do not depend on the index lists or the layer range
    (``kernels.copy_checks``: geometry, buffers, pinned host memory, one GPU; the stream; the
    engine); returns the direction and the GPU."""
    validate_pools(src, dst)
    return _check_buffers(src, dst, stream, engine)


def _check_buffers(
    src: PoolBufferLike, dst: PoolBufferLike, stream: torch.cuda.Stream | None, engine: str
) -> tuple[str, torch.device]:
    """:func:`check_pair` past the pools' own checks."""
    if src.buffer is None or dst.buffer is None:
        raise TransferError("launch_dma needs materialized pools (accounting mode goes through copy_items)")
    direction = check_device_buffers(src.buffer, dst.buffer)
    if engine not in DMA_ENGINES:
        raise TransferError(f"unknown DMA engine {engine!r}; known: {list(DMA_ENGINES)}")
    device = dst.buffer.device if dst.buffer.device.type == "cuda" else src.buffer.device
    _check_stream(stream, device)
    return direction, device


def _validate(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
    stream: torch.cuda.Stream | None,
    engine: str,
) -> tuple[str, torch.device]:
    """Every check of a copy (:func:`check_pair`, the layer range, the index lists); returns the
    direction and the GPU."""
    validate_copy(src, dst, src_indices, dst_indices, layer_begin, layer_end)
    checked = _check_buffers(src, dst, stream, engine)
    if src_indices.numel() and layer_end > layer_begin:
        check_overlap(src, dst, src_indices, dst_indices)
    return checked
