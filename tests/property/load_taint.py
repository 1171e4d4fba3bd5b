"""What was computed on a host → device load in flight, kept by the tree state machine itself.

The machine never reads the tree's records of what rests on a load: it follows the data. Every
index it hands the tree (device pages and state slots of an insert, host pages and slots of a
backup, device indices of a load) is tracked per load in flight:

- an **insert** computes on a load when its tokens share with the load's prefix at least one
  page the load brings (a load of KV pages: any loaded page — a branch off an upper loaded node
  included) or, for a load of the boundary state alone, the whole prefix up to that state. Then
  the pages past the shared prefix that the tree kept, and the states past the load's first
  page it kept (a state given to a loaded node, splitting it, included; for a state alone: past
  that state), are *tainted*;
- a **backup** taints the host page or slot it copies a tainted device index into, and a
  **load** the device page or slot it copies a tainted host index into;
- an index the machine allocates afresh is clean again (the tree freed it meanwhile).

A load that finishes forgets its taint (what was computed on it is good). After a load's undo —
a failure (``abort_load(drop_below=True)``) or a cancel — no node may hold a tainted index of it
on any tier, and a match of what was inserted on it must not offer one (:meth:`Taint.survivors`);
a failure reports (``stale_hook``) the storage keys of what inserts computed on it
(:meth:`Taint.missing_keys`). Indices the tree keeps for a failed load's readers (retired)
belong to no node and do not count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from asynccache.tree import HybridRadixTree, LoadPlan, TreeNode

POOLS = ("device_kv", "device_mamba", "host_kv", "host_mamba")


def _ints(indices: torch.Tensor | Iterable[int] | int | None) -> list[int]:
    if indices is None:
        return []
    if isinstance(indices, int):
        return [indices]
    if isinstance(indices, torch.Tensor):
        return [int(i) for i in indices.tolist()]
    return [int(i) for i in indices]


@dataclass(eq=False)
class Flight:
    """A load in flight: its prefix (whole pages), the first page it brings (its end page for a
    load of the state alone), and the indices holding data computed on it, per pool."""

    plan: LoadPlan
    salt: str
    tokens: tuple[int, ...]
    first: int
    page: int
    tainted: dict[str, set[int]] = field(default_factory=lambda: {p: set() for p in POOLS})
    #: token sequences inserted on it (whole pages), for the matches after its undo
    seqs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    #: every insert that rests on it: (tokens, salt, first page whose state key it may have
    #: stored, pages whose KV it gave the tree), for the storage keys its failure reports
    rests: list[tuple[tuple[int, ...], str, int, list[int]]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return len(self.tokens) // self.page

    @property
    def kv(self) -> bool:
        """A load of KV pages (else of the boundary state alone)."""
        return self.first < self.end

    def shared(self, tokens: Sequence[int]) -> int:
        """Whole pages ``tokens`` shares with this load's prefix."""
        n = min(len(tokens), len(self.tokens)) // self.page
        k = 0
        while k < n and tuple(tokens[k * self.page : (k + 1) * self.page]) == self.tokens[k * self.page : (k + 1) * self.page]:
            k += 1
        return k


