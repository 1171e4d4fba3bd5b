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
