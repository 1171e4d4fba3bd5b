"""Item copies on the GPU's copy engines (DMA): CUDA runtime memcpys, no SMs.

Primitives:

- ``plan_segments(...) -> CopySegments`` — the byte ranges of a copy with adjacent items merged
  (host-side arithmetic on the CPU index tensors).
- ``launch_dma(src, dst, src_indices, dst_indices, layer_begin, layer_end, *, stream=, engine=)
  -> DmaLaunch | None`` — validate, plan, enqueue.
- ``dma_layer_copier(src, dst, src_indices, dst_indices, *, stream=, engine=) -> issue(layer,
  count=1)`` — validate and plan once, then enqueue a layer (or a few) per call (a
  layer-by-layer load).
- ``plan_strided_runs(segments) -> StridedRuns`` — those segments grouped into runs at constant
  source and destination strides (one ``cudaMemcpy2DAsync`` each).
- ``progression_rows(...)`` — the same plan, without the vector planner, for index lists made
  of a few pieces consecutive on both sides (a load): one memcpy or 2D copy per piece.
- ``batch_check(device_index) -> str`` — ``"ok"`` when ``cudaMemcpyBatchAsync`` is present and
  passed its self-check on that GPU, else the reason (checked once per device).
- ``DMA_ENGINES`` — ``"auto"``, ``"batch"``, ``"strided"``, ``"2d"``, ``"loop"``.

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

Merging. The copy's ``(layer, pair)`` items are listed in the order that makes neighbours
adjacent in memory — pair-major when both pools keep an item's layers back to back
(``page_first``: ``layer_stride == item_bytes``), layer-major otherwise — and a run of items
whose source *and* destination addresses each follow on is one segment::

    src indices  7  8  9  3        layer_first → layer_first, one layer
    dst indices  0  1  2  9        segments: [7..9] → [0..2] (3 items), [3] → [9]

Host memory must be pinned (as for the Triton path), so every memcpy is asynchronous; the
index tensors are read during the call only and may change right after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asynccache.errors import TransferError
from kernels.api import (
    DMA_ENGINES,
    PoolBufferLike,
    check_device_buffers,
    check_overlap,
    current_device,
    validate_copy,
    validate_indices,
    validate_pools,
)
from kernels.cudart import CudaRuntime, cuda_runtime
from kernels.plan import DMA_BATCH_MAX_COPIES

__all__ = [
    "CopySegments",
    "DmaLaunch",
    "DMA_ENGINES",
    "MAX_2D_PITCH",
    "STRIDED_MIN_GAIN",
    "StridedRuns",
    "batch_check",
    "check_pair",
    "dma_layer_copier",
    "launch_dma",
    "plan_segments",
    "plan_strided_runs",
    "progression_rows",
]

#: Largest row pitch the ``2d`` engine passes to ``cudaMemcpy2DAsync`` (the device limit).
MAX_2D_PITCH = 2**31 - 1
#: ``auto`` takes the ``strided`` engine when it needs at most 1/this of the segments' copies.
STRIDED_MIN_GAIN = 4
_LEGACY_STREAMS = (0, 1)  # cudaStreamLegacy: the null stream and its explicit handle


#: One strided run as Python ints: ``(src_offset, dst_offset, width, height, src_pitch, dst_pitch)``.
_Row = tuple[int, int, int, int, int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class CopySegments:
    """Contiguous byte ranges of one copy: ``dst[dst_offsets[k] : +sizes[k]] = src[src_offsets[k] : +sizes[k]]``.

    int64 CPU tensors, offsets in bytes from the start of each pool's buffer."""

    src_offsets: torch.Tensor
    dst_offsets: torch.Tensor
    sizes: torch.Tensor

    @property
    def num_copies(self) -> int:
        return self.sizes.numel()

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.numpy().sum())


@dataclass(frozen=True, slots=True, kw_only=True)
class StridedRuns:
    """Segments grouped into 2D copies: run ``k`` moves ``heights[k]`` rows of ``widths[k]`` bytes,
    row ``r`` from ``src_offsets[k] + r · src_pitches[k]`` to ``dst_offsets[k] + r · dst_pitches[k]``.

    int64 CPU tensors, offsets in bytes from the start of each pool's buffer."""

    src_offsets: torch.Tensor
    dst_offsets: torch.Tensor
    widths: torch.Tensor
    heights: torch.Tensor
    src_pitches: torch.Tensor
    dst_pitches: torch.Tensor

    @property
    def num_runs(self) -> int:
        return self.widths.numel()


