"""Copy conformance helpers shared by the CPU, interpreter and GPU copy tests.

Primitives:

- ``CopyCase`` — an item size and the dtype its bytes are filled as (awkward sizes included).
- ``COPY_CASES`` — the catalogue every copy test runs over (bf16, fp16, fp32, uint8; item sizes
  that are not powers of two, not multiples of 16, single bytes, several KiB).
- ``LAYOUT_PAIRS`` — every (src layout, dst layout) pair.
- ``make_item_pool(...)`` — an ``ItemPool`` filled with random values of a dtype.
- ``index_pairs(kind, ...)`` — (src_indices, dst_indices) for the index-list shapes the tests
  use: ``"scattered"`` (random, includes each pool's last index), ``"single"``, ``"empty"``,
  ``"all"`` (a full permutation).
- ``assert_copied(...)`` — source unchanged, each mapped destination item equal to its source
  bit for bit, every other destination byte untouched; the reference is a plain loop over items.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asynccache.pools.base import ItemPool, PoolLayout

__all__ = ["COPY_CASES", "LAYOUT_PAIRS", "CopyCase", "assert_copied", "index_pairs", "make_item_pool", "snapshot"]


@dataclass(frozen=True, slots=True)
class CopyCase:
    item_bytes: int
    dtype: torch.dtype

    @property
    def id(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}-{self.item_bytes}B"


COPY_CASES: tuple[CopyCase, ...] = (
    CopyCase(1, torch.uint8),  # 1-byte words
    CopyCase(13, torch.uint8),  # odd
    CopyCase(4097, torch.uint8),  # a page and a byte
    CopyCase(6, torch.bfloat16),  # 2-byte words
    CopyCase(4100, torch.bfloat16),  # 4-byte words, not a multiple of 16
    CopyCase(130, torch.float16),  # 2-byte words
    CopyCase(8200, torch.float16),  # 8-byte words
    CopyCase(20, torch.float32),  # 4-byte words
    CopyCase(48, torch.float32),  # 16-byte words, not a power of two
    CopyCase(4112, torch.float32),  # 16-byte words, a page and a vector
    CopyCase(4096, torch.uint8),  # one full 4 KiB page
)

LAYOUT_PAIRS: tuple[tuple[PoolLayout, PoolLayout], ...] = tuple(
    (s, d) for s in (PoolLayout.LAYER_FIRST, PoolLayout.PAGE_FIRST) for d in (PoolLayout.LAYER_FIRST, PoolLayout.PAGE_FIRST)
)


def make_item_pool(
    *,
    num_layers: int,
    num_items: int,
    case: CopyCase,
    layout: PoolLayout,
    device: str | torch.device = "cpu",
    pin: bool | None = None,
    seed: int = 0,
) -> ItemPool:
    """A pool whose bytes are random values of ``case.dtype`` (generated on the CPU)."""
    pool = ItemPool(
        name=f"test_{layout.value}",
        layer_ids=tuple(range(num_layers)),
        num_items=num_items,
        item_bytes=case.item_bytes,
        layout=layout,
        device=device,
        pin=pin,
    )
    assert pool.buffer is not None
    gen = torch.Generator().manual_seed(seed)
    nbytes = pool.buffer.numel()
    if case.dtype == torch.uint8:
        values = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    else:
        values = torch.randn(nbytes // case.dtype.itemsize, generator=gen).to(case.dtype).view(torch.uint8)
    pool.buffer.view(-1).copy_(values)
    return pool


def index_pairs(
    kind: str, *, src_items: int, dst_items: int, count: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Int64 CPU index lists; destination indices are always distinct."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "empty":
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    if kind == "single":
        return torch.tensor([src_items - 1]), torch.tensor([0])
    if kind == "all":
        n = min(src_items, dst_items)
        return torch.randperm(src_items, generator=gen)[:n], torch.randperm(dst_items, generator=gen)[:n]
    if kind != "scattered":
        raise ValueError(f"unknown index kind {kind!r}")
    n = count if count is not None else max(1, min(src_items, dst_items) // 2)
    src = torch.randperm(src_items, generator=gen)[:n]
    dst = torch.randperm(dst_items, generator=gen)[:n]
    # The last index of each pool is an edge of the address range: always include it.
    src[0] = src_items - 1
    if (dst == dst_items - 1).any():
        dst[dst == dst_items - 1] = dst[0]
    dst[0] = dst_items - 1
    return src, dst


def snapshot(pool: ItemPool) -> torch.Tensor:
    """``[num_layers, num_items, item_bytes]`` CPU copy of a pool's bytes."""
    assert pool.buffer is not None
    flat = pool.buffer.detach().to("cpu").reshape(-1)
    return flat.as_strided(
        (pool.num_layers, pool.num_items, pool.item_bytes), (pool.layer_stride_bytes, pool.item_stride_bytes, 1)
    ).clone()


def assert_copied(
    *,
    src: ItemPool,
    dst: ItemPool,
    src_before: torch.Tensor,
    dst_before: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
) -> None:
    """Raise ``AssertionError`` naming the first wrong item (call after the copy completed)."""
    src_after, dst_after = snapshot(src), snapshot(dst)
    assert torch.equal(src_after, src_before), "the copy modified its source"
    want = dst_before.clone()
    for layer in range(layer_begin, layer_end):
        for s, d in zip(src_indices.tolist(), dst_indices.tolist(), strict=True):
            want[layer, d] = src_before[layer, s]
    if torch.equal(dst_after, want):
        return
    wrong = (dst_after != want).any(dim=2).nonzero().tolist()
    mapped = {d for d in dst_indices.tolist()}
    layer, item = wrong[0]
    what = "mapped" if item in mapped and layer_begin <= layer < layer_end else "unmapped"
    raise AssertionError(f"{len(wrong)} destination items wrong; first: layer {layer}, item {item} ({what})")
