"""The copy engines: the engine of a planned copy, and the CUDA runtime calls that enqueue it.

Primitives:

- ``DmaLaunch`` — what was enqueued: direction, engine, memcpy segments, runtime calls, bytes.
- ``batch_check(device_index) -> str`` — ``"ok"`` when ``cudaMemcpyBatchAsync`` is present and
  passed its self-check on that GPU, else the reason (checked once per device).
- ``_plan(...) -> _Prepared | None`` and ``_issue(prepared, ...) -> DmaLaunch`` — plan a
  validated copy (``kernels.dma_plan``) and choose its engine; enqueue it, optionally a few
  layers further on. Internal to ``kernels.dma_copy``, which validates first.

Engines (how the memcpys are issued; all on the caller's stream, in stream order):

- ``batch``: ``cudaMemcpyBatchAsync``, every segment of the copy in one call (chunks of
  ``kernels.plan.DMA_BATCH_MAX_COPIES``). The legacy default stream, which that call rejects,
  is bridged through a side stream joined with events both ways.
- ``strided``: one ``cudaMemcpy2DAsync`` per strided run of segments (rows = the run's
  segments, pitches = its two strides; a run of one is a plain memcpy). A layer's pages between
  a ``page_first`` host pool and a ``layer_first`` device pool, both with consecutive indices,
  are one call (rows = pages, source pitch = the host page stride): the copy engines move it at
  the contiguous copy's speed, and enqueueing costs microseconds where a batch of per-page
  copies costs about 0.75 µs per page.
- ``2d``: one ``cudaMemcpy2DAsync`` per item pair covering all layers of the range (rows =
  layers, pitches = the two layer strides): ``num_pairs`` calls. For mixed layouts, where an
  item's layers are contiguous on one side only.
- ``loop``: one ``cudaMemcpyAsync`` per segment (about a microsecond of host time each).
- ``auto``: ``loop`` for a single segment (one plain memcpy), ``strided`` when its runs are at
  most a quarter of the segments
  (``STRIDED_MIN_GAIN``), else ``batch`` where it passed its self-check, else ``2d`` when that
  needs fewer calls than ``loop`` (and both pitches fit in 31 bits), else ``loop``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from asynccache.errors import TransferError
from kernels.copy_checks import PoolBufferLike
from kernels.cudart import CudaRuntime, cuda_runtime
from kernels.dma_plan import (
    MAX_2D_PITCH,
    STRIDED_MIN_GAIN,
    CopySegments,
    _Row,
    _runs_may_pay,
    _strided_rows,
    plan_segments,
    progression_rows,
)
from kernels.plan import DMA_BATCH_MAX_COPIES

__all__ = ["DmaLaunch", "batch_check"]


_LEGACY_STREAMS = (0, 1)  # cudaStreamLegacy: the null stream and its explicit handle


@dataclass(frozen=True, slots=True, kw_only=True)
class DmaLaunch:
    """What was enqueued: direction, engine, memcpy segments, runtime calls, bytes."""

    direction: str
    engine: str
    num_copies: int
    num_calls: int
    num_bytes: int


@functools.cache
def batch_check(device_index: int) -> str:
    """``"ok"`` if ``cudaMemcpyBatchAsync`` copies correctly on this GPU, else why not.

    Runs once per device (then cached): three copies of odd sizes host → device into reversed
    slots and back, on a private stream, synchronised and compared byte for byte. A runtime
    error is reported, not raised, so the DMA path falls back to another engine.
    """
    try:
        rt = cuda_runtime()
    except TransferError as e:
        return str(e)
    if not rt.has_batch:
        return f"cudaMemcpyBatchAsync not available (runtime {rt.runtime_version}, {rt.path})"
    sizes = torch.tensor([1, 4097, 65552], dtype=torch.int64)
    offsets = torch.cat((torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]))
    total = int(sizes.sum())
    gen = torch.Generator().manual_seed(11)
    host = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen).pin_memory()
    back = torch.zeros(total, dtype=torch.uint8).pin_memory()
    device = torch.device("cuda", device_index)
    with torch.cuda.device(device):
        dev = torch.zeros(total + 4096, dtype=torch.uint8, device=device)
        dev_offsets = torch.tensor([4096 + 65552 + 4097, 4096 + 65552, 4096], dtype=torch.int64)  # reversed order
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            _issue_batch(rt, host.data_ptr() + offsets, dev.data_ptr() + dev_offsets, sizes, stream.cuda_stream)
            _issue_batch(rt, dev.data_ptr() + dev_offsets, back.data_ptr() + offsets, sizes, stream.cuda_stream)
        except TransferError as e:
            return str(e)
        finally:
            stream.synchronize()  # the buffers must outlive whatever was enqueued
    if not torch.equal(back, host):
        return "cudaMemcpyBatchAsync self-check: the copied bytes differ"
    return "ok"


def _issue_batch(rt: CudaRuntime, src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, stream: int) -> int:
    """``cudaMemcpyBatchAsync`` over int64 pointer/size tensors, in chunks; returns the calls made."""
    calls = 0
    for begin in range(0, sizes.numel(), DMA_BATCH_MAX_COPIES):
        end = min(begin + DMA_BATCH_MAX_COPIES, sizes.numel())
        s, d, z = src_ptrs[begin:end].contiguous(), dst_ptrs[begin:end].contiguous(), sizes[begin:end].contiguous()
        rt.memcpy_batch_async(d.data_ptr(), s.data_ptr(), z.data_ptr(), end - begin, stream)
        calls += 1
    return calls


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """A stream for batch copies asked of the legacy default stream (one per device)."""
    return torch.cuda.Stream(device=torch.device("cuda", device_index))


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A validated copy, ready to issue: its segments (and, for the ``strided`` and ``loop``
    engines, the rows to issue as Python ints), engine, direction, device and byte count. Offsets are relative to the pools'
    buffers, so the plan of one layer issues any other layer by moving the two base addresses
    (no per-layer host arithmetic on tensors)."""

    segments: CopySegments | None  # None when planned from index progressions (rows only)
    engine: str
    direction: str
    device: torch.device
    num_bytes: int
    num_copies: int
    run_rows: tuple[_Row, ...] = ()


