"""What a storage backend reports: its counters and, per batch call, its failures.

Primitives:

- :class:`BackendStatistics` — a frozen snapshot of a backend's counters (``statistics()``);
  :data:`COUNTER_NAMES` — the counters a backend keeps for it.
- :class:`BatchReport` — the failures and invalid objects of one batch call, logged as at most
  two warnings (one for failures, one for invalid objects) naming the first of each.
- :func:`describe_error` — an error as one short line of a warning.

I/O errors and timeouts of any call are counted and reported with one warning per batch; an
invalid object is a miss, counted, removed and reported the same way (the failure model is in
:mod:`storage_backends.base`). Warnings go to the ``asynccache.storage`` logger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from storage_backends.backend_core import BackendCore

__all__ = ["COUNTER_NAMES", "BackendStatistics", "BatchReport", "describe_error"]

logger = logging.getLogger("asynccache.storage")


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendStatistics:
    """Counters since the backend was opened. ``num_hits``/``num_misses`` count items of
    ``batch_get_v2`` (a corrupt or failed item is also a miss); ``num_writes`` objects stored,
    ``num_write_skips`` objects already present (put-if-absent), ``num_rejected`` writes skipped
    for lack of room (an object larger than the capacity, or room that failed deletes did not
    free), ``num_speculative_skipped`` speculative writes skipped because only regular objects
    could have made room for them, ``num_evictions`` objects deleted to make room, ``num_deletes``
    objects ``batch_delete_v2`` removed (or found absent); ``num_failures`` items of any call
    that failed on an I/O error, a timeout or a backend that is not set up (each key of a failed
    probe window; a failed delete counts once), ``num_timeouts`` of them on a timeout;
    ``used_bytes`` is ``None`` when no capacity is tracked."""

    uri: str
    num_hits: int = 0
    num_misses: int = 0
    num_corrupt: int = 0
    num_failures: int = 0
    num_timeouts: int = 0
    num_writes: int = 0
    num_write_skips: int = 0
    num_rejected: int = 0
    num_speculative_skipped: int = 0
    num_evictions: int = 0
    num_deletes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    used_bytes: int | None = None
    capacity_bytes: int | None = None


COUNTER_NAMES = tuple(f for f in BackendStatistics.__dataclass_fields__ if f.startswith(("num_", "bytes_")))


class BatchReport:
    """Failures of one batch call, reported as one warning."""

    def __init__(self, backend: BackendCore, call: str, num_items: int) -> None:
        self.backend = backend
        self.call = call
        self.num_items = num_items
        self.num_failed = 0
        self.first_failed: tuple[str, str] | None = None
        self.invalid: list[tuple[str, str]] = []

    def fail(self, name: str, error: BaseException | str, *, count: int = 1) -> None:
        """``count`` items failed with ``error`` (several when one request or step served them
        all: a probe window, the backend's setup)."""
        if self.first_failed is None:
            self.first_failed = (name, describe_error(error))
        self.num_failed += count

    def corrupt(self, name: str, error: BaseException) -> None:
        self.invalid.append((name, describe_error(error)))

    def emit(self) -> None:
        uri = self.backend.uri
        if self.first_failed is not None:
            name, why = self.first_failed
            logger.warning(
                "storage %s: %s: %d of %d items failed; first: %s: %s",
                uri, self.call, self.num_failed, self.num_items, name, why,
            )
        if self.invalid:
            name, why = self.invalid[0]
            logger.warning(
                "storage %s: %s: %d invalid objects treated as misses and removed; first: %s: %s",
                uri, self.call, len(self.invalid), name, why,
            )


def describe_error(error: BaseException | str) -> str:
    if isinstance(error, str):
        return error
    if isinstance(error, TimeoutError) and not str(error):
        return "timed out"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:300]}"
