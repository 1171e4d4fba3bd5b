"""The hybrid radix tree (HiMamba radix cache): :class:`HybridRadixTree`, and insert.

For a hybrid model a cached prefix is usable only up to the deepest point where the recurrent
state is available; KV beyond it is dead weight. The tree knows, for every cached prefix, where
its KV pages and its states live (device, host), what may be evicted, and how much the next
request can reuse. It is plain synchronous code: it never awaits and never copies bytes — the
controller moves the bytes and reports back through the load / backup protocol.

Operations (this module; matching in ``match``, eviction in ``evict`` and, by bytes,
``evict_bytes``, allocation that evicts in ``alloc``, copies in ``load`` and ``transfer`` (what
depends on a load in flight: ``pending``), split and cascade in ``core``, locks in ``locks``,
bookkeeping in ``bookkeeping``):

- :class:`HybridRadixTree` — the tree, made of those parts.
- :meth:`HybridRadixTree.match_prefix` — walk page-aligned keys, cut back to the deepest state
  (in ``match``).
- :meth:`HybridRadixTree.insert` — device pages and states of a finished (or prefilled) request.
- :meth:`HybridRadixTree.insert_host` — host-only nodes for data prefetched from storage.
- :meth:`HybridRadixTree.forget_archived` — storage lost objects of a path: its nodes are no
  longer marked archived.
- :meth:`HybridRadixTree.state_positions` — where the scheduler should snapshot states.

Keys: one page is ``page_size`` token ids as int64 bytes; a node's children are keyed by the
bytes of their first page (how a walk compares keys: ``match``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from asynccache.checks import as_int, check_int
from asynccache.errors import ConfigError, StaleMatchError
from asynccache.policy.base import AdmissionContext
from asynccache.pools.base import ItemPool
from asynccache.tree.alloc import AllocationMixin
from asynccache.tree.evict_bytes import ByteEvictionMixin
from asynccache.tree.hashing import TokenIds, encode_tokens
from asynccache.tree.load import LoadMixin
from asynccache.tree.match import MatchMixin
from asynccache.tree.node import Tier, TreeNode
from asynccache.tree.results import InsertResult, MatchResult

__all__ = ["HybridRadixTree"]


class HybridRadixTree(MatchMixin, ByteEvictionMixin, AllocationMixin, LoadMixin):
    """Radix tree over page-aligned token ids with per-tier KV and recurrent-state bookkeeping.

    ``device_kv`` / ``device_mamba``: device pools (pages, state slots). ``host_kv`` /
    ``host_mamba``: host pools, or ``None`` for no host tier (``host_mamba`` needs ``host_kv``).
    Pools may be in accounting mode (``materialize=False``). ``admission`` (default
    :class:`~asynccache.policy.EndsAdmission`), ``eviction`` (default
    :class:`~asynccache.policy.LRUEviction`), ``write_policy`` (default ``write_through``).
    ``model_id`` names the hash namespace (default: the spec's namespace id). ``write_back``:
    the callback device eviction uses under ``write_back`` (see :meth:`evict_device`).
    ``clock``: the time source of ``last_access`` (default ``time.monotonic``; trace replay
    passes its simulated clock).

    Call from one thread (the event loop's); no method awaits or blocks.
    """

    # ---- admission -------------------------------------------------------------------------
    def state_positions(
        self, prompt_len: int, *, total_len: int | None = None, match: MatchResult | None = None
    ) -> set[int]:
        """Where the scheduler should snapshot states for a request (the admission policy's
        answer with this tree's page size)."""
        return self.admission.state_positions(prompt_len, page_size=self.page_size, total_len=total_len, match=match)

    # ---- insert ------------------------------------------------------------------------------
    def _insert_path(
        self,
        root: TreeNode,
        buf: bytes,
        num_pages: int,
        indices: torch.Tensor,
        cuts: Sequence[int],
        tier: Tier,
        offset: int = 0,
    ) -> tuple[list[TreeNode], list[TreeNode], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Create / split nodes so ``buf`` is a path with a node boundary at every page in
        ``cuts``; attach ``indices`` (pages ``[offset, num_pages)``) on ``tier`` to the nodes
        that lack that tier. Pages before ``offset`` must already be held on ``tier`` (checked by
        the caller; ``offset`` must be in ``cuts``). Returns the path, the nodes given pages
        and the caller's index slices of pages held already, with the node's own."""
        page_bytes = self.page_bytes
        device = tier is Tier.DEVICE
        path: list[TreeNode] = []
        dups: list[tuple[torch.Tensor, torch.Tensor]] = []
        fresh: list[TreeNode] = []
        pos = 0
        node = root
        ci = 0
        while pos < num_pages:
            while ci < len(cuts) and cuts[ci] <= pos:
                ci += 1
            stop = cuts[ci] if ci < len(cuts) else num_pages
            b = pos * page_bytes
            child = node.children.get(buf[b : b + page_bytes])
            if child is None:
                assert pos >= offset, "pages before the offset must be in the tree"
                child = self._new_child(node, buf[b : stop * page_bytes], pos)
                if device:
                    self._set_device_kv(child, indices[pos - offset : stop - offset])
                else:
                    self._set_host_kv(child, indices[pos - offset : stop - offset])
                fresh.append(child)
            else:
                if buf.startswith(child.key, b):
                    k = child.num_pages
                else:
                    k = self._common_pages(child.key, buf, b, num_pages * page_bytes)
                k = min(k, stop - pos)
                if k < child.num_pages:
                    child = self._split(child, k)
                held = child.device_kv if device else child.host_kv
                if pos < offset:
                    assert held is not None, "pages before the offset must be held on the tier"
                    path.append(child)
                    node = child
                    pos = child.end_page
                    continue
                seg = indices[pos - offset : pos - offset + k]
                if held is None:
                    # Not on this tier (e.g. evicted from the device): take the new pages.
                    if device:
                        self._set_device_kv(child, seg)
                    else:
                        self._set_host_kv(child, seg)
                    fresh.append(child)
                else:
                    # Already cached: free the caller's copy, except indices equal to the node's
                    # own (a request passing back the pages of its match): see _free_duplicates.
                    dups.append((seg, held))
            path.append(child)
            node = child
            pos = child.end_page
        return path, fresh, dups

    def insert(
        self,
        tokens: TokenIds,
        kv_indices: torch.Tensor | Sequence[int],
        *,
        states: Mapping[int, int] | None = None,
        salt: str = "",
        prompt_len: int | None = None,
    ) -> InsertResult:
        """Cache the device KV pages (one per full page of ``tokens``) and the device state
        slots ``states`` (``{page-aligned token position: slot}``) of a request.

        Ownership of every index passed moves to the tree: pages and states it keeps become node
        data; pages already cached on the device (duplicates), states already present and states
        the admission policy refuses are freed. A caller may pass the tree's own indices for the
        matched prefix (``match.device_kv_indices`` followed by its new pages): an index equal to
        the one the node holds is left alone. Nodes are split so each kept state sits at a node
        end. Nodes that only had a host copy get the new device pages. Mutates the tree, the LRU
        lists (the path becomes most recent) and the device pools (frees). On ``ConfigError``
        nothing changed and the caller still owns everything. :class:`StaleMatchError`, with
        nothing changed either, when an index passed is one of a failed load's, still held for
        the readers of its match (``asynccache.tree.pending``): the caller keeps only what it
        allocated itself.
        """
        buf, num_pages = encode_tokens(tokens, self.page_size)
        kv = self._check_indices(kv_indices, num_pages, "kv_indices", self.device_kv)
        offered = self._check_states(states, num_pages, "states", self.device_mamba)
        if prompt_len is not None:
            prompt_len = check_int("prompt_len", prompt_len, minimum=0)
        pages, slots = self._pending.retired_among(kv, offered.values())
        if pages or slots:
            what = " and ".join(f"{name} {ids}" for name, ids in (("device pages", pages), ("state slots", slots)) if ids)
            raise StaleMatchError(
                f"insert passes back {what} of a failed load: the match that reported them never got their "
                "bytes, nor did what was computed on them; free this request's own pages, unlock the match "
                "(the failed load's indices go back to the pools then) and match again"
            )
        root = self._root_for(salt, create=True)
        if num_pages == 0:
            return InsertResult(last_node=root)
        kept = offered
        if offered:
            _, cached_pages = self._walk(root, buf, num_pages)
            ctx = AdmissionContext(
                page_size=self.page_size,
                num_tokens=num_pages * self.page_size,
                num_cached_tokens=cached_pages * self.page_size,
                prompt_len=prompt_len,
                tier=Tier.DEVICE,
                salt=salt,
            )
            keep = self.admission.keep_states([p * self.page_size for p in sorted(offered)], ctx)
            kept = {p: s for p, s in offered.items() if p * self.page_size in keep}
        path, fresh, dups = self._insert_path(root, buf, num_pages, kv, sorted(kept), Tier.DEVICE)
        # Refused states are freed, but not a node's own slot passed back at its own end.
        ends = {n.end_page: n.device_state for n in path}
        free_slots = [s for p, s in offered.items() if p not in kept and ends.get(p) != s]
        new_states = self._attach_states(path, kept, Tier.DEVICE, free_slots)
        # What was computed here may rest on pages or a state a load is still bringing (its
        # storage keys count even where nothing new is kept: a storage-only snapshot).
        self._pending.on_insert(path, fresh, new_states)
        num_dups = self._free_duplicates(self.device_kv, dups)
        if free_slots:
            self.device_mamba.free(torch.tensor(free_slots, dtype=torch.int64))
        self._touch_path(path)
        return InsertResult(
            last_node=path[-1],
            num_new_pages=sum(n.num_pages for n in fresh),
            num_duplicate_pages=num_dups,
            num_new_states=len(new_states),
            num_freed_states=len(free_slots),
            backup_nodes=self._backup_candidates(path, on_hit=False),
        )

    def insert_host(
        self,
        tokens: TokenIds,
        host_kv_indices: torch.Tensor | Sequence[int],
        *,
        host_states: Mapping[int, int] | None = None,
        start_page: int = 0,
        salt: str = "",
    ) -> InsertResult:
        """Cache host pages (one per full page of ``tokens``) and host state slots
        (``host_states={page-aligned position: slot}``), e.g. data prefetched from storage.

        Ownership passes to the tree as in :meth:`insert`: nodes that lack a host copy get these
        pages (new nodes are host-only), duplicates are freed to the host pools. Every offered
        state is kept where the node has no host state yet. With ``start_page > 0``,
        ``host_kv_indices`` cover pages ``[start_page, len(tokens) // page_size)`` only and the
        pages before must already have host copies (keep them locked with ``lock_host``);
        otherwise ``ConfigError`` and nothing changes. States go at ``start_page`` or past it
        (one at ``start_page`` with no pages: a state for a prefix the host already holds).
        What it gives nodes below a load in flight goes with that load if its copy fails
        (``abort_load(drop_below=True)``): it may have been computed on what the load brings.
        """
        if self.host_kv is None:
            raise ConfigError("insert_host needs a host KV pool")
        buf, num_pages = encode_tokens(tokens, self.page_size)
        if as_int(start_page) is None or not 0 <= start_page <= num_pages:
            raise ConfigError(f"start_page={start_page} outside 0..{num_pages}")
        kv = self._check_indices(host_kv_indices, num_pages - start_page, "host_kv_indices", self.host_kv)
        offered = self._check_states(host_states, num_pages, "host_states", self.host_mamba)
        if offered and self.host_mamba is None:
            raise ConfigError("host_states given but the tree has no host state pool")
        if any(p < start_page for p in offered):
            raise ConfigError("host_states positions must not lie before start_page")
        root = self._root_for(salt, create=start_page == 0)
        if start_page and not self._held_on_host(root, buf, start_page):
            raise ConfigError(f"the first {start_page} pages are not all on the host")
        if num_pages == 0:
            return InsertResult(last_node=root)
        cuts = sorted({*offered, start_page} - {0})
        path, fresh, dups = self._insert_path(root, buf, num_pages, kv, cuts, Tier.HOST, start_page)
        free_slots: list[int] = []
        new_states = self._attach_states(path, offered, Tier.HOST, free_slots)
        # Restored below a load in flight, it may be what was computed on that load, archived
        # and evicted meanwhile: it goes with the load if the load fails.
        self._pending.on_restore(path, fresh, new_states)
        num_dups = self._free_duplicates(self.host_kv, dups)
        if free_slots:
            assert self.host_mamba is not None
            self.host_mamba.free(torch.tensor(free_slots, dtype=torch.int64))
        self._touch_path(path)
        return InsertResult(
            last_node=path[-1],
            num_new_pages=sum(n.num_pages for n in fresh),
            num_duplicate_pages=num_dups,
            num_new_states=len(new_states),
            num_freed_states=len(free_slots),
        )

    def forget_archived(self, tokens: TokenIds, *, start_page: int = 0, salt: str = "") -> list[TreeNode]:
        """Storage may have lost objects of pages ``[start_page, len(tokens) // page_size)`` of
        ``tokens`` or the state at their end (a read found one missing or invalid, and a backend
        removes an invalid object): clear ``archived`` on the nodes of that path holding any of
        those pages or ending there, so the next archive through them writes them again
        (put-if-absent: what is still stored is not written twice) and
        ``evict_host(archived_only=True)`` no longer takes them for stored. Returns the nodes
        unmarked, top-down. Nothing else changes (no LRU position, no hit count); a path the
        tree holds in part is walked as far as it goes."""
        buf, num_pages = encode_tokens(tokens, self.page_size)
        if as_int(start_page) is None or not 0 <= start_page <= num_pages:
            raise ConfigError(f"start_page={start_page} outside 0..{num_pages}")
        root = self._roots.get(salt)
        if root is None:
            return []
        path, matched = self._walk(root, buf, num_pages)
        end = path[-1] if path else root
        if matched > end.end_page:  # the tokens end inside the next node, which holds some of them
            b = end.end_page * self.page_bytes
            path.append(end.children[buf[b : b + self.page_bytes]])
        unmarked = [n for n in path if n.archived and (n.end_page > start_page or n.end_page == num_pages)]
        for n in unmarked:
            n.archived = False
        return unmarked

    def _held_on_host(self, root: TreeNode, buf: bytes, num_pages: int) -> bool:
        """Whether the tree holds host copies of the first ``num_pages`` pages of ``buf``."""
        path, matched = self._walk(root, buf[: num_pages * self.page_bytes], num_pages)
        if matched < num_pages or any(n.host_kv is None for n in path):
            return False
        end = path[-1] if path else root
        if end.end_page < num_pages:  # the boundary falls inside the next node
            partial = end.children[buf[end.end_page * self.page_bytes : (end.end_page + 1) * self.page_bytes]]
            return partial.host_kv is not None
        return True

    def _attach_states(
        self, path: Sequence[TreeNode], states: Mapping[int, int], tier: Tier, free_slots: list[int]
    ) -> list[TreeNode]:
        """Give each ``{end page: slot}`` state to the path node ending there on ``tier``; a node
        that already holds a state there keeps it and the offered slot goes to ``free_slots``
        (unless it is the node's own slot, passed back).
        Returns the nodes given a state."""
        if not states:
            return []
        by_end = {n.end_page: n for n in path}
        attached: list[TreeNode] = []
        for p, slot in states.items():
            node = by_end[p]
            held = node.device_state if tier is Tier.DEVICE else node.host_state
            if held is not None:
                if held != slot:  # the node's own slot passed back (like its own pages) stays
                    free_slots.append(slot)
                continue
            if tier is Tier.DEVICE:
                self._set_device_state(node, slot)
            else:
                self._set_host_state(node, slot)
            attached.append(node)
        return attached

    def _touch_path(self, path: Sequence[TreeNode]) -> None:
        # Deepest first, so every ancestor ends up more recent than its descendants and an LRU
        # scan meets leaves before the nodes above them.
        now = self.clock()
        for n in reversed(path):
            n.last_access = now
            self._touch(n)

    @staticmethod
    def _free_duplicates(pool: ItemPool, dups: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Free at once the caller's indices of pages held already (``(given, held)``) but the node's own."""
        if not dups:
            return 0
        given, held = (torch.cat(t) for t in zip(*dups, strict=True))
        indices = given[given != held]
        pool.free(indices)
        return int(indices.numel())
