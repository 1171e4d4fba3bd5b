"""Small builders for tree tests: pools, a tree, requests with recognisable page contents.

Every KV page written through :func:`put` holds its page hash (16 bytes, tiled) and every state
holds the hash of the page it follows with a state marker, so a test can check that the indices
the tree hands out point at the right bytes after any number of evictions, backups and loads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from asynccache.policy import AdmissionPolicy, EvictionPolicy, WritePolicy
from asynccache.pools import DeviceKVPool, DeviceMambaPool, HostKVPool, MambaPoolHost
from asynccache.pools.base import ItemPool
from asynccache.spec import HybridSpec
from asynccache.tree import HybridRadixTree, InsertResult, MatchResult, SyncTransfer
from asynccache.tree.hashing import encode_tokens

PAGE = 4


class Clock:
    """A deterministic clock: every reading is one tick later."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make_spec(page_size: int = PAGE) -> HybridSpec:
    return HybridSpec.preset("tiny", page_size=page_size)


def make_tree(
    *,
    device_pages: int = 64,
    device_states: int = 16,
    host_pages: int | None = 128,
    host_states: int | None = 32,
    write_policy: WritePolicy | str = "write_through",
    admission: AdmissionPolicy | None = None,
    eviction: EvictionPolicy | None = None,
    materialize: bool = True,
    page_size: int = PAGE,
    model_id: str | None = None,
) -> tuple[HybridRadixTree, SyncTransfer]:
    spec = make_spec(page_size)
    tree = HybridRadixTree(
        spec,
        device_kv=DeviceKVPool(spec, device_pages, materialize=materialize),
        device_mamba=DeviceMambaPool(spec, device_states, materialize=materialize),
        host_kv=None if host_pages is None else HostKVPool(spec, num_pages=host_pages, materialize=materialize),
        host_mamba=None if host_states is None else MambaPoolHost(spec, num_slots=host_states, materialize=materialize),
        admission=admission,
        eviction=eviction,
        write_policy=write_policy,
        model_id=model_id,
        clock=Clock(),
    )
    transfer = SyncTransfer(tree)
    if tree.write_policy.writes_back_on_evict:
        tree.write_back = transfer.write_back
    return tree, transfer


def toks(*parts: Iterable[int] | int) -> list[int]:
    """Concatenate token lists; an int ``n`` stands for ``n`` distinct filler tokens."""
    out: list[int] = []
    for p in parts:
        if isinstance(p, int):
            base = 10_000 + 97 * len(out)
            out.extend(range(base, base + p))
        else:
            out.extend(p)
    return out


def seq(seed: int, n: int) -> list[int]:
    """``n`` tokens unique to ``seed``."""
    return [seed * 100_000 + i for i in range(n)]


def _page_digest(tree: HybridRadixTree, tokens: Sequence[int], salt: str) -> list[bytes]:
    m = tree._match(*encode_tokens(tokens, tree.page_size), salt, touch=False)
    return [m.page_hashes.raw(i) for i in range(len(m.page_hashes))]  # type: ignore[attr-defined]


def _state_digest(page_digest: bytes) -> bytes:
    return hashlib.blake2b(page_digest + b"state", digest_size=16).digest()


def _fill(pool: ItemPool, index: int, digest: bytes) -> None:
    if pool.buffer is None:
        return
    view = pool.index_bytes(index)
    pattern = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    reps = -(-view.shape[-1] // 16)
    view.copy_(pattern.repeat(reps)[: view.shape[-1]].expand_as(view))


def _holds(pool: ItemPool, index: int, digest: bytes) -> bool:
    if pool.buffer is None:
        return True
    view = pool.index_bytes(index)
    pattern = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    return bool(torch.equal(view[:, :16], pattern.expand(view.shape[0], 16)))


def put(
    tree: HybridRadixTree,
    tokens: Sequence[int],
    *,
    prompt_len: int | None = None,
    states: Iterable[int] | None = None,
    salt: str = "",
) -> InsertResult:
    """Allocate device pages and state slots for ``tokens``, write their contents, insert.

    ``states``: token positions. Default: the admission policy's positions for a request whose
    prompt is ``prompt_len`` tokens and whose total is ``tokens``; without ``prompt_len``, one
    state at the last full page.
    """
    n_pages = len(tokens) // tree.page_size
    if states is None and prompt_len is None:
        states = [n_pages * tree.page_size] if n_pages else []
    elif states is None:
        assert prompt_len is not None
        states = tree.state_positions(prompt_len, total_len=len(tokens))
    positions = sorted(states)
    alloc = tree.alloc_device(n_pages, len(positions))
    assert alloc is not None, "no device room for the test request"
    digests = _page_digest(tree, tokens, salt)
    for i in range(n_pages):
        _fill(tree.device_kv, int(alloc.kv_indices[i]), digests[i])
    slots = alloc.state_slots.tolist()
    for pos, slot in zip(positions, slots, strict=True):
        _fill(tree.device_mamba, slot, _state_digest(digests[pos // tree.page_size - 1]))
    return tree.insert(
        tokens, alloc.kv_indices, states=dict(zip(positions, slots, strict=True)), salt=salt, prompt_len=prompt_len
    )


def check_contents(tree: HybridRadixTree, tokens: Sequence[int], match: MatchResult, *, salt: str = "") -> None:
    """The device pages and the device state a match hands out hold the right bytes."""
    if match.pending_load:
        return
    digests = _page_digest(tree, tokens, salt)
    for i, idx in enumerate(match.device_kv_indices.tolist()):
        assert _holds(tree.device_kv, idx, digests[i]), f"device page {idx} does not hold page {i}"
    node = match.last_node
    if match.num_tokens and node.device_state is not None:
        d = _state_digest(digests[match.num_tokens // tree.page_size - 1])
        assert _holds(tree.device_mamba, node.device_state, d), "the device state holds another position's state"
    if match.num_tokens and node.host_state is not None and tree.host_mamba is not None:
        d = _state_digest(digests[match.num_tokens // tree.page_size - 1])
        assert _holds(tree.host_mamba, node.host_state, d), "the host state holds another position's state"
    if tree.host_kv is not None:
        for n in tree.path_to(node) if node.parent is not None else []:
            if n.host_kv is None or n.loading or n.host_lock:
                continue
            for j, idx in enumerate(n.host_kv.tolist()):
                assert _holds(tree.host_kv, idx, digests[n.start_page + j]), f"host page {idx} holds wrong bytes"
