"""Recurrent rows padded to bucket lengths, so that passes of new lengths replay CUDA graphs.

A recurrent layer's CUDA graph (``asynccache.reference.graphs``) fits one pass shape. Without
padding, a prompt of a length the process has not run before cuts into passes of new lengths,
and those run eagerly, bound by the host (docs/benchmarks.md, runs BM and BN: 2.1–3.7 × the
time of a repeated length at 1.2–2k tokens). With padding, the recurrent layers compute every
group of segments of ``m > 1`` tokens as ``bucket_length(m)`` tokens: at most 16 lengths up to
2,048, each at most 25 % (and 63 tokens) longer than the segment.

The padded tokens change nothing that is read:

- the recurrent layers see zero hidden rows there, and their gates are masked to β = 0 and
  g = 0, which leaves the state as the last real token left it (the chunked rule's own
  padding, ``asynccache.reference.gdn``); the outputs of real tokens are causal, so they
  never read a padded token;
- the conv state kept is the last ``kernel − 1`` *real* inputs (``GdnGroup.conv_tail``);
- attention layers, MLP-only layers, the KV pool and the logits see only the real rows: the
  model scatters each recurrent layer's input into the padded rows and gathers its output back.

Padding is a function of the pass's segment lengths alone, the same whether the pass then runs
eagerly or from a graph, so the same segmentation still gives the same bits. The bits differ
from an unpadded pass (matrix products of another shape may round otherwise), which is why it
is a model option (``HybridModel(bucket_passes=…)``), on by default on CUDA.

Primitives:

- :func:`bucket_length` — the padded length of a group of ``m``-token segments.
- :func:`bucket_lengths` — every padded length up to a bound (what a warm-up captures).
- :class:`RowPadding` — moving hidden rows between the pass's layout and the padded one.
- :func:`pad_recurrent_rows` — a pass context whose recurrent groups are padded.
- :func:`run_recurrent_layer` — one recurrent layer over the padded rows, eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from asynccache.reference.gdn import CHUNK_SIZE

if TYPE_CHECKING:
    from asynccache.pools import DeviceKVPool, DeviceMambaPool
    from asynccache.reference.context import GdnGroup, PassContext
    from asynccache.reference.layers import DecoderLayer

__all__ = [
    "BUCKET_MAX_TOKENS",
    "RowPadding",
    "bucket_length",
    "bucket_lengths",
    "pad_recurrent_rows",
    "run_recurrent_layer",
]

#: Passes whose padded rows would exceed this are not padded: longer passes never replay graphs
#: (``LayerGraphs.max_tokens`` defaults to it), so padding them would only add work.
BUCKET_MAX_TOKENS = 2048


def bucket_length(m: int) -> int:
    """The padded length of segments of ``m`` tokens: ``m`` for ``m ≤ 1`` (decode), else ``m``
    rounded up to a multiple of ``max(64, 2^⌈log₂ m⌉ / 8)``: four buckets an octave above 256
    tokens (64, 128, 192, 256, 320, 384, 448, 512, 640, …, 1792, 2048, 2560, …)."""
    if m < 0:
        raise ValueError(f"a segment length is >= 0, got {m}")
    if m <= 1:
        return m
    step = max(CHUNK_SIZE, 1 << max(0, (m - 1).bit_length() - 3))
    return -(-m // step) * step


def bucket_lengths(max_tokens: int = BUCKET_MAX_TOKENS) -> tuple[int, ...]:
    """Every padded length of segments of more than one token, up to ``max_tokens``, ascending."""
    out: list[int] = []
    m = 2
    while (n := bucket_length(m)) <= max_tokens:
        out.append(n)
        m = n + 1
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RowPadding:
    """The padded layout of a pass's rows: real row ``i`` is padded row ``real_rows[i]``; the
    other ``num_rows − len(real_rows)`` rows are padding."""

    num_rows: int
    real_rows: torch.Tensor  # int64 [T] device

    def pad(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ``[T, D]`` in the padded layout ``[num_rows, D]``, padding rows zero."""
        out = h.new_empty(self.num_rows, h.shape[-1])
        self.pad_into(h, out)
        return out

    def pad_into(self, h: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``h`` into ``out`` (``[num_rows, D]``) in the padded layout, padding rows zero."""
        out.zero_()
        out.index_copy_(0, self.real_rows, h)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """The real rows of ``y`` ``[num_rows, D]``, in the pass's order."""
        return y.index_select(0, self.real_rows)


def pad_recurrent_rows(ctx: PassContext, *, conv_kernel: int, max_tokens: int = BUCKET_MAX_TOKENS) -> PassContext:
    """``ctx`` with every recurrent group of ``m > 1``-token segments padded to
    :func:`bucket_length` tokens; ``ctx`` itself when the padded rows would exceed
    ``max_tokens``.

    A group already at its bucket length is marked padded too (no position is), so that it
    shares its shape, and its graphs, with the groups padded to that length. ``ctx.padding`` is
    set when some row is padded."""
    groups = ctx.gdn_groups
    lengths = [bucket_length(g.length) for g in groups]
    num_rows = sum(n * g.num_seqs for n, g in zip(lengths, groups, strict=True))
    if num_rows > max_tokens:
        return ctx
    device = ctx.token_ids.device
    moved = num_rows != ctx.num_tokens  # some row is padded: rows move
    real_rows: list[torch.Tensor] = []
    padded: list[GdnGroup] = []
    row = 0
    for g, n in zip(groups, lengths, strict=True):
        if moved:
            starts = row + n * torch.arange(g.num_seqs, dtype=torch.int64)
            real_rows.append((starts[:, None] + torch.arange(g.length, dtype=torch.int64)).flatten())
        marks = {}
        if g.length > 1:
            pads, conv_tail = _marks(n, g.length, conv_kernel, device)
            marks = {"pads": pads, "conv_tail": conv_tail}
        padded.append(dataclasses.replace(g, length=n, row_begin=row, row_end=row + n * g.num_seqs, **marks))
        row += n * g.num_seqs
    padding = RowPadding(num_rows=num_rows, real_rows=torch.cat(real_rows).to(device)) if moved else None
    return dataclasses.replace(ctx, gdn_groups=tuple(padded), padding=padding)


@functools.lru_cache(maxsize=256)
def _marks(n: int, length: int, conv_kernel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's ``pads`` and ``conv_tail`` (read-only; shared by every pass of that shape, so
    a pass does not copy them to the device again)."""
    pads = (torch.arange(n) >= length).to(device)
    conv_tail = (length + torch.arange(conv_kernel - 1, dtype=torch.int64)).to(device)
    return pads, conv_tail


def run_recurrent_layer(
    layer: DecoderLayer, h: torch.Tensor, ctx: PassContext, kv_pool: DeviceKVPool, state_pool: DeviceMambaPool
) -> torch.Tensor:
    """``layer`` (a recurrent one) over ``h`` ``[T, D]``, eagerly: through the padded rows when
    ``ctx`` has them."""
    if ctx.padding is None:
        return layer(h, ctx, kv_pool, state_pool)
    return ctx.padding.unpad(layer(ctx.padding.pad(h), ctx, kv_pool, state_pool))
