"""The hybrid radix tree (synchronous; never awaits).

- :class:`HybridRadixTree` — match / insert / evict (by count or by bytes) / lock / load and
  backup protocols.
- :class:`TreeNode`, :class:`Tier`, :class:`Resource` — nodes and where their data lives.
- :class:`EvictHow`, :data:`EvictListener`, :data:`DemoteFn`, :data:`WriteBackFn` — eviction
  notifications and callbacks.
- :class:`LRUList`, :class:`HostLRUList` — the four intrusive LRU lists.
- Results: :class:`MatchResult`, :class:`InsertResult`, :class:`EvictResult`,
  :class:`LoadPlan`, :class:`BackupPlan`, :class:`Allocation`, :class:`ReleasedIndices`,
  :class:`TreeStats`.
- :class:`TreeError` — protocol misuse. :func:`check_integrity` — every invariant.
- :class:`SyncTransfer` — synchronous stand-in for the controller's copies (CPU tests, trace
  replay in accounting mode).
"""

from asynccache.tree.core import POOL_NAMES, DemoteFn, EvictListener, WriteBackFn
from asynccache.tree.errors import TreeError
from asynccache.tree.hashing import PageHashes, TokenIds, encode_tokens, seed_hash
from asynccache.tree.integrity import check_integrity
from asynccache.tree.lru import HostLRUList, LRUList
from asynccache.tree.node import EvictHow, Resource, Tier, TreeNode
from asynccache.tree.results import (
    Allocation,
    BackupPlan,
    EvictResult,
    InsertResult,
    LoadPlan,
    MatchResult,
    ReleasedIndices,
    TreeStats,
)
from asynccache.tree.sync_io import SyncTransfer
from asynccache.tree.tree import HybridRadixTree

__all__ = [
    "POOL_NAMES",
    "Allocation",
    "BackupPlan",
    "DemoteFn",
    "EvictHow",
    "EvictListener",
    "EvictResult",
    "HostLRUList",
    "HybridRadixTree",
    "InsertResult",
    "LRUList",
    "LoadPlan",
    "MatchResult",
    "PageHashes",
    "ReleasedIndices",
    "Resource",
    "SyncTransfer",
    "Tier",
    "TokenIds",
    "TreeError",
    "TreeNode",
    "TreeStats",
    "WriteBackFn",
    "check_integrity",
    "encode_tokens",
    "seed_hash",
]