class Taint:
    """The machine's record of what rests on each load in flight (see the module docstring)."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.flights: dict[int, Flight] = {}

    def fresh(self, pool: str, indices: torch.Tensor | Iterable[int] | int | None) -> None:
        """The machine allocated ``indices`` of ``pool``: whatever they held is gone."""
        ids = _ints(indices)
        if ids:
            for f in self.flights.values():
                f.tainted[pool].difference_update(ids)

    def copied(self, src: str, dst: str, src_ids: object, dst_ids: object) -> None:
        """A copy (backup or load) from ``src_ids`` of pool ``src`` into ``dst_ids`` of ``dst``."""
        pairs = list(zip(_ints(src_ids), _ints(dst_ids), strict=True))  # type: ignore[arg-type]
        for f in self.flights.values():
            bad = f.tainted[src]
            f.tainted[dst].update(d for s, d in pairs if s in bad)

    def begin(self, plan: LoadPlan, tokens: Sequence[int], salt: str, num_kv_pages: int) -> None:
        """``plan`` began for the prefix ``tokens`` (whole pages): its copies read what other
        loads' taint may cover, and what is computed on it from now on is its own."""
        self.copied("host_kv", "device_kv", plan.host_kv_indices, plan.device_kv_indices)
        self.copied("host_mamba", "device_mamba", plan.host_state_slots, plan.device_state_slots)
        end = len(tokens) // self.page
        self.flights[plan.plan_id] = Flight(plan, salt, tuple(tokens[: end * self.page]), end - num_kv_pages, self.page)

    def end(self, plan: LoadPlan) -> Flight | None:
        """``plan`` finished or was undone: forget it (returns its record)."""
        return self.flights.pop(plan.plan_id, None)

    def inserted(
        self,
        tokens: Sequence[int],
        salt: str,
        kv: Sequence[int],
        states: dict[int, int],
        held_kv: Sequence[int],
        held_states: dict[int, int],
    ) -> None:
        """An insert of ``tokens`` gave the tree device pages ``kv`` (one per whole page) and
        device states ``{token position: slot}``; ``held_kv`` and ``held_states`` are what the
        path holds after it (the tree kept an index where it holds it: it freed the others)."""
        n = len(tokens) // self.page
        whole = tuple(tokens[: n * self.page])
        for f in self.flights.values():
            if f.salt != salt:
                continue
            k = f.shared(tokens)
            if f.kv and k > f.first:
                start, after = k, f.first  # computed with attention over loaded pages
            elif not f.kv and k >= f.end:
                start, after = f.end, f.end  # resumed from the pending state
            else:
                continue
            pages = [i for i in range(start, n) if held_kv[i] == kv[i]]
            slots = [s for p, s in states.items() if p // self.page > after and held_states.get(p) == s]
            f.tainted["device_kv"].update(int(kv[i]) for i in pages)
            f.tainted["device_mamba"].update(int(s) for s in slots)
            f.rests.append((whole, salt, after, pages))
            if pages or slots:
                f.seqs.append((whole, salt))

    def missing_keys(self, tree: HybridRadixTree, f: Flight, heard: Sequence[tuple[frozenset[str], frozenset[str]]]) -> list[str]:
        """The storage keys of what was computed on ``f``'s failed load that ``stale_hook`` did
        not report (``heard``): the KV keys of the pages inserts gave the tree, and the state keys
        of every page of those inserts past the load's first page (a storage-only snapshot may
        have stored a state at any of them)."""
        kv_keys = {k for keys, _ in heard for k in keys}
        state_keys = {k for _, keys in heard for k in keys}
        out: list[str] = []
        for tokens, salt, after, pages in f.rests:
            hashes = tree.match_prefix(list(tokens), salt=salt).page_hashes
            lost_kv = [i for i in pages if hashes[i] not in kv_keys]
            lost_states = [i for i in range(after, len(tokens) // self.page) if hashes[i] not in state_keys]
            if lost_kv or lost_states:
                out.append(f"an insert of {len(tokens)} tokens: KV keys of pages {lost_kv}, state keys of pages {lost_states}")
        return out

    def survivors(self, tree: HybridRadixTree, f: Flight) -> list[str]:
        """What still offers data computed on ``f``'s load: nodes holding a tainted index, and
        matches of what was inserted on it that report one."""
        out: list[str] = []
        for n in tree.iter_nodes():
            out += self._held(n, f, "node")
        for tokens, salt in f.seqs:
            m = tree.match_prefix(list(tokens), salt=salt)
            bad = set(_ints(m.device_kv_indices)) & f.tainted["device_kv"]
            if bad:
                out.append(f"a match of {len(tokens)} tokens offers device pages {sorted(bad)}")
            if m.num_tokens:
                for n in tree.path_to(m.last_node):
                    out += self._held(n, f, f"a match of {len(tokens)} tokens ({m.num_tokens} cached) runs through")
        return out

    @staticmethod
    def _held(n: TreeNode, f: Flight, what: str) -> list[str]:
        out = []
        for pool, value in (
            ("device_kv", n.device_kv),
            ("device_mamba", n.device_state),
            ("host_kv", n.host_kv),
            ("host_mamba", n.host_state),
        ):
            bad = set(_ints(value)) & f.tainted[pool]
            if bad:
                out.append(f"{what} {n}, whose {pool} {sorted(bad)} was computed on failed load {f.plan.plan_id}")
        return out
