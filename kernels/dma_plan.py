"""The plan of a copy-engine copy: which byte ranges move, merged into as few runtime calls as
they allow. Host arithmetic on the CPU index tensors only (no GPU, no runtime calls).

Primitives:

- ``plan_segments(...) -> CopySegments`` — the byte ranges of a copy with adjacent items merged
  (host-side arithmetic on the CPU index tensors).
- ``plan_strided_runs(segments) -> StridedRuns`` — those segments grouped into runs at constant
  source and destination strides (one ``cudaMemcpy2DAsync`` each).
- ``progression_rows(...)`` — the same plan, without the vector planner, for index lists made
  of a few pieces consecutive on both sides (a load): one memcpy or 2D copy per piece.
- ``MAX_2D_PITCH``, ``STRIDED_MIN_GAIN`` — the largest pitch of a 2D copy; the gain in calls at
  which ``auto`` takes strided runs.

Merging. The copy's ``(layer, pair)`` items are listed in the order that makes neighbours
adjacent in memory — pair-major when both pools keep an item's layers back to back
(``page_first``: ``layer_stride == item_bytes``), layer-major otherwise — and a run of items
whose source *and* destination addresses each follow on is one segment::

    src indices  7  8  9  3        layer_first → layer_first, one layer
    dst indices  0  1  2  9        segments: [7..9] → [0..2] (3 items), [3] → [9]

Rows. The engines issue a strided run as a row ``(src_offset, dst_offset, width, height,
src_pitch, dst_pitch)`` of Python ints (``CudaRuntime.memcpy_rows``); offsets are relative to the
start of each pool's buffer, so a plan of one layer range serves any other by moving the bases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.copy_checks import PoolBufferLike

__all__ = [
    "MAX_2D_PITCH",
    "STRIDED_MIN_GAIN",
    "CopySegments",
    "StridedRuns",
    "plan_segments",
    "plan_strided_runs",
    "progression_rows",
]


#: Largest row pitch the ``2d`` engine passes to ``cudaMemcpy2DAsync`` (the device limit).
MAX_2D_PITCH = 2**31 - 1
#: ``auto`` takes the ``strided`` engine when it needs at most 1/this of the segments' copies.
STRIDED_MIN_GAIN = 4


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
