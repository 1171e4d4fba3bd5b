"""Hypothesis state machine over the hybrid radix tree, on real (CPU) pools.

Rules: insert, match, lock / unlock (device and host), evict_device (write-back callbacks that
finish at once or stay in flight), evict_host, evict_bytes (either tier), back up a path, begin / finish / abort a load or a
backup, fail a load (its readers' pages held until they unlock), insert_host (prefetched data),
mark_archived, claim / release in-flight indices.
``check_integrity()`` runs after every step, and every match checks that the device pages and
states it hands out hold the bytes of the pages they stand for (each page is written with its
chained hash, each state with a digest of its position), so a wrong index anywhere is caught.

Runs ``max_examples × stateful_step_count = 150 × 100`` steps; the test asserts at least 10,000
rule steps ran (a few examples stop early when hypothesis runs out of buffer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from asynccache.policy import BlockGridAdmission, EndsAdmission, EveryPageAdmission
from asynccache.policy.ranked import evictable
from asynccache.pools import DeviceKVPool, DeviceMambaPool, HostKVPool, MambaPoolHost
from asynccache.pools.base import ItemPool
from asynccache.spec import HybridSpec
from asynccache.tree import (
    BackupPlan,
    HybridRadixTree,
    LoadPlan,
    MatchResult,
    Tier,
    TreeError,
    TreeNode,
)
from asynccache.tree.hashing import encode_tokens
from kernels.api import copy_items

PAGE = 4
MAX_EXAMPLES = 150
STEPS_PER_EXAMPLE = 100
SPEC = HybridSpec.preset("tiny", page_size=PAGE)
STEPS = [0]

page_ids = st.lists(st.integers(0, 4), min_size=1, max_size=7)
salts = st.sampled_from(["", "", "tenant-b"])


def tokens_of(pages: Sequence[int], tail: int) -> list[int]:
    """Page id ``p`` is the tokens ``1000·p … 1000·p + PAGE-1``; a short tail follows."""
    out = [1000 * p + k for p in pages for k in range(PAGE)]
    return out + [7] * tail


def digests(tree: HybridRadixTree, tokens: Sequence[int], salt: str) -> list[bytes]:
    m = tree._match(*encode_tokens(tokens, PAGE), salt, touch=False)
    return [m.page_hashes.raw(i) for i in range(len(m.page_hashes))]  # type: ignore[attr-defined]


def state_digest(page_digest: bytes) -> bytes:
    return hashlib.blake2b(page_digest + b"state", digest_size=16).digest()


def fill(pool: ItemPool, index: int, digest: bytes) -> None:
    view = pool.index_bytes(index)
    view.copy_(torch.frombuffer(bytearray(digest * -(-view.shape[-1] // 16)), dtype=torch.uint8)[: view.shape[-1]])


def holds(pool: ItemPool, index: int, digest: bytes) -> bool:
    head = pool.index_bytes(index)[:, :16]
    return bool(torch.equal(head, torch.frombuffer(bytearray(digest), dtype=torch.uint8).expand_as(head)))


class TreeMachine(RuleBasedStateMachine):
    tree: HybridRadixTree

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective:2", "write_back"]),
        admission=st.sampled_from(["ends", "every_page", "grid"]),
        host=st.sampled_from(["full", "full", "kv_only", "none"]),
    )
    def setup(self, policy: str, admission: str, host: str) -> None:
        adm = {"ends": EndsAdmission(), "every_page": EveryPageAdmission(), "grid": BlockGridAdmission(2)}[admission]
        self.tree = HybridRadixTree(
            SPEC,
            device_kv=DeviceKVPool(SPEC, 24),
            device_mamba=DeviceMambaPool(SPEC, 8),
            host_kv=None if host == "none" else HostKVPool(SPEC, num_pages=40),
            host_mamba=MambaPoolHost(SPEC, num_slots=10) if host == "full" else None,
            admission=adm,
            write_policy=policy,
            write_back=self.write_back,
        )
        # (node, the device lock's token; None for a host lock)
        self.locks: list[tuple[TreeNode, int | None]] = []
        self.loads: list[LoadPlan] = []
        self.backups: list[BackupPlan] = []
        self.claims: list[torch.Tensor] = []
        self.defer = False
        self.known: list[tuple[tuple[int, ...], str]] = []

    def step(self) -> None:
        STEPS[0] += 1

    def pick(self, data: st.DataObject, *, tail: bool = True) -> tuple[list[int], list[int], str]:
        """Page ids, tokens and salt: mostly a prefix or extension of a sequence seen before."""
        if self.known and data.draw(st.integers(0, 3)) > 0:
            pages, salt = data.draw(st.sampled_from(self.known))
            pages = list(pages[: data.draw(st.integers(1, len(pages)))])
            pages += data.draw(st.lists(st.integers(0, 4), max_size=2))
        else:
            pages, salt = data.draw(page_ids), data.draw(salts)
        extra = data.draw(st.integers(0, PAGE - 1)) if tail else 0
        return pages, tokens_of(pages, extra), salt

    def remember(self, pages: list[int], salt: str) -> None:
        self.known.append((tuple(pages), salt))
        if len(self.known) > 24:
            self.known.pop(0)

    # ---- copies ----------------------------------------------------------------------------
    def start_backup(self, nodes: Sequence[TreeNode], defer: bool) -> BackupPlan | None:
        tree = self.tree
        need_kv, need_states = tree.backup_pages_needed(nodes)
        for n in nodes:
            tree.lock_host(n)
        try:
            alloc = tree.alloc_host(need_kv, need_states)
        finally:
            for n in nodes:
                tree.unlock_host(n)
        if alloc is None:
            return None
        plan = tree.begin_backup(nodes, alloc.kv_indices, alloc.state_slots)
        if defer:
            self.backups.append(plan)
        else:
            self.complete_backup(plan)
        return plan

    def complete_backup(self, plan: BackupPlan) -> None:
        # The copy happens at completion: if the tree let anything overwrite the source or the
        # destination meanwhile, the content checks of later matches fail.
        tree = self.tree
        assert tree.host_kv is not None
        copy_items(tree.device_kv, tree.host_kv, plan.device_kv_indices, plan.host_kv_indices)
        if tree.host_mamba is not None:
            copy_items(tree.device_mamba, tree.host_mamba, plan.device_state_slots, plan.host_state_slots)
        tree.finish_backup(plan)

    def write_back(self, nodes: Sequence[TreeNode]) -> bool:
        return self.start_backup(nodes, self.defer) is not None

    # ---- checks ----------------------------------------------------------------------------
    def check_match(self, tokens: list[int], salt: str, m: MatchResult) -> None:
        tree = self.tree
        n_pages = len(tokens) // PAGE
        assert m.num_tokens % PAGE == 0 and m.num_tokens <= n_pages * PAGE
        assert m.num_device_tokens + m.num_host_tokens == m.num_tokens
        assert m.num_matched_tokens >= m.num_tokens
        assert m.device_kv_indices.numel() * PAGE == m.num_device_tokens
        assert m.last_node.end_tokens == m.num_tokens if m.num_tokens else m.last_node.parent is None
        if m.num_tokens:
            assert m.last_node.has_state and m.state_tier is not None
        assert m.needs_load == (m.num_host_tokens > 0 or m.state_tier is Tier.HOST)
        if m.pending_load:
            return
        d = digests(tree, tokens, salt)
        for i, idx in enumerate(m.device_kv_indices.tolist()):
            assert holds(tree.device_kv, idx, d[i]), f"device page {idx} does not hold page {i}"
        node = m.last_node
        if m.num_tokens and node.device_state is not None:
            assert holds(tree.device_mamba, node.device_state, state_digest(d[m.num_tokens // PAGE - 1]))
        if m.num_tokens and node.host_state is not None and not node.host_lock:
            assert tree.host_mamba is not None
            assert holds(tree.host_mamba, node.host_state, state_digest(d[m.num_tokens // PAGE - 1]))
        for n in tree.path_to(node) if m.num_tokens else []:
            if n.host_kv is not None and not n.host_lock:
                assert tree.host_kv is not None
                for j, idx in enumerate(n.host_kv.tolist()):
                    assert holds(tree.host_kv, idx, d[n.start_page + j]), f"host page {idx} holds wrong bytes"

    @invariant()
    def integrity(self) -> None:
        self.tree.check_integrity()

    # ---- rules -----------------------------------------------------------------------------
    @rule(data=st.data(), prompt_pages=st.integers(0, 9), back_up=st.integers(0, 3).map(bool))
    def insert(self, data: st.DataObject, prompt_pages: int, back_up: bool) -> None:
        self.step()
        tree = self.tree
        pages, tokens, salt = self.pick(data)
        n_pages = len(pages)
        prompt_len = min(prompt_pages * PAGE + len(tokens) % PAGE, len(tokens))
        positions = sorted(tree.state_positions(prompt_len, total_len=len(tokens)))
        alloc = tree.alloc_device(n_pages, len(positions))
        if alloc is None:
            positions = []
            alloc = tree.alloc_device(n_pages, 0)
            if alloc is None:
                return
        d = digests(tree, tokens, salt)
        for i in range(n_pages):
            fill(tree.device_kv, int(alloc.kv_indices[i]), d[i])
        slots = alloc.state_slots.tolist()
        for pos, slot in zip(positions, slots, strict=True):
            fill(tree.device_mamba, slot, state_digest(d[pos // PAGE - 1]))
        r = tree.insert(
            tokens, alloc.kv_indices, states=dict(zip(positions, slots, strict=True)), salt=salt, prompt_len=prompt_len
        )
        self.remember(pages, salt)
        assert r.num_new_pages + r.num_duplicate_pages == n_pages
        assert r.num_new_states + r.num_freed_states == len(positions)
        if r.backup_nodes and back_up:
            self.start_backup(r.backup_nodes, defer=False)

    @rule(data=st.data(), back_up=st.integers(0, 3).map(bool))
    def match(self, data: st.DataObject, back_up: bool) -> None:
        self.step()
        _, tokens, salt = self.pick(data)
        m = self.tree.match_prefix(tokens, salt=salt)
        self.check_match(tokens, salt, m)
        if m.backup_nodes and back_up:
            self.start_backup(m.backup_nodes, defer=False)

    @rule(data=st.data(), host=st.booleans())
    def lock(self, data: st.DataObject, host: bool) -> None:
        self.step()
        _, tokens, salt = self.pick(data)
        m = self.tree.match_prefix(tokens, salt=salt)
        if m.num_tokens:
            if host:
                self.tree.lock_host(m.last_node)
                self.locks.append((m.last_node, None))
            else:
                self.locks.append((m.last_node, self.tree.lock(m.last_node)))

    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        self.step()
        if self.locks:
            node, token = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
            if token is None:
                self.tree.unlock_host(node)
            else:
                self.tree.unlock(node, token)

    @rule(pages=st.integers(0, 10), states=st.integers(0, 3), defer=st.booleans())
    def evict_device(self, pages: int, states: int, defer: bool) -> None:
        self.step()
        self.defer = defer
        free0 = (self.tree.device_kv.num_free, self.tree.device_mamba.num_free)
        r = self.tree.evict_device(num_kv_pages=pages, num_states=states)
        assert self.tree.device_kv.num_free - free0[0] == r.num_kv_pages
        assert self.tree.device_mamba.num_free - free0[1] == r.num_states

    @rule(pages=st.integers(0, 10), states=st.integers(0, 3), archived_only=st.booleans())
    def evict_host(self, pages: int, states: int, archived_only: bool) -> None:
        self.step()
        self.tree.evict_host(num_kv_pages=pages, num_states=states, archived_only=archived_only)

    @rule(
        data=st.data(),
        pages=st.integers(0, 8),
        states=st.integers(0, 2),
        count_states=st.booleans(),
        defer=st.booleans(),
    )
    def evict_bytes(self, data: st.DataObject, pages: int, states: int, count_states: bool, defer: bool) -> None:
        """What the tier's pools got back is what the result counts, and at least what was asked
        unless nothing evictable is left (or write-backs are still in flight)."""
        self.step()
        self.defer = defer
        tree = self.tree
        if tree.host_kv is not None and data.draw(st.booleans()):
            tier, kv_pool, state_pool = Tier.HOST, tree.host_kv, tree.host_mamba
            kv_lru, state_lru = tree.host_kv_lru, tree.host_state_lru
        else:
            tier, kv_pool, state_pool = Tier.DEVICE, tree.device_kv, tree.device_mamba
            kv_lru, state_lru = tree.device_kv_lru, tree.device_state_lru
        counted = state_pool if count_states else None
        ask = pages * kv_pool.bytes_per_index + (states * counted.bytes_per_index if counted is not None else 0)

        def free() -> tuple[int, int, int]:
            kv, slots = kv_pool.num_free, state_pool.num_free if state_pool is not None else 0
            return kv, slots, kv * kv_pool.bytes_per_index + (slots * counted.bytes_per_index if counted else 0)

        kv0, slots0, bytes0 = free()
        r = tree.evict_bytes(tier, ask, count_states=count_states)
        kv1, slots1, bytes1 = free()
        assert (kv1 - kv0, slots1 - slots0) == (r.num_kv_pages, r.num_states)
        if bytes1 - bytes0 < ask and not (r.num_pending_kv_pages or r.num_pending_states):
            key = tier.value
            assert not any(evictable(n, f"{key}_kv") for n in kv_lru.iter_oldest())
            if counted is not None:
                assert not any(evictable(n, f"{key}_state") for n in state_lru.iter_oldest())

    @rule(data=st.data())
    def release_states(self, data: st.DataObject) -> None:
        self.step()
        tree = self.tree
        _, tokens, salt = self.pick(data)
        m = tree.match_prefix(tokens, salt=salt)
        node = m.last_node
        free0 = [p.num_free for p in (tree.device_mamba, tree.host_mamba) if p is not None]
        r = tree.release_states([node])
        freed = sum(p.num_free for p in (tree.device_mamba, tree.host_mamba) if p is not None) - sum(free0)
        assert freed == r.num_states
        if node.parent is not None and node.alive:
            assert node.device_state is None or node.device_lock or node.loading
            assert node.host_state is None or node.host_lock

    @rule(data=st.data(), defer=st.booleans())
    def back_up_path(self, data: st.DataObject, defer: bool) -> None:
        self.step()
        tree = self.tree
        _, tokens, salt = self.pick(data)
        m = tree.match_prefix(tokens, salt=salt)
        if m.num_tokens and tree.has_host:
            path = tree.path_to(m.last_node)
            if any(tree.backup_pages_needed([n]) != (0, 0) for n in path):
                self.start_backup(path, defer)

    @rule(data=st.data())
    def finish_backup(self, data: st.DataObject) -> None:
        self.step()
        if self.backups:
            self.complete_backup(self.backups.pop(data.draw(st.integers(0, len(self.backups) - 1))))

    @rule(data=st.data())
    def abort_backup(self, data: st.DataObject) -> None:
        self.step()
        if not self.backups:
            return
        i = data.draw(st.integers(0, len(self.backups) - 1))
        try:
            released = self.tree.abort_backup(self.backups[i])
        except TreeError:
            return  # a later backup depends on it; the tree refused and changed nothing
        self.backups.pop(i)
        assert self.tree.host_kv is not None
        self.tree.host_kv.free(released.kv_indices)
        if self.tree.host_mamba is not None:
            self.tree.host_mamba.free(released.state_slots)

    @rule(data=st.data())
    def begin_load(self, data: st.DataObject) -> None:
        self.step()
        tree = self.tree
        # Mostly aim at a node whose state or KV is on the host only, so loads happen often.
        targets = sorted(
            (n for n in tree.iter_nodes() if n.has_state and (n.device_state is None or n.device_kv is None)),
            key=lambda n: n.node_id,
        )
        if targets and data.draw(st.integers(0, 3)) > 0:
            node = data.draw(st.sampled_from(targets))
            tokens = tree.token_ids(node).tolist()
            salt = tree.path_to(node)[0].parent.salt  # type: ignore[union-attr]
        else:
            _, tokens, salt = self.pick(data)
        m = tree.match_prefix(tokens, salt=salt)
        if not m.needs_load:
            return
        # Both locks, as the controller takes them: making device room may demote to a full
        # host, whose eviction must not take the host copy this load reads.
        owner_token = tree.lock(m.last_node)
        tree.lock_host(m.last_node)
        try:
            alloc = tree.alloc_device(m.num_load_kv_pages, m.num_load_states)
        finally:
            tree.unlock(m.last_node, owner_token)
            tree.unlock_host(m.last_node)
        if alloc is None:
            return
        plan = tree.begin_load(m, alloc.kv_indices, alloc.state_slot)
        self.loads.append(plan)
        again = tree.match_prefix(tokens, salt=salt)
        assert again.pending_load and plan in tree.pending_loads(again)
        if data.draw(st.booleans()):
            # A second request reaches the pending data and holds it: a reader of the load.
            self.locks.append((again.last_node, tree.lock(again.last_node)))
        if data.draw(st.integers(0, 2)) == 0:
            # A request computes past the pending data: what it inserts rests on the load.
            ext = tree.token_ids(again.last_node).tolist() + tokens_of([data.draw(st.integers(0, 4))], 0)
            self.put(ext, salt)

    def put(self, tokens: list[int], salt: str) -> None:
        """Insert ``tokens`` (whole pages) with a state at their end, contents written."""
        tree = self.tree
        alloc = tree.alloc_device(len(tokens) // PAGE, 1)
        if alloc is None:
            return
        d = digests(tree, tokens, salt)
        for i, idx in enumerate(alloc.kv_indices.tolist()):
            fill(tree.device_kv, idx, d[i])
        assert alloc.state_slot is not None
        fill(tree.device_mamba, alloc.state_slot, state_digest(d[-1]))
        tree.insert(tokens, alloc.kv_indices, states={len(tokens): alloc.state_slot}, salt=salt)

    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        self.step()
        if not self.loads:
            return
        plan = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        tree = self.tree
        if plan.num_kv_pages:
            assert tree.host_kv is not None
            copy_items(tree.host_kv, tree.device_kv, plan.host_kv_indices, plan.device_kv_indices)
        if plan.num_states:
            assert tree.host_mamba is not None
            copy_items(tree.host_mamba, tree.device_mamba, plan.host_state_slots, plan.device_state_slots)
        tree.finish_load(plan)

    @rule(data=st.data())
    def abort_load(self, data: st.DataObject) -> None:
        self.step()
        if not self.loads:
            return
        i = data.draw(st.integers(0, len(self.loads) - 1))
        try:
            released = self.tree.abort_load(self.loads[i])
        except TreeError:
            return
        self.loads.pop(i)
        self.tree.device_kv.free(released.kv_indices)
        self.tree.device_mamba.free(released.state_slots)

    @rule(data=st.data())
    def fail_load(self, data: st.DataObject) -> None:
        """The copy failed: what was computed on the load goes too, and pages a reader holds
        wait for its unlock (the tree frees them then)."""
        self.step()
        if not self.loads:
            return
        i = data.draw(st.integers(0, len(self.loads) - 1))
        try:
            released = self.tree.abort_load(self.loads[i], drop_below=True)
        except TreeError:
            return
        self.loads.pop(i)
        self.tree.device_kv.free(released.kv_indices)
        self.tree.device_mamba.free(released.state_slots)

    @rule(data=st.data(), with_state=st.booleans())
    def insert_host(self, data: st.DataObject, with_state: bool) -> None:
        self.step()
        tree = self.tree
        if tree.host_kv is None:
            return
        with_state = with_state and tree.host_mamba is not None
        pages, tokens, salt = self.pick(data, tail=False)
        alloc = tree.alloc_host(len(pages), int(with_state))
        if alloc is None:
            return
        d = digests(tree, tokens, salt)
        for i, idx in enumerate(alloc.kv_indices.tolist()):
            fill(tree.host_kv, idx, d[i])
        states = {}
        if with_state:
            assert tree.host_mamba is not None and alloc.state_slot is not None
            fill(tree.host_mamba, alloc.state_slot, state_digest(d[-1]))
            states = {len(tokens): alloc.state_slot}
        tree.insert_host(tokens, alloc.kv_indices, host_states=states, salt=salt)
        self.remember(pages, salt)

    @rule(data=st.data())
    def mark_archived(self, data: st.DataObject) -> None:
        self.step()
        _, tokens, salt = self.pick(data)
        m = self.tree.match_prefix(tokens, salt=salt)
        if m.num_tokens:
            self.tree.mark_archived(m.last_node)

    @rule(release=st.booleans())
    def claim(self, release: bool) -> None:
        self.step()
        tree = self.tree
        if release and self.claims:
            idx = self.claims.pop()
            tree.release_in_flight("device_kv", idx)
            tree.device_kv.free(idx)
            return
        idx = tree.device_kv.alloc(1)
        if idx is not None:
            tree.claim_in_flight("device_kv", idx)
            self.claims.append(idx)


def test_tree_state_machine() -> None:
    STEPS[0] = 0
    run_state_machine_as_test(
        TreeMachine,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=STEPS_PER_EXAMPLE,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert STEPS[0] >= 10_000, STEPS[0]
