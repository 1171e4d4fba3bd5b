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


@pytest.mark.parametrize("page_size", ["1", "3"])
def test_small_page_sizes_have_room_for_the_fill(page_size: str) -> None:
    """The pools' slack holds the largest filling request, counted in pages of --page-size."""
    argv = ["bench", "tree", "--preset", "tiny", "--tree-pages", "100", "--sizes", "128", "--repeats", "1"]
    assert main([*argv, "--page-size", page_size]) == 0


def test_every_repeat_has_its_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each timed insert takes two states (one for a one-page prompt, which has no page boundary
    before its end), counted per repeat and per size; none is left unused."""
    from asynccache.bench import tree as tree_bench

    trees: list[tree_bench.HybridRadixTree] = []
    build = tree_bench._build_tree

    def keep(*args: object) -> tree_bench.HybridRadixTree:
        trees.append(build(*args))  # type: ignore[arg-type]
        return trees[-1]

    monkeypatch.setattr(tree_bench, "_build_tree", keep)
    # --repeats 2100 overflowed the states of a 100-page tree before they were counted per repeat.
    argv = ["bench", "tree", "--preset", "tiny", "--tree-pages", "100", "--sizes", "64,128", "--repeats", "2100"]
    assert main(argv) == 0
    (tree,) = trees
    held = tree.device_mamba.num_items - tree.device_mamba.num_free
    assert held == tree.stats().device_states


def test_pools_too_small_are_a_typed_error() -> None:
    import argparse

    from asynccache.bench import tree as tree_bench
    from asynccache.errors import CapacityError

    args = argparse.Namespace(preset="tiny", page_size=64, tree_pages=10, repeats=1, admission="ends")
    tree = tree_bench._build_tree(args, [64])
    with pytest.raises(CapacityError, match="benchmark pools are too small"):
        tree_bench._alloc(tree, tree.device_kv.num_free + 1, 0)
