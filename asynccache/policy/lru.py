"""Least-recently-used eviction: the order of the tree's LRU lists, oldest first.

Matching and inserting touch a path from its deepest node up to the root, so a parent is always
more recent than its children and an LRU scan reaches leaves before their ancestors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from asynccache.policy.base import EvictionPolicy

if TYPE_CHECKING:
    from asynccache.tree.lru import LRUList
    from asynccache.tree.node import TreeNode

__all__ = ["LRUEviction"]


class LRUEviction(EvictionPolicy):
    """Evict the least recently used node first."""

    name: ClassVar[str] = "lru"

    def candidates(self, lru: LRUList, *, now: float) -> Iterator[TreeNode]:
        return lru.iter_oldest()