@dataclass(frozen=True, slots=True, kw_only=True)
class DmaLaunch:
    """What was enqueued: direction, engine, memcpy segments, runtime calls, bytes."""

    direction: str
    engine: str
    num_copies: int
    num_calls: int
    num_bytes: int


def plan_segments(
    *,
    item_bytes: int,
    src_layer_stride_bytes: int,
    src_item_stride_bytes: int,
    dst_layer_stride_bytes: int,
    dst_item_stride_bytes: int,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
) -> CopySegments:
    """Segments of ``src[l, src_indices[i]] → dst[l, dst_indices[i]]``, adjacent items merged.

    Pure host arithmetic (vectorized; int64 throughout). Every copied byte is in exactly one
    segment; a segment never spans a gap on either side.
    """
    if src_indices.numel() * (layer_end - layer_begin) <= _SMALL_PLAN:
        return _plan_small(
            item_bytes, src_layer_stride_bytes, src_item_stride_bytes, dst_layer_stride_bytes, dst_item_stride_bytes,
            src_indices.tolist(), dst_indices.tolist(), range(layer_begin, layer_end),
        )  # fmt: skip
    # numpy on the index tensors' memory: a few short vector ops, each about a microsecond here
    # against several through torch's dispatcher.
    layers = np.arange(layer_begin, layer_end, dtype=np.int64)
    si = src_indices.to(torch.int64).numpy()
    di = dst_indices.to(torch.int64).numpy()
    if src_layer_stride_bytes == dst_layer_stride_bytes == item_bytes:  # an item's layers are adjacent
        src = si[:, None] * src_item_stride_bytes + layers[None, :] * src_layer_stride_bytes
        dst = di[:, None] * dst_item_stride_bytes + layers[None, :] * dst_layer_stride_bytes
    else:
        src = layers[:, None] * src_layer_stride_bytes + si[None, :] * src_item_stride_bytes
        dst = layers[:, None] * dst_layer_stride_bytes + di[None, :] * dst_item_stride_bytes
    src, dst = src.reshape(-1), dst.reshape(-1)
    n = src.size
    starts = np.ones(n, dtype=bool)
    starts[1:] = (src[1:] != src[:-1] + item_bytes) | (dst[1:] != dst[:-1] + item_bytes)
    first = np.flatnonzero(starts)
    sizes = np.diff(first, append=n) * item_bytes
    return CopySegments(
        src_offsets=torch.from_numpy(np.ascontiguousarray(src[first], dtype=np.int64)),
        dst_offsets=torch.from_numpy(np.ascontiguousarray(dst[first], dtype=np.int64)),
        sizes=torch.from_numpy(np.ascontiguousarray(sizes, dtype=np.int64)),
    )


#: Copies of at most this many (layer, pair) items are planned in plain Python (a state slot's
#: layer is one item): cheaper than the vector ops' fixed costs.
_SMALL_PLAN = 8


def _plan_small(
    item_bytes: int,
    src_layer_stride: int,
    src_item_stride: int,
    dst_layer_stride: int,
    dst_item_stride: int,
    src_indices: list[int],
    dst_indices: list[int],
    layers: range,
) -> CopySegments:
    """:func:`plan_segments` for a handful of items, item by item in the same order."""
    if src_layer_stride == dst_layer_stride == item_bytes:
        order = [(s, d, la) for s, d in zip(src_indices, dst_indices, strict=True) for la in layers]
    else:
        order = [(s, d, la) for la in layers for s, d in zip(src_indices, dst_indices, strict=True)]
    segs: list[list[int]] = []
    for s, d, la in order:
        so, do = la * src_layer_stride + s * src_item_stride, la * dst_layer_stride + d * dst_item_stride
        if segs and segs[-1][0] + segs[-1][2] == so and segs[-1][1] + segs[-1][2] == do:
            segs[-1][2] += item_bytes
        else:
            segs.append([so, do, item_bytes])
    cols = list(zip(*segs, strict=True)) if segs else [(), (), ()]
    src, dst, size = (torch.tensor(c, dtype=torch.int64) for c in cols)
    return CopySegments(src_offsets=src, dst_offsets=dst, sizes=size)


