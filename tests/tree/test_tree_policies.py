"""Admission, write and eviction policy objects, alone and as the tree uses them."""

from __future__ import annotations

from collections.abc import Collection
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tree_builders import PAGE, make_tree, seq

from asynccache.errors import ConfigError
from asynccache.policy import (
    AdmissionContext,
    BlockGridAdmission,
    EndsAdmission,
    EveryPageAdmission,
    WriteMode,
    WritePolicy,
    end_positions,
)
from asynccache.tree import Tier


def _match(num_tokens: int) -> Any:
    return SimpleNamespace(num_tokens=num_tokens)


def test_ends_admission_positions() -> None:
    ends = EndsAdmission()
    assert ends.state_positions(200, page_size=64, total_len=300) == {192, 256}
    assert ends.state_positions(256, page_size=64) == {192, 256}
    assert ends.state_positions(257, page_size=64) == {256}
    assert ends.state_positions(63, page_size=64, total_len=64) == {64}
    assert ends.state_positions(0, page_size=64) == set()
    assert ends.state_positions(256, page_size=64, total_len=400, match=_match(192)) == {256, 384}
    assert end_positions(128, page_size=64, total_len=128) == {64, 128}


def test_every_page_and_block_grid_positions() -> None:
    assert EveryPageAdmission().state_positions(130, page_size=64, total_len=260) == {64, 128, 192, 256}
    assert EveryPageAdmission().state_positions(130, page_size=64, match=_match(64)) == {128}
    grid = BlockGridAdmission(2, include_ends=False)
    assert grid.state_positions(200, page_size=64, total_len=300) == {128, 256}
    assert BlockGridAdmission(2).state_positions(200, page_size=64, total_len=300) == {128, 192, 256}
    assert "BlockGridAdmission(2" in repr(grid)


@pytest.mark.parametrize(
    "call",
    [
        lambda: BlockGridAdmission(0),
        lambda: EndsAdmission().state_positions(10, page_size=4, total_len=5),
        lambda: EndsAdmission().state_positions(10, page_size=0),
        lambda: EveryPageAdmission().state_positions(-1, page_size=4),
    ],
)
def test_admission_rejects_bad_arguments(call: Any) -> None:
    with pytest.raises(ConfigError):
        call()


def test_write_policy_parsing_and_decisions() -> None:
    assert WritePolicy.parse("write_through").mode is WriteMode.WRITE_THROUGH
    assert WritePolicy.parse("write_back").writes_back_on_evict
    sel = WritePolicy.parse("write_through_selective:3")
    assert sel.mode is WriteMode.WRITE_THROUGH_SELECTIVE and sel.hit_threshold == 3
    assert str(sel) == "write_through_selective:3"
    assert WritePolicy.parse(str(sel)) == sel
    assert WritePolicy.parse(WriteMode.WRITE_BACK) == WritePolicy.write_back()
    for bad in ("write_sometimes", "write_back:3", "write_through_selective:x"):
        with pytest.raises(ConfigError):
            WritePolicy.parse(bad)
    with pytest.raises(ConfigError):
        WritePolicy.write_through_selective(0)
    cold, hot = SimpleNamespace(hit_count=1), SimpleNamespace(hit_count=3)
    assert not sel.backup_on_hit(cold) and sel.backup_on_hit(hot)  # type: ignore[arg-type]
    assert WritePolicy.write_through().backup_on_insert(cold)  # type: ignore[arg-type]
    assert not WritePolicy.write_back().backup_on_insert(hot)  # type: ignore[arg-type]


def test_admission_can_refuse_offered_states() -> None:
    seen: list[AdmissionContext] = []

    class DeepestOnly(EndsAdmission):
        def keep_states(self, offered: Collection[int], ctx: AdmissionContext) -> set[int]:
            seen.append(ctx)
            return {max(offered)}

    tree, _ = make_tree(admission=DeepestOnly())
    common = seq(1, 3 * PAGE)
    first = common + seq(2, 2 * PAGE)
    kv = tree.device_kv.alloc(5)
    slots = tree.device_mamba.alloc(2)
    assert kv is not None and slots is not None
    r = tree.insert(first, kv, states={3 * PAGE: int(slots[0]), 5 * PAGE: int(slots[1])}, prompt_len=17)
    assert r.num_new_states == 1 and r.num_freed_states == 1
    assert tree.device_mamba.num_free == tree.device_mamba.num_items - 1
    assert seen[-1].num_cached_tokens == 0 and seen[-1].prompt_len == 17 and seen[-1].tier is Tier.DEVICE
    second = common + seq(3, PAGE)
    kv2 = tree.device_kv.alloc(4)
    slot = tree.device_mamba.alloc(1)
    assert kv2 is not None and slot is not None
    tree.insert(second, kv2, states={4 * PAGE: int(slot[0])})
    assert seen[-1].num_cached_tokens == 3 * PAGE  # the branch point
    tree.check_integrity()


def test_a_refused_state_that_is_the_nodes_own_slot_passed_back_stays_the_nodes() -> None:
    """A next turn passes back its match's pages and boundary slot with its new ones; the
    policy keeps only the deepest state. The refused one is the node's own slot: not freed."""

    class DeepestOnly(EndsAdmission):
        def keep_states(self, offered: Collection[int], ctx: AdmissionContext) -> set[int]:
            return {max(offered)}

    tree, _ = make_tree(admission=DeepestOnly())
    turn = seq(1, 3 * PAGE)
    kv, slots = tree.device_kv.alloc(3), tree.device_mamba.alloc(1)
    assert kv is not None and slots is not None
    tree.insert(turn, kv, states={3 * PAGE: int(slots[0])})
    match = tree.match_prefix(turn)
    own = match.last_node.device_state
    new, slot = tree.device_kv.alloc(2), tree.device_mamba.alloc(1)
    assert new is not None and slot is not None
    r = tree.insert(
        turn + seq(2, 2 * PAGE),
        torch.cat([match.device_kv_indices, new]),
        states={3 * PAGE: own, 5 * PAGE: int(slot[0])},
    )
    assert r.num_freed_states == 0 and r.num_new_states == 1
    assert match.last_node.device_state == own and tree.device_mamba.allocator.is_allocated(own)
    tree.check_integrity()


def test_tree_state_positions_uses_its_page_size() -> None:
    tree, _ = make_tree()
    assert tree.state_positions(9, total_len=14) == {8, 12}