def _plan(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
    engine: str,
    direction: str,
    device: torch.device,
) -> _Prepared | None:
    """Plan a validated copy (``kernels.dma_copy._validate``): segments, engine, rows."""
    if src_indices.numel() == 0 or layer_end == layer_begin:
        return None
    assert src.buffer is not None and dst.buffer is not None
    if engine in ("auto", "strided") and (fast := progression_rows(src, dst, src_indices, dst_indices, layer_begin, layer_end)):
        chosen, rows, num_copies = fast
        return _Prepared(
            segments=None,
            engine=chosen if engine == "auto" else engine,
            direction=direction,
            device=device,
            num_bytes=src_indices.numel() * (layer_end - layer_begin) * src.item_bytes,
            num_copies=num_copies,
            run_rows=rows,
        )
    segments = plan_segments(
        item_bytes=src.item_bytes,
        src_layer_stride_bytes=src.layer_stride_bytes,
        src_item_stride_bytes=src.item_stride_bytes,
        dst_layer_stride_bytes=dst.layer_stride_bytes,
        dst_item_stride_bytes=dst.item_stride_bytes,
        src_indices=src_indices,
        dst_indices=dst_indices,
        layer_begin=layer_begin,
        layer_end=layer_end,
    )
    num_layers = layer_end - layer_begin
    fits_2d = max(src.layer_stride_bytes, dst.layer_stride_bytes, src.item_bytes) <= MAX_2D_PITCH
    assert device.index is not None
    chosen = engine
    runs = None
    if engine == "strided" or (engine == "auto" and _runs_may_pay(segments)):
        runs = _strided_rows(segments)
    if engine == "auto":
        if segments.num_copies == 1:
            chosen = "loop"  # one plain memcpy: nothing to batch or group
        elif runs is not None and len(runs) * STRIDED_MIN_GAIN <= segments.num_copies:
            chosen = "strided"
        elif batch_check(device.index) == "ok":
            chosen = "batch"
        elif num_layers > 1 and fits_2d and src_indices.numel() < segments.num_copies:
            chosen = "2d"
        else:
            chosen = "loop"
    elif engine == "2d" and not fits_2d:
        raise TransferError(f"layer strides past {MAX_2D_PITCH} bytes do not fit cudaMemcpy2DAsync's pitch")
    elif engine == "batch" and (why := batch_check(device.index)) != "ok":
        raise TransferError(f"the batch engine is unusable on {device}: {why}")
    return _Prepared(
        segments=segments,
        engine=chosen,
        direction=direction,
        device=device,
        num_bytes=segments.num_bytes,
        num_copies=segments.num_copies,
        run_rows=_rows(chosen, runs, segments),
    )