def plan_strided_runs(segments: CopySegments, *, max_pitch: int = MAX_2D_PITCH) -> StridedRuns:
    """Group ``segments`` (in order) into strided runs, greedily: a run starts at a segment and
    takes the next while it has the same size and lies the run's two strides further on; both
    strides (set by the run's first two segments) are at least the width — rows never overlap —
    and at most ``max_pitch``. A pair whose second segment could start a run of its own is not
    a run (the second starts one); a segment that starts no run is a run of height 1.
    Every byte of ``segments`` is in exactly one row of one run."""
    return _runs_from_rows(_strided_rows(segments, max_pitch))


def _links(segments: CopySegments, max_pitch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ds, dd, link)``: the source and destination distance from each segment to the next,
    and whether the two can be neighbouring rows of one run (same width, both strides fit)."""
    src, dst, size = (t.numpy() for t in (segments.src_offsets, segments.dst_offsets, segments.sizes))
    ds, dd = np.diff(src), np.diff(dst)
    width = size[:-1]
    link = (size[1:] == width) & (ds >= width) & (ds <= max_pitch) & (dd >= width) & (dd <= max_pitch)
    return ds, dd, link


def _strided_rows(segments: CopySegments, max_pitch: int = MAX_2D_PITCH) -> list[_Row]:
    """:func:`plan_strided_runs` as rows: vectorized link tests, then one step per run."""
    src, dst, size = (t.numpy() for t in (segments.src_offsets, segments.dst_offsets, segments.sizes))
    n = size.size
    if n == 0:
        return []
    ds, dd, link = _links(segments, max_pitch)
    # cont[j]: link j continues the run of link j-1 (same strides, same width); cont[0] is False.
    cont = np.zeros(n - 1, dtype=bool)
    cont[1:] = (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1]) & (size[2:] == size[1:-1])
    breaks = np.flatnonzero(~cont)  # links that start afresh (sorted; contains 0 when n > 1)
    rows: list[_Row] = []
    k = 0
    while k < n:
        w = int(size[k])
        h, sp, dp = 1, w, w
        if k + 1 < n and link[k]:
            # the run takes links k, k+1, … up to the next link that does not continue it
            nxt = np.searchsorted(breaks, k + 1)
            end = int(breaks[nxt]) if nxt < breaks.size else n - 1  # first link not taken
            h = end - k + 1
            if h == 2 and k + 2 < n and link[k + 1]:
                h = 1  # the second segment starts a run of its own: leave it to that run
            else:
                sp, dp = int(ds[k]), int(dd[k])
        rows.append((int(src[k]), int(dst[k]), w, h, sp, dp))
        k += h
    return rows


def _pieces(
    src_indices: torch.Tensor, dst_indices: torch.Tensor, limit: int
) -> tuple[list[int], list[int], list[int]] | None:
    """``(src starts, dst starts, lengths)`` of the maximal pieces where both index lists
    advance by one (``7 8 9 | 3`` → ``[7, 3]``), or ``None`` past ``limit`` pieces: a handful
    of vector ops, then a Python step per piece."""
    si, di = src_indices.numpy(), dst_indices.numpy()
    n = si.size
    if n == 1:
        return [int(si[0])], [int(di[0])], [1]
    cut = np.flatnonzero((np.diff(si) != 1) | (np.diff(di) != 1))
    if cut.size + 1 > limit:
        return None
    starts = [0, *(int(c) + 1 for c in cut)]
    lengths = [b - a for a, b in zip(starts, [*starts[1:], n], strict=True)]
    return [int(si[i]) for i in starts], [int(di[i]) for i in starts], lengths


def progression_rows(
    src: PoolBufferLike,
    dst: PoolBufferLike,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
    *,
    max_pitch: int = MAX_2D_PITCH,
) -> tuple[str, tuple[_Row, ...], int] | None:
    """``(engine, rows, segments)`` of a copy whose index lists are made of a few pieces that
    are consecutive on both sides — what the allocators give a load, more pieces the more the
    device pool is fragmented — planned without the vector planner: a piece of one layer is one
    strided run (or, adjacent on both sides, one segment), and a layer range stacks those.
    ``None`` when the pieces are too many to pay (more than one row per ``STRIDED_MIN_GAIN``
    items, and more than ``STRIDED_MIN_GAIN`` rows) or the geometry is one the planner handles
    (both pools page_first over several layers). The rows move exactly the bytes of
    :func:`plan_segments`'s segments (``tests/kernels/test_dma_plan.py`` checks it).
    """
    n, k, w = src_indices.numel(), layer_end - layer_begin, src.item_bytes
    s_item, d_item = src.item_stride_bytes, dst.item_stride_bytes
    s_layer, d_layer = src.layer_stride_bytes, dst.layer_stride_bytes
    if n == 0 or k <= 0 or (s_layer == d_layer == w and k > 1):
        return None
    limit = max(STRIDED_MIN_GAIN, n * k // STRIDED_MIN_GAIN)  # a few rows always beat a batch's fixed cost
    pieces = _pieces(src_indices, dst_indices, limit)
    if pieces is None:
        return None
    src_starts, dst_starts, lengths = pieces
    merged = s_item == d_item == w  # a piece's items are one segment per layer
    if not merged and not w <= min(s_item, d_item) <= max(s_item, d_item) <= max_pitch:
        return None
    rows: list[_Row] = []
    segments = 0
    base_s, base_d = layer_begin * s_layer, layer_begin * d_layer
    for s0, d0, m in zip(src_starts, dst_starts, lengths, strict=True):
        so, do = base_s + s0 * s_item, base_d + d0 * d_item
        if merged or m == 1:
            # One segment per layer, the layers at the two layer strides: one memcpy, or one
            # 2D copy of k rows.
            width = m * w
            if k == 1:
                rows.append((so, do, width, 1, width, width))
            elif width <= min(s_layer, d_layer) and max(s_layer, d_layer) <= max_pitch:
                rows.append((so, do, width, k, s_layer, d_layer))
            else:
                return None
            segments += k
        else:
            # Per layer, m segments of one item at the two item strides: one 2D copy a layer.
            rows.extend((so + la * s_layer, do + la * d_layer, w, m, s_item, d_item) for la in range(k))
            segments += m * k
        if len(rows) > limit:
            return None
    engine = "loop" if len(rows) == 1 and rows[0][3] == 1 else "strided"
    return engine, tuple(rows), segments


def _runs_from_rows(rows: list[_Row]) -> StridedRuns:
    cols = list(zip(*rows, strict=True)) if rows else [()] * 6
    t = [torch.tensor(c, dtype=torch.int64) for c in cols]
    return StridedRuns(src_offsets=t[0], dst_offsets=t[1], widths=t[2], heights=t[3], src_pitches=t[4], dst_pitches=t[5])


def _runs_may_pay(segments: CopySegments, max_pitch: int = MAX_2D_PITCH) -> bool:
    """Whether strided runs could cut the calls ``STRIDED_MIN_GAIN``-fold: a vectorized bound
    that spares scattered copies the per-run walk. Each run of ``h`` rows uses ``h - 1`` links
    between neighbours, so there are at least ``segments - links`` runs."""
    n = segments.num_copies
    if n < STRIDED_MIN_GAIN:
        return False
    links = int(np.count_nonzero(_links(segments, max_pitch)[2]))
    return (n - links) * STRIDED_MIN_GAIN <= n


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

    Checks everything before enqueueing (``kernels.api``: geometry, indices, pinned host memory,
    one GPU, in-pool overlap; the stream's type and device; the engine) and raises
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
    ``shared`` what ``kernels.api.shares_buffer`` returned for them, if given). A range
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
        if not (0 <= layer and count >= 1 and layer + count <= num_layers):
            raise TransferError(f"layers [{layer}, {layer + count}) outside 0..{num_layers - 1}")
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
    (``kernels.api``: geometry, buffers, pinned host memory, one GPU; the stream; the engine);
    returns the direction and the GPU."""
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
    """Plan a validated copy (:func:`_validate`): segments, engine, rows."""
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
