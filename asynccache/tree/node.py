"""Tree nodes and the tiers their data lives on.

A :class:`TreeNode` covers ``num_pages ≥ 1`` full pages of token ids (its ``key``, int64
little-endian bytes) starting at page ``start_page`` of the sequence. Independently it holds::

    device_kv     int64 device page indices (one per page) | None     ┐ KV of its pages
    host_kv       int64 host page indices                  | None     ┘
    device_state  device state slot                        | None     ┐ recurrent state after its
    host_state    host state slot                          | None     ┘ last token
    device_lock / host_lock   pins (path locks of requests, in-flight copies)
    lock_tokens               tokens of the device locks taken on this very node (``lock(node)``;
                              None without any), not through a descendant: the tokens an
                              ``unlock(node, token)`` accepts (``num_locks``, their number)
    loading                   number of in-flight host→device loads writing into it
    hit_count, last_access    usage, for eviction and selective write-through
    archived                  its pages (and state) are in storage (L3)

Tier invariants (checked by ``check_integrity``): KV on a tier is prefix-closed (a node holds
device KV only if its parent does; host copies form a contiguous prefix from the root); a state
on a tier implies the node's KV on that tier; every node holds KV on at least one tier.

Nodes are created and mutated only by the tree. Policies and callers read them.
"""

from __future__ import annotations

from enum import Enum

import torch

from asynccache.errors import TreeError
from asynccache.tree.hashing import chain_hashes

__all__ = ["EvictHow", "Resource", "Tier", "TreeNode"]


class Tier(str, Enum):
    """Where data lives. ``STORAGE`` is reached through the controller, never held by a node."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class Resource(str, Enum):
    """What an LRU list orders: KV pages or recurrent states."""

    KV = "kv"
    STATE = "state"


class EvictHow(str, Enum):
    """What an eviction did with a victim's copy on its tier (see ``asynccache.tree.evict``)."""

    DEMOTE = "demote"  # freed; the tier below keeps a copy (the host, or storage via ``demote``)
    WRITE_BACK = "write_back"  # freed once the eviction had written it back to the host
    DROP = "drop"  # freed; no copy was made below by this eviction
    CASCADE = "cascade"  # deleted by the tombstone cascade after an eviction
    RELEASE = "release"  # state freed on every tier by ``release_states``


#: Number of LRU lists a node can be linked into (device KV, device state, host KV, host state).
NUM_LRU_LISTS = 4


