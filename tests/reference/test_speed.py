"""The prefill-speed measurement's chunked mode: the forwards a chunked prefill is cut into."""

from __future__ import annotations

import torch

from asynccache.reference.speed import (
    chunk_batches,
    make_prefill_batch,
    prefill_tokens_per_s,
)
from asynccache.spec import HybridSpec


def test_chunks_continue_each_prompt_where_the_last_one_ended() -> None:
    spec = HybridSpec.preset("tiny", page_size=4)
    batch = make_prefill_batch(spec, 10, 2)
    chunks = chunk_batches(batch, 4)
    assert [[(s.start, s.token_ids.numel(), s.state_slot) for s in c.sequences] for c in chunks] == [
        [(0, 4, 0), (0, 4, 1)],
        [(4, 4, 0), (4, 4, 1)],
        [(8, 2, 0), (8, 2, 1)],
    ]
    for i, seq in enumerate(batch.sequences):
        joined = torch.cat([c.sequences[i].token_ids for c in chunks])
        assert torch.equal(joined, seq.token_ids)
        assert all(torch.equal(c.sequences[i].kv_page_indices, seq.kv_page_indices) for c in chunks)


def test_a_chunked_prefill_is_measured_as_such() -> None:
    res = prefill_tokens_per_s("tiny", 16, 1, device="cpu", dtype=torch.float32, warmup=0, iters=1, chunk_size=8)
    assert res.chunk_size == 8 and not res.cuda_graphs and len(res.seconds) == 1
    assert res.as_dict()["chunk_size"] == 8
