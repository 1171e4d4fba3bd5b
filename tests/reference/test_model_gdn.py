"""Gated delta rule math: chunked vs recurrent, block inverse, resumable conv."""

from __future__ import annotations

import pytest
import torch

from asynccache.reference.gdn import (
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
    unit_lower_inverse,
)


def make_inputs(b: int, t: int, h: int, dk: int, dv: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(b, t, h, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(b, t, h, dk, generator=gen))
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 0.3
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize(("t", "chunk"), [(1, 64), (63, 64), (64, 64), (150, 64), (150, 16), (257, 32)])
def test_chunked_matches_recurrent(t: int, chunk: int) -> None:
    q, k, v, g, beta, s0 = make_inputs(2, t, 3, 16, 8)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    assert o.shape == o_ref.shape == (2, t, 3, 8)
    assert s.shape == s_ref.shape == (2, 3, 16, 8)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 100])
def test_fewer_key_heads_read_repeated(t: int) -> None:
    """GQA: value head j reads key head j // 2 when there are half as many key heads."""
    q, k, v, g, beta, s0 = make_inputs(2, t, 4, 16, 8, seed=11)
    q2, k2 = q[:, :, ::2], k[:, :, ::2]  # 2 key heads
    q_rep, k_rep = q2.repeat_interleave(2, dim=2), k2.repeat_interleave(2, dim=2)
    o_ref, s_ref = recurrent_gated_delta_rule(q_rep, k_rep, v, g, beta, s0)
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o, s = rule(q2, k2, v, g, beta, s0)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple"):
        chunk_gated_delta_rule(q[:, :, :3], k[:, :, :3], v, g, beta, s0)


def test_zero_initial_state_is_none() -> None:
    q, k, v, g, beta, s0 = make_inputs(1, 70, 2, 8, 8)
    zeros = torch.zeros_like(s0)
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o_none, s_none = rule(q, k, v, g, beta, None)
        o_zero, s_zero = rule(q, k, v, g, beta, zeros)
        assert torch.equal(o_none, o_zero) and torch.equal(s_none, s_zero)


def test_state_carries_across_calls() -> None:
    """Two chunked calls threading the state equal one recurrent pass."""
    q, k, v, g, beta, s0 = make_inputs(1, 200, 2, 16, 16, seed=3)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o1, s1 = chunk_gated_delta_rule(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128], s0)
    o2, s2 = chunk_gated_delta_rule(q[:, 128:], k[:, 128:], v[:, 128:], g[:, 128:], beta[:, 128:], s1)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s_ref, rtol=1e-5, atol=1e-5)


def test_chunked_is_deterministic() -> None:
    inputs = make_inputs(2, 150, 3, 16, 8, seed=5)
    o1, s1 = chunk_gated_delta_rule(*inputs)
    o2, s2 = chunk_gated_delta_rule(*inputs)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_state_forgets_with_strong_decay() -> None:
    """g → −∞ wipes the state before the token is written: output depends on the token only."""
    q, k, v, g, beta, s0 = make_inputs(1, 1, 1, 8, 8)
    g = torch.full_like(g, -1e4)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    expected = k[0, 0, 0, :, None] * (beta[0, 0, 0] * v[0, 0, 0])[None, :]
    torch.testing.assert_close(s[0, 0], expected)
    torch.testing.assert_close(o[0, 0, 0], q[0, 0, 0] @ expected)


@pytest.mark.parametrize("c", [1, 2, 5, 16, 64])
def test_unit_lower_inverse(c: int) -> None:
    gen = torch.Generator().manual_seed(c)
    a = torch.tril(torch.randn(3, 2, c, c, generator=gen) * 0.3, diagonal=-1)
    a_noisy = a + torch.triu(torch.randn(3, 2, c, c, generator=gen), diagonal=0)  # ignored entries
    inv = unit_lower_inverse(a_noisy)
    eye = torch.eye(c)
    torch.testing.assert_close(inv @ (eye + a), eye.expand_as(a), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.triu(inv, diagonal=1), torch.zeros_like(inv))


def test_unit_lower_inverse_rejects_non_square_blocks() -> None:
    with pytest.raises(ValueError, match="square"):
        unit_lower_inverse(torch.zeros(3, 4))


def test_causal_conv1d_resumes_from_state() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 20, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    y, state = causal_conv1d(x, w, None)
    y1, s1 = causal_conv1d(x[:, :7], w, None)
    y2, s2 = causal_conv1d(x[:, 7:9], w, s1)  # shorter than the kernel: state mixes old and new
    y3, s3 = causal_conv1d(x[:, 9:], w, s2)
    torch.testing.assert_close(torch.cat([y1, y2, y3], dim=1), y)
    assert torch.equal(s3, state)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))
    # Against torch's conv1d with left zero padding.
    ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), w[:, None, :], groups=6)
    torch.testing.assert_close(y, torch.nn.functional.silu(ref.transpose(1, 2)))
