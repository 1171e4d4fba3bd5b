"""The blocks of the reference hybrid model, computing on packed rows of one pass.

Primitives:

- :class:`RMSNorm`.
- :class:`Attention` — GQA attention with per-head q/k RMSNorm and RoPE. Writes the new tokens'
  K/V into the paged device KV pool, then reads every key ``[0, end)`` back from the pool and
  attends with SDPA (so prefix keys and new keys go through the same rounding): query heads
  share their KV head inside the kernel (``enable_gqa``), and a chunk that continues a prefix
  uses a bottom-right aligned causal mask (``causal_lower_right``), which the fused kernels take
  as such instead of an explicit mask. On CUDA the cuDNN backend of SDPA is left out: it builds
  an execution plan for every new sequence length (~60 ms each on an H200, over a second for
  some), which a server sees on nearly every prompt; flash attention has no such cost.
- :class:`GatedDeltaNet` — Qwen3-Next's linear attention: fused q/k/v/z and b/a projections, a
  short causal conv over q/k/v with SiLU, L2-normed q/k, β = σ(b),
  g = −exp(A_log)·softplus(a + dt_bias), the gated delta rule (chunked for prefill, recurrent for
  single tokens), a z-gated RMSNorm and the output projection. Reads the working state slot, writes
  it back and writes snapshots. Segments padded to a bucket length
  (``asynccache.reference.padding``) have their padded positions' gates masked to β = 0, g = 0.
- :class:`MLP` — SwiGLU.
- :class:`DecoderLayer` — pre-norm residual block: norm → mixer → residual → norm → MLP → residual.

Parameter names follow Hugging Face's Qwen3-Next where one exists (``linear_attn.in_proj_qkvz``,
``linear_attn.in_proj_ba``, ``conv1d``, ``A_log``, ``dt_bias``, ``input_layernorm`` …); fused
projections use vLLM's names (``self_attn.qkv_proj``, ``mlp.gate_up_proj``). Unlike a released
Qwen3-Next checkpoint, ``in_proj_qkvz`` rows are laid out ``[q | k | v | z]`` (not interleaved
per key head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from asynccache.errors import ConfigError
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference.context import PassContext
from asynccache.reference.gdn import (
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from asynccache.reference.rope import apply_rope
from asynccache.spec import HybridSpec

__all__ = ["MLP", "RMS_EPS", "Attention", "DecoderLayer", "GatedDeltaNet", "RMSNorm"]

RMS_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, RMS_EPS)


class Attention(nn.Module):
    def __init__(self, spec: HybridSpec, layer_id: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        d = self.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * d, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, spec.hidden_size, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(d, dtype=dtype)
        self.k_norm = RMSNorm(d, dtype=dtype)

    def forward(self, x: torch.Tensor, ctx: PassContext, kv_pool: DeviceKVPool) -> torch.Tensor:
        t = x.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).view(t, h + 2 * hk, d).split([h, hk, hk], dim=1)
        q = apply_rope(self.q_norm(q), ctx.rope_cos, ctx.rope_sin)
        k = apply_rope(self.k_norm(k), ctx.rope_cos, ctx.rope_sin)
        k_cache, v_cache = kv_pool.kv_cache(self.layer_id)
        k_cache[ctx.kv_write_pages, ctx.kv_write_offsets] = k.to(k_cache.dtype)
        v_cache[ctx.kv_write_pages, ctx.kv_write_offsets] = v.to(v_cache.dtype)

        out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
        for span in ctx.attn_spans:
            keys = k_cache[span.pages].flatten(0, 1)[: span.end].to(x.dtype)  # [S, hk, d]
            vals = v_cache[span.pages].flatten(0, 1)[: span.end].to(x.dtype)
            qs = q[span.row_begin : span.row_end].transpose(0, 1)[None]  # [1, h, n, d]
            ks = keys.transpose(0, 1)[None]  # [1, hk, S, d]: query head i reads key head i // (h / hk)
            vs = vals.transpose(0, 1)[None]
            n = span.row_end - span.row_begin
            # Query i sits at position end - n + i: a bottom-right aligned causal mask (the usual
            # causal mask when the span starts at 0), which the fused kernels take as such.
            mask = causal_lower_right(n, span.end) if n > 1 else None
            o = _sdpa(qs, ks, vs, mask)
            out[span.row_begin : span.row_end] = o[0].transpose(0, 1)
        if ctx.decode is not None:
            dg = ctx.decode
            b = dg.row_end - dg.row_begin
            # Padding keys (past a sequence's end) may hold any bits, NaN included: zero them,
            # since a masked score is only -inf-biased by the fused kernels and 0 · NaN = NaN.
            valid = dg.key_mask[:, 0, 0, :, None, None]  # [B, L, 1, 1]
            keys = k_cache[dg.page_table].flatten(1, 2).to(x.dtype).masked_fill(~valid, 0)  # [B, L, hk, d]
            vals = v_cache[dg.page_table].flatten(1, 2).to(x.dtype).masked_fill(~valid, 0)
            qs = q[dg.row_begin : dg.row_end][:, :, None, :]  # [B, h, 1, d]
            o = _sdpa(qs, keys.transpose(1, 2), vals.transpose(1, 2), dg.key_mask)
            out[dg.row_begin : dg.row_end] = o.view(b, h, d)
        return self.o_proj(out.view(t, h * d))


#: SDPA backends on CUDA: all but cuDNN (see the module docstring).
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | CausalBias | None) -> torch.Tensor:
    """GQA SDPA; a bottom-right causal mask that is not square dispatches straight to a fused
    kernel, everything else chooses among ``_CUDA_SDPA_BACKENDS`` on CUDA."""
    if not q.is_cuda or (isinstance(mask, CausalBias) and mask.seq_len_q != mask.seq_len_kv):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with sdpa_kernel(_CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: HybridSpec, layer_id: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        geo = spec.linear
        if geo is None or geo.kind != "gated_deltanet":
            raise ConfigError(f"the reference model runs gated_deltanet layers, not {geo and geo.kind!r}")
        self.layer_id = layer_id
        self.num_k_heads, self.k_dim = geo.num_k_heads, geo.head_k_dim
        self.num_v_heads, self.v_dim = geo.num_heads, geo.head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"{self.num_v_heads} value heads are not a multiple of {self.num_k_heads} key heads")
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv_kernel = geo.conv_kernel
        hidden = spec.hidden_size
        self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + self.value_size, bias=False, dtype=dtype)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False, dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.conv_kernel, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = RMSNorm(self.v_dim, dtype=dtype)
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, ctx: PassContext, state_pool: DeviceMambaPool) -> torch.Tensor:
        t = x.shape[0]
        hk, dk, hv, dv = self.num_k_heads, self.k_dim, self.num_v_heads, self.v_dim
        qkvz = self.in_proj_qkvz(x)
        ba = self.in_proj_ba(x).float()
        state = state_pool.state(self.layer_id)
        conv_pool, ssm_pool = state["conv"], state["ssm"]
        weight = self.conv1d.weight[:, 0]
        neg_a = -self.A_log.float().exp()
        dt_bias = self.dt_bias.float()
        out = torch.empty(t, self.value_size, dtype=x.dtype, device=x.device)
        for grp in ctx.gdn_groups:
            b, m = grp.num_seqs, grp.length
            rows = slice(grp.row_begin, grp.row_end)
            mixed = qkvz[rows].view(b, m, -1)
            conv_in, z = mixed[..., : self.conv_dim], mixed[..., self.conv_dim :]
            if grp.all_fresh:
                conv0, ssm0 = None, None
            else:
                conv0 = conv_pool[grp.state_slots]
                ssm0 = ssm_pool[grp.state_slots].float()
                if grp.fresh is not None:  # some segments start a sequence: their state is zero
                    conv0 = conv0.masked_fill(grp.fresh[:, None, None], 0)
                    ssm0 = ssm0.masked_fill(grp.fresh[:, None, None, None], 0)
            y, conv_new = causal_conv1d(conv_in, weight, conv0, tail=grp.conv_tail)
            q, k, v = y.split([self.key_size, self.key_size, self.value_size], dim=-1)
            q = l2norm(q.view(b, m, hk, dk), scale=dk**-0.5)
            k = l2norm(k.view(b, m, hk, dk))  # GQA: value head j reads key head j // (hv / hk)
            v = v.view(b, m, hv, dv)
            b_gate, a_gate = ba[rows].view(b, m, 2 * hv).split(hv, dim=-1)
            beta = b_gate.sigmoid()
            g = neg_a * F.softplus(a_gate + dt_bias)
            if grp.pads is not None:  # padded positions leave the state alone: β = 0, g = 0
                beta = beta.masked_fill(grp.pads[:, None], 0.0)
                g = g.masked_fill(grp.pads[:, None], 0.0)
            rule = recurrent_gated_delta_rule if m == 1 else chunk_gated_delta_rule
            o, ssm_new = rule(q, k, v, g, beta, ssm0)
            out[rows] = self._gated_norm(o, z.reshape(b, m, hv, dv)).reshape(b * m, self.value_size)
            conv_new = conv_new.to(conv_pool.dtype)
            ssm_new = ssm_new.to(ssm_pool.dtype)
            conv_pool[grp.state_slots] = conv_new
            ssm_pool[grp.state_slots] = ssm_new
            if grp.snapshot_index is not None:
                conv_pool[grp.snapshot_slots] = conv_new[grp.snapshot_index]
                ssm_pool[grp.snapshot_slots] = ssm_new[grp.snapshot_index]
        return self.out_proj(out)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values, times ``weight · silu(z)`` (fp32, cast to ``z``'s dtype)."""
        normed = F.rms_norm(o.float(), (o.shape[-1],), self.norm.weight.float(), RMS_EPS)
        # z is a view of the projection output: only its fp32 copy may be activated in place.
        return normed.mul_(F.silu(z.float(), inplace=z.dtype != torch.float32)).to(z.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One global layer id: attention, gated DeltaNet, or (neither) an MLP-only block."""

    def __init__(self, spec: HybridSpec, layer_id: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        is_attn, is_linear = spec.layer_kind(layer_id)
        if is_attn and is_linear:
            raise ConfigError(f"layer {layer_id} is both attention and recurrent; the reference model runs one per layer")
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(spec.hidden_size, dtype=dtype)
        self.self_attn = Attention(spec, layer_id, dtype=dtype) if is_attn else None
        self.linear_attn = GatedDeltaNet(spec, layer_id, dtype=dtype) if is_linear else None
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, dtype=dtype)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size, dtype=dtype)

    def forward(
        self, h: torch.Tensor, ctx: PassContext, kv_pool: DeviceKVPool, state_pool: DeviceMambaPool
    ) -> torch.Tensor:
        if self.self_attn is not None:
            h = h + self.self_attn(self.input_layernorm(h), ctx, kv_pool)
        elif self.linear_attn is not None:
            h = h + self.linear_attn(self.input_layernorm(h), ctx, state_pool)
        return h + self.mlp(self.post_attention_layernorm(h))

