"""The capacity index's speculative objects (``storage_backends.capacity.LRUCapacity``)."""

from __future__ import annotations

from storage_backends.capacity import LRUCapacity, Stored


def test_speculative_victims_go_first_and_a_speculative_reservation_takes_no_regular_one() -> None:
    cap = LRUCapacity(30)
    for name, speculative in (("r1", False), ("s1", True), ("r2", False)):
        assert cap.reserve(10, speculative=speculative) == []
        cap.commit(name, 10, 10, speculative=speculative)
    assert cap.reserve(10, speculative=True) == [Stored("s1", 10, True)]  # never r1, the LRU
    cap.commit("s2", 10, 10, speculative=True)
    with cap.busy("s2"):
        assert cap.reserve(10, speculative=True) is None  # only regular objects could go
    assert cap.used_bytes == 30
    assert cap.reserve(15) == [Stored("s2", 10, True), Stored("r1", 10, False)]
    assert cap.used_bytes == 25 and not cap.holds("s2") and not cap.holds("r1")


def test_a_read_or_a_regular_commit_makes_a_speculative_object_regular() -> None:
    cap = LRUCapacity(30)
    cap.commit("s1", 10, 0, speculative=True)
    cap.commit("s2", 10, 0, speculative=True)
    cap.commit("r1", 10, 0)
    cap.touch("s1")
    cap.commit("s2", 10, 0)  # a regular put that found it
    assert not cap.is_speculative("s1") and not cap.is_speculative("s2")
    assert cap.reserve(10) == [Stored("r1", 10, False)]  # regular order: r1, s1, s2
    cap.commit("r2", 10, 10, speculative=True)  # a speculative put of a new object
    cap.commit("s1", 10, 0, speculative=True)  # ...and of a regular one: it stays regular
    assert cap.is_speculative("r2") and not cap.is_speculative("s1")


def test_a_speculative_victim_whose_delete_failed_is_restored_speculative() -> None:
    cap = LRUCapacity(20)
    cap.commit("s1", 10, 0, speculative=True)
    cap.commit("r1", 10, 0)
    victims = cap.reserve(10)
    assert victims == [Stored("s1", 10, True)]
    cap.release(10)
    cap.restore(victims)  # the delete failed: counted again, still speculative, still first
    assert cap.is_speculative("s1") and cap.used_bytes == 20
    taken = cap.take(["s1", "r1", "absent"])
    assert taken == [Stored("s1", 10, True), Stored("r1", 10, False)] and cap.used_bytes == 0
    cap.restore(taken)
    assert cap.is_speculative("s1") and cap.holds("r1") and cap.used_bytes == 20
    cap.load([("r1", 10), ("new", 5)])  # found on first use: regular; a held name is kept as it is
    assert cap.used_bytes == 25 and not cap.is_speculative("new")
    cap.discard("s1")
    assert not cap.holds("s1") and cap.used_bytes == 15


def test_a_miss_taken_after_a_commit_of_the_same_name_keeps_it_counted() -> None:
    """A read marks the index before its I/O; an object it found absent leaves the index only
    if no write committed it since (the store would otherwise hold bytes nothing counts)."""
    cap = LRUCapacity(30)
    cap.commit("a", 10, 0)
    since = cap.mark()
    cap.commit("b", 10, 0)  # written while the read of "b" ran: it saw "b" absent
    cap.discard("b", since=since)
    cap.discard("a", since=since)  # committed before the read: its miss means it is gone
    assert cap.holds("b") and not cap.holds("a") and cap.used_bytes == 10
    cap.discard("b", since=cap.mark())  # a read that began after the commit
    assert not cap.holds("b") and cap.used_bytes == 0
