"""Triton kernel that gathers/scatters pool items between device and pinned host memory.

Primitives:

- ``launch_copy(src, dst, src_indices, dst_indices, layer_begin, layer_end, *, max_ctas=, stream=,
  tuning=) -> CopyLaunch | None`` — validate, plan, stage the indices, launch once.
- ``plan_launch(...) -> (CopyPlan, direction) | None`` — the validation and planning alone.
- ``CopyLaunch`` — what was launched (plan, compiled kernel, the device index tensor).

Host memory is addressed directly by the GPU: a pinned host tensor's ``data_ptr`` is a valid
device address under unified addressing, so an H2D load is the kernel reading host memory over
PCIe (no staging copy, no per-item ``cudaMemcpy``) and a D2H backup is the kernel writing it.
Every layout pair works the same way because an item's address is
``base + layer·layer_stride + index·item_stride`` in both layouts (``asynccache.pools.base``).

Addresses are int64 throughout (task numbers, indices, layers are widened before any multiply):
an int32 overflow past 2**31 would read or write far outside the buffers.

Index tensors arrive on the CPU (they were range-checked there). They travel to the GPU as one
``[2, num_pairs]`` int64 tensor through a pinned staging buffer and a non-blocking copy on the
launch stream: no host synchronisation. The caching host allocator keeps the staging buffer
until that copy has run; the device tensor is allocated on the launch stream, so the caching
device allocator reuses it only after the kernel (and it is also returned in ``CopyLaunch``).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernel runs on CPU
tensors through Triton's interpreter; that is for tests only (slow), production CPU copies use
``kernels.api``'s torch path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from asynccache.errors import TransferError
from kernels.copy_checks import (
    PoolBufferLike,
    check_device_buffers,
    check_overlap,
    copy_direction,
    resolve_max_ctas,
    validate_copy,
)
from kernels.plan import DEFAULT_TUNING, CopyPlan, CopyTuning, plan_copy

__all__ = ["CopyLaunch", "copy_direction", "interpreting", "launch_copy", "plan_launch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyLaunch:
    """One kernel launch: its plan, the compiled kernel (``None`` under the interpreter), and the
    device index tensor it reads (kept alive here for callers that hold on to the launch)."""

    plan: CopyPlan
    direction: str
    indices: torch.Tensor
    kernel: Any

    @property
    def num_bytes(self) -> int:
        return self.plan.num_bytes


def interpreting() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter."""
    return not isinstance(_copy_items_kernel, triton.runtime.JITFunction)


