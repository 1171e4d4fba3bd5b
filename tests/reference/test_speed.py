"""The prefill-speed measurement: the forwards a chunked prefill is cut into, prompts of new
lengths, and the bucket modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asynccache.errors import ConfigError
from asynccache.reference.speed import (
    chunk_batches,
    main,
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


def test_new_lengths_and_both_bucket_modes_from_the_command_line(tmp_path: Path) -> None:
    """``--length-step``: each iteration a length not run before; ``--bucket-passes both``: the
    same iterations without, then with padding to bucket lengths."""
    out = tmp_path / "speed.jsonl"
    args = ["--preset", "tiny", "--seq-len", "16", "--batch", "2", "--device", "cpu", "--iters", "2"]
    assert main([*args, "--length-step", "3", "--bucket-passes", "both", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["bucket_passes"] for r in rows] == [False, True]
    for r in rows:
        assert r["lengths"] == [19, 22] and r["length_step"] == 3  # the warm-up took 16
        rates = sorted(2 * n / s for n, s in zip(r["lengths"], r["seconds"], strict=True))
        assert r["tokens_per_s"] == round(sum(rates) / 2, 1)
    res = prefill_tokens_per_s("tiny", 16, 1, device="cpu", dtype=torch.float32, warmup=0, iters=1)
    assert res.lengths == (16,) and not res.bucket_passes  # one length; no padding on the CPU by default
    with pytest.raises(ConfigError, match="length_step"):
        prefill_tokens_per_s("tiny", 16, 1, device="cpu", dtype=torch.float32, length_step=-1)
