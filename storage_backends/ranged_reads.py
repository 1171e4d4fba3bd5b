"""Reading a batch of objects as ranges: which work units a batch becomes, and how the ranges'
results add up to each object's outcome.

A payload larger than the range size (a Mamba state of tens of MB) is cut into ranges that go
first in the batch, so that several jobs read it at once instead of one job at the end; each
range is checksummed on its own (``PayloadChecksum(first_block=…)``), and the object is a hit only
when the ranges' partial checksums add up (mod 2⁶⁴) to the checksum its header records. Each
range opens the object on its own, so each also says which file it read (device and inode): an
object replaced between two of its ranges is a failure (read again later), not a corruption
(which would remove the valid replacement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asynccache.errors import BackendError, ObjectFormatError
from storage_backends.base import BatchItem, Outcome
from storage_backends.object_format import add_checksums

__all__ = ["item_outcomes", "read_units"]

#: A work unit: ``(item index in the batch, payload offset, length)``.
Unit = tuple[int, int, int]


def read_units(items: Sequence[BatchItem], range_bytes: int) -> list[Unit]:
    """The batch's work units: an item whose payload exceeds ``range_bytes`` as ranges of that
    size (a multiple of the checksum block), and those first; the others whole, in order."""
    big: list[Unit] = []
    small: list[Unit] = []
    for i, item in enumerate(items):
        total = item.geometry.payload_bytes
        if total <= range_bytes:
            small.append((i, 0, total))
        else:
            big.extend((i, off, min(range_bytes, total - off)) for off in range(0, total, range_bytes))
    return big + small


def item_outcomes(num_items: int, units: Sequence[Unit], results: Sequence[Any]) -> list[Outcome]:
    """Each item's outcome from its ranges' results — ``False`` (absent), an exception, or
    ``(want, partial, file)``: the header's checksum (``None`` but for the range that read the
    header), the range's partial checksum and the identity of the file it read. The first
    corruption, else the first failure, else ``False`` if a range found the object absent, else
    a failure if the ranges read different files (replaced meanwhile), else ``True`` when the
    partial checksums add up to the header's (else a corruption)."""
    parts: list[list[Any]] = [[] for _ in range(num_items)]
    for (i, _, _), result in zip(units, results, strict=True):
        parts[i].append(result)
    outcomes: list[Outcome] = []
    for results_of_item in parts:
        errors = [r for r in results_of_item if isinstance(r, BaseException)]
        if errors:
            outcomes.append(next((e for e in errors if isinstance(e, ObjectFormatError)), errors[0]))
        elif any(r is False for r in results_of_item):
            outcomes.append(False)
        elif len({file for _, _, file in results_of_item}) > 1:
            outcomes.append(BackendError("object replaced while its ranges were read"))
        else:
            want = next(w for w, _, _ in results_of_item if w is not None)
            total = add_checksums(partial for _, partial, _ in results_of_item)
            outcomes.append(True if total == want else ObjectFormatError("payload checksum mismatch"))
    return outcomes
