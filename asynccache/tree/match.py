"""Matching a prompt against the hybrid radix tree: walk its page-aligned keys, cut the match back
to the deepest state.

Primitives: :class:`MatchMixin` — ``match_prefix`` (the reusable prefix of a prompt, as a
:class:`~asynccache.tree.results.MatchResult`), and the walk that ``insert`` shares: the nodes a
prompt's pages run through and the whole pages it shares with a node's key.

A node's children are keyed by the bytes of their first page and a node's whole key is compared
with one ``memcmp`` (a mismatch inside a key is located with numpy), so a match costs O(nodes on
the path), not O(tokens) Python steps.
"""

from __future__ import annotations

import numpy as np
import torch

from asynccache.tree.core import TreeCore
from asynccache.tree.hashing import PageHashes, TokenIds, encode_tokens
from asynccache.tree.node import Tier, TreeNode
from asynccache.tree.results import MatchResult

__all__ = ["MatchMixin"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class MatchMixin(TreeCore):
    """``match_prefix`` and the walk over page-aligned keys (``_walk``, ``_common_pages``)."""

    # ---- walking -----------------------------------------------------------------------------
    def _common_pages(self, key: bytes, buf: bytes, pos: int, end: int) -> int:
        """Whole pages shared by ``key`` and ``buf[pos:end]`` (both int64 token bytes)."""
        n = min(len(key), end - pos) // 8
        a = np.frombuffer(key, dtype="<i8", count=n)
        b = np.frombuffer(buf, dtype="<i8", count=n, offset=pos)
        neq = a != b
        i = int(neq.argmax()) if n else 0
        first = i if n and neq[i] else n
        return first // self.page_size

    def _walk(self, root: TreeNode, buf: bytes, num_pages: int) -> tuple[list[TreeNode], int]:
        """Nodes fully contained in the prompt, top-down, and the pages matched on any tier
        (including a partially matched last node). Mutates nothing."""
        page_bytes = self.page_bytes
        end = num_pages * page_bytes
        path: list[TreeNode] = []
        pos = 0
        node = root
        while pos < end:
            child = node.children.get(buf[pos : pos + page_bytes])
            if child is None:
                break
            key = child.key
            if buf.startswith(key, pos):
                path.append(child)
                pos += len(key)
                node = child
                continue
            return path, pos // page_bytes + self._common_pages(key, buf, pos, end)
        return path, pos // page_bytes

    # ---- match -------------------------------------------------------------------------------
    def match_prefix(self, tokens: TokenIds, *, salt: str = "") -> MatchResult:
        """The reusable prefix of ``tokens`` (see :class:`MatchResult`).

        Only full pages count; the scheduler passes ``tokens[:-1]`` so at least one token is
        computed. Mutates LRU positions, ``hit_count`` and ``last_access`` of the nodes of the
        usable prefix (nothing else); never splits nodes.
        """
        buf, num_pages = encode_tokens(tokens, self.page_size)
        return self._match(buf, num_pages, salt, touch=True)

    def _match(self, buf: bytes, num_pages: int, salt: str, *, touch: bool) -> MatchResult:
        root = self._roots.get(salt)
        if root is None:
            root = self._root_for(salt, create=False)
            hashes = PageHashes(buf, num_pages, self.page_size, root.seed_hash)
            return MatchResult(num_tokens=0, last_node=root, matched_node=root, page_hashes=hashes, salt=salt)
        path, matched_pages = self._walk(root, buf, num_pages)
        matched = path[-1] if path else root
        if matched_pages > matched.end_page:  # the prompt branches off inside the next node
            b = matched.end_page * self.page_bytes
            matched = matched.children[buf[b : b + self.page_bytes]]
        cut = len(path)
        while cut and path[cut - 1].device_state is None and path[cut - 1].host_state is None:
            cut -= 1
        usable = path[:cut]
        last = usable[-1] if cut else root
        on_device = 0
        while on_device < cut and usable[on_device].device_kv is not None:
            on_device += 1
        if on_device == 0:
            device_kv = _EMPTY
        elif on_device == 1:
            device_kv = usable[0].device_kv  # type: ignore[assignment]
        else:
            device_kv = torch.cat([n.device_kv for n in usable[:on_device]])  # type: ignore[misc]
        num_device_tokens = usable[on_device - 1].end_tokens if on_device else 0
        num_tokens = last.end_tokens
        if last.device_state is not None:
            state_tier: Tier | None = Tier.DEVICE
        elif last.host_state is not None:
            state_tier = Tier.HOST
        else:
            state_tier = None
        load_nodes = tuple(usable[on_device:])
        if state_tier is Tier.HOST and not load_nodes:
            load_nodes = (last,)
        pending = False
        for n in usable:
            if n.loading:
                # A load in flight on the path: pending if it writes what this match reads (a
                # load of another node's state alone does not).
                pending = bool(self._pending.covering(usable, last))
                break
        backup_nodes: tuple[TreeNode, ...] = ()
        if touch and cut:
            now = self.clock()
            dkv, dst, hkv, hst = self.device_kv_lru, self.device_state_lru, self.host_kv_lru, self.host_state_lru
            # Deepest first, so ancestors end up more recent than their descendants.
            for n in reversed(usable):
                n.hit_count += 1
                n.last_access = now
                if n.device_kv is not None:
                    dkv.touch(n)
                if n.device_state is not None:
                    dst.touch(n)
                if n.host_kv is not None:
                    hkv.touch(n)
                if n.host_state is not None:
                    hst.touch(n)
            backup_nodes = self._backup_candidates(usable, on_hit=True)
        return MatchResult(
            num_tokens=num_tokens,
            last_node=last,
            device_kv_indices=device_kv,
            num_device_tokens=num_device_tokens,
            num_host_tokens=num_tokens - num_device_tokens,
            state_tier=state_tier,
            needs_load=bool(load_nodes),
            load_nodes=load_nodes,
            pending_load=pending,
            num_matched_tokens=matched_pages * self.page_size,
            matched_node=matched,
            backup_nodes=backup_nodes,
            page_hashes=PageHashes(buf, num_pages, self.page_size, root.seed_hash),
            salt=salt,
        )
