"""The ctypes binding of the CUDA runtime: version queries and error naming (no GPU needed) and
events on raw handles (GPU)."""

from __future__ import annotations

import ctypes

import pytest
import torch

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_raw_events_order_streams_and_time_like_torch_events(runtime: cudart.CudaRuntime) -> None:
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record(side)
        for _ in range(20):
            a = a @ a / 2048
        done = cudart.CudaEvent(runtime)
        done.record(side.cuda_stream)
    # The current stream waits on the raw event: the copy below reads the finished product.
    runtime.stream_wait_event(torch.cuda.current_stream().cuda_stream, done.cuda_event)
    out = a.clone()
    done.synchronize()
    assert done.query()
    torch.cuda.synchronize()
    assert torch.equal(out, a)
    later = cudart.CudaEvent(runtime)
    later.record(side.cuda_stream)
    later.synchronize()
    # Either kind of event times against the other.
    ms = cudart.elapsed_ms(start, done)
    assert ms > 0 and done.elapsed_time(later) >= 0
    # A query on an event whose work is still running is not an error left for torch to find.
    busy = cudart.CudaEvent(runtime)
    with torch.cuda.stream(side):
        for _ in range(50):
            a = a @ a / 2048
        busy.record(side.cuda_stream)
    busy.query()
    torch.ones(1, device="cuda").sum().item()  # torch's next launch checks the last error
    busy.synchronize()
    del busy, done, later  # destroyed with the objects
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_events_of_a_device_reuse_handles_once_their_objects_are_gone(runtime: cudart.CudaRuntime) -> None:
    """``CudaEvent(rt, device=)`` takes a freed handle of that device back; a stream that waited
    on the handle's earlier record is not affected by its new record."""
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    first = cudart.CudaEvent(runtime, device=dev)
    handle = first.cuda_event
    with torch.cuda.stream(side):
        for _ in range(20):
            a = a @ a / 2048
        first.record(side.cuda_stream)
    runtime.stream_wait_event(torch.cuda.current_stream().cuda_stream, first.cuda_event)
    mid, out = a, a.clone()  # ordered after the 20 products
    del first
    again = cudart.CudaEvent(runtime, device=dev)
    assert again.cuda_event == handle  # reused, not made anew
    with torch.cuda.stream(side):
        for _ in range(20):
            a = a @ a / 2048
        again.record(side.cuda_stream)  # a later record: the wait above keeps the earlier one
    torch.cuda.synchronize()
    assert torch.equal(out, mid)
    again.synchronize()
    assert again.query()
    plain = cudart.CudaEvent(runtime)
    assert plain.cuda_event != handle
    del again, plain
    torch.cuda.synchronize()
