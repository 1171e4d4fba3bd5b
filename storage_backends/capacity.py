"""Byte accounting of a backend's stored objects against a capacity, with LRU eviction.

Primitives:

- :class:`LRUCapacity` — stored bytes against ``capacity_bytes``: ``reserve`` room for a new
  object (choosing least-recently-used victims), then ``commit`` or ``release`` the
  reservation; ``busy`` marks objects being read or written, which are never chosen; ``load``
  adds the objects found on first use, ``touch`` / ``discard`` follow reads and absent objects
  (``discard(name, since=mark())``: unless a write committed it after the read began);
  ``take`` takes objects out to delete them and ``restore`` puts back those whose delete failed;
  ``excess_bytes`` is what the index counts beyond the capacity.
- :class:`Stored` — an object the index counted: name, size, and whether it is speculative.

Speculative objects (``speculative=True`` on ``reserve`` and ``commit``: storage-only snapshots
nobody has asked for yet) have a recency order of their own. They are every reservation's first
victims, least recently used first, and a speculative reservation takes only free room and
speculative victims: it never displaces a regular object. A read (``touch``) or a regular
``commit`` of one makes it regular. Objects found on first use count as regular (whether an
object was speculative is not stored with it).

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
from typing import NamedTuple

__all__ = ["LRUCapacity", "Stored"]


class Stored(NamedTuple):
    """An object counted by the index (a victim or an object taken out to delete it)."""

    name: str
    size: int
    speculative: bool = False


class LRUCapacity:
    """Stored bytes against a capacity, with LRU victims. Event-loop only (not thread-safe).

    ``reserve`` counts a new object's bytes before it is written and picks victims (removed
    from the index at once, so concurrent writers never pick the same victim); ``commit`` /
    ``release`` settle the reservation. An object the index already holds reserves nothing (a
    put of it is a put-if-absent that finds it) and is never its own victim. A victim (or an
    object taken out with ``take``) whose delete fails is still stored: ``restore`` counts it
    again, so the index never counts less than what its deletes left. Speculative objects: see
    the module docstring."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # regular objects, least recent first
        self._speculative: OrderedDict[str, int] = OrderedDict()  # evicted before any regular one
        self._busy: Counter[str] = Counter()
        self._commits = 0  # commits so far: ``mark``
        self._committed_at: dict[str, int] = {}  # name → its last commit's number (names held)

    def _order(self, speculative: bool) -> OrderedDict[str, int]:
        return self._speculative if speculative else self._sizes

    def load(self, entries: Iterable[tuple[str, int]]) -> None:
        """Add existing objects (regular), least recently used first."""
        for name, size in entries:
            if not self.holds(name):
                self._sizes[name] = size
                self.used_bytes += size

    def touch(self, name: str) -> None:
        """``name`` was read: the most recently used, and regular."""
        size = self._speculative.pop(name, None)
        if size is not None:
            self._sizes[name] = size
        elif name in self._sizes:
            self._sizes.move_to_end(name)

    def mark(self) -> int:
        """The number of commits so far: a read notes it before its I/O, so that an object it
        found absent is not dropped when a write committed it meanwhile (``discard(since=)``)."""
        return self._commits

    def discard(self, name: str, *, since: int | None = None) -> None:
        """Take ``name`` out of the index. ``since`` (a :meth:`mark`): only if no commit of
        ``name`` came after it — a read that found the object absent, while a write of it
        committed, leaves it counted."""
        if since is not None and self._committed_at.get(name, -1) >= since:
            return
        self._committed_at.pop(name, None)
        size = self._sizes.pop(name, None)
        if size is None:
            size = self._speculative.pop(name, None)
        if size is not None:
            self.used_bytes -= size

    def holds(self, name: str) -> bool:
        return name in self._sizes or name in self._speculative

    def is_speculative(self, name: str) -> bool:
        return name in self._speculative

    def take(self, names: Iterable[str]) -> list[Stored]:
        """Take the objects the index holds among ``names`` out of it, to delete them, for
        :meth:`restore` should the delete fail."""
        taken = [self._entry(name) for name in dict.fromkeys(names) if self.holds(name)]
        for entry in taken:
            self.discard(entry.name)
        return taken

    def _entry(self, name: str) -> Stored:
        if name in self._speculative:
            return Stored(name, self._speculative[name], True)
        return Stored(name, self._sizes[name])

    def restore(self, entries: Sequence[Stored]) -> None:
        """Count again objects that :meth:`take` or :meth:`reserve` took out but whose delete
        failed, as the least recently used of their kind (they were chosen as such, or are
        invalid). A name the index holds again meanwhile (a put found the object and counted
        it) stays as it is."""
        for name, size, speculative in reversed(entries):
            if not self.holds(name):
                order = self._order(speculative)
                order[name] = size
                order.move_to_end(name, last=False)
                self.used_bytes += size

    def reserve(self, size: int, *, speculative: bool = False) -> list[Stored] | None:
        """Room for ``size`` more bytes: the victims to delete (speculative objects first, then
        regular ones, each least recently used first; out of the index), or ``None`` (nothing
        changed). Busy objects (:meth:`busy`) are never victims; a ``speculative`` reservation
        takes no regular victim."""
        if size > self.capacity_bytes:
            return None
        need = self.used_bytes + size - self.capacity_bytes
        victims: list[Stored] = []
        if need > 0:
            for order, kind in ((self._speculative, True), (self._sizes, False)):
                if need <= 0 or (speculative and not kind):
                    break
                for name, nbytes in order.items():
                    if self._busy[name]:
                        continue
                    victims.append(Stored(name, nbytes, kind))
                    need -= nbytes
                    if need <= 0:
                        break
            if need > 0:
                return None
            for victim in victims:
                self.discard(victim.name)
        self.used_bytes += size
        return victims

    @property
    def excess_bytes(self) -> int:
        """Bytes counted beyond the capacity (0 when within it)."""
        return max(0, self.used_bytes - self.capacity_bytes)

    def commit(self, name: str, size: int, reserved: int, *, speculative: bool = False) -> None:
        """An object of ``size`` bytes exists under ``name``, for which ``reserved`` bytes were
        reserved (0 when the index held it at the time), written ``speculative`` or not. A
        regular write makes a speculative object regular; a speculative write leaves a regular
        object regular."""
        self._committed_at[name] = self._commits
        self._commits += 1
        if self.holds(name):
            self.used_bytes -= reserved
            if speculative and name in self._speculative:
                self._speculative.move_to_end(name)
            else:
                self.touch(name)
        else:
            self._order(speculative)[name] = size
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
