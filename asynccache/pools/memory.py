"""Allocation of pool byte buffers, with pinning decided once per process.

Pinning needs a working accelerator: on CPU-only torch and on CUDA builds without a driver
``pin_memory=True`` raises. ``pin=None`` pins when a probe allocation succeeds and falls back to
pageable memory otherwise; ``pin=True`` demands it and raises :class:`PinningError`.

A host buffer can also live in shared memory (``shared=True``, :class:`SharedHostMemory`): an
anonymous memory file mapped shared, pinned by registering it with the CUDA runtime, which
other processes of the same user map by :attr:`SharedHostMemory.path` — the local disk's reader
processes read objects straight into such a pool's slots.

Host buffers are checked against what the machine has (:func:`host_limit_bytes`) before they
are allocated; :func:`check_host_bytes` checks several together (pageable and shared buffers
commit no memory until written, so each alone would pass).

- :func:`allocate_bytes` — a pool's flat byte buffer (device, pinned, pageable or shared host);
- :class:`SharedHostMemory` — host memory in a memory file another process can map;
- :func:`host_limit_bytes`, :func:`check_host_bytes`, :func:`available_host_bytes`,
  :func:`pinning_available`.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import weakref
from collections.abc import Mapping

import torch

from asynccache.errors import (
    CapacityError,
    ConfigError,
    PinningError,
    SharedMemoryError,
)

__all__ = [
    "HOST_ALIGN",
    "HOST_LIMIT_ENV",
    "SharedHostMemory",
    "allocate_bytes",
    "available_host_bytes",
    "check_host_bytes",
    "host_limit_bytes",
    "pinning_available",
]

#: Pageable host buffers start on a 4 KiB boundary, so that storage can read into them with
#: ``O_DIRECT`` (direct reads fall back to the page cache for views that are not aligned).
HOST_ALIGN = 4096

#: The environment variable that caps host memory for pools (a whole number of bytes; ``0`` or
#: unset: MemAvailable).
HOST_LIMIT_ENV = "ASYNCCACHE_HOST_LIMIT_BYTES"


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


def host_limit_bytes() -> int | None:
    """The host memory pools may take: :data:`HOST_LIMIT_ENV` when set to a positive number of
    bytes, else MemAvailable (None where unknown). A value that is not a whole number of bytes
    is a :class:`ConfigError`."""
    raw = os.environ.get(HOST_LIMIT_ENV, "").strip()
    if raw:
        try:
            limit = int(raw)
        except ValueError:
            raise ConfigError(f"{HOST_LIMIT_ENV} must be a whole number of bytes, got {raw!r}") from None
        if limit < 0:
            raise ConfigError(f"{HOST_LIMIT_ENV} must be >= 0 bytes, got {raw!r}")
        if limit:
            return limit
    return available_host_bytes()


def check_host_bytes(sizes: Mapping[str, int]) -> None:
    """Raise :class:`CapacityError` unless host buffers of ``sizes`` (bytes, by name) fit in
    :func:`host_limit_bytes` together."""
    total = sum(sizes.values())
    limit = host_limit_bytes()
    if limit is None or total <= limit:
        return
    if len(sizes) == 1:
        ((what, nbytes),) = sizes.items()
        raise CapacityError(f"{what}: {nbytes} bytes requested but only {limit} bytes of host memory are available")
    parts = " + ".join(f"{what} {nbytes}" for what, nbytes in sizes.items())
    raise CapacityError(
        f"host pools of {parts} = {total} bytes requested together but only {limit} bytes of host memory are available"
    )


class SharedHostMemory:
    """``size`` bytes of host memory in an anonymous memory file (``memfd``), mapped shared;
    :attr:`tensor` is a flat uint8 view of it (page-aligned). While this object lives another
    process of the same user maps the same memory by opening :attr:`path`. With ``pin`` the
    mapping is registered with the CUDA runtime (page-locked, as pinned memory), and
    unregistered when this object is collected. A failure once the memory file is made is a
    :class:`SharedMemoryError` (caused by the error), the file and its mapping released."""

    def __init__(self, size: int, *, pin: bool, what: str) -> None:
        if size <= 0:
            raise ValueError(f"{what}: shared memory needs a positive size, got {size}")
        self.size = size
        self.pinned = False
        self._fd = os.memfd_create(f"asynccache-{what}", os.MFD_CLOEXEC)
        mapping: mmap.mmap | None = None
        try:
            os.ftruncate(self._fd, size)
            mapping = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._map = mapping
            self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
            if pin:
                rt = torch.cuda.cudart()
                err = rt.cudaHostRegister(self.tensor.data_ptr(), size, 0)
                if int(err) != 0:
                    raise SharedMemoryError(f"{what}: cudaHostRegister of {size} bytes of shared memory failed ({err})")
                self.pinned = True
        except BaseException as e:
            # Nothing is registered (registering is the last step): the mapping and the memory
            # file are all there is to give back. The tensor goes first: it holds the mapping.
            self.tensor = None  # type: ignore[assignment]
            if mapping is not None:
                with contextlib.suppress(BufferError):  # a view still exported: unmapped when collected
                    mapping.close()
            os.close(self._fd)
            if isinstance(e, SharedMemoryError) or not isinstance(e, Exception):
                raise
            raise SharedMemoryError(f"{what}: cannot set up {size} bytes of shared memory: {e}") from e
        weakref.finalize(self, _release_shared, self._fd, self.tensor.data_ptr() if pin else None)

    @property
    def path(self) -> str:
        """Where another process opens this memory (while this object lives)."""
        return f"/proc/{os.getpid()}/fd/{self._fd}"


def _release_shared(fd: int, registered_ptr: int | None) -> None:
    if registered_ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(registered_ptr)
    os.close(fd)


def allocate_bytes(
    nbytes: int, *, device: torch.device, pin: bool | None, what: str, shared: bool = False
) -> tuple[torch.Tensor, bool, SharedHostMemory | None]:
    """A flat uint8 buffer of ``nbytes`` on ``device``; returns (buffer, pinned, shared memory).
    A pageable host buffer's address is a multiple of ``HOST_ALIGN``; a pinned one's is where
    the pinned allocator puts it (a page boundary for pool-sized blocks); a ``shared`` one is a
    :class:`SharedHostMemory` (host only, page-aligned, ``None`` when ``nbytes`` is 0)."""
    if shared and device.type != "cpu":
        raise ConfigError(f"{what}: only host memory can be shared between processes, not {device}")
    if device.type != "cpu":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), False, None
        except torch.OutOfMemoryError as e:
            raise CapacityError(f"{what}: cannot allocate {nbytes} bytes on {device}: {e}") from e
    check_host_bytes({what: nbytes})
    do_pin = pinning_available() if pin is None else pin
    if do_pin and not pinning_available():
        raise PinningError(f"{what}: pinned host memory was demanded but no accelerator can pin memory here")
    if shared and nbytes > 0:
        try:
            mem = SharedHostMemory(nbytes, pin=do_pin, what=what)
        except OSError as e:
            raise SharedMemoryError(f"{what}: cannot map {nbytes} bytes of shared host memory: {e}") from e
        return mem.tensor, mem.pinned, mem
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
    return buf, do_pin, None
