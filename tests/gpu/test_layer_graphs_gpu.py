"""CUDA graphs of the recurrent layers: a replay computes exactly what the eager layers compute."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_model_gpu import MID, forward, pools, seq, tokens

from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference import HybridModel
from asynccache.reference.padding import bucket_lengths

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _steps(model: HybridModel, kv: DeviceKVPool, st: DeviceMambaPool) -> list[torch.Tensor]:
    """Prefill two sequences, then small passes of several shapes (decode pairs, a 64-token
    chunk with a snapshot, a fresh prompt beside a continuing one), each shape several
    times with other slots and pages."""
    a, b = tokens(256, MID.vocab_size, 11), tokens(192, MID.vocab_size, 12)
    out = [forward(model, kv, st, seq(a, 0, list(range(8)), 0), seq(b, 0, list(range(8, 16)), 1))]
    nxt = out[-1].argmax(-1)
    for i in range(4):  # decode pairs: one shape
        pair = forward(model, kv, st, seq(nxt[:1], 256 + i, list(range(8)) + [40], 0),
                       seq(nxt[1:], 192 + i, list(range(8, 16)), 1))
        out.append(pair)
        nxt = pair.argmax(-1)
    for r in range(3):  # 64-token chunks with a snapshot, on fresh slots each time
        c = tokens(64, MID.vocab_size, 20 + r)
        st.buffer[:, 4 + r] = st.buffer[:, 0]  # type: ignore[index]
        out.append(forward(model, kv, st, seq(c, 260, list(range(8)) + [41 + r, 44 + r], 4 + r, {320: 10 + r})))
    for r in range(3):  # a fresh 1-token prompt beside a continuing decode: one group, mixed fresh mask
        fresh = tokens(1, MID.vocab_size, 30 + r)
        out.append(forward(model, kv, st, seq(fresh, 0, [30 + r], 13), seq(nxt[1:], 196 + r, list(range(8, 16)), 1)))
    torch.cuda.synchronize()
    out.append(st.buffer.clone())  # type: ignore[union-attr]
    out.append(kv.buffer.clone())  # type: ignore[union-attr]
    return out


def test_replayed_layers_are_bit_identical_to_eager() -> None:
    eager = HybridModel(MID, device="cuda", dtype=torch.bfloat16, cuda_graphs=False)
    graphed = HybridModel(MID, device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    assert eager.layer_graphs is None and graphed.layer_graphs is not None
    want = _steps(eager, *pools(MID, num_pages=48, num_slots=16))
    first_pools = pools(MID, num_pages=48, num_slots=16)
    got = _steps(graphed, *first_pools)
    graphs = graphed.layer_graphs
    assert graphs.num_captures > 0 and graphs.num_replays > 2 * graphs.num_captures  # replays, not just captures
    for i, (x, y) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(x, y), f"step {i} differs"
    # The same shapes over other pools (the first ones still alive): graphs of their own.
    captures = graphs.num_captures
    again = _steps(graphed, *pools(MID, num_pages=48, num_slots=16))
    assert graphs.num_captures > captures
    for i, (x, y) in enumerate(zip(want, again, strict=True)):
        assert torch.equal(x, y), f"step {i} differs over the second pools"
    del first_pools


def test_large_passes_stay_eager() -> None:
    model = HybridModel(MID, device="cuda", dtype=torch.bfloat16)
    assert model.layer_graphs is not None
    model.layer_graphs.eager_runs = 0
    n = model.layer_graphs.max_tokens + 1
    num_pages = -(-(n + 1) // MID.page_size)
    kv, st = pools(MID, num_pages=num_pages)
    ids = tokens(n, MID.vocab_size, 5)
    forward(model, kv, st, seq(ids, 0, list(range(num_pages)), 0))
    assert model.layer_graphs.num_captures == 0
    forward(model, kv, st, seq(ids[:1], ids.numel(), list(range(num_pages)), 0))
    assert model.layer_graphs.num_captures == len(MID.mamba_layer_ids)


def test_prefill_chunks_replay_bit_identical_to_eager() -> None:
    """Chunks of 1,024 tokens continuing a prefix (a chunked prefill, the head of a split
    restore): replayed from the second one on, the same bits as eager chunks."""
    runs = []
    for graphs in (False, True):
        model = HybridModel(MID, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs)
        kv, st = pools(MID, num_pages=80)
        ids = tokens(4 * 1024 + 1, MID.vocab_size, 9)
        out = [forward(model, kv, st, seq(ids[i : i + 1024], i, list(range(80)), 0)) for i in range(0, 4096, 1024)]
        out.append(forward(model, kv, st, seq(ids[4096:], 4096, list(range(80)), 0)))
        torch.cuda.synchronize()
        runs.append((out, st.buffer.clone(), kv.buffer.clone(), model.layer_graphs))  # type: ignore[union-attr]
    (want, st_want, kv_want, _), (got, st_got, kv_got, graphs) = runs
    assert graphs is not None and graphs.num_replays >= 2 * len(MID.mamba_layer_ids)
    for i, (x, y) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(x, y), f"chunk {i} differs"
    assert torch.equal(st_want, st_got) and torch.equal(kv_want, kv_got)


def test_kept_shapes_are_bounded_by_their_tokens() -> None:
    model = HybridModel(MID, device="cuda", dtype=torch.bfloat16, bucket_passes=False)  # shapes of these lengths
    graphs = model.layer_graphs
    assert graphs is not None
    graphs.eager_runs = 0
    graphs.max_total_tokens = 1000
    kv, st = pools(MID, num_pages=40)
    ids = tokens(2048, MID.vocab_size, 10)
    for n in (300, 400, 200):  # 900 tokens: all kept
        forward(model, kv, st, seq(ids[:n], 0, list(range(40)), 0))
    assert graphs.num_shapes == 3 and graphs.total_tokens == 900
    forward(model, kv, st, seq(ids[:500], 0, list(range(40)), 0))  # the oldest two go
    assert graphs.num_shapes == 2 and graphs.total_tokens == 700
    forward(model, kv, st, seq(ids[:1500], 0, list(range(40)), 0))  # alone over the budget: kept alone
    assert graphs.num_shapes == 1 and graphs.total_tokens == 1500


def test_graphs_go_with_their_pool() -> None:
    model = HybridModel(MID, device="cuda", dtype=torch.bfloat16)
    graphs = model.layer_graphs
    assert graphs is not None
    graphs.eager_runs = 0
    kv, st = pools(MID)
    ids = tokens(4, MID.vocab_size, 6)
    forward(model, kv, st, seq(ids, 0, [0], 0))
    assert graphs.num_captures == len(MID.mamba_layer_ids) and len(graphs._shapes) == 1
    del kv, st
    import gc

    gc.collect()
    assert not graphs._shapes and not graphs._pools


def test_new_lengths_replay_the_graphs_of_their_bucket() -> None:
    """Prompts of new lengths in one bucket (asynccache.reference.padding): one shape captured
    at the second, replayed from then on, the same bits as eager padded passes. Then packed
    passes of two continuing sequences and a decode row, of new lengths each time."""
    runs = []
    for graphs in (False, True):
        model = HybridModel(MID, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs)
        assert model.bucket_passes
        kv, st = pools(MID, num_pages=48, num_slots=8)
        out = []
        for i, n in enumerate((1090, 1111, 1200, 1280, 1153)):  # all padded to 1,280
            out.append(forward(model, kv, st, seq(tokens(n, MID.vocab_size, 40 + i), 0, list(range(32)), 0)))
        shapes = None if model.layer_graphs is None else model.layer_graphs.num_shapes
        ends = [1153, 0, 0]
        for i, (a, b) in enumerate(((100, 70), (90, 80), (120, 65), (110, 75))):  # groups of 128, 128 and 1 rows
            out.append(forward(model, kv, st, seq(tokens(a, MID.vocab_size, 50 + i), ends[0], list(range(32)), 0),
                               seq(tokens(b, MID.vocab_size, 60 + i), ends[1], list(range(32, 40)), 1),
                               seq(tokens(1, MID.vocab_size, 70 + i), ends[2], list(range(40, 42)), 2)))
            ends = [ends[0] + a, ends[1] + b, ends[2] + 1]
        torch.cuda.synchronize()
        runs.append((out, st.buffer.clone(), kv.buffer.clone(), model.layer_graphs, shapes))  # type: ignore[union-attr]
    (want, st_want, kv_want, _, _), (got, st_got, kv_got, graphs, shapes) = runs
    assert graphs is not None and shapes == 1  # five prompt lengths, one bucket
    assert graphs.num_captures == 2 * len(MID.mamba_layer_ids)  # that bucket and the packed shape
    assert graphs.num_replays == (4 + 2) * len(MID.mamba_layer_ids)
    for i, (x, y) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(x, y), f"pass {i} differs"
    assert torch.equal(st_want, st_got) and torch.equal(kv_want, kv_got)


def test_a_warm_up_lets_first_passes_of_new_lengths_replay() -> None:
    """``HybridModel.warm_up`` at the bucket lengths: a prompt's first pass of a length never
    computed before (a split restore's head) replays at once, with the bits of an eager padded
    pass; the warm-up's pages and slot are the only ones it wrote."""
    lengths = bucket_lengths(512)
    runs = []
    for graphs in (False, True):
        model = HybridModel(MID, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs)
        kv, st = pools(MID, num_pages=48, num_slots=8)
        before_kv, before_st = kv.buffer.clone(), st.buffer.clone()  # type: ignore[union-attr]
        warmed = asyncio.run(model.warm_up(kv, st, lengths=lengths, kv_page_indices=torch.arange(40, 48), state_slot=7))
        torch.cuda.synchronize()
        assert kv.buffer.shape[1] == 48 and st.buffer.shape[1] == 8  # type: ignore[union-attr]  # [layer, item, bytes]
        assert torch.equal(kv.buffer[:, :40], before_kv[:, :40])  # type: ignore[index]
        assert torch.equal(st.buffer[:, :7], before_st[:, :7])  # type: ignore[index]
        assert torch.equal(kv.buffer[:, 40:], before_kv[:, 40:]) is (not graphs)  # type: ignore[index]  # computed with graphs only
        captures = 0 if model.layer_graphs is None else model.layer_graphs.num_captures
        assert warmed == captures
        out = [forward(model, kv, st, seq(tokens(n, MID.vocab_size, 80 + n), 0, list(range(8)), i % 4))
               for i, n in enumerate((300, 77, 450, 130))]  # buckets 320, 128, 512, 192: first sightings
        torch.cuda.synchronize()
        runs.append((out, model.layer_graphs, captures))
    (want, _, _), (got, graphs, captures) = runs
    assert graphs is not None and captures == len(lengths) * len(MID.mamba_layer_ids)
    assert graphs.num_captures == captures  # nothing captured after the warm-up
    assert graphs.num_replays == (len(lengths) + 4) * len(MID.mamba_layer_ids)  # each length's second pass, then all four
    for i, (x, y) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(x, y), f"pass {i} differs"
