"""The reference model on CUDA: bf16 determinism, restore-and-continue, chunked ≈ recurrent, CPU parity.

Plain (synchronous) tests that drive the model with ``asyncio.run``, so they need no asyncio
plugin on the GPU machine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference import ForwardBatch, HybridModel, SequenceInput
from asynccache.reference.gdn import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from asynccache.spec import PRESETS, HybridSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Qwen3-Next head geometry (128-dim heads, 2:1 value:key heads) at a test-friendly width.
MID = HybridSpec.from_hf_config(
    {
        **PRESETS["hybrid-3b"],
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "head_dim": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "intermediate_size": 1024,
        "vocab_size": 1024,
    },
    model_id="mid",
)


def seq(ids: torch.Tensor, start: int, pages: list[int], slot: int, snapshots: dict[int, int] | None = None) -> SequenceInput:
    return SequenceInput(
        token_ids=ids,
        start=start,
        kv_page_indices=torch.tensor(pages, dtype=torch.int64),
        state_slot=slot,
        snapshots=snapshots or {},
    )


def forward(model: HybridModel, kv: DeviceKVPool, st: DeviceMambaPool, *seqs: SequenceInput) -> torch.Tensor:
    return asyncio.run(model.forward(ForwardBatch(sequences=seqs), kv, st))


def pools(spec: HybridSpec, num_pages: int = 32, num_slots: int = 16) -> tuple[DeviceKVPool, DeviceMambaPool]:
    kv, st = DeviceKVPool(spec, num_pages, device="cuda"), DeviceMambaPool(spec, num_slots, device="cuda")
    kv.buffer.fill_(0xFF)  # type: ignore[union-attr]  # NaN: reading unwritten bytes would show
    st.buffer.fill_(0xFF)  # type: ignore[union-attr]
    return kv, st


def tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_bf16_same_segmentation_is_bit_identical() -> None:
    model = HybridModel(MID, device="cuda", dtype=torch.bfloat16)
    a, b = tokens(300, MID.vocab_size, 1), tokens(150, MID.vocab_size, 2)
    runs = []
    for _ in range(2):
        kv, st = pools(MID)
        first = forward(model, kv, st, seq(a[:200], 0, [0, 1, 2, 3, 4], 0, {128: 2}), seq(b, 0, [8, 9, 10], 1))
        second = forward(model, kv, st, seq(a[200:], 200, [0, 1, 2, 3, 4], 0, {256: 3}))
        nxt = second.argmax(-1)
        third = forward(model, kv, st, seq(nxt, 300, [0, 1, 2, 3, 4], 0))
        torch.cuda.synchronize()
        runs.append((first, second, third, st.buffer.clone(), kv.buffer[:, [0, 1, 2, 3, 4, 8, 9, 10]].clone()))  # type: ignore[union-attr,index]
    for x, y in zip(*runs, strict=True):
        assert torch.equal(x, y)
    assert torch.isfinite(runs[0][2]).all()


def test_bf16_restored_prefix_continues_bit_identically() -> None:
    model = HybridModel(MID, device="cuda", dtype=torch.bfloat16)
    ids = tokens(256, MID.vocab_size, 3)
    kv, st = pools(MID)
    forward(model, kv, st, seq(ids[:128], 0, [0, 1], 0))
    kv.buffer[:, [20, 21]] = kv.buffer[:, [0, 1]]  # type: ignore[index]
    st.buffer[:, 9] = st.buffer[:, 0]  # type: ignore[index]
    in_place = forward(model, kv, st, seq(ids[128:], 128, [0, 1, 2, 3], 0))
    restored = forward(model, kv, st, seq(ids[128:], 128, [20, 21, 22, 23], 9))
    assert torch.equal(in_place, restored)
    for i in range(4):  # decode, both sequences batched together
        nxt = in_place.argmax(-1)
        both = forward(model, kv, st, seq(nxt, 256 + i, [0, 1, 2, 3, 4], 0), seq(nxt, 256 + i, [20, 21, 22, 23, 24], 9))
        assert torch.equal(both[0], both[1])
        in_place = both[:1]


def test_bf16_segmented_prefill_is_close_to_one_pass() -> None:
    model = HybridModel(MID, device="cuda", dtype=torch.bfloat16)
    ids = tokens(400, MID.vocab_size, 4)
    kv, st = pools(MID)
    single = forward(model, kv, st, seq(ids, 0, list(range(7)), 0))
    kv, st = pools(MID)
    forward(model, kv, st, seq(ids[:192], 0, list(range(7)), 0))
    split = forward(model, kv, st, seq(ids[192:], 192, list(range(7)), 0))
    cos = torch.nn.functional.cosine_similarity(single, split, dim=-1)
    assert cos.min() > 0.99, cos


@pytest.mark.parametrize("t", [1, 100, 300])
def test_chunked_matches_recurrent_on_cuda(t: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t)
    b, h, dk, dv = 2, 8, 128, 128
    q = l2norm(torch.randn(b, t, h, dk, device="cuda", generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(b, t, h, dk, device="cuda", generator=gen))
    v = torch.randn(b, t, h, dv, device="cuda", generator=gen)
    g = -torch.rand(b, t, h, device="cuda", generator=gen) * 0.2
    beta = torch.rand(b, t, h, device="cuda", generator=gen)
    s0 = torch.randn(b, h, dk, dv, device="cuda", generator=gen)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)
    o_cpu, s_cpu = chunk_gated_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), s0.cpu())
    torch.testing.assert_close(o.cpu(), o_cpu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.cpu(), s_cpu, rtol=1e-4, atol=1e-4)


def test_fp32_cuda_matches_cpu(tmp_path: Path) -> None:
    """The same weights (through a safetensors file) give the same logits on CPU and CUDA."""
    spec = HybridSpec.preset("tiny")
    cpu_model = HybridModel(spec, seed=5)
    path = tmp_path / "tiny.safetensors"
    cpu_model.save_safetensors(path)
    gpu_model = HybridModel.from_safetensors(spec, path, device="cuda")
    ids = tokens(200, spec.vocab_size, 6)
    results = []
    for model, device in ((cpu_model, "cpu"), (gpu_model, "cuda")):
        kv, st = DeviceKVPool(spec, 8, device=device), DeviceMambaPool(spec, 4, device=device)
        forward(model, kv, st, seq(ids[:128], 0, [0, 1, 2, 3], 0, {64: 1}))
        results.append(forward(model, kv, st, seq(ids[128:], 128, [0, 1, 2, 3], 0)).cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(results[1].argmax(-1), results[0].argmax(-1))