class TreeNode:
    """One edge of the radix tree (see the module docstring). Roots have no pages."""

    __slots__ = (
        "__weakref__",
        "_hashes",
        "alive",
        "archived",
        "children",
        "device_kv",
        "device_lock",
        "device_state",
        "hit_count",
        "host_kv",
        "host_lock",
        "host_state",
        "key",
        "last_access",
        "links",
        "loading",
        "lock_tokens",
        "node_id",
        "num_device_children",
        "num_host_children",
        "num_pages",
        "page_size",
        "parent",
        "salt",
        "seed_hash",
        "start_page",
    )

    def __init__(
        self,
        *,
        node_id: int,
        parent: TreeNode | None,
        key: bytes,
        start_page: int,
        num_pages: int,
        page_size: int,
        salt: str = "",
        seed_hash: bytes = b"",
    ) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.key = key
        self.start_page = start_page
        self.num_pages = num_pages
        self.page_size = page_size
        self.device_kv: torch.Tensor | None = None
        self.host_kv: torch.Tensor | None = None
        self.device_state: int | None = None
        self.host_state: int | None = None
        self.device_lock = 0
        self.host_lock = 0
        self.lock_tokens: set[int] | None = None
        self.loading = 0
        self.hit_count = 0
        self.last_access = 0.0
        self.archived = False
        self.alive = True
        self.num_device_children = 0
        self.num_host_children = 0
        # prev/next pointers of the NUM_LRU_LISTS intrusive lists (see asynccache.tree.lru).
        self.links: list[TreeNode | None] = [None] * (2 * NUM_LRU_LISTS)
        self.salt = salt
        self.seed_hash = seed_hash
        self._hashes: list[bytes] | None = None

    # ---- geometry ------------------------------------------------------------------------
    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def end_page(self) -> int:
        return self.start_page + self.num_pages

    @property
    def start_tokens(self) -> int:
        return self.start_page * self.page_size

    @property
    def end_tokens(self) -> int:
        """Depth of the node's end in tokens (where its state sits)."""
        return (self.start_page + self.num_pages) * self.page_size

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    # ---- contents ------------------------------------------------------------------------
    @property
    def num_locks(self) -> int:
        """Device locks taken on this very node (live ``lock_tokens``)."""
        return 0 if self.lock_tokens is None else len(self.lock_tokens)

    @property
    def has_state(self) -> bool:
        """A state exists on the device or the host."""
        return self.device_state is not None or self.host_state is not None

    @property
    def on_device(self) -> bool:
        return self.device_kv is not None

    @property
    def on_host(self) -> bool:
        return self.host_kv is not None

    def token_ids(self) -> torch.Tensor:
        """The node's tokens as an int64 tensor (a copy)."""
        return torch.frombuffer(bytearray(self.key), dtype=torch.int64)

    # ---- hashes --------------------------------------------------------------------------
    def raw_page_hashes(self) -> list[bytes]:
        """Chained digests of the node's pages, computed on first use and cached.

        ``h_i = blake2b(h_{i-1} ‖ page i tokens)``; the chain starts at the root's seed (model
        namespace and tenant salt). Mutates only the cache of this node and of ancestors whose
        hashes were not computed yet. A root covers no pages and has no storage keys: asking it
        raises :class:`~asynccache.errors.TreeError` (its chain's start is ``seed_hash``, also
        :meth:`last_raw_hash`; a miss's ``match.last_node`` is a root, the prompt's keys are
        ``match.page_hashes``).
        """
        if self._hashes is not None:
            return self._hashes
        if self.parent is None:
            raise TreeError(
                f"{self} covers no pages and has no page hashes (a miss's last_node is a root: the "
                "prompt's keys are match.page_hashes; the chain's seed is seed_hash)"
            )
        pending: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None and node.parent is not None and node._hashes is None:
            pending.append(node)
            node = node.parent
        assert node is not None
        prev = node.seed_hash if node.parent is None else node._hashes[-1]  # type: ignore[index]
        for n in reversed(pending):
            n._hashes = chain_hashes(prev, n.key, n.page_size)
            prev = n._hashes[-1]
        assert self._hashes is not None
        return self._hashes

    def last_raw_hash(self) -> bytes:
        """Digest of the node's last page (the root's seed for a root)."""
        if self.parent is None:
            return self.seed_hash
        return self.raw_page_hashes()[-1]

    @property
    def page_hashes(self) -> tuple[str, ...]:
        """Hex storage keys of the node's pages (its state is stored under the last one); a root
        raises :class:`~asynccache.errors.TreeError` (see :meth:`raw_page_hashes`)."""
        return tuple(h.hex() for h in self.raw_page_hashes())

    def __repr__(self) -> str:
        if self.parent is None:
            return f"TreeNode(root, id={self.node_id}, salt={self.salt!r})"
        parts = [f"id={self.node_id}", f"pages=[{self.start_page},{self.end_page})"]
        if self.device_kv is not None:
            parts.append("dkv")
        if self.host_kv is not None:
            parts.append("hkv")
        if self.device_state is not None:
            parts.append(f"dstate={self.device_state}")
        if self.host_state is not None:
            parts.append(f"hstate={self.host_state}")
        if self.device_lock or self.host_lock:
            parts.append(f"locks={self.device_lock}/{self.host_lock}")
        if not self.alive:
            parts.append("deleted")
        return f"TreeNode({', '.join(parts)})"
