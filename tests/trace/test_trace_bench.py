"""``asynccache bench trace`` end to end on a small trace: table, JSON schema, plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynccache.cli import main


def _write_trace(path: Path) -> Path:
    rows = []
    for i in range(30):
        conv = i % 5
        ids = [0, 1] + [100 + conv * 50 + k for k in range(i // 5 + 2)]
        rows.append({"timestamp": i * 1000, "input_length": (len(ids) - 1) * 8 + 3, "output_length": 4, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_trace_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "bench", "trace", "--trace", str(trace), "--spec", "tiny", "--page-size", "8", "--block-size", "8",
            "--device-budget", "64KiB", "--budgets", "64KiB,256KiB", "--storage-budgets", "0,4MiB",
            "--policies", "ends/lru,branch/cost-aware,adaptive/utility/write_back", "--jobs", "1", "--engine", "sync",
            "--json", str(out_json), "--plot", str(out_png),
        ]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "infinite-cache bound" in text and "branch + cost-aware" in text
    doc = json.loads(out_json.read_text())
    assert 0 < doc["bound"] < 1
    assert len(doc["results"]) == 3 * 2 * 2
    for r in doc["results"]:
        assert set(r) >= {"admission", "eviction", "budget_bytes", "hit_rate", "fraction_of_bound", "flops_saved"}
        assert set(r["budget_bytes"]) == {"device", "host", "storage"}
        assert r["budget_bytes"]["device"] == 64 * 1024
        assert 0 <= r["hit_rate"] <= doc["bound"] + 1e-12
        assert r["fraction_of_bound"] == pytest.approx(r["hit_rate"] / doc["bound"])
        assert r["flops_saved"] >= 0
        assert {"device_kv", "device_state", "device_stuck", "host_kv", "host_state", "host_stuck"} <= set(r["evictions"])
    assert "evicted kv/state/stuck" in text
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Re-report from the JSON: the same rows, as Markdown.
    assert main(["bench", "trace", "--from-json", str(out_json), "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| policy |") and table.count("\n| ") == 12  # one row per replay
    assert "| adaptive + utility | write_back, disk through |" in table


def test_the_page_size_follows_the_block_size_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    out_json = tmp_path / "r.json"
    rc = main(
        [
            "bench", "trace", "--trace", str(trace), "--spec", "tiny", "--block-size", "8",
            "--device-budget", "64KiB", "--budgets", "64KiB", "--storage-budgets", "0",
            "--policies", "ends/lru", "--jobs", "1", "--engine", "sync", "--json", str(out_json),
        ]
    )  # fmt: skip
    assert rc == 0
    assert json.loads(out_json.read_text())["page_size"] == 8
    assert "(page 8," in capsys.readouterr().out


_RESULT = {
    "admission": "ends", "eviction": "lru", "write_policy": "write_through, disk through",
    "budget_bytes": {"device": 65536, "host": 1048576, "storage": 0}, "hit_rate": 0.25, "fraction_of_bound": 0.5,
    "flops_saved": 1.0, "flops_total": 4.0, "hit_rate_by_tier": {"device": 0.25, "host": 0.0, "storage": 0.0},
    "hit_tokens": 25, "prompt_tokens": 100, "num_requests": 30, "bytes_moved": {"h2d": 0, "d2h": 0},
    "evictions": {"device_kv": 0}, "peak_bytes": {"device": 4096}, "extra": {}, "wall_s": 0.1,
}  # fmt: skip


def test_a_result_file_of_the_right_types_is_re_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, png = tmp_path / "r.json", tmp_path / "r.png"
    path.write_text(json.dumps({"bound": 0.5, "results": [_RESULT], "trace": "t", "num_requests": 30, "spec": "tiny"}))
    assert main(["bench", "trace", "--from-json", str(path), "--plot", str(png)]) == 0
    assert "ends + lru" in capsys.readouterr().out and png.exists()


@pytest.mark.parametrize(
    ("text", "plot", "needle"),
    [
        ("{not json", False, "cannot read"),
        (None, False, "cannot read"),
        ("[1, 2]", False, "is not a result of this benchmark"),
        ('{"bound": "x", "results": []}', False, "is not a result of this benchmark"),
        ('{"bound": 0.5, "results": [{}]}', False, "is not a result of this benchmark"),
        ('{"bound": 0.5, "results": []}', True, "nothing to plot"),
        ("HIT_TOKENS_STR", False, "'hit_tokens' must be an integer"),
        ("BUDGET_STR", False, "'budget_bytes' must be an object of integers"),
        ("NUM_REQUESTS_NULL", True, "num_requests must be an integer"),
        ('{"bound": NaN, "results": []}', False, "bound must be a fraction in [0, 1]"),
        ('{"bound": -3, "results": []}', False, "bound must be a fraction in [0, 1]"),
        ('{"bound": "0.5", "results": []}', False, "bound must be a fraction in [0, 1]"),
        ('{"bound": true, "results": []}', False, "bound must be a fraction in [0, 1]"),
        ("HIT_TOKENS_ABOVE_PROMPT", False, "tokens hit of"),
        ("TIER_HUGE", False, "is not a result of this benchmark"),
        ("[" * 100000 + "]" * 100000, False, "cannot read"),
        ("SPEC_NUMBER", True, "trace and spec must be strings"),
    ],
)
def test_from_json_that_cannot_be_re_reported_is_one_error_line(
    tmp_path: Path, text: str | None, plot: bool, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "r.json"
    if text is not None and text.isupper() and text[0].isalpha():  # a valid result file, one value wrong
        doc = {"bound": 0.5, "results": [_RESULT], "trace": "t", "num_requests": 30, "spec": "tiny"}
        if text == "HIT_TOKENS_STR":
            doc["results"] = [{**_RESULT, "hit_tokens": "1000"}]
        elif text == "BUDGET_STR":
            doc["results"] = [{**_RESULT, "budget_bytes": {"device": "64KiB"}}]
        elif text == "NUM_REQUESTS_NULL":
            doc["num_requests"] = None
        elif text == "HIT_TOKENS_ABOVE_PROMPT":
            doc["results"] = [{**_RESULT, "hit_tokens": _RESULT["prompt_tokens"] + 1}]
        elif text == "TIER_HUGE":
            doc["results"] = [{**_RESULT, "hit_rate_by_tier": {"device": 1e308}}]
        else:
            doc["spec"] = 80
        text = json.dumps(doc)
    if text is not None:
        path.write_text(text)
    argv = ["bench", "trace", "--from-json", str(path)] + (["--plot", str(tmp_path / "r.png")] if plot else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and needle in err
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("policy", ["foo/lru", "ends/foo", "block-grid:0/lru"])
def test_a_policy_no_replay_can_run_is_refused_before_any_replay(
    tmp_path: Path, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    argv = ["bench", "trace", "--trace", str(trace), "--spec", "tiny", "--block-size", "8", "--device-budget", "64KiB",
            "--budgets", "64KiB", "--storage-budgets", "0", "--policies", f"ends/lru,{policy}", "--jobs", "1",
            "--engine", "sync"]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "[1/2]" not in captured.err and "replays" not in captured.out
    assert captured.err.startswith("error: ") and len(captured.err.splitlines()) == 1


def _argv(trace: Path, *more: str) -> list[str]:
    return ["bench", "trace", "--trace", str(trace), "--spec", "tiny", "--block-size", "8", "--device-budget", "64KiB",
            "--jobs", "1", "--engine", "sync", *more]  # fmt: skip


@pytest.mark.parametrize(
    ("more", "needle"),
    [
        # The (host 0, disk) cells are invalid: refused before the valid cells replay (it was
        # refused when its turn came, and the other cells' results were lost).
        (["--budgets", "64KiB,0", "--storage-budgets", "0,4MiB", "--policies", "ends/lru"], "needs a host tier"),
        # Ids above 255 take two tokens of the tiny vocabulary: a one-token page is refused.
        (["--page-size", "1", "--budgets", "64KiB", "--storage-budgets", "0", "--policies", "ends/lru"],
         "spell a block id"),
        # Every cell skipped (the reference has no storage tier): nothing to replay is an error.
        (["--budgets", "64KiB", "--storage-budgets", "4MiB", "--policies", "attention-only/lru"], "no replay to run"),
    ],
)  # fmt: skip
def test_a_cell_no_replay_can_run_is_refused_before_any_replay(
    tmp_path: Path, more: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    out_json = tmp_path / "r.json"
    assert main([*_argv(trace, *more), "--json", str(out_json)]) == 2
    captured = capsys.readouterr()
    assert "[1/" not in captured.err and "replays" not in captured.out
    assert captured.err.startswith("error: ") and len(captured.err.splitlines()) == 1 and needle in captured.err
    assert not out_json.exists()


def test_a_failed_replay_starts_no_queued_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With parallel replays, the first failing cell cancels the queued ones (the pool used to
    run every queued replay before the error came out)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from asynccache.bench import trace as bench_trace
    from asynccache.errors import ConfigError

    class ThreadPool(ThreadPoolExecutor):
        def __init__(self, max_workers: int, mp_context: object = None) -> None:
            super().__init__(max_workers=max_workers)

    started: list[int] = []
    release = threading.Event()

    def run_cell(cell: SimpleNamespace, trace: object, bound: object) -> None:
        started.append(cell.index)
        if cell.index == 0:
            raise ConfigError("cell 0 failed")
        release.wait(5.0)  # the replays running beside it end only when the test ends

    monkeypatch.setattr(bench_trace, "ProcessPoolExecutor", ThreadPool)
    monkeypatch.setattr(bench_trace, "_run_cell", run_cell)
    cells = [SimpleNamespace(index=i) for i in range(10)]
    threading.Timer(0.5, release.set).start()
    with pytest.raises(ConfigError, match="cell 0 failed"):
        bench_trace._run_cells(cells, trace=None, bound=None, jobs=2)  # type: ignore[arg-type]
    release.set()
    assert len(started) <= 3  # the failed cell, the one beside it, at most one taken meanwhile


def test_an_output_that_names_the_trace_or_the_other_output_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    before = trace.read_text()
    same = [["--json", str(tmp_path / "." / "t.jsonl")], ["--json", str(tmp_path / "r.png"), "--plot", str(tmp_path / "r.png")]]
    for extra in same:
        argv = ["bench", "trace", "--trace", str(trace), "--spec", "tiny", "--page-size", "8", "--block-size", "8",
                "--policies", "ends/lru", "--jobs", "1", "--engine", "sync", *extra]  # fmt: skip
        assert main(argv) == 2
        assert "names too" in capsys.readouterr().err
    assert trace.read_text() == before


def test_a_trace_replays_the_same_whatever_its_clock_starts_at(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Times count from the first request: Unix-epoch or negative stamps replay as from 0."""
    base = _write_trace(tmp_path / "t.jsonl")
    docs = []
    for shift in (0, 1_740_000_000_000, -1_000_000):
        rows = [json.loads(line) for line in base.read_text().splitlines()]
        path = tmp_path / f"t{shift}.jsonl"
        path.write_text("".join(json.dumps({**r, "timestamp": r["timestamp"] + shift}) + "\n" for r in rows))
        out = tmp_path / f"r{shift}.json"
        argv = ["bench", "trace", "--trace", str(path), "--spec", "tiny", "--page-size", "8", "--block-size", "8",
                "--device-budget", "64KiB", "--budgets", "64KiB", "--storage-budgets", "0,4MiB",
                "--policies", "adaptive/reuse/write_back,branch/cost-aware", "--jobs", "1", "--engine", "sync",
                "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        doc = json.loads(out.read_text())
        docs.append([{k: v for k, v in r.items() if k not in ("wall_s", "extra")} for r in doc["results"]])
    capsys.readouterr()
    assert docs[0] == docs[1] == docs[2]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_the_trace_is_read_once_whatever_the_replays(
    tmp_path: Path, jobs: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every replay replays what the bound was computed on (the trace may be a pipe)."""
    from asynccache.bench import trace as bench_trace

    trace = _write_trace(tmp_path / "t.jsonl")
    reads: list[str] = []
    real = bench_trace.load_trace

    def counted(path: object, **kwargs: object) -> object:
        reads.append(str(path))
        return real(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_trace, "load_trace", counted)
    argv = ["bench", "trace", "--trace", str(trace), "--spec", "tiny", "--page-size", "8", "--block-size", "8",
            "--device-budget", "64KiB", "--budgets", "64KiB,256KiB", "--storage-budgets", "0",
            "--policies", "ends/lru", "--jobs", jobs, "--engine", "sync"]  # fmt: skip
    assert main(argv) == 0
    assert reads == [str(trace)]
    assert "2 replays" in capsys.readouterr().out
