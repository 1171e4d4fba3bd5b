"""Device-side description of one pass: packed tokens, KV addresses, state slots, groups.

Primitives:

- :class:`PassContext` — everything the layers of one pass read, built once per pass and
  shared by every layer: packed token ids and absolute positions, RoPE angles, the page and
  offset each new token's K/V goes to, per-segment attention spans, the recurrent groups and the
  rows whose logits are wanted.
- :class:`AttnSpan` — one segment's rows and the pages holding its keys ``[0, end)``.
- :class:`DecodeGroup` — single-token segments attended together (padded page table + mask).
- :class:`GdnGroup` — segments of equal length, run through the recurrent layers as one batch
  (possibly padded to a bucket length: ``asynccache.reference.padding``).
- :func:`build_pass_context`.

Packed rows follow the pass's segment order; segments of equal length are adjacent (the planner
sorts them longest first), so every group is a contiguous row range::

    rows   [ seg0 (len 8) | seg1 (len 8) | seg2 (len 3) | seg3 (1) | seg4 (1) ]
    groups [ GdnGroup(len 8, 2 seqs)     | GdnGroup(3)  | GdnGroup(1, 2 seqs) ]
    attn   [ AttnSpan     | AttnSpan     | AttnSpan     | DecodeGroup (2)     ]
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import torch

from asynccache.reference.batch import Segment
from asynccache.reference.padding import RowPadding
from asynccache.reference.rope import rope_cos_sin

__all__ = ["AttnSpan", "DecodeGroup", "GdnGroup", "PassContext", "build_pass_context"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AttnSpan:
    """A segment's query rows ``[row_begin, row_end)``: keys ``[0, end)`` live in ``pages``."""

    row_begin: int
    row_end: int
    start: int
    end: int
    pages: torch.Tensor  # int64 device, covering [0, end)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DecodeGroup:
    """Single-token segments in rows ``[row_begin, row_end)``, attended in one batched call."""

    row_begin: int
    row_end: int
    page_table: torch.Tensor  # int64 [B, max_pages], rows padded with a valid page
    key_mask: torch.Tensor  # bool [B, 1, 1, max_pages · P]: key j is valid (j < end)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GdnGroup:
    """``num_seqs`` segments of ``length`` tokens each in rows ``[row_begin, row_end)``."""

    length: int
    num_seqs: int
    row_begin: int
    row_end: int
    state_slots: torch.Tensor  # int64 [B] device: working slots (read, then written)
    fresh: torch.Tensor | None  # bool [B] device: segment starts at 0 (state = zeros); None: none do
    all_fresh: bool
    snapshot_index: torch.Tensor | None  # int64 [k] device: group members that emit a snapshot
    snapshot_slots: torch.Tensor | None  # int64 [k] device: where
    # Set when the segments are padded to ``length`` (asynccache.reference.padding): bool
    # ``[length]`` device, True at the padded positions; and int64 ``[conv_kernel - 1]``
    # device, the positions of the last real conv inputs in the conv's input window.
    pads: torch.Tensor | None = None
    conv_tail: torch.Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PassContext:
    segments: tuple[Segment, ...]
    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    rope_cos: torch.Tensor  # fp32 [T, 1, head_dim // 2]
    rope_sin: torch.Tensor
    kv_write_pages: torch.Tensor  # int64 [T]
    kv_write_offsets: torch.Tensor  # int64 [T]
    attn_spans: tuple[AttnSpan, ...]
    decode: DecodeGroup | None
    gdn_groups: tuple[GdnGroup, ...]
    logit_rows: torch.Tensor  # int64 [k] device: last row of every segment that ends its sequence
    logit_seq_indices: tuple[int, ...]
    # The recurrent layers' rows when ``gdn_groups`` are padded (asynccache.reference.padding).
    padding: RowPadding | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def recurrent_tokens(self) -> int:
        """The rows the recurrent layers compute: ``num_tokens`` plus any padding."""
        return self.num_tokens if self.padding is None else self.padding.num_rows


