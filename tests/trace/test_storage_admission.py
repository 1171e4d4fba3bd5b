"""The storage admission rule (``asynccache.storage_admission``): a storage that must evict a
regular object for an archive takes it only when its chance of return is at least that of the
coldest stored state it would displace; with room, every archive is written."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from asynccache.storage import PoolName
from asynccache.storage_admission import ArchiveAdmission
from asynccache.trace.storage_index import AccountingStorage

NOW = 100.0


class Returns:
    """An eviction policy's side of the rule: p(turn, age) = turn / (1 + age)."""

    def __init__(self) -> None:
        self.scale = 1.0

    def turn_of(self, node: Any) -> int:
        return int(node.turn)

    def reuse_estimate(self) -> Any:
        scale = self.scale

        def p(turn: int, age: float) -> float:
            return scale * turn / (1.0 + age)

        return p


def node(name: str, *, turn: int, last_access: float) -> Any:
    """A one-page path's node with a host state."""
    return SimpleNamespace(page_hashes=[name], host_state=0, turn=turn, last_access=last_access)


def storage(capacity: int) -> AccountingStorage:
    return AccountingStorage(capacity, object_bytes={PoolName.KV: 1, PoolName.MAMBA: 1})


def archive(rule: ArchiveAdmission, store: AccountingStorage, n: Any) -> bool:
    """What a tier does: ask the rule, write the path (KV, then the state), record it."""
    ticket = rule.ticket(n)
    if not rule.admit(n, [n], store, ticket):
        return False
    store.put(PoolName.KV, n.page_hashes)
    store.put(PoolName.MAMBA, [n.page_hashes[-1]])
    rule.written(n, ticket, store)
    return True


def full_of_warm_paths() -> tuple[ArchiveAdmission, AccountingStorage]:
    """A storage of 4 objects holding two warm paths (turn 3, used at 90 and 95 s)."""
    rule, store = ArchiveAdmission(Returns(), now=lambda: NOW), storage(4)
    assert archive(rule, store, node("w", turn=3, last_access=90.0))
    assert archive(rule, store, node("x", turn=3, last_access=95.0))
    assert store.used_bytes == 4
    return rule, store


def test_a_tight_storage_skips_an_archive_colder_than_the_state_it_would_displace() -> None:
    rule, store = full_of_warm_paths()
    cold = node("c", turn=1, last_access=10.0)  # p = 1/91 against w's 3/11
    assert store.displaced(rule.objects(cold, [cold])) == [(PoolName.KV, "w"), (PoolName.MAMBA, "w")]
    assert not archive(rule, store, cold)
    assert not store.contains(PoolName.KV, "c") and store.contains(PoolName.MAMBA, "w")
    assert rule.counts() == {"admitted_over_victim": 0, "skipped": 1}


def test_a_tight_storage_takes_an_archive_warmer_than_the_state_it_would_displace() -> None:
    rule, store = full_of_warm_paths()
    hot = node("h", turn=3, last_access=99.0)  # p = 3/2
    assert archive(rule, store, hot)
    assert store.contains(PoolName.MAMBA, "h") and not store.contains(PoolName.MAMBA, "w")
    assert rule.counts() == {"admitted_over_victim": 1, "skipped": 0}


def test_with_room_every_archive_is_written() -> None:
    rule, store = ArchiveAdmission(Returns(), now=lambda: NOW), storage(100)
    for i in range(10):
        assert archive(rule, store, node(f"w{i}", turn=3, last_access=99.0))
    assert archive(rule, store, node("c", turn=1, last_access=0.0))
    assert rule.counts() == {"admitted_over_victim": 0, "skipped": 0}


def test_room_that_speculative_objects_give_up_counts_as_room() -> None:
    rule, store = full_of_warm_paths()
    store.capacity_bytes = 6
    store.put(PoolName.MAMBA, ["s1", "s2"], speculative=True)  # full again, of snapshots
    cold = node("c", turn=1, last_access=10.0)
    assert store.displaced(rule.objects(cold, [cold])) == []
    assert archive(rule, store, cold)
    assert store.contains(PoolName.MAMBA, "w") and not store.contains(PoolName.MAMBA, "s1")


def test_objects_already_stored_need_no_room() -> None:
    """A path already stored is refreshed, not written: nothing is displaced."""
    rule, store = full_of_warm_paths()
    again = node("w", turn=1, last_access=0.0)
    assert store.displaced(rule.objects(again, [again])) == []
    assert archive(rule, store, again)


def test_a_policy_without_a_return_estimate_takes_everything() -> None:
    rule, store = ArchiveAdmission(object(), now=lambda: NOW), storage(4)
    assert not rule.active and rule.ticket(node("c", turn=1, last_access=0.0)) is None
    for name in ("w", "x", "c"):
        assert archive(rule, store, node(name, turn=1, last_access=0.0))
    assert store.contains(PoolName.MAMBA, "c") and not store.contains(PoolName.MAMBA, "w")


def test_the_ticket_is_the_candidate_as_it_stood_when_its_host_write_completed() -> None:
    """The controller writes an archive later in the step than the synchronous engine: a
    ticket taken before the policy re-learns its rates, or before a match touches the node,
    decides as it would have then."""
    policy = Returns()
    rule, store = ArchiveAdmission(policy, now=lambda: NOW), storage(4)
    archive(rule, store, node("w", turn=3, last_access=90.0))
    archive(rule, store, node("x", turn=3, last_access=95.0))
    cold = node("c", turn=1, last_access=10.0)
    ticket = rule.ticket(cold)
    policy.scale = 0.0  # re-learnt: every chance is 0 now, so a fresh ticket admits anything
    assert rule.admit(cold, [cold], store, rule.ticket(cold))
    assert not rule.admit(cold, [cold], store, ticket)
    policy.scale = 1.0
    ticket = rule.ticket(cold)
    cold.last_access = NOW  # touched since: a fresh ticket would admit it
    assert rule.admit(cold, [cold], store, rule.ticket(cold))
    assert not rule.admit(cold, [cold], store, ticket)


def test_the_records_of_evicted_states_are_swept() -> None:
    """A long run archives far more states than a small disk holds: the rule's records stay
    within twice the sweep's floor or twice what the storage holds, not one per archive."""
    rule, store = ArchiveAdmission(Returns(), now=lambda: NOW), storage(8)
    for i in range(5000):  # each archive a warmer path than the last: all admitted
        assert archive(rule, store, node(f"n{i}", turn=3, last_access=float(i)))
    assert store.used_bytes <= 8
    assert 0 < rule.num_records <= 2 * 1024
    assert rule.counts()["skipped"] == 0


def test_a_backend_without_the_rule_leaves_no_records() -> None:
    rule = ArchiveAdmission(Returns(), now=lambda: NOW)
    n = node("a", turn=3, last_access=NOW)
    rule.written(n, rule.ticket(n), object())  # a backend that cannot say what it displaces
    assert rule.num_records == 0
