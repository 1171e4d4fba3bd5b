"""Allocation of pool byte buffers, with pinning decided once per process.

Pinning needs a working accelerator: on CPU-only torch and on CUDA builds without a driver
``pin_memory=True`` raises. ``pin=None`` pins when a probe allocation succeeds and falls back to
pageable memory otherwise; ``pin=True`` demands it and raises :class:`PinningError`.
"""

from __future__ import annotations

import functools
import os

import torch

from asynccache.errors import CapacityError, PinningError

__all__ = ["HOST_ALIGN", "pinning_available", "allocate_bytes", "available_host_bytes"]

#: Pageable host buffers start on a 4 KiB boundary, so that storage can read into them with
#: ``O_DIRECT`` (direct reads fall back to the page cache for views that are not aligned).
HOST_ALIGN = 4096


@functools.cache
def pinning_available() -> bool:
    """True when pinned host memory can be allocated (probe once)."""
    try:
        if not torch.accelerator.is_available():
            return False
        torch.empty(16, dtype=torch.uint8, pin_memory=True)
        return True
    except (RuntimeError, AttributeError):
        return False


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def allocate_bytes(
    nbytes: int, *, device: torch.device, pin: bool | None, what: str
) -> tuple[torch.Tensor, bool]:
    """A flat uint8 buffer of ``nbytes`` on ``device``; returns (buffer, pinned). A pageable
    host buffer's address is a multiple of ``HOST_ALIGN``; a pinned one's is where the pinned
    allocator puts it (a page boundary for pool-sized blocks)."""
    if device.type != "cpu":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), False
        except torch.OutOfMemoryError as e:
            raise CapacityError(f"{what}: cannot allocate {nbytes} bytes on {device}: {e}") from e
    avail = available_host_bytes()
    limit = int(os.environ.get("ASYNCCACHE_HOST_LIMIT_BYTES", "0")) or avail
    if limit is not None and nbytes > limit:
        raise CapacityError(f"{what}: {nbytes} bytes requested but only {limit} bytes of host memory are available")
    do_pin = pinning_available() if pin is None else pin
    if do_pin and not pinning_available():
        raise PinningError(f"{what}: pinned host memory was demanded but no accelerator can pin memory here")
    try:
        if do_pin:
            # not padded: the pinned allocator rounds sizes up to a power of two, so padding
            # could double the block
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:  # pageable blocks start on 64 bytes: pad and slice
            raw = torch.empty(nbytes + HOST_ALIGN, dtype=torch.uint8)
            start = -raw.data_ptr() % HOST_ALIGN
            buf = raw[start : start + nbytes]
    except RuntimeError as e:
        raise CapacityError(f"{what}: cannot allocate {nbytes} bytes of host memory: {e}") from e
    return buf, do_pin