def build_pass_context(
    segments: tuple[Segment, ...], *, page_size: int, head_dim: int, device: torch.device
) -> PassContext:
    """Lay out a pass's segments as packed rows and move the indices the layers need to ``device``."""
    token_ids, positions, write_pages = [], [], []
    rows: list[tuple[int, int]] = []
    row = 0
    for seg in segments:
        pos = torch.arange(seg.start, seg.end, dtype=torch.int64)
        token_ids.append(seg.token_ids.to("cpu", torch.int64))
        positions.append(pos)
        write_pages.append(seg.kv_page_indices.to("cpu")[pos // page_size])
        rows.append((row, row + seg.length))
        row += seg.length
    pos_all = torch.cat(positions)
    positions_d = pos_all.to(device)
    cos, sin = rope_cos_sin(positions_d, head_dim)

    singles = [i for i, seg in enumerate(segments) if seg.length == 1]
    decode = None
    if len(singles) > 1:  # batched decode attention; singles are the last rows (longest first)
        decode = _decode_group([segments[i] for i in singles], rows[singles[0]][0], page_size, device)
        spans_for = [i for i in range(len(segments)) if i not in set(singles)]
    else:
        spans_for = list(range(len(segments)))
    attn_spans = tuple(
        AttnSpan(
            row_begin=rows[i][0],
            row_end=rows[i][1],
            start=segments[i].start,
            end=segments[i].end,
            pages=segments[i].kv_page_indices.to(device),
        )
        for i in spans_for
    )

    groups = []
    for length, members in groupby(range(len(segments)), key=lambda i: segments[i].length):
        idx = list(members)
        segs = [segments[i] for i in idx]
        fresh = [s.start == 0 for s in segs]
        snap = [(j, s.snapshot_slot) for j, s in enumerate(segs) if s.snapshot_slot is not None]
        groups.append(
            GdnGroup(
                length=length,
                num_seqs=len(idx),
                row_begin=rows[idx[0]][0],
                row_end=rows[idx[-1]][1],
                state_slots=torch.tensor([s.state_slot for s in segs], dtype=torch.int64).to(device),
                fresh=torch.tensor(fresh).to(device) if any(fresh) and not all(fresh) else None,
                all_fresh=all(fresh),
                snapshot_index=torch.tensor([j for j, _ in snap], dtype=torch.int64).to(device) if snap else None,
                snapshot_slots=torch.tensor([s for _, s in snap], dtype=torch.int64).to(device) if snap else None,
            )
        )

    last = [(rows[i][1] - 1, seg.seq_index) for i, seg in enumerate(segments) if seg.is_last]
    return PassContext(
        segments=segments,
        token_ids=torch.cat(token_ids).to(device),
        positions=positions_d,
        rope_cos=cos,
        rope_sin=sin,
        kv_write_pages=torch.cat(write_pages).to(device),
        kv_write_offsets=(pos_all % page_size).to(device),
        attn_spans=attn_spans,
        decode=decode,
        gdn_groups=tuple(groups),
        logit_rows=torch.tensor([r for r, _ in last], dtype=torch.int64).to(device),
        logit_seq_indices=tuple(s for _, s in last),
    )


def _decode_group(segs: list[Segment], row_begin: int, page_size: int, device: torch.device) -> DecodeGroup:
    max_pages = max(int(s.kv_page_indices.numel()) for s in segs)
    table = torch.empty(len(segs), max_pages, dtype=torch.int64)
    for b, s in enumerate(segs):
        pages = s.kv_page_indices.to("cpu")
        table[b, : pages.numel()] = pages
        table[b, pages.numel() :] = pages[0]
    ends = torch.tensor([s.end for s in segs], dtype=torch.int64)
    mask = torch.arange(max_pages * page_size)[None, :] < ends[:, None]
    return DecodeGroup(
        row_begin=row_begin,
        row_end=row_begin + len(segs),
        page_table=table.to(device),
        key_mask=mask[:, None, None, :].to(device),
    )
