"""Byte accounting of a backend's stored objects against a capacity, with LRU eviction.

Primitives:

- :class:`LRUCapacity` — stored bytes against ``capacity_bytes``: ``reserve`` room for a new
  object (choosing least-recently-used victims), then ``commit`` or ``release`` the
  reservation; ``busy`` marks objects being read or written, which are never chosen; ``load``
  adds the objects found on first use, ``touch`` / ``discard`` follow reads and absent objects;
  ``take`` takes objects out to delete them and ``restore`` puts back those whose delete failed;
  ``excess_bytes`` is what the index counts beyond the capacity.

The index counts more than the capacity only when deletes failed (their objects are counted
again) or the first-use scan found more: the room the reservations took is then not there, and
the writer skips new objects until the index is back within the capacity (see
:mod:`storage_backends.batch_io`), so the store does not outgrow it through this process.

The index is the backend's view of its namespace: it covers the objects written through this
process and those its first-use scan found, so it may hold objects another process removed
(a later read's miss drops them) and miss objects another process wrote.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

__all__ = ["LRUCapacity"]


class LRUCapacity:
    """Stored bytes against a capacity, with LRU victims. Event-loop only (not thread-safe).

    ``reserve`` counts a new object's bytes before it is written and picks victims (removed
    from the index at once, so concurrent writers never pick the same victim); ``commit`` /
    ``release`` settle the reservation. An object the index already holds reserves nothing (a
    put of it is a put-if-absent that finds it) and is never its own victim. A victim (or an
    object taken out with ``take``) whose delete fails is still stored: ``restore`` counts it
    again, so the index never counts less than what its deletes left."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._busy: Counter[str] = Counter()

    def load(self, entries: Iterable[tuple[str, int]]) -> None:
        """Add existing objects, least recently used first."""
        for name, size in entries:
            if name not in self._sizes:
                self._sizes[name] = size
                self.used_bytes += size

    def touch(self, name: str) -> None:
        if name in self._sizes:
            self._sizes.move_to_end(name)

    def discard(self, name: str) -> None:
        size = self._sizes.pop(name, None)
        if size is not None:
            self.used_bytes -= size

    def holds(self, name: str) -> bool:
        return name in self._sizes

    def take(self, names: Iterable[str]) -> list[tuple[str, int]]:
        """Take the objects the index holds among ``names`` out of it, to delete them: their
        ``(name, size)``, for :meth:`restore` should the delete fail."""
        taken = [(name, self._sizes[name]) for name in dict.fromkeys(names) if name in self._sizes]
        for name, _ in taken:
            self.discard(name)
        return taken

    def restore(self, entries: Sequence[tuple[str, int]]) -> None:
        """Count again objects that :meth:`take` or :meth:`reserve` took out but whose delete
        failed, as the least recently used (they were chosen as such, or are invalid). A name
        the index holds again meanwhile (a put found the object and counted it) stays as it is."""
        for name, size in reversed(entries):
            if name not in self._sizes:
                self._sizes[name] = size
                self._sizes.move_to_end(name, last=False)
                self.used_bytes += size

    def reserve(self, size: int) -> list[tuple[str, int]] | None:
        """Room for ``size`` more bytes: the victims to delete (``(name, size)``, least recently
        used first, out of the index), or ``None`` (nothing changed). Busy objects
        (:meth:`busy`) are never victims."""
        if size > self.capacity_bytes:
            return None
        need = self.used_bytes + size - self.capacity_bytes
        victims: list[tuple[str, int]] = []
        if need > 0:
            for name, nbytes in self._sizes.items():
                if self._busy[name]:
                    continue
                victims.append((name, nbytes))
                need -= nbytes
                if need <= 0:
                    break
            if need > 0:
                return None
            for name, _ in victims:
                self.discard(name)
        self.used_bytes += size
        return victims

    @property
    def excess_bytes(self) -> int:
        """Bytes counted beyond the capacity (0 when within it)."""
        return max(0, self.used_bytes - self.capacity_bytes)

    def commit(self, name: str, size: int, reserved: int) -> None:
        """An object of ``size`` bytes exists under ``name``, for which ``reserved`` bytes were
        reserved (0 when the index held it at the time)."""
        if name in self._sizes:
            self.used_bytes -= reserved
            self._sizes.move_to_end(name)
        else:
            self._sizes[name] = size
            self.used_bytes += size - reserved

    def release(self, reserved: int) -> None:
        self.used_bytes -= reserved

    @contextmanager
    def busy(self, name: str) -> Iterator[None]:
        self._busy[name] += 1
        try:
            yield
        finally:
            self._busy[name] -= 1
            if not self._busy[name]:
                del self._busy[name]
