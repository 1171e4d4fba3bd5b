"""``asynccache bench tree`` runs end to end and writes the documented JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynccache.cli import main


@pytest.mark.parametrize("admission", ["ends", "every-page"])
def test_bench_tree_writes_json(tmp_path: Path, admission: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tree.json"
    argv = ["bench", "tree", "--tree-pages", "3000", "--sizes", "1024,4096", "--repeats", "2"]
    assert main([*argv, "--admission", admission, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"match_us", "insert_us"}
    for key in ("match_us", "insert_us"):
        assert set(data[key]) == {"1024", "4096"}
        assert all(isinstance(v, float) and v > 0 for v in data[key].values())
    assert "match µs" in capsys.readouterr().out


def test_the_collector_is_unfrozen_when_the_timing_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench freezes the tree's objects out of the collector while it times; an error on the
    way leaves them collectable again."""
    import gc

    from asynccache.bench import tree as tree_bench

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("match failed")

    monkeypatch.setattr(tree_bench.HybridRadixTree, "match_prefix", fail)
    argv = ["bench", "tree", "--preset", "tiny", "--tree-pages", "100", "--sizes", "64", "--repeats", "1"]
    with pytest.raises(RuntimeError, match="match failed"):
        main(argv)
    assert gc.get_freeze_count() == 0
