"""The intrusive LRU lists: O(1) operations and iteration that survives removals."""

from __future__ import annotations

import random

import pytest

from asynccache.tree import HostLRUList, LRUList, Resource, Tier, TreeNode


def _nodes(n: int) -> list[TreeNode]:
    return [
        TreeNode(node_id=i, parent=None, key=b"\0" * 8, start_page=0, num_pages=1, page_size=1) for i in range(n)
    ]


def _ids(lst: LRUList) -> list[int]:
    return [n.node_id for n in lst.check_links()]


def test_push_touch_remove_keep_order() -> None:
    lst = LRUList(0, name="t", tier=Tier.DEVICE, resource=Resource.KV)
    a, b, c, d = _nodes(4)
    for n in (a, b, c):
        lst.push(n)
    assert _ids(lst) == [0, 1, 2] and len(lst) == 3
    lst.touch(a)
    assert _ids(lst) == [1, 2, 0]
    lst.touch(a)  # already newest
    assert lst.oldest() is b and lst.newest() is a
    lst.insert_after(b, d)
    assert _ids(lst) == [1, 3, 2, 0]
    lst.remove(c)
    assert _ids(lst) == [1, 3, 0] and c not in lst and d in lst
    assert [n.node_id for n in lst.iter_newest()] == [0, 3, 1]
    assert lst.members() == list(lst.iter_oldest()) == lst.check_links()
    with pytest.raises(AssertionError):
        lst.push(a)
    with pytest.raises(AssertionError):
        lst.remove(c)


def test_lists_in_different_slots_are_independent() -> None:
    one = LRUList(0, name="one", tier=Tier.DEVICE, resource=Resource.KV)
    two = HostLRUList(3, name="two", resource=Resource.STATE)
    assert two.tier is Tier.HOST
    a, b = _nodes(2)
    one.push(a)
    one.push(b)
    two.push(b)
    two.push(a)
    assert _ids(one) == [0, 1] and _ids(two) == [1, 0]
    one.remove(a)
    assert a in two and a not in one
    with pytest.raises(ValueError):
        LRUList(4, name="x", tier=Tier.DEVICE, resource=Resource.KV)


def test_iteration_survives_removal_of_the_current_and_following_nodes() -> None:
    lst = LRUList(1, name="t", tier=Tier.DEVICE, resource=Resource.STATE)
    nodes = _nodes(6)
    for n in nodes:
        lst.push(n)
    seen = []
    for n in lst.iter_oldest():
        seen.append(n.node_id)
        if n.node_id == 1:
            lst.remove(n)  # the current one
            lst.remove(nodes[2])  # and the next two
            lst.remove(nodes[3])
        if n.node_id == 4:
            lst.remove(nodes[5])
    assert seen == [0, 1, 4]
    assert _ids(lst) == [0, 4]


def test_check_links_detects_corruption() -> None:
    lst = LRUList(0, name="t", tier=Tier.DEVICE, resource=Resource.KV)
    a, b, c = _nodes(3)
    for n in (a, b, c):
        lst.push(n)
    b.links[0] = c  # wrong prev pointer
    with pytest.raises(AssertionError, match="prev pointer"):
        lst.check_links()


def test_members_is_the_list_in_lru_order_after_any_operations() -> None:
    rng = random.Random(5)
    lst = LRUList(2, name="t", tier=Tier.HOST, resource=Resource.STATE)
    nodes = _nodes(40)
    for _ in range(2000):
        node = rng.choice(nodes)
        if node not in lst:
            anchor = rng.choice(nodes)
            if anchor in lst and rng.random() < 0.3:
                lst.insert_after(anchor, node)
            else:
                lst.push(node)
        elif rng.random() < 0.5:
            lst.touch(node)
        else:
            lst.remove(node)
        assert lst.members() == lst.check_links()
    assert 0 < len(lst.members()) < 40
