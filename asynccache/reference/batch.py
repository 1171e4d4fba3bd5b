"""What a forward pass computes: the inputs the scheduler hands the model, and how they are cut.

Primitives:

- :class:`SequenceInput` — one sequence's new tokens, where its KV pages and working state
  slot are, and which state snapshots to emit.
- :class:`ForwardBatch` — the sequences of one step.
- :class:`Segment` — a run of tokens computed through all layers in one go.
- :func:`plan_passes` — validate a batch and cut it into passes of segments.

Segmentation: a sequence with snapshots at positions p₁ < p₂ < … is cut at those positions into
segments ``[start, p₁), [p₁, p₂), …, [pₖ, start + n)``, and each segment runs through *all*
layers before the next one starts. A forward with snapshots at P therefore computes exactly
what separate forward calls split at P compute, bit for bit: the state emitted at p is the
state a call ending at p leaves in the working slot, and a continuation restored from it matches
a cold run split at p. A pass holds at most one segment of each sequence; segments of different
sequences share a pass when the model packs sequences (see ``HybridModel``).

::

    seq A  start=0, n=200, snapshots {64: s1, 128: s2}     seq B  start=0, n=100
    pass 0  A[0, 64)  →snapshot s1     B[0, 100)
    pass 1  A[64, 128) →snapshot s2
    pass 2  A[128, 200)                                     (packed; unpacked: one segment a pass)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asynccache.checks import as_int
from asynccache.errors import ConfigError

__all__ = ["ForwardBatch", "Segment", "SequenceInput", "plan_passes"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SequenceInput:
    """One sequence of a forward step.

    - ``token_ids``: int64 ``[n]``, n ≥ 1, the tokens to compute (positions ``[start, start+n)``),
      ids in ``[0, vocab_size)``.
    - ``start``: tokens already in the KV cache and folded into the working state.
    - ``kv_page_indices``: int64 device page indices covering positions ``[0, start + n)``;
      page ``i`` holds positions ``[i·P, (i+1)·P)``. The model writes the new tokens' K/V there.
    - ``state_slot``: the working state slot (state after ``start`` tokens, updated in place;
      ignored and overwritten when ``start == 0``).
    - ``snapshots``: ``{position p: slot}`` with ``start < p ≤ start + n``: after ``p`` tokens,
      copy every recurrent layer's state (conv and ssm) into ``slot``.

    Integers given as other integer types (NumPy, 0-d integer tensors) are kept as Python ints:
    ``start``, ``state_slot`` and ``snapshots`` (a new dict), so that positions and slots compare
    and hash by value; two keys of one position are a :class:`ConfigError`. Anything else is
    left for :func:`plan_passes` to refuse.
    """

    token_ids: torch.Tensor
    start: int
    kv_page_indices: torch.Tensor
    state_slot: int
    snapshots: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("start", "state_slot"):
            value = as_int(getattr(self, name))
            if value is not None:
                object.__setattr__(self, name, value)
        snaps = self.snapshots
        if not isinstance(snaps, Mapping):
            raise ConfigError(f"snapshots must be a mapping of positions to slots, got {type(snaps).__name__}")
        ints: dict[object, object] = {}
        for p, slot in snaps.items():
            key = _int_or_same(p)
            if key in ints:
                raise ConfigError(f"snapshot position {key} is given twice")
            ints[key] = _int_or_same(slot)
        object.__setattr__(self, "snapshots", ints)

    @property
    def num_new_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def end(self) -> int:
        """Tokens in the cache after this step."""
        return self.start + self.num_new_tokens


def _int_or_same(value: object) -> object:
    n = as_int(value)
    return value if n is None else n


@dataclass(frozen=True, slots=True, eq=False)
class ForwardBatch:
    """The sequences of one forward step; logits come back in this order."""

    sequences: tuple[SequenceInput, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequences", tuple(self.sequences))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Segment:
    """Tokens ``[start, start + len(token_ids))`` of sequence ``seq_index``, computed in one go."""

    seq_index: int
    token_ids: torch.Tensor
    start: int
    kv_page_indices: torch.Tensor  # pages covering [0, end)
    state_slot: int
    snapshot_slot: int | None  # copy the state after `end` tokens here
    is_last: bool  # the sequence's logits come from this segment's last token

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def end(self) -> int:
        return self.start + self.length


def _validate(seq: SequenceInput, i: int, *, page_size: int, num_pages: int, vocab_size: int) -> None:
    ids = seq.token_ids
    for name in ("token_ids", "kv_page_indices"):
        if not isinstance(getattr(seq, name), torch.Tensor):
            raise ConfigError(f"sequence {i}: {name} must be a 1-D int64 torch.Tensor, got {type(getattr(seq, name)).__name__}")
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() < 1:
        raise ConfigError(f"sequence {i}: token_ids must be a non-empty 1-D int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    # Host tensors only: on the device the check would wait for it (an out-of-range id there is
    # a device-side assert).
    if ids.device.type == "cpu" and vocab_size and not bool(((ids >= 0) & (ids < vocab_size)).all()):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0].item()
        raise ConfigError(f"sequence {i}: token id {bad} outside the vocabulary [0, {vocab_size})")
    if as_int(seq.start) is None or seq.start < 0:
        raise ConfigError(f"sequence {i}: start must be an int >= 0, got {seq.start!r}")
    pages = seq.kv_page_indices
    if pages.dim() != 1 or pages.dtype != torch.int64:
        raise ConfigError(f"sequence {i}: kv_page_indices must be a 1-D int64 tensor")
    need = -(-seq.end // page_size)
    if pages.numel() < need:
        raise ConfigError(f"sequence {i}: {pages.numel()} KV pages cannot hold {seq.end} tokens (page size {page_size})")
    if pages.device.type == "cpu" and need and not bool(((pages[:need] >= 0) & (pages[:need] < num_pages)).all()):
        raise ConfigError(f"sequence {i}: KV page index outside the pool's {num_pages} pages")
    for p, slot in seq.snapshots.items():
        if as_int(p) is None or not seq.start < p <= seq.end:
            raise ConfigError(f"sequence {i}: snapshot position {p} outside ({seq.start}, {seq.end}]")
        if slot == seq.state_slot:
            raise ConfigError(f"sequence {i}: snapshot slot {slot} is the working slot")


def _segments(seq: SequenceInput, i: int, page_size: int) -> list[Segment]:
    cuts = sorted(p for p in seq.snapshots if p < seq.end)
    bounds = [seq.start, *cuts, seq.end]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        out.append(
            Segment(
                seq_index=i,
                token_ids=seq.token_ids[lo - seq.start : hi - seq.start],
                start=lo,
                kv_page_indices=seq.kv_page_indices[: -(-hi // page_size)],
                state_slot=seq.state_slot,
                snapshot_slot=seq.snapshots.get(hi),
                is_last=hi == seq.end,
            )
        )
    return out


def plan_passes(
    sequences: Sequence[SequenceInput], *, page_size: int, num_pages: int, num_slots: int, pack: bool,
    vocab_size: int = 0,
) -> list[tuple[Segment, ...]]:
    """Validate the batch and cut it into passes (see the module docstring).

    Checked (a :class:`ConfigError`): shapes and dtypes, working and snapshot slots, snapshot
    positions, and — for tensors in host memory, as checking device tensors would synchronise
    the host — KV page indices against ``num_pages`` and token ids against ``vocab_size``
    (0: not checked).

    ``pack=True``: pass ``j`` holds the ``j``-th segment of every sequence that has one, longest
    first (so equal lengths are adjacent). ``pack=False``: one segment per pass, sequence by
    sequence, so a sequence's result cannot depend on the others.
    """
    if not sequences:
        raise ConfigError("a forward batch needs at least one sequence")
    for i, seq in enumerate(sequences):  # integers in range before the slots are compared
        for slot in (seq.state_slot, *seq.snapshots.values()):
            if as_int(slot) is None or not 0 <= slot < num_slots:
                raise ConfigError(f"sequence {i}: state slot {slot!r} is not an int or outside the pool's {num_slots} slots")
    working = [s.state_slot for s in sequences]
    snaps = [slot for s in sequences for slot in s.snapshots.values()]
    if len(set(working)) != len(working):
        raise ConfigError(f"two sequences share a working state slot: {working}")
    if len(set(snaps)) != len(snaps) or set(snaps) & set(working):
        raise ConfigError("snapshot slots must be distinct from each other and from every working slot")
    per_seq = []
    for i, seq in enumerate(sequences):
        _validate(seq, i, page_size=page_size, num_pages=num_pages, vocab_size=vocab_size)
        per_seq.append(_segments(seq, i, page_size))
    if not pack:
        return [(seg,) for segs in per_seq for seg in segs]
    depth = max(len(segs) for segs in per_seq)
    passes = []
    for j in range(depth):
        segs = [s[j] for s in per_seq if len(s) > j]
        passes.append(tuple(sorted(segs, key=lambda s: -s.length)))
    return passes

