"""Layer-by-layer copiers on the GPU: per-layer copies through one plan (copy engines) or one
launch per layer (kernel) land exactly where per-call ``copy_items`` copies do, for every layer,
layout and method."""

from __future__ import annotations

import pytest
import torch

from asynccache.errors import TransferError
from asynccache.pools import DeviceKVPool, HostKVPool
from asynccache.spec import HybridSpec
from kernels import PoolPair, copy_items, layer_copier
from kernels.dma_copy import dma_layer_copier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


INDEX_SETS = {
    "scattered": ([3, 4, 5, 9, 0, 39, 17], [10, 11, 12, 2, 30, 0, 31]),
    # Consecutive on both sides: from a page_first host, each layer is one strided run.
    "consecutive": (list(range(7, 31)), list(range(4, 28))),
}


def _pools(layout: str) -> tuple[HybridSpec, HostKVPool, DeviceKVPool, DeviceKVPool]:
    """A random 40-page host KV pool and two poisoned 32-page device pools (Qwen3-Next, page 64)."""
    spec = HybridSpec.preset("qwen3-next-80b", page_size=64)
    host = HostKVPool(spec, num_pages=40, layout=layout)
    assert host.buffer is not None
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    cached = DeviceKVPool(spec, 32, device="cuda")
    plain = DeviceKVPool(spec, 32, device="cuda")
    for pool in (cached, plain):
        assert pool.buffer is not None
        pool.buffer.fill_(0x5A)
    return spec, host, cached, plain


@pytest.mark.parametrize("method", ["dma", "triton", "dma:batch"])
@pytest.mark.parametrize("indices", sorted(INDEX_SETS))
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_layer_copier_matches_per_call_copies(layout: str, indices: str, method: str) -> None:
    spec, host, cached, plain = _pools(layout)
    src, dst = (torch.tensor(v, dtype=torch.int64) for v in INDEX_SETS[indices])
    stream = torch.cuda.Stream()
    copy = layer_copier(host, cached, src, dst, stream=stream, method=method)
    for li in range(spec.num_attention_layers):
        assert copy(li) == src.numel() * host.item_bytes
        copy_items(host, plain, src, dst, layer_begin=li, layer_end=li + 1, stream=stream, method=method)
    stream.synchronize()
    assert cached.buffer is not None and plain.buffer is not None
    assert torch.equal(cached.buffer, plain.buffer)
    for li, lid in enumerate(spec.attention_layer_ids):
        assert torch.equal(cached.layer_items(lid)[dst.cuda()].cpu(), host.layer_items(lid)[src])


def test_a_per_layer_load_of_consecutive_pages_is_one_strided_call_per_layer() -> None:
    """page_first host → device, consecutive indices: ``auto`` issues one 2D memcpy per layer
    (one plan, issued for each layer), and the pages land exactly."""
    spec = HybridSpec.preset("qwen3-next-80b", page_size=64)
    host = HostKVPool(spec, num_pages=40, layout="page_first")
    dev = DeviceKVPool(spec, 32, device="cuda")
    assert host.buffer is not None and dev.buffer is not None
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    dev.buffer.fill_(0x5A)
    src, dst = torch.arange(8, 38), torch.arange(1, 31)
    stream = torch.cuda.Stream()
    issue = dma_layer_copier(host, dev, src, dst, stream=stream)
    for li in range(spec.num_attention_layers):
        launch = issue(li)
        assert launch is not None and launch.engine == "strided"
        assert (launch.num_copies, launch.num_calls) == (30, 1)
    stream.synchronize()
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[dst] = False
    for lid in spec.attention_layer_ids:
        assert torch.equal(dev.layer_items(lid)[dst.cuda()].cpu(), host.layer_items(lid)[src])
        assert bool((dev.layer_items(lid)[untouched.cuda()] == 0x5A).all())


@pytest.mark.parametrize("method", ["dma", "triton"])
def test_copiers_of_one_pool_pair_copy_layer_ranges_exactly(method: str) -> None:
    """Two copiers of one :class:`PoolPair` (the pools checked once), issuing ranges of
    several layers as well as single layers, land where per-call ``copy_items`` copies do; a
    pair over pageable host memory is rejected when it is made."""
    spec, host, cached, plain = _pools("page_first")
    stream = torch.cuda.Stream()
    pair = PoolPair(host, cached, stream=stream, method=method)
    n = spec.num_attention_layers
    for src, dst in (([3, 4, 5, 9, 0], [10, 11, 12, 2, 30]), (list(range(20, 30)), list(range(14, 24)))):
        si, di = torch.tensor(src), torch.tensor(dst)
        copy = pair.layer_copier(si, di)
        assert copy(0, 3) == 3 * si.numel() * host.item_bytes
        for li in range(3, n):
            copy(li)
        copy_items(host, plain, si, di, stream=stream, method=method)
    stream.synchronize()
    assert cached.buffer is not None and plain.buffer is not None
    assert torch.equal(cached.buffer, plain.buffer)
    pageable = HostKVPool(spec, num_pages=4, layout="page_first", pin=False)
    with pytest.raises(TransferError, match="pageable"):
        PoolPair(pageable, cached, stream=stream, method="dma")


@pytest.mark.parametrize("method", ["dma", "dma:batch", "triton"])
@pytest.mark.parametrize("layers", [(0.5, 1), (0, 1.5), (True, 1)])
def test_a_layer_copier_refuses_a_non_integer_layer_range(method: str, layers: tuple[object, object]) -> None:
    """Every method checks the range alike: a float is refused before any copy is issued (the
    copy engines' planner would otherwise plan offsets from it)."""
    _, host, cached, _ = _pools("page_first")
    assert cached.buffer is not None
    before = cached.buffer.clone()
    copy = layer_copier(host, cached, torch.tensor([0]), torch.tensor([1]), method=method)
    with pytest.raises(TransferError, match="must be ints"):
        copy(*layers)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    assert torch.equal(cached.buffer, before)