def _rows(engine: str, runs: list[_Row] | None, segments: CopySegments) -> tuple[_Row, ...]:
    """The rows ``CudaRuntime.memcpy_rows`` issues for the ``strided`` engine (its runs) and the
    ``loop`` engine (one row per segment); empty for the others."""
    if engine == "strided":
        assert runs is not None
        return tuple(runs)
    if engine == "loop":
        cols = (segments.src_offsets.tolist(), segments.dst_offsets.tolist(), segments.sizes.tolist())
        return tuple((so, do, n, 1, n, n) for so, do, n in zip(*cols, strict=True))
    return ()


def _issue(
    prepared: _Prepared,
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    num_layers: int,
    stream: torch.cuda.Stream | None,
    *,
    shift: tuple[int, int] = (0, 0),
) -> DmaLaunch:
    """Enqueue ``prepared``; ``shift``: bytes added to the source and destination base addresses
    (a one-layer plan issued for another layer; the ``2d`` engine takes ``layer_begin`` instead)."""
    assert src.buffer is not None and dst.buffer is not None
    chosen, device = prepared.engine, prepared.device
    assert device.index is not None
    rt = cuda_runtime()
    with torch.cuda.device(device.index):
        caller = torch.cuda.current_stream(device) if stream is None else stream
        issue_on = caller
        if chosen == "batch" and caller.cuda_stream in _LEGACY_STREAMS:
            issue_on = _side_stream(device.index)
            issue_on.wait_stream(caller)
        handle = issue_on.cuda_stream
        src_base, dst_base = src.buffer.data_ptr() + shift[0], dst.buffer.data_ptr() + shift[1]
        try:
            if chosen == "batch":
                segments = prepared.segments
                assert segments is not None
                calls = _issue_batch(
                    rt, segments.src_offsets + src_base, segments.dst_offsets + dst_base, segments.sizes, handle
                )
            elif chosen == "2d":
                calls = _issue_2d(rt, src, dst, src_indices, dst_indices, layer_begin, num_layers, handle)
            else:
                rt.memcpy_rows(prepared.run_rows, src_base, dst_base, handle)
                calls = len(prepared.run_rows)
        finally:
            # Copies queued on the side stream before a failing call still run: the caller's
            # stream waits for them too, so nothing frees or reuses their buffers early.
            if issue_on is not caller:
                caller.wait_stream(issue_on)
    return DmaLaunch(
        direction=prepared.direction,
        engine=chosen,
        num_copies=prepared.num_copies,
        num_calls=calls,
        num_bytes=prepared.num_bytes,
    )


def _issue_2d(
    rt: CudaRuntime,
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    num_layers: int,
    stream: int,
) -> int:
    """One ``cudaMemcpy2DAsync`` per item pair: rows are the layers of the range."""
    assert src.buffer is not None and dst.buffer is not None
    width = src.item_bytes
    # A single row still needs pitch >= width; the pitch of one row is never used.
    src_pitch = src.layer_stride_bytes if num_layers > 1 else width
    dst_pitch = dst.layer_stride_bytes if num_layers > 1 else width
    src_base = src.buffer.data_ptr() + layer_begin * src.layer_stride_bytes
    dst_base = dst.buffer.data_ptr() + layer_begin * dst.layer_stride_bytes
    for s, d in zip(src_indices.tolist(), dst_indices.tolist(), strict=True):
        rt.memcpy_2d_async(
            dst_base + d * dst.item_stride_bytes, dst_pitch, src_base + s * src.item_stride_bytes, src_pitch,
            width, num_layers, stream,
        )  # fmt: skip
    return src_indices.numel()
