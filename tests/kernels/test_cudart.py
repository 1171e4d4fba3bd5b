"""The ctypes binding of the CUDA runtime (no GPU needed: version queries and error naming only)."""

from __future__ import annotations

import ctypes

import pytest

from asynccache.errors import TransferError
from kernels import cudart


@pytest.fixture(scope="module")
def runtime() -> cudart.CudaRuntime:
    try:
        return cudart.cuda_runtime()
    except TransferError as e:
        pytest.skip(f"no CUDA runtime library here: {e}")


def test_candidates_prefer_the_mapped_library_then_sonames() -> None:
    candidates = cudart.cudart_candidates()
    assert candidates[-3:] == ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    assert len(candidates) == len(set(candidates))


def test_attribute_struct_matches_the_c_layout() -> None:
    # {int srcAccessOrder; {int, int} srcLocHint; {int, int} dstLocHint; unsigned flags}
    assert ctypes.sizeof(cudart._MemcpyAttributes) == 24
    assert cudart._MemcpyAttributes.flags.offset == 20


def test_batch_prototype_follows_the_runtime_version(runtime: cudart.CudaRuntime) -> None:
    assert runtime.runtime_version > 0
    if runtime.runtime_version >= 13000:
        assert runtime.batch_signature == "13" and runtime.has_batch
    elif runtime.runtime_version >= cudart.BATCH_MIN_VERSION:
        assert runtime.batch_signature == "12.8"
    else:
        assert not runtime.has_batch
    described = runtime.describe()
    assert described["runtime_version"] == runtime.runtime_version and described["path"] == runtime.path


def test_errors_are_raised_with_their_cuda_name(runtime: cudart.CudaRuntime) -> None:
    runtime.check(0, "nothing")
    with pytest.raises(TransferError, match=r"cudaMemcpyAsync failed: cudaErrorInvalidValue"):
        runtime.check(1, "cudaMemcpyAsync")
    assert runtime.error_name(100) == "cudaErrorNoDevice"
