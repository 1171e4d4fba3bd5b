"""Launch planning for the item-copy kernel: word width, tile shape, grid (host-side, no Triton).

Primitives:

- ``CopyTuning(num_warps, tile_bytes, pipeline)`` — the per-direction knobs of the kernel.
- ``DEFAULT_TUNING`` — measured defaults for ``"h2d"``, ``"d2h"`` and ``"d2d"`` copies
  (docs/benchmarks.md, Transfer); ``DEFAULT_MAX_CTAS`` — the default CTA cap.
- ``word_bytes_for(...)`` — the widest access (16, 8, 4, 2 or 1 bytes) that divides the item size,
  every stride and both base addresses.
- ``plan_copy(...) -> CopyPlan`` — everything the launcher passes to the kernel.
- ``DMA_MIN_RUN_BYTES``, ``dma_run_bytes(...)`` — when ``copy_items``' automatic choice sends a
  copy to the copy engines (``kernels.dma_copy``) instead of the kernel; ``DMA_BATCH_MAX_COPIES``.

How the work is cut. A copy moves ``num_layers × num_pairs`` items of ``item_words`` words. Each
item is cut into ``num_chunks`` chunks of ``chunk_words`` (a power of two); one *task* is one
chunk of one item of one layer, numbered chunk-fastest::

    task = ((layer - layer_begin) · num_pairs + pair) · num_chunks + chunk

One loop iteration of a CTA copies a tile of ``rows`` consecutive tasks (``rows × chunk_words``
words: several small items, or several chunks of one large item, at once), so a CTA has a whole
tile of loads in flight before its first store whatever the item size. With ``pipeline`` the
next tile's loads are issued before the current tile's stores (two tiles in flight). A CTA
walks iterations ``pid, pid + grid, …`` (persistent loop), so ``grid ≤ max_ctas`` bounds the SMs
a copy occupies while a forward pass runs next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asynccache.errors import TransferError

__all__ = [
    "DEFAULT_MAX_CTAS",
    "DEFAULT_TUNING",
    "DMA_BATCH_MAX_COPIES",
    "DMA_MIN_RUN_BYTES",
    "INT32_TASK_LIMIT",
    "CopyPlan",
    "CopyTuning",
    "choose_chunk_words",
    "dma_run_bytes",
    "plan_copy",
    "word_bytes_for",
]

#: Default cap on the CTAs of one copy launch (the controller config may override it per call).
#: On the H200, 8 CTAs reach the ceiling of SM-issued PCIe traffic for 4 KiB…2 MiB items (H2D
#: 0.92, D2H 0.94–0.95 of the DMA engine); 4 CTAs lose 4 KiB pages (docs/benchmarks.md).
DEFAULT_MAX_CTAS = 8

#: ``copy_items(method="auto")`` copies with the DMA engines when one contiguous run of bytes
#: (an item, or an item's layers where both pools keep them adjacent) is at least this long, and
#: with the Triton kernel otherwise. The copy engines use no SMs (a concurrent GEMM keeps its
#: speed: +0.6 % / +1.2 % beside H2D / D2H KV-page copies, against +17 % / +158 % beside the
#: 8-CTA kernel) and reach the link from 64 KiB (0.99–1.01 on the H200); each copy costs them a
#: fixed setup, so 4–16 KiB items go faster through the kernel (0.03–0.45 vs 0.93–0.94), and
#: 32 KiB varied between machines (docs/benchmarks.md, Transfer).
DMA_MIN_RUN_BYTES = 65536

#: Copies per ``cudaMemcpyBatchAsync`` call (longer lists are issued in several calls).
DMA_BATCH_MAX_COPIES = 16384

#: Task numbers below this are decomposed with int32 division (addresses are int64 regardless).
INT32_TASK_LIMIT = 2**31

_WORD_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyTuning:
    """Kernel knobs for one copy direction.

    ``num_warps``: warps per CTA (more warps, more loads in flight per SM). ``tile_bytes``: bytes
    one CTA loads per loop iteration (a power of two ≥ 32). ``chunk_bytes``: the longest piece of
    one item a tile row covers (a power of two; fewer, longer rows need fewer registers for
    addresses; at most half a tile). ``pipeline``: issue the next tile's loads before storing the
    current tile.
    """

    num_warps: int = 16
    tile_bytes: int = 32768
    chunk_bytes: int = 4096
    pipeline: bool = True

    def __post_init__(self) -> None:
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise TransferError(f"num_warps must be a power of two in 1..32, got {self.num_warps}")
        for name in ("tile_bytes", "chunk_bytes"):
            value = getattr(self, name)
            if value < 32 or value & (value - 1):
                raise TransferError(f"{name} must be a power of two >= 32, got {value}")


#: Per-direction defaults: ``h2d`` reads pinned host memory over PCIe (latency-bound: many bytes
#: in flight per CTA), ``d2h`` writes it (posted writes), ``d2d`` stays in HBM. The h2d and d2h
#: entries are measured on the GPU (``python -m kernels.tune``; docs/benchmarks.md, Transfer).
DEFAULT_TUNING: dict[str, CopyTuning] = {
    # tuned: begin (python -m kernels.tune --write-defaults rewrites the lines up to "tuned: end")
    "h2d": CopyTuning(num_warps=16, tile_bytes=32768, chunk_bytes=16384, pipeline=True),
    "d2h": CopyTuning(num_warps=16, tile_bytes=32768, chunk_bytes=16384, pipeline=True),
    # tuned: end
    "d2d": CopyTuning(num_warps=8, tile_bytes=16384, chunk_bytes=8192, pipeline=True),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyPlan:
    """One launch, fully described (sizes and strides in words of ``word_bytes``)."""

    word_bytes: int  # widest aligned access (bytes); the kernel moves it as ``align_words`` elements
    word_dtype: torch.dtype  # element type of the kernel's pointers (int32 for 4-, 8- and 16-byte words)
    align_words: int  # every row start is a multiple of this many words (16-byte vectors when 4)
    item_words: int
    chunk_words: int
    num_chunks: int
    rows: int
    num_pairs: int
    layer_begin: int
    num_layers: int
    num_tasks: int
    num_iters: int
    grid: int
    src_layer_stride: int
    src_item_stride: int
    dst_layer_stride: int
    dst_item_stride: int
    tuning: CopyTuning

    @property
    def even(self) -> bool:
        """True when chunks tile every item exactly (no column mask needed)."""
        return self.num_chunks * self.chunk_words == self.item_words

    @property
    def wide(self) -> bool:
        """True when task numbers may pass int32 (the kernel then divides in int64, slower)."""
        return self.num_iters * self.rows >= INT32_TASK_LIMIT

    @property
    def num_bytes(self) -> int:
        return self.num_layers * self.num_pairs * self.item_words * self.word_dtype.itemsize


def word_bytes_for(*values: int) -> int:
    """Largest power of two ≤ 16 dividing every value (sizes, strides, addresses in bytes)."""
    word = 16
    for v in values:
        while word > 1 and v % word:
            word //= 2
    return word


def choose_chunk_words(item_words: int, *, align_words: int, max_chunk_words: int) -> int:
    """Largest power-of-two chunk ≤ ``max_chunk_words`` whose padding wastes ≤ 1/8 of the lanes.

    ``align_words`` (a power of two dividing ``item_words``) always qualifies (no padding), so a
    chunk is always found; chunks never go below it so every row start stays aligned.
    """
    if item_words <= 0 or align_words <= 0 or item_words % align_words:
        raise TransferError(f"bad chunking: {item_words} words aligned to {align_words}")
    limit = max(align_words, max_chunk_words)
    chunk = 1 << (limit.bit_length() - 1)
    while chunk > align_words:
        padded = math.ceil(item_words / chunk) * chunk
        if (padded - item_words) * 8 <= padded:
            return chunk
        chunk //= 2
    return align_words


def plan_copy(
    *,
    item_bytes: int,
    src_layer_stride_bytes: int,
    src_item_stride_bytes: int,
    dst_layer_stride_bytes: int,
    dst_item_stride_bytes: int,
    src_address: int,
    dst_address: int,
    num_pairs: int,
    layer_begin: int,
    layer_end: int,
    max_ctas: int,
    tuning: CopyTuning,
) -> CopyPlan:
    """Plan one launch; ``num_pairs`` and the layer range must be non-empty."""
    if num_pairs <= 0 or layer_end <= layer_begin:
        raise TransferError("plan_copy needs at least one item pair and one layer")
    if max_ctas < 1:
        raise TransferError(f"max_ctas must be >= 1, got {max_ctas}")
    word = word_bytes_for(
        item_bytes,
        src_layer_stride_bytes,
        src_item_stride_bytes,
        dst_layer_stride_bytes,
        dst_item_stride_bytes,
        src_address,
        dst_address,
    )
    elem = min(word, 4)  # 16- and 8-byte words are int32 vectors of 4 or 2 (Triton vectorizes them)
    align = word // elem
    tile_words = max(tuning.tile_bytes // elem, 2 * align)
    item_words = item_bytes // elem
    chunk = choose_chunk_words(
        item_words, align_words=align, max_chunk_words=min(tuning.chunk_bytes // elem, tile_words // 2)
    )
    num_chunks = math.ceil(item_words / chunk)
    rows = max(2, tile_words // chunk)
    num_layers = layer_end - layer_begin
    num_tasks = num_layers * num_pairs * num_chunks
    num_iters = math.ceil(num_tasks / rows)
    return CopyPlan(
        word_bytes=word,
        word_dtype=_WORD_DTYPES[elem],
        align_words=align,
        item_words=item_words,
        chunk_words=chunk,
        num_chunks=num_chunks,
        rows=rows,
        num_pairs=num_pairs,
        layer_begin=layer_begin,
        num_layers=num_layers,
        num_tasks=num_tasks,
        num_iters=num_iters,
        grid=min(max_ctas, num_iters),
        src_layer_stride=src_layer_stride_bytes // elem,
        src_item_stride=src_item_stride_bytes // elem,
        dst_layer_stride=dst_layer_stride_bytes // elem,
        dst_item_stride=dst_item_stride_bytes // elem,
        tuning=tuning,
    )


def dma_run_bytes(*, item_bytes: int, src_layer_stride_bytes: int, dst_layer_stride_bytes: int, num_layers: int) -> int:
    """Bytes of one contiguous run of a copy on both sides, whatever the indices: an item, or the
    ``num_layers`` consecutive layers of an item when both pools store them back to back
    (``page_first`` on both sides)."""
    if num_layers > 1 and src_layer_stride_bytes == dst_layer_stride_bytes == item_bytes:
        return item_bytes * num_layers
    return item_bytes
