"""Mooncake-format request traces (JSON Lines).

One request per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, …]}

- ``timestamp``: arrival in milliseconds from the start of the trace (:func:`load_trace`
  counts them from the first request's: a trace stamped with, say, Unix times replays the same);
- ``input_length`` / ``output_length``: token counts (no tokens are given);
- ``hash_ids``: one id per ``block_size``-token block of the input (512 in the Mooncake traces),
  the last block may be partial: ``len(hash_ids) == ceil(input_length / block_size)``. Equal ids
  mean an equal prefix up to the end of that block (the ids are prefix-chain ids).

Primitives:

- :class:`TraceRequest` — one request (frozen).
- :class:`Trace` — every request of a file, stored column-wise (numpy) so a 12k-request trace
  costs a few MB; ``trace[i]`` gives a :class:`TraceRequest`, ``trace.hash_ids_of(i)`` the ids
  as a numpy view.
- :func:`load_trace` — parse and validate a file (:class:`TraceFormatError` names the line).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from asynccache.errors import TraceFormatError

__all__ = ["MOONCAKE_BLOCK_SIZE", "Trace", "TraceFormatError", "TraceRequest", "load_trace"]

#: Tokens per hash id in the Mooncake FAST'25 traces.
MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request of a trace. ``timestamp_s`` is seconds from the start of the trace."""

    index: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """Column-wise requests: request ``i``'s ids are ``hash_ids[offsets[i]:offsets[i + 1]]``."""

    timestamps_s: np.ndarray  # float64 [n]
    input_lengths: np.ndarray  # int64 [n]
    output_lengths: np.ndarray  # int64 [n]
    offsets: np.ndarray  # int64 [n + 1]
    hash_ids: np.ndarray  # int64 [offsets[-1]]
    block_size: int = MOONCAKE_BLOCK_SIZE
    name: str = ""

    def __len__(self) -> int:
        return int(self.input_lengths.shape[0])

    def __getitem__(self, i: int) -> TraceRequest:
        return TraceRequest(
            index=i,
            timestamp_s=float(self.timestamps_s[i]),
            input_length=int(self.input_lengths[i]),
            output_length=int(self.output_lengths[i]),
            hash_ids=tuple(int(x) for x in self.hash_ids_of(i)),
        )

    def __iter__(self) -> Iterator[TraceRequest]:
        return (self[i] for i in range(len(self)))

    def hash_ids_of(self, i: int) -> np.ndarray:
        """Request ``i``'s block ids (a view, do not modify)."""
        return self.hash_ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.input_lengths.sum())

    @property
    def duration_s(self) -> float:
        return float(self.timestamps_s[-1] - self.timestamps_s[0]) if len(self) else 0.0

    @property
    def num_unique_blocks(self) -> int:
        return int(np.unique(self.hash_ids).size)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (for quick runs and tests)."""
        n = min(n, len(self))
        end = int(self.offsets[n])
        return Trace(
            timestamps_s=self.timestamps_s[:n],
            input_lengths=self.input_lengths[:n],
            output_lengths=self.output_lengths[:n],
            offsets=self.offsets[: n + 1],
            hash_ids=self.hash_ids[:end],
            block_size=self.block_size,
            name=self.name,
        )

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[tuple[float, int, int, Sequence[int]]],
        *,
        block_size: int = MOONCAKE_BLOCK_SIZE,
        name: str = "",
        where: Callable[[int], str] | None = None,
    ) -> Trace:
        """Build from ``(timestamp_s, input_length, output_length, hash_ids)`` tuples (validated;
        ``where``: how an error names request ``i``, see :func:`validate_trace`)."""
        ts = np.asarray([r[0] for r in requests], dtype=np.float64)
        inp = np.asarray([r[1] for r in requests], dtype=np.int64)
        out = np.asarray([r[2] for r in requests], dtype=np.int64)
        lens = np.asarray([len(r[3]) for r in requests], dtype=np.int64)
        offsets = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        ids = np.fromiter((int(x) for r in requests for x in r[3]), dtype=np.int64, count=int(offsets[-1]))
        trace = cls(
            timestamps_s=ts,
            input_lengths=inp,
            output_lengths=out,
            offsets=offsets,
            hash_ids=ids,
            block_size=block_size,
            name=name,
        )
        validate_trace(trace, where=where)
        return trace


def validate_trace(trace: Trace, *, where: Callable[[int], str] | None = None) -> None:
    """Check the format's invariants; raise :class:`TraceFormatError` naming the request
    (``where(i)``; default ``request i``, counted from 0; :func:`load_trace` names the file's
    line).

    - ``input_length >= 1``, ``output_length >= 0``;
    - ``len(hash_ids) == ceil(input_length / block_size)``;
    - timestamps are finite and never decrease (replay follows them);
    - hash ids are >= 0;
    - an id always has the same parent id (ids are prefix-chain ids), so equal ids mean equal
      prefixes and token synthesis from ids is consistent.
    """
    at = where or (lambda i: f"request {i}")
    bs = trace.block_size
    if bs <= 0:
        raise TraceFormatError(f"block_size must be positive, got {bs}")
    n = len(trace)
    if n == 0:
        raise TraceFormatError(f"trace {trace.name!r} has no requests")
    bad = np.flatnonzero(trace.input_lengths < 1)
    if bad.size:
        raise TraceFormatError(f"{at(int(bad[0]))}: input_length must be >= 1")
    bad = np.flatnonzero(trace.output_lengths < 0)
    if bad.size:
        raise TraceFormatError(f"{at(int(bad[0]))}: output_length must be >= 0")
    expected = -(-trace.input_lengths // bs)
    got = np.diff(trace.offsets)
    bad = np.flatnonzero(expected != got)
    if bad.size:
        i = int(bad[0])
        raise TraceFormatError(
            f"{at(i)}: {int(got[i])} hash ids for input_length {int(trace.input_lengths[i])} "
            f"(expected ceil({int(trace.input_lengths[i])}/{bs}) = {int(expected[i])})"
        )
    bad = np.flatnonzero(~np.isfinite(trace.timestamps_s))
    if bad.size:
        raise TraceFormatError(f"{at(int(bad[0]))}: timestamp must be finite")
    bad = np.flatnonzero(np.diff(trace.timestamps_s) < 0)
    if bad.size:
        raise TraceFormatError(f"{at(int(bad[0]) + 1)}: timestamp goes backwards")
    if trace.hash_ids.size and int(trace.hash_ids.min()) < 0:
        i = int(np.searchsorted(trace.offsets, int(np.flatnonzero(trace.hash_ids < 0)[0]), side="right")) - 1
        raise TraceFormatError(f"{at(i)}: hash ids must be >= 0")
    # Parent consistency: the id before each id (or -1 at a prompt start) must be unique per id.
    ids = trace.hash_ids
    parents = np.empty_like(ids)
    parents[1:] = ids[:-1]
    parents[trace.offsets[:-1]] = -1
    order = np.lexsort((parents, ids))
    sid, spar = ids[order], parents[order]
    clash = np.flatnonzero((sid[1:] == sid[:-1]) & (spar[1:] != spar[:-1]))
    if clash.size:
        k = int(clash[0])
        raise TraceFormatError(
            f"hash id {int(sid[k])} follows both {int(spar[k])} and {int(spar[k + 1])}: "
            "ids are not prefix-chain ids"
        )


def load_trace(
    path: str | PathLike[str], *, block_size: int = MOONCAKE_BLOCK_SIZE, limit: int | None = None
) -> Trace:
    """Read a Mooncake-format JSONL file (the first ``limit`` requests if given)."""
    path = Path(path)
    rows: list[tuple[float, int, int, Sequence[int]]] = []
    lines: list[int] = []  # each row's line in the file
    try:
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    rows.append(_request(json.loads(line)))
                    lines.append(lineno)
                except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError) as e:
                    raise TraceFormatError(f"{path}:{lineno}: not a Mooncake request ({e!r})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"cannot read trace {path}: {e}") from e
    except RecursionError as e:  # JSON nested too deeply for the parser
        raise TraceFormatError(f"{path}:{lineno}: not a Mooncake request (nested too deeply)") from e
    trace = Trace.from_requests(rows, block_size=block_size, name=path.stem, where=lambda i: f"{path}:{lines[i]}")
    # Times from the first request: the replay's clock steps by a fixed epsilon and policies
    # count from 0, so the same trace stamped from another origin replays the same.
    stamps = trace.timestamps_s
    stamps -= stamps[0]  # in place (the trace is frozen, its columns are its own)
    return trace


_INT64_MAX = 2**63 - 1


def _request(obj: Any) -> tuple[float, int, int, list[int]]:
    """One JSON object as ``(timestamp_s, input_length, output_length, hash_ids)``; ValueError
    (or TypeError, KeyError) for anything that is not one. The values' ranges (finite
    timestamps, ids >= 0, …) are :func:`validate_trace`'s."""
    if not isinstance(obj, dict):
        raise TypeError(f"a request is a JSON object, got {type(obj).__name__}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TypeError(f"hash_ids must be a list, got {type(ids).__name__}")
    stamp = obj["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise TypeError(f"timestamp must be a number, got {stamp!r}")
    return (
        float(stamp) / 1000.0,
        _int(obj["input_length"], "input_length"),
        _int(obj["output_length"], "output_length"),
        [_int(x, "hash id") for x in ids],
    )


def _int(value: Any, what: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _INT64_MAX:
        raise ValueError(f"{what} must be an integer within 64 bits, got {value!r}")
    return value
