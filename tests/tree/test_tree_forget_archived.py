"""``tree.forget_archived``: a path's nodes stop counting as stored once storage is found to
have lost their objects (the storage tier's part: tests/integration/test_storage_forget_archived.py)."""

from __future__ import annotations

import pytest
from tree_builders import PAGE, make_tree, put, seq

from asynccache.errors import ConfigError


def test_forget_archived_unmarks_the_nodes_holding_the_pages_or_ending_there() -> None:
    tree, _ = make_tree()
    s = seq(1, 6 * PAGE)
    put(tree, s, states=[2 * PAGE, 4 * PAGE, 6 * PAGE])
    a, b, c = tree.path_to(tree.match_prefix(s).last_node)
    other = put(tree, seq(2, 2 * PAGE)).last_node
    for n in (a, b, c, other):
        tree.mark_archived(n)
    order = [n.node_id for n in tree.device_kv_lru.iter_oldest()]
    hits = [n.hit_count for n in (a, b, c)]
    assert tree.forget_archived(s[: 4 * PAGE], start_page=3) == [b]  # page 3, inside b
    assert (a.archived, b.archived, c.archived, other.archived) == (True, False, True, True)
    assert tree.forget_archived(s[: 4 * PAGE], start_page=4) == []  # b, ending there: unmarked already
    tree.mark_archived(b)
    assert tree.forget_archived(s[: 4 * PAGE], start_page=4) == [b]  # the state at the end
    assert tree.forget_archived(s[: 5 * PAGE] + [7] * PAGE, start_page=0) == [a, c]  # ends inside c
    assert [n.node_id for n in tree.device_kv_lru.iter_oldest()] == order and [n.hit_count for n in (a, b, c)] == hits
    assert tree.forget_archived(s, salt="tenant") == [] and tree.forget_archived(seq(3, PAGE)) == []
    with pytest.raises(ConfigError, match="start_page"):
        tree.forget_archived(s, start_page=7)
    tree.check_integrity()
