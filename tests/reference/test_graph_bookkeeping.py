"""What ``LayerGraphs`` remembers of the shapes it has seen but not captured: bounded (a server
sees a new shape for nearly every prefill's last chunk). CPU-only: a first sighting never
captures, so stand-ins for the pass context, hidden state and state pool do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asynccache.reference import graphs
from asynccache.reference.graphs import LayerGraphs


class _Pool:
    """A stand-in state pool (graphs are kept per pool, by a weak reference)."""


def _ctx(num_tokens: int) -> SimpleNamespace:
    group = SimpleNamespace(
        length=num_tokens, num_seqs=1, row_begin=0, row_end=num_tokens, all_fresh=False, fresh=None, snapshot_index=None,
        pads=None,
    )
    return SimpleNamespace(num_tokens=num_tokens, recurrent_tokens=num_tokens, gdn_groups=(group,))


def test_shapes_seen_once_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs, "MAX_SEEN_SHAPES", 8)
    lg = LayerGraphs(max_tokens=4096)
    hidden = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    pool = _Pool()
    for n in range(1, 21):
        assert lg.bind(_ctx(n), hidden, pool) is None  # type: ignore[arg-type]  # first sighting: eager
    assert len(lg._seen) == 8
    assert {k[1][0] for k in lg._seen} == set(range(13, 21))  # the newest kept
    assert lg.num_shapes == 0 and lg.total_tokens == 0
