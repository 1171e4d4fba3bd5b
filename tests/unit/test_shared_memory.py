"""Host pools in shared memory (``shared=True``): another process maps the same bytes by path;
on CUDA the memory is registered (pinned) and the copy engines read it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asynccache import ConfigError, HybridSpec, SharedMemoryError
from asynccache.pools import HostKVPool, MambaPoolHost
from asynccache.pools.memory import SharedHostMemory, allocate_bytes

SPEC = HybridSpec.preset("small", page_size=8)

WRITER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, int(sys.argv[2]), mmap.MAP_SHARED)
m[int(sys.argv[3]):int(sys.argv[3]) + 4] = b"\\x01\\x02\\x03\\x04"
print(m[0:4].hex())
"""


def test_another_process_maps_the_pool_by_path() -> None:
    pool = HostKVPool(SPEC, num_pages=4, pin=False, shared=True)
    mem = pool.shared_memory
    assert isinstance(mem, SharedHostMemory) and mem.size == pool.size_bytes
    assert pool.buffer.data_ptr() == mem.tensor.data_ptr() and mem.tensor.data_ptr() % 4096 == 0
    pool.index_bytes(0).view(-1)[:4] = torch.tensor([9, 8, 7, 6], dtype=torch.uint8)
    offset = pool.index_bytes(2).data_ptr() - mem.tensor.data_ptr()
    out = subprocess.run([sys.executable, "-c", WRITER, mem.path, str(mem.size), str(offset)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "09080706"  # the child sees the parent's bytes
    assert pool.index_bytes(2).view(-1)[:4].tolist() == [1, 2, 3, 4]  # and the parent the child's


def test_pools_are_private_unless_asked_and_device_memory_is_never_shared() -> None:
    assert MambaPoolHost(SPEC, num_slots=2, pin=False).shared_memory is None
    assert MambaPoolHost(SPEC, num_slots=2, pin=False, materialize=False, shared=True).shared_memory is None
    with pytest.raises(ConfigError, match="only host memory"):
        allocate_bytes(4096, device=torch.device("cuda"), pin=None, what="test", shared=True)


@pytest.mark.gpu
def test_shared_pools_are_pinned_on_cuda_and_copy_exactly() -> None:
    pool = HostKVPool(SPEC, num_pages=4, pin=True, shared=True)
    assert pool.pinned and pool.buffer.is_pinned()
    src = torch.randint(0, 256, (pool.size_bytes,), dtype=torch.uint8, device="cuda")
    pool.buffer.view(-1).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool.buffer.view(-1).cuda(), src)


def _open_memfds(what: str) -> int:
    """Open descriptors of this process on memory files named for ``what``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += f"asynccache-{what}" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            pass
    return count


def test_a_failed_registration_releases_the_memory_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinning that fails other than by its error return (no CUDA runtime here) leaves no
    memory file open: the error is a SharedMemoryError caused by it."""

    def no_runtime() -> None:
        raise RuntimeError("no CUDA runtime")

    monkeypatch.setattr(torch.cuda, "cudart", no_runtime)
    for _ in range(3):
        with pytest.raises(SharedMemoryError, match="leaktest") as info:
            SharedHostMemory(1 << 16, pin=True, what="leaktest")
        assert isinstance(info.value.__cause__, RuntimeError)
        del info
    assert _open_memfds("leaktest") == 0