@triton.jit
def _tile_rows(
    it,
    rows,
    idx_ptr,
    src_layer_stride,
    src_item_stride,
    dst_layer_stride,
    dst_item_stride,
    item_words,
    num_chunks,
    num_pairs,
    layer_begin,
    num_tasks,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    ALIGN: tl.constexpr,
    EVEN: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Rows of tile ``it``: src and dst word offsets of each row's chunk (int64) and the number
    of words to copy in it (``0`` past the last task; a multiple of ``ALIGN``, of ``CHUNK`` when
    ``EVEN``). Per-row values only: the ``[ROWS, CHUNK]`` offsets are formed at the access so
    that loop-carried state stays one value per row."""
    if WIDE:
        task = (tl.full((ROWS,), 0, tl.int64) + it) * ROWS + rows  # widened before the multiply
    else:
        task = it * ROWS + rows  # num_iters · ROWS < 2**31 (plan): int32 division is cheap
    row_ok = task < num_tasks
    chunk = task % num_chunks
    item_task = task // num_chunks
    pair = item_task % num_pairs
    layer = (item_task // num_pairs + layer_begin).to(tl.int64)
    src_item = tl.load(idx_ptr + pair, mask=row_ok, other=0)  # int64 item indices
    dst_item = tl.load(idx_ptr + num_pairs + pair, mask=row_ok, other=0)
    word = chunk.to(tl.int64) * CHUNK
    src_row = tl.multiple_of(layer * src_layer_stride + src_item * src_item_stride + word, ALIGN)
    dst_row = tl.multiple_of(layer * dst_layer_stride + dst_item * dst_item_stride + word, ALIGN)
    if EVEN:
        left = tl.multiple_of(tl.where(row_ok, CHUNK, 0), CHUNK)
    else:
        left = tl.multiple_of(tl.where(row_ok, tl.minimum(item_words - word, CHUNK), 0).to(tl.int32), ALIGN)
    return src_row, dst_row, left


@triton.jit(do_not_specialize=["num_pairs", "layer_begin", "num_tasks", "num_iters"])
def _copy_items_kernel(
    src_ptr,
    dst_ptr,
    idx_ptr,
    src_layer_stride,
    src_item_stride,
    dst_layer_stride,
    dst_item_stride,
    item_words,
    num_chunks,
    num_pairs,
    layer_begin,
    num_tasks,
    num_iters,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    ALIGN: tl.constexpr,
    EVEN: tl.constexpr,
    WIDE: tl.constexpr,
    PIPELINE: tl.constexpr,
):
    """Persistent loop over tiles ``pid, pid + grid, …``; ``grid ≤ num_iters`` (launcher)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, CHUNK)
    if PIPELINE:
        # Two tiles in flight: tile i+1's loads are issued before tile i's stores, so a CTA
        # never waits a full PCIe round trip with nothing outstanding.
        src_row, dst_row, left = _tile_rows(
            pid, rows, idx_ptr, src_layer_stride, src_item_stride, dst_layer_stride, dst_item_stride,
            item_words, num_chunks, num_pairs, layer_begin, num_tasks, ROWS, CHUNK, ALIGN, EVEN, WIDE,
        )  # fmt: skip
        mask = cols[None, :] < left[:, None]
        data = tl.load(src_ptr + (src_row[:, None] + cols[None, :]), mask=mask, other=0)
        for it in range(pid + step, num_iters, step):
            nxt_src_row, nxt_dst_row, nxt_left = _tile_rows(
                it, rows, idx_ptr, src_layer_stride, src_item_stride, dst_layer_stride, dst_item_stride,
                item_words, num_chunks, num_pairs, layer_begin, num_tasks, ROWS, CHUNK, ALIGN, EVEN, WIDE,
            )  # fmt: skip
            nxt_mask = cols[None, :] < nxt_left[:, None]
            nxt = tl.load(src_ptr + (nxt_src_row[:, None] + cols[None, :]), mask=nxt_mask, other=0)
            tl.store(dst_ptr + (dst_row[:, None] + cols[None, :]), data, mask=cols[None, :] < left[:, None])
            dst_row = nxt_dst_row
            left = nxt_left
            data = nxt
        tl.store(dst_ptr + (dst_row[:, None] + cols[None, :]), data, mask=cols[None, :] < left[:, None])
    else:
        for it in range(pid, num_iters, step):
            src_row, dst_row, left = _tile_rows(
                it, rows, idx_ptr, src_layer_stride, src_item_stride, dst_layer_stride, dst_item_stride,
                item_words, num_chunks, num_pairs, layer_begin, num_tasks, ROWS, CHUNK, ALIGN, EVEN, WIDE,
            )  # fmt: skip
            mask = cols[None, :] < left[:, None]
            data = tl.load(src_ptr + (src_row[:, None] + cols[None, :]), mask=mask, other=0)
            tl.store(dst_ptr + (dst_row[:, None] + cols[None, :]), data, mask=mask)


def _check_buffers(src: torch.Tensor, dst: torch.Tensor) -> str:
    """Device rules of a launch (``kernels.copy_checks.check_device_buffers``); returns the
    direction. Two host buffers are accepted under the interpreter only."""
    return check_device_buffers(src, dst, allow_host_only=interpreting())


def _stage_indices(
    src_indices: torch.Tensor, dst_indices: torch.Tensor, device: torch.device, stream: torch.cuda.Stream | None
) -> torch.Tensor:
    """``[2, num_pairs]`` int64 indices on ``device``, enqueued on ``stream`` without a host sync."""
    if device.type != "cuda":
        return torch.stack((src_indices, dst_indices)).contiguous()
    staging = torch.empty((2, src_indices.numel()), dtype=torch.int64, pin_memory=True)
    staging[0].copy_(src_indices)
    staging[1].copy_(dst_indices)
    with torch.cuda.stream(stream):
        return staging.to(device, non_blocking=True)


