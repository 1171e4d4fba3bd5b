"""The copy-engine path's per-step plan cache: per-layer copies through one cached plan land
exactly where uncached copies do, for every layer and layout."""

from __future__ import annotations

import pytest
import torch

from asynccache.pools import DeviceKVPool, HostKVPool
from asynccache.spec import HybridSpec
from kernels import copy_items

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_cached_plan_matches_per_call_plans(layout: str) -> None:
    spec = HybridSpec.preset("qwen3-next-80b", page_size=64)
    host = HostKVPool(spec, num_pages=40, layout=layout)
    assert host.buffer is not None
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    src = torch.tensor([3, 4, 5, 9, 0, 39, 17], dtype=torch.int64)
    dst = torch.tensor([10, 11, 12, 2, 30, 0, 31], dtype=torch.int64)
    cached = DeviceKVPool(spec, 32, device="cuda")
    plain = DeviceKVPool(spec, 32, device="cuda")
    for pool in (cached, plain):
        assert pool.buffer is not None
        pool.buffer.fill_(0x5A)
    cache: dict = {}
    stream = torch.cuda.Stream()
    for li in range(spec.num_attention_layers):
        copy_items(host, cached, src, dst, layer_begin=li, layer_end=li + 1, stream=stream, method="dma", plan_cache=cache)
        copy_items(host, plain, src, dst, layer_begin=li, layer_end=li + 1, stream=stream, method="dma")
    stream.synchronize()
    assert len(cache) == 1
    assert cached.buffer is not None and plain.buffer is not None
    assert torch.equal(cached.buffer, plain.buffer)
    for li, lid in enumerate(spec.attention_layer_ids):
        assert torch.equal(cached.layer_items(lid)[dst.cuda()].cpu(), host.layer_items(lid)[src])
