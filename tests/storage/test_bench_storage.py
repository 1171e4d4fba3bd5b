"""`asynccache bench storage` end to end on small sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from storage_harness import SeaweedServer

from asynccache.cli import main

KEYS = {"uri", "write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps", "write_ratio", "read_ratio"}


def run_bench(tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / "bench.json"
    argv = ["bench", "storage", "--tp-size", "4", "--num-pages", "6", "--num-states", "1", "--batch-pages", "4",
            "--rounds", "2", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_bench_storage_local_disk(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    report = run_bench(tmp_path, "--uri", f"file://{root}", "--cold-reads")
    assert KEYS <= set(report) and report["uri"] == f"file://{root}"
    assert all(float(report[k]) > 0 for k in KEYS - {"uri"})  # type: ignore[arg-type]
    assert list(root.iterdir()) == []  # everything it wrote is gone


def test_bench_storage_default_uri_is_a_temporary_directory(tmp_path: Path) -> None:
    report = run_bench(tmp_path, "--no-fsync")
    assert str(report["uri"]).startswith("file://") and not Path(str(report["uri"])[7:]).exists()
    assert report["fsync"] is False


def test_bench_storage_refuses_a_backend_without_raw_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "storage", "--uri", "memory://", "--num-pages", "1", "--num-states", "0"]) == 1
    assert "no raw path" in capsys.readouterr().err


@pytest.mark.s3
def test_bench_storage_object_store(tmp_path: Path, s3_env: SeaweedServer) -> None:
    report = run_bench(tmp_path, "--uri", s3_env.uri("bench"))
    assert KEYS <= set(report) and float(report["read_ratio"]) > 0  # type: ignore[arg-type]