def plan_launch(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int = 0,
    layer_end: int | None = None,
    *,
    max_ctas: int | None = None,
    tuning: CopyTuning | None = None,
) -> tuple[CopyPlan, str] | None:
    """Validate a copy and plan its launch; ``None`` when there is nothing to copy.

    Raises :class:`TransferError` for a bad dtype, layout, stride, contiguity, index
    dtype/shape/range, pageable host memory, a bad CTA cap or an in-pool overlap.
    """
    layer_end = src.num_layers if layer_end is None else layer_end
    validate_copy(src, dst, src_indices, dst_indices, layer_begin, layer_end)
    if src.buffer is None or dst.buffer is None:
        raise TransferError("launch_copy needs materialized pools (accounting mode goes through copy_items)")
    direction = _check_buffers(src.buffer, dst.buffer)
    cap = resolve_max_ctas(max_ctas)
    if src_indices.numel() == 0 or layer_end == layer_begin:
        return None
    check_overlap(src, dst, src_indices, dst_indices)
    plan = plan_copy(
        item_bytes=src.item_bytes,
        src_layer_stride_bytes=src.layer_stride_bytes,
        src_item_stride_bytes=src.item_stride_bytes,
        dst_layer_stride_bytes=dst.layer_stride_bytes,
        dst_item_stride_bytes=dst.item_stride_bytes,
        src_address=src.buffer.data_ptr(),
        dst_address=dst.buffer.data_ptr(),
        num_pairs=src_indices.numel(),
        layer_begin=layer_begin,
        layer_end=layer_end,
        max_ctas=cap,
        tuning=tuning or DEFAULT_TUNING.get(direction, DEFAULT_TUNING["d2d"]),
    )
    return plan, direction


def launch_copy(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int = 0,
    layer_end: int | None = None,
    *,
    max_ctas: int | None = None,
    stream: torch.cuda.Stream | None = None,
    tuning: CopyTuning | None = None,
) -> CopyLaunch | None:
    """Copy ``src[l, src_indices[i]] → dst[l, dst_indices[i]]`` for ``l`` in ``[layer_begin, layer_end)``.

    One launch on ``stream`` (default: the current stream of the CUDA buffer's device), at most
    ``max_ctas`` CTAs (default ``DEFAULT_MAX_CTAS``); ``tuning`` overrides the direction's
    ``DEFAULT_TUNING``. Returns ``None`` when there is nothing to copy. Everything is checked
    before launching (:func:`plan_launch`); destination indices must be distinct (the last
    writer would win in an unspecified order). Asynchronous: the caller orders later work on the
    stream (e.g. records an event after it).
    """
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TransferError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    planned = plan_launch(
        src, dst, src_indices, dst_indices, layer_begin, layer_end, max_ctas=max_ctas, tuning=tuning
    )
    if planned is None:
        return None
    plan, direction = planned
    assert src.buffer is not None and dst.buffer is not None
    device = dst.buffer.device if dst.buffer.device.type == "cuda" else src.buffer.device
    src_words = src.buffer.reshape(-1).view(plan.word_dtype)
    dst_words = dst.buffer.reshape(-1).view(plan.word_dtype)
    if device.type == "cuda":
        with torch.cuda.device(device):
            indices = _stage_indices(src_indices, dst_indices, device, stream)
            with torch.cuda.stream(stream):
                kernel = _launch(plan, src_words, dst_words, indices)
    else:
        indices = _stage_indices(src_indices, dst_indices, device, stream)
        kernel = _launch(plan, src_words, dst_words, indices)
    return CopyLaunch(plan=plan, direction=direction, indices=indices, kernel=kernel)


def _launch(plan: CopyPlan, src_words: torch.Tensor, dst_words: torch.Tensor, indices: torch.Tensor) -> Any:
    return _copy_items_kernel[(plan.grid,)](
        src_words,
        dst_words,
        indices,
        plan.src_layer_stride,
        plan.src_item_stride,
        plan.dst_layer_stride,
        plan.dst_item_stride,
        plan.item_words,
        plan.num_chunks,
        plan.num_pairs,
        plan.layer_begin,
        plan.num_tasks,
        plan.num_iters,
        ROWS=plan.rows,
        CHUNK=plan.chunk_words,
        ALIGN=plan.align_words,
        EVEN=plan.even,
        WIDE=plan.wide,
        PIPELINE=plan.tuning.pipeline,
        num_warps=plan.tuning.num_warps,
        num_stages=1,
    )
