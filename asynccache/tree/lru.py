"""Intrusive doubly-linked LRU lists of tree nodes.

The tree keeps four: device KV, device state (:class:`LRUList`), host KV, host state
(:class:`HostLRUList`). A node is a member of a list exactly while it holds that resource on that
tier. ``push`` (newest end), ``touch`` (move to the newest end), ``remove`` and ``insert_after``
are O(1) pointer updates on ``node.links`` — no dict, no allocation::

    sentinel ⇄ oldest ⇄ … ⇄ newest ⇄ sentinel        links[2·slot] = prev, links[2·slot+1] = next

``remove`` clears the node's prev pointer (membership) but keeps its next pointer, so an
iterator positioned on a removed node still finds the next member: :meth:`iter_oldest` survives
the removal of any nodes between two steps (eviction removes the yielded node and sometimes its
ancestors). Synchronous; the tree owns all mutation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from asynccache.tree.node import NUM_LRU_LISTS, Resource, Tier

if TYPE_CHECKING:
    from asynccache.tree.node import TreeNode

__all__ = ["HostLRUList", "LRUList"]


class _Sentinel:
    __slots__ = ("links",)

    def __init__(self) -> None:
        self.links: list[object] = [None] * (2 * NUM_LRU_LISTS)


class LRUList:
    """Nodes holding one resource on one tier, least recently used first."""

    __slots__ = ("_head", "_n", "_p", "_size", "name", "resource", "tier")

    def __init__(self, slot: int, *, name: str, tier: Tier, resource: Resource) -> None:
        if not 0 <= slot < NUM_LRU_LISTS:
            raise ValueError(f"LRU slot {slot} outside 0..{NUM_LRU_LISTS - 1}")
        self.name = name
        self.tier = tier
        self.resource = resource
        self._p = 2 * slot
        self._n = 2 * slot + 1
        head = _Sentinel()
        head.links[self._p] = head
        head.links[self._n] = head
        self._head = head
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, node: object) -> bool:
        links = getattr(node, "links", None)
        return links is not None and links[self._p] is not None

    def push(self, node: TreeNode) -> None:
        """Append ``node`` at the newest end. It must not be a member."""
        p, n, head = self._p, self._n, self._head
        assert node.links[p] is None, f"{node} is already in {self.name}"
        tail = head.links[p]
        node.links[p] = tail
        node.links[n] = head
        tail.links[n] = node  # type: ignore[union-attr]
        head.links[p] = node
        self._size += 1

    def insert_after(self, anchor: TreeNode, node: TreeNode) -> None:
        """Link ``node`` right after (newer than) member ``anchor``."""
        p, n = self._p, self._n
        assert node.links[p] is None and anchor.links[p] is not None
        nxt = anchor.links[n]
        node.links[p] = anchor
        node.links[n] = nxt
        anchor.links[n] = node
        nxt.links[p] = node  # type: ignore[union-attr]
        self._size += 1

    def remove(self, node: TreeNode) -> None:
        """Unlink member ``node`` (its next pointer is kept for iterators resting on it)."""
        p, n = self._p, self._n
        prev = node.links[p]
        assert prev is not None, f"{node} is not in {self.name}"
        nxt = node.links[n]
        prev.links[n] = nxt
        nxt.links[p] = prev  # type: ignore[union-attr]
        node.links[p] = None
        self._size -= 1

    def touch(self, node: TreeNode) -> None:
        """Move member ``node`` to the newest end."""
        p, n, head = self._p, self._n, self._head
        if head.links[p] is node:
            return
        prev = node.links[p]
        nxt = node.links[n]
        prev.links[n] = nxt  # type: ignore[union-attr]
        nxt.links[p] = prev  # type: ignore[union-attr]
        tail = head.links[p]
        node.links[p] = tail
        node.links[n] = head
        tail.links[n] = node  # type: ignore[union-attr]
        head.links[p] = node

    def oldest(self) -> TreeNode | None:
        first = self._head.links[self._n]
        return None if first is self._head else first  # type: ignore[return-value]

    def newest(self) -> TreeNode | None:
        last = self._head.links[self._p]
        return None if last is self._head else last  # type: ignore[return-value]

    def iter_oldest(self) -> Iterator[TreeNode]:
        """Members from least to most recently used, tolerating removals between steps.

        Nodes pushed during the iteration may or may not be visited.
        """
        p, n, head = self._p, self._n, self._head
        cur = head.links[n]
        while cur is not head:
            yield cur  # type: ignore[misc]
            nxt = cur.links[n]  # type: ignore[union-attr]
            # A removed node keeps the next pointer it had when it left; follow the chain.
            while nxt is not head and nxt.links[p] is None:  # type: ignore[union-attr]
                nxt = nxt.links[n]  # type: ignore[union-attr]
            cur = nxt

    def members(self) -> list[TreeNode]:
        """Members from least to most recently used, as a list (a snapshot: one pass without a
        generator's per-member cost)."""
        n, head = self._n, self._head
        out: list[TreeNode] = []
        append = out.append
        cur = head.links[n]
        while cur is not head:
            append(cur)  # type: ignore[arg-type]
            cur = cur.links[n]  # type: ignore[union-attr]
        return out

    def iter_newest(self) -> Iterator[TreeNode]:
        """Members from most to least recently used (no mutation allowed meanwhile)."""
        p, head = self._p, self._head
        cur = head.links[p]
        while cur is not head:
            yield cur  # type: ignore[misc]
            cur = cur.links[p]  # type: ignore[union-attr]

    def check_links(self) -> list[TreeNode]:
        """Walk both directions and return the members oldest first (for integrity checks)."""
        p, n, head = self._p, self._n, self._head
        forward: list[TreeNode] = []
        prev: object = head
        cur = head.links[n]
        steps = 0
        while cur is not head:
            assert cur is not None, f"{self.name}: broken next pointer"
            assert cur.links[p] is prev, f"{self.name}: prev pointer of {cur} does not match its predecessor"
            forward.append(cur)  # type: ignore[arg-type]
            prev = cur
            cur = cur.links[n]  # type: ignore[union-attr]
            steps += 1
            assert steps <= self._size, f"{self.name}: more linked nodes than its size {self._size} (cycle?)"
        assert head.links[p] is prev, f"{self.name}: sentinel prev pointer does not match the last member"
        assert len(forward) == self._size, f"{self.name}: {len(forward)} linked nodes but size {self._size}"
        return forward

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, size={self._size})"


class HostLRUList(LRUList):
    """An LRU list of the host tier (host KV copies or host states)."""

    __slots__ = ()

    def __init__(self, slot: int, *, name: str, resource: Resource) -> None:
        super().__init__(slot, name=name, tier=Tier.HOST, resource=resource)
