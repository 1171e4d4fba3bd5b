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


def test_bench_storage_removes_the_folders_it_created_for_a_root(tmp_path: Path) -> None:
    """A file:// root that did not exist is created by the run and removed with what it wrote;
    a folder that existed before stays."""
    root = tmp_path / "kept" / "a" / "b"
    root.parent.parent.mkdir()
    run_bench(tmp_path, "--uri", f"file://{root}", "--no-fsync", "--rounds", "1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "kept"]
    assert list((tmp_path / "kept").iterdir()) == []


def test_bench_storage_default_uri_is_a_temporary_directory(tmp_path: Path) -> None:
    report = run_bench(tmp_path, "--no-fsync")
    assert str(report["uri"]).startswith("file://") and not Path(str(report["uri"])[7:]).exists()
    assert report["fsync"] is False


def test_bench_storage_refuses_a_backend_without_raw_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "storage", "--uri", "memory://", "--num-pages", "1", "--num-states", "0"]) == 2
    assert "no raw path" in capsys.readouterr().err


@pytest.mark.s3
def test_bench_storage_object_store(tmp_path: Path, s3_env: SeaweedServer) -> None:
    report = run_bench(tmp_path, "--uri", s3_env.uri("bench"))
    assert KEYS <= set(report) and float(report["read_ratio"]) > 0  # type: ignore[arg-type]


def test_bench_storage_refuses_the_namespace_option_and_keeps_what_is_stored_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run removes its namespace at the end: a namespace given with --option could be one
    that holds earlier data, so it is refused and that data stays."""
    from storage_backends.local_disk import LocalDiskBackend

    uri = (tmp_path / "store").as_uri()
    stored = Path(LocalDiskBackend(uri, namespace="x").namespace_dir) / "kv" / "00" / "object"
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"earlier data")
    argv = ["bench", "storage", "--uri", uri, "--option", "namespace=x", "--tp-size", "4", "--num-pages", "1",
            "--num-states", "0", "--rounds", "1"]  # fmt: skip
    assert main(argv) == 2
    assert "--option namespace" in capsys.readouterr().err
    assert stored.read_bytes() == b"earlier data"


def test_option_values_are_ints_numbers_booleans_none_or_text() -> None:
    from asynccache.bench.storage import parse_options

    pairs = ["a=3", "b=2.5", "c=1e3", "d=TRUE", "e=false", "f=None", "g=none", "h=zstd", "i=nan", "j="]
    assert parse_options(pairs) == {
        "a": 3, "b": 2.5, "c": 1000.0, "d": True, "e": False, "f": None, "g": None, "h": "zstd", "i": "nan", "j": ""
    }  # fmt: skip


def test_bench_storage_takes_a_float_option_and_none(tmp_path: Path) -> None:
    report = run_bench(tmp_path, "--option", "timeout_s=2.5", "--option", "direct_io=None")
    assert report["options"] == {"timeout_s": 2.5, "direct_io": None}


def test_an_unreachable_object_store_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed write is the error (status 1, a backend that fails); the removal of the run's
    objects, which fails too, is logged and does not hide it."""
    pytest.importorskip("obstore")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    argv = ["bench", "storage", "--uri", "s3://bkt/p?endpoint_url=http://127.0.0.1:9", "--option", "timeout_s=1",
            "--tp-size", "4", "--num-pages", "1", "--num-states", "0", "--rounds", "1"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("error: backend write failed: 1 of 1 objects")
