"""Recurrent rows padded to bucket lengths (``asynccache.reference.padding``), on CPU in fp32:
the buckets, the pass shapes they make repeat, and a padded forward computing what an unpadded
one computes — logits, working states, snapshots and KV pages — while touching nothing else."""

from __future__ import annotations

import pytest
import torch
from test_model import SPEC, make_pools, make_tokens, run, seq, state_of

from asynccache.reference import HybridModel
from asynccache.reference.batch import plan_passes
from asynccache.reference.context import build_pass_context
from asynccache.reference.graphs import pass_shape
from asynccache.reference.padding import (
    BUCKET_MAX_TOKENS,
    bucket_length,
    bucket_lengths,
    pad_recurrent_rows,
)


def test_buckets() -> None:
    assert [bucket_length(m) for m in (0, 1, 2, 63, 64, 65, 256, 257, 320, 321, 513, 1025, 2048)] == [
        0, 1, 64, 64, 64, 128, 256, 320, 320, 384, 640, 1280, 2048,
    ]  # fmt: skip
    previous = 0
    for m in range(2, 4 * BUCKET_MAX_TOKENS):
        b = bucket_length(m)
        assert b >= previous and b % 64 == 0 and bucket_length(b) == b
        assert b - m < max(64, m // 4), m  # at most 63 tokens or a quarter more
        previous = b
    assert len({bucket_length(m) for m in range(2, BUCKET_MAX_TOKENS + 1)}) == 16
    with pytest.raises(ValueError):
        bucket_length(-1)


def _ctx(lengths: list[int], *, pad: bool) -> object:
    seqs = [seq(make_tokens(n, seed=n), 64, list(range(40)), i) for i, n in enumerate(lengths)]
    (segments,) = plan_passes(seqs, page_size=SPEC.page_size, num_pages=40, num_slots=8, pack=True)
    ctx = build_pass_context(segments, page_size=SPEC.page_size, head_dim=SPEC.head_dim, device=torch.device("cpu"))
    assert SPEC.linear is not None
    return pad_recurrent_rows(ctx, conv_kernel=SPEC.linear.conv_kernel) if pad else ctx


def test_new_lengths_in_one_bucket_share_a_pass_shape() -> None:
    """What makes a CUDA graph replay for a prompt of a new length: the shape it is keyed on."""
    for lengths in ([1090, 1111, 1280], [17, 40, 63], [130, 150, 192]):
        assert len({pass_shape(_ctx([n], pad=True)) for n in lengths}) == 1  # type: ignore[arg-type]
        assert len({pass_shape(_ctx([n], pad=False)) for n in lengths}) == 3  # type: ignore[arg-type]
    # A packed pass: each group padded on its own, decode rows untouched.
    a, b = _ctx([100, 100, 37, 1, 1], pad=True), _ctx([120, 120, 50, 1, 1], pad=True)
    assert pass_shape(a) == pass_shape(b)  # type: ignore[arg-type]
    assert a.recurrent_tokens == 2 * 128 + 64 + 2 and a.num_tokens == 239  # type: ignore[attr-defined]
    # Past the graphs' limit nothing is padded (those passes run eagerly either way).
    assert _ctx([BUCKET_MAX_TOKENS + 1], pad=True).padding is None  # type: ignore[attr-defined]
    # Segments at a bucket length: no row is padded, yet the shape is that of padded ones.
    exact = _ctx([128], pad=True)
    assert exact.padding is None and exact.gdn_groups[0].pads is not None  # type: ignore[attr-defined]
    assert pass_shape(exact) == pass_shape(_ctx([100], pad=True))  # type: ignore[arg-type]


async def test_padded_forward_computes_what_an_unpadded_one_does() -> None:
    """A packed batch of several groups (two sequences of one length, one of another, two
    decode rows; fresh and continuing; snapshots), then decode steps: the padded model agrees
    with the unpadded one to fp32 rounding, and writes exactly the same KV pages and slots."""
    prompts = [make_tokens(n, seed=n) for n in (100, 100, 37)]
    pages = [[0, 1, 2, 3], [4, 5], [6]]
    results = []
    for bucket in (False, True):
        model = HybridModel(SPEC, seed=2, pack_sequences=True, bucket_passes=bucket)
        kv, st = make_pools()
        await run(model, kv, st, seq(prompts[0][:40], 0, pages[0], 0))  # a continuing sequence
        await run(model, kv, st, seq(make_tokens(1, seed=7), 0, [7], 3))  # two decoding ones
        await run(model, kv, st, seq(make_tokens(1, seed=8), 0, [8], 4))
        steps = [
            await run(
                model, kv, st,
                seq(prompts[0], 40, pages[0], 0, {100: 8}),
                seq(prompts[1], 0, pages[1], 1, {64: 9}),
                seq(prompts[2], 0, pages[2], 2),
                seq(make_tokens(1, seed=9), 1, [7], 3),
                seq(make_tokens(1, seed=10), 1, [8], 4),
            )
        ]  # fmt: skip
        ends = [140, 100, 37, 2, 2]
        for _ in range(2):
            nxt = steps[-1].argmax(-1)
            steps.append(
                await run(model, kv, st, *(seq(nxt[i : i + 1], ends[i], pg, i) for i, pg in enumerate([*pages, [7], [8]])))
            )
            ends = [e + 1 for e in ends]
        caches = [t.clone() for lid in SPEC.attention_layer_ids for t in kv.kv_cache(lid)]
        caches += [t.clone() for lid in SPEC.mamba_layer_ids for t in st.state(lid).values()]
        results.append((steps, caches))
    (steps_u, caches_u), (steps_p, caches_p) = results
    for u, p in zip(steps_u, steps_p, strict=True):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, u, rtol=1e-5, atol=1e-5)
        assert torch.equal(p.argmax(-1), u.argmax(-1))
    # The pools were filled with NaN bytes: the same entries stay untouched, the rest agree.
    for before, after in zip(caches_u, caches_p, strict=True):
        assert torch.equal(before.isnan(), after.isnan())
        assert not before.isnan().all()  # something was written
        torch.testing.assert_close(after.nan_to_num(), before.nan_to_num(), rtol=1e-5, atol=1e-5)


async def test_padded_state_is_the_state_after_the_real_tokens() -> None:
    """The state a padded pass leaves equals that of the same tokens computed one at a time
    (the exact recurrence, never padded): padding neither advances the recurrence nor keeps
    padded conv inputs."""
    ids = make_tokens(37)
    model = HybridModel(SPEC, seed=4, bucket_passes=True)
    kv, st = make_pools()
    await run(model, kv, st, seq(ids, 0, [0, 1, 2], 0))
    kv2, st2 = make_pools()
    for i in range(37):
        await run(model, kv2, st2, seq(ids[i : i + 1], i, [0, 1, 2], 0))
    for key, value in state_of(st2, 0).items():
        torch.testing.assert_close(state_of(st, 0)[key], value, rtol=1e-4, atol=1e-4)


def test_bucket_lengths() -> None:
    """Every padded length up to a bound, ascending: what a warm-up computes."""
    assert bucket_lengths() == tuple(sorted({bucket_length(m) for m in range(2, BUCKET_MAX_TOKENS + 1)}))
    assert len(bucket_lengths()) == 16 and bucket_lengths()[-1] == BUCKET_MAX_TOKENS
    assert bucket_lengths(63) == () and bucket_lengths(64) == (64,) and bucket_lengths(700) == (
        64, 128, 192, 256, 320, 384, 448, 512, 640,
    )  # fmt: skip
