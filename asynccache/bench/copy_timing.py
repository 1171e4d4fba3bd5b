"""Building blocks of the copy benchmarks (``asynccache bench transfer``, ``python -m
kernels.tune``): a host and a device pool of random bytes with scattered index lists, and the
timing and checking of copies between them.

Primitives:

- ``PoolPair`` / ``make_pool_pair(item_bytes, num_items, device, *, seed=)`` — the two pools
  and their index lists; ``PoolPair.ends(direction)`` gives ``(src, dst, src_indices,
  dst_indices)`` for ``"h2d"`` or ``"d2h"``.
- ``fill_random(buffer, seed)`` — random bytes in a buffer (never time on zeros).
- ``time_median_s(fn, *, reps, device, warmup=1)`` — median seconds of a call (CUDA events on
  the current stream; a host clock on CPU).
- ``contiguous_seconds`` / ``scattered_seconds`` — one contiguous copy of as many bytes, and
  one scattered ``copy_items`` of the pair.
- ``check_copy(pair, direction)`` — the last scattered copy landed bit for bit.
- ``grid_for(pair, direction, ctas, method=)`` — the grid a CUDA launch of the copy uses.
- ``UNCAPPED`` — the CTA cap of an uncapped kernel launch (one CTA per tile; ``--ctas 0``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asynccache.pools.base import ItemPool, PoolLayout
from kernels.api import copy_items

__all__ = [
    "UNCAPPED",
    "PoolPair",
    "check_copy",
    "contiguous_seconds",
    "fill_random",
    "grid_for",
    "make_pool_pair",
    "scattered_seconds",
    "time_median_s",
]

_FILL_PERIOD = 1048573  # a prime number of bytes
#: ``--ctas 0`` means uncapped: one CTA per tile.
UNCAPPED = 2**31 - 1


@dataclass(slots=True)
class PoolPair:
    """A host pool and a device pool of ``2·num_items`` single-layer items, and the scattered
    index lists (``num_items`` distinct random indices on each side)."""

    host: ItemPool
    device: ItemPool
    host_indices: torch.Tensor
    device_indices: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.host_indices.numel() * self.host.item_bytes

    def ends(self, direction: str) -> tuple[ItemPool, ItemPool, torch.Tensor, torch.Tensor]:
        """(src, dst, src_indices, dst_indices) for ``"h2d"`` or ``"d2h"``."""
        if direction == "h2d":
            return self.host, self.device, self.host_indices, self.device_indices
        return self.device, self.host, self.device_indices, self.host_indices


def make_pool_pair(item_bytes: int, num_items: int, device: torch.device, *, seed: int = 0) -> PoolPair:
    """Pools filled with random bytes (never time on zeros)."""
    gen = torch.Generator().manual_seed(seed)
    pin = True if device.type == "cuda" else None
    host = ItemPool(
        name="bench_host", layer_ids=(0,), num_items=2 * num_items, item_bytes=item_bytes,
        layout=PoolLayout.PAGE_FIRST, device="cpu", pin=pin,
    )  # fmt: skip
    dev = ItemPool(
        name="bench_device", layer_ids=(0,), num_items=2 * num_items, item_bytes=item_bytes,
        layout=PoolLayout.LAYER_FIRST, device=device, pin=False,
    )  # fmt: skip
    fill_random(dev.buffer, seed)
    fill_random(host.buffer, seed + 1)
    host_indices = torch.randperm(2 * num_items, generator=gen)[:num_items]
    device_indices = torch.randperm(2 * num_items, generator=gen)[:num_items]
    return PoolPair(host, dev, host_indices, device_indices)


def fill_random(buf: torch.Tensor | None, seed: int) -> None:
    """Random bytes in ``buf`` (a pool's buffer), from ``seed``: on the GPU for a device or
    pinned buffer, a repeated random block on CPU."""
    assert buf is not None
    flat = buf.view(-1)
    if flat.numel() == 0:
        return
    if flat.device.type == "cuda":
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        flat.random_(0, 256, generator=gen)
    elif flat.is_pinned() and torch.cuda.is_available():
        tmp = torch.empty_like(flat, device="cuda")
        tmp.random_(0, 256, generator=torch.Generator(device="cuda").manual_seed(seed))
        flat.copy_(tmp)
    else:
        # A random block of prime length repeated: cheap on a small CPU, and two items can only
        # hold the same bytes if their offsets differ by a multiple of the prime (> any pool here).
        period = min(flat.numel(), _FILL_PERIOD)
        block = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        whole = flat.numel() // period
        flat[: whole * period].view(whole, period).copy_(block.expand(whole, period))
        flat[whole * period :].copy_(block[: flat.numel() - whole * period])


def time_median_s(fn: Callable[[], object], *, reps: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of ``fn`` (CUDA events around each call on the current stream; a host
    clock on CPU)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def contiguous_seconds(pair: PoolPair, direction: str, num_bytes: int, *, reps: int) -> float:
    """One contiguous copy of ``num_bytes`` between the pools' buffers (pinned memcpy on CUDA)."""
    assert pair.host.buffer is not None and pair.device.buffer is not None
    host = pair.host.buffer.view(-1)[:num_bytes]
    dev = pair.device.buffer.view(-1)[:num_bytes]
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    non_blocking = dev.device.type == "cuda"
    return time_median_s(lambda: dst.copy_(src, non_blocking=non_blocking), reps=reps, device=dev.device)


def scattered_seconds(pair: PoolPair, direction: str, ctas: int, *, reps: int, method: str = "triton") -> float:
    """Median seconds of one scattered ``copy_items`` of the pair (``method`` as there; CPU: torch)."""
    src, dst, si, di = pair.ends(direction)
    return time_median_s(
        lambda: copy_items(src, dst, si, di, max_ctas=ctas, method=None if method == "torch" else method),
        reps=reps,
        device=pair.device.device,
    )


def check_copy(pair: PoolPair, direction: str) -> None:
    """Raise if the last scattered copy did not land bit for bit (compared on the device)."""
    src, dst, si, di = pair.ends(direction)
    assert src.buffer is not None and dst.buffer is not None
    dev = pair.device.device
    got = dst.buffer.to(dev).view(dst.num_items, -1)[di.to(dev)]
    want = src.buffer.to(dev).view(src.num_items, -1)[si.to(dev)]
    if not torch.equal(got, want):
        raise RuntimeError(f"{direction} scattered copy of {src.item_bytes}-byte items is wrong")


def grid_for(pair: PoolPair, direction: str, ctas: int, method: str = "triton") -> int:
    """The grid a CUDA launch of this copy uses (0 on CPU and for DMA, where there is no grid)."""
    if pair.device.device.type != "cuda" or method == "dma":
        return 0
    from kernels.triton_copy import plan_launch

    src, dst, si, di = pair.ends(direction)
    planned = plan_launch(src, dst, si, di, max_ctas=ctas)
    assert planned is not None
    return planned[0].grid
