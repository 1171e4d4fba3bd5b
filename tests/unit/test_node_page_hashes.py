"""TreeNode.page_hashes: a node's storage keys are the prompt's; a root (a miss's last_node) has
none and says so with a TreeError, not a bare assertion."""

from __future__ import annotations

import pytest

from asynccache.errors import TreeError
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.spec import HybridSpec
from asynccache.tree import HybridRadixTree

PAGE = 4


def _tree() -> HybridRadixTree:
    spec = HybridSpec.preset("tiny", page_size=PAGE)
    return HybridRadixTree(
        spec,
        device_kv=DeviceKVPool(spec, 16, materialize=False),
        device_mamba=DeviceMambaPool(spec, 4, materialize=False),
        host_kv=None,
        host_mamba=None,
    )


def test_a_miss_last_node_is_a_root_without_page_hashes() -> None:
    tree = _tree()
    tokens = list(range(3 * PAGE))
    match = tree.match_prefix(tokens)
    assert match.num_tokens == 0 and match.last_node.is_root
    assert len(match.page_hashes) == 3  # the prompt's keys are on the match
    with pytest.raises(TreeError, match="root.*no page hashes"):
        _ = match.last_node.page_hashes
    with pytest.raises(TreeError, match="no page hashes"):
        match.last_node.raw_page_hashes()
    assert match.last_node.last_raw_hash() == match.last_node.seed_hash


def test_an_inserted_node_has_the_prompt_page_hashes() -> None:
    tree = _tree()
    tokens = list(range(3 * PAGE))
    alloc = tree.alloc_device(3, 1)
    assert alloc is not None
    tree.insert(tokens, alloc.kv_indices, states={3 * PAGE: int(alloc.state_slots[0])})
    match = tree.match_prefix(tokens)
    node = match.last_node
    assert not node.is_root and node.num_pages == 3
    assert node.page_hashes == tuple(match.page_hashes)
    assert node.last_raw_hash().hex() == node.page_hashes[-1]
