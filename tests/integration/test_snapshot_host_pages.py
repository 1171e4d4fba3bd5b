"""A storage-only snapshot archive reads the tree's host copies of its path only when each host
page still holds the page it was planned for, with its bytes landed.

The archive plans the host pages it reads when it starts; a backup that was giving the path
those host copies may be undone before the archive writes (cancelled while queued here; a copy
that failed at issue on a GPU), its pages freed, and a later backup may take the same pages back:
for the same pages of the path with its copy not landed yet, or for other pages of the path
(another order). Either way the archive must not store those bytes under the planned keys: it
stores nothing (``snapshot_kv_lost``), and what storage holds for the path is byte exact.
"""

from __future__ import annotations

from pathlib import Path

import torch
from test_storage_snapshots import (
    NUM_PAGES,
    PAGE,
    SNAPS,
    TOKENS,
    fill_device,
    free_slots,
    kv_bytes,
    make_cache,
    restored,
)


async def archive_over_a_backup_undone_and_taken_again(tmp_path: Path, *, reorder: bool) -> None:
    async with make_cache(tmp_path) as cache:
        ctrl, tree = cache.controller, cache.tree
        tier = ctrl.tiering
        assert tier is not None and cache.host_kv is not None
        pages, slots = fill_device(cache, NUM_PAGES, 1 + len(SNAPS), seed=3)
        kv = kv_bytes(cache, pages)
        res = tree.insert(TOKENS, pages, states={len(TOKENS): slots[0]})
        snaps = dict(zip(SNAPS, slots[1:], strict=True))
        backup = ctrl.write(res.backup_nodes)  # queued: the path's host pages attached
        assert backup is not None and backup.plan is not None
        archive = ctrl.archive_snapshots(res.last_node, snaps)  # plans the backup's host pages
        assert archive is not None
        assert ctrl.cancel(backup)  # undone: its host pages are free again
        ctrl.start_writing()  # the staging copy (done at once on the CPU)
        if reorder:
            # A branch splits the path at page 2; the two parts are backed up apart while another
            # user holds the first two free pages: the same pages, in another order.
            alloc = tree.alloc_device(3, 0)
            assert alloc is not None
            tree.insert(TOKENS[: 2 * PAGE] + [252] * PAGE, alloc.kv_indices)
            upper, lower = tree.path_to(res.last_node)
            taken = cache.host_kv.alloc(2)
            assert taken is not None and ctrl.write([upper]) is not None
            cache.host_kv.free(taken)
            assert ctrl.write([lower]) is not None
            ctrl.start_writing()  # both landed before the archive writes
            pages = torch.cat([n.host_kv for n in (upper, lower) if n.host_kv is not None])
            assert sorted(pages.tolist()) == sorted(backup.plan.host_kv_indices.tolist())
            assert not torch.equal(pages, backup.plan.host_kv_indices)
        else:
            # The path backed up again: the same host pages, the same order, not copied yet.
            again = ctrl.write(tree.path_to(res.last_node))
            assert again is not None and torch.equal(again.plan.host_kv_indices, backup.plan.host_kv_indices)
        assert await archive == dict.fromkeys(SNAPS, False)
        assert tier.counts["snapshot_kv_lost"] == 1
        free_slots(cache, snaps.values())
        ctrl.start_writing()
        await ctrl.wait_idle()
        await tier.drain()  # the path's own archive (its end state)
    async with make_cache(tmp_path) as cache:
        got_kv, _ = await restored(cache, TOKENS + [251] * PAGE, NUM_PAGES * PAGE)
        assert torch.equal(got_kv, kv)


async def test_host_pages_taken_again_by_a_backup_not_landed_are_not_archived(tmp_path: Path) -> None:
    await archive_over_a_backup_undone_and_taken_again(tmp_path, reorder=False)


async def test_host_pages_taken_again_for_other_pages_of_the_path_are_not_archived(tmp_path: Path) -> None:
    await archive_over_a_backup_undone_and_taken_again(tmp_path, reorder=True)
