"""The command line with bad input: one line on stderr and exit status 2, found before a long run;
and runs over a store that an earlier run filled measure this run only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asynccache.cli import main

TINY_MULTITURN = ["bench", "multiturn", "--preset", "tiny", "--clients", "2", "--rounds", "2", "--request-len", "16",
                  "--output-len", "4"]  # fmt: skip


def _trace(tmp_path: Path) -> Path:
    rows = [{"timestamp": i, "input_length": 20, "output_length": 2, "hash_ids": [0, 1, 100 + i]} for i in range(6)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["bench", "multiturn", "--preset", "nope"], ("unknown preset 'nope'",)),
        (["bench", "tree", "--preset", "nope"], ("unknown preset",)),
        (["bench", "trace"], ("--trace FILE is required",)),
        (["bench", "trace", "--trace", "/nonexistent/t.jsonl"], ("cannot read trace",)),
        (["bench", "storage", "--preset", "nope"], ("unknown preset",)),
        (["bench", "storage", "--option", "no_such_option=1"], ("does not take",)),
        ([*TINY_MULTITURN, "--storage-option", "read_processes"], ("--storage-option", "KEY=VALUE")),
        ([*TINY_MULTITURN, "--modes", "kv+mamba+storage", "--storage-option", "no_such_option=1"], ("does not take",)),
        ([*TINY_MULTITURN, "--modes", "kv+mamba+storage", "--storage-option", "read_processes=-1"],
         ("read_processes must be",)),
        (["bench", "overlap", "--preset", "tiny", "--device", "cpu", "--copy-method", "bogus"], ("copy_method",)),
        (["bench", "tree", "--json", "/nonexistent/x.json"], ("--json", "no such directory")),
        (["bench", "transfer", "--device", "cpu", "--json", "/"], ("--json", "is a directory")),
        (["bench", "transfer", "--device", "cpu", "--json", "/proc/x.json"], ("--json", "not writable")),
        ([*TINY_MULTITURN, "--plot", "p.txt"], ("--plot", ".png")),
        (["bench", "prefix", "--from-json", "r.json", "--plot", "x.txt"], ("--plot", ".png")),
        (["bench", "trace", "--from-json", "r.json", "--plot", "x.txt"], ("--plot", ".png")),
        (["bench", "trace", "--from-json", "r.json", "--json", "y.json"], ("--json", "--from-json")),
        (["bench", "overlap", "--preset", "tiny", "--device", "cpu", "--prefix-tokens", "127"], ("--prefix-tokens",)),
        (["bench", "overlap", "--preset", "tiny", "--device", "cpu", "--prefix-tokens", "10"], ("--prefix-tokens",)),
        (["bench", "tree", "--sizes", "10,1024"], ("--sizes", "--page-size")),
        (["bench", "storage", "--uri", "memory://", "--num-pages", "1"], ("no raw path",)),
        ([*TINY_MULTITURN, "--modes", "kv-offload", "--storage", "file:///tmp/x"], ("kv+mamba+storage",)),
        ([*TINY_MULTITURN, "--modes", "no-offload", "--storage-option", "read_processes=0"], ("kv+mamba+storage",)),
        (["bench", "storage", "--num-pages", "0", "--num-states", "0"], ("nothing to measure",)),
        ([*TINY_MULTITURN, "--modes", "kv-ofload"], ("--modes", "unknown modes ['kv-ofload']")),  # had no "error:"
        ([*TINY_MULTITURN, "--modes", ","], ("--modes names no mode",)),
        (["bench", "prefix", "--preset", "tiny", "--repeats", "0"], ("--repeats >= 1",)),
        (["bench", "prefix", "--from-json", "/nonexistent/r.json"], ("cannot read /nonexistent/r.json",)),
        (["bench", "storage", "--uri", "memory://", "--cold-reads"], ("--cold-reads", "file://")),
        (["bench", "storage", "--uri", "s3://[::1", "--num-pages", "1"], ("--uri", "malformed")),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], needles: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    _one_line_error(capsys, *needles)


def test_bench_storage_with_a_root_it_cannot_write_under_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file above the root: the raw path's folder cannot be made (was a FileNotFoundError
    traceback); the folders the run made are removed."""
    (tmp_path / "file").write_text("")
    uri = f"file://{tmp_path}/file/store"
    assert main(["bench", "storage", "--uri", uri, "--preset", "tiny", "--num-pages", "1", "--rounds", "1"]) == 2
    _one_line_error(capsys, uri, "cannot write under")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_bench_prefix_with_a_storage_dir_it_cannot_write_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run measured every tier with a disk tier that stored nothing, then failed with a
    traceback reading the directory."""
    (tmp_path / "file").write_text("")
    argv = ["bench", "prefix", "--preset", "tiny", "--device", "cpu", "--storage-dir", str(tmp_path / "file" / "disk")]
    assert main(argv) == 2
    _one_line_error(capsys, "--storage-dir", "cannot write there")
    assert capsys.readouterr().out == ""  # nothing was measured


def test_trace_bad_sizes_and_empty_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(_trace(tmp_path))
    assert main(["bench", "trace", "--trace", trace, "--block-size", "8", "--budgets", "12XB"]) == 2
    _one_line_error(capsys, "12XB")
    assert main(["bench", "trace", "--trace", trace, "--block-size", "8", "--policies", ","]) == 2
    _one_line_error(capsys, "--policies")


def test_an_output_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--json", "--plot"):
        assert main([*TINY_MULTITURN, flag, str(tmp_path / "missing" / "x")]) == 2
        _one_line_error(capsys, flag, "no such directory")
    # Nothing ran: no table on stdout.
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "argv",
    [
        [*TINY_MULTITURN, "--clients", "0"],
        [*TINY_MULTITURN, "--rounds", "-1"],
        [*TINY_MULTITURN, "--max-parallel", "0"],
        [*TINY_MULTITURN, "--max-running", "0"],
        [*TINY_MULTITURN, "--host-kv-bytes", "0"],
        ["bench", "tree", "--repeats", "0"],
        ["bench", "tree", "--sizes", "0"],
        ["bench", "transfer", "--reps", "0"],
        ["bench", "overlap", "--repeats", "0"],
        ["bench", "trace", "--jobs", "0"],
        ["bench", "storage", "--rounds", "0"],  # these four were a line without "error:"
        ["bench", "storage", "--batch-pages", "0"],
        ["bench", "storage", "--tp-size", "0"],
    ],
)
def test_counts_that_must_be_positive_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "tree", "--seed", "-1"], "must be >= 0"),
        ([*TINY_MULTITURN, "--seed", "-1"], "must be >= 0"),
        ([*TINY_MULTITURN, "--seed", str(2**64)], "must be <= 9223372036854775807"),  # was a traceback
        ([*TINY_MULTITURN, "--lookahead-host-fraction", "1.5"], "must be in [0, 1]"),
        ([*TINY_MULTITURN, "--lookahead-host-fraction", "nan"], "must be in [0, 1]"),
        ([*TINY_MULTITURN, "--lookahead-host-fraction", "x"], "not a number"),
        ([*TINY_MULTITURN, "--dtype", "int8"], "invalid choice: 'int8'"),  # were tracebacks
        ([*TINY_MULTITURN, "--dtype", "uint8"], "invalid choice: 'uint8'"),
        ([*TINY_MULTITURN, "--dtype", "fp8"], "invalid choice: 'fp8'"),
        (["bench", "overlap", "--compute-ratio", "nan"], "finite number > 0"),
        (["bench", "overlap", "--compute-ratio", "inf"], "finite number > 0"),
        (["bench", "overlap", "--compute-ratio", "-1"], "finite number > 0"),
        (["bench", "overlap", "--device", "foo"], "not a device"),
        (["bench", "storage", "--max-concurrency", "0"], "must be >= 1"),
        (["bench", "storage", "--num-pages", "-1"], "must be >= 0"),
        (["bench", "storage", "--num-states", "-1"], "must be >= 0"),
        (["bench", "trace", "--active-params", "-5"], "finite number > 0"),
        (["bench", "trace", "--active-params", "nan"], "finite number > 0"),
    ],
)
def test_values_out_of_range_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("bench", ["overlap", "multiturn", "prefix"])
def test_cuda_without_cuda_is_a_usage_error(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", bench, "--preset", "tiny", "--device", "cuda"])
    assert info.value.code == 2
    assert "no CUDA device available" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--device", "cuda"], "no CUDA device available",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
        (["--device", "cpu", "--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)  # fmt: skip
def test_speed_bad_device_or_dtype_is_a_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each was a traceback (an AssertionError without CUDA, a RuntimeError building the model)."""
    from asynccache.reference import speed

    with pytest.raises(SystemExit) as info:
        speed.main(["--preset", "tiny", "--seq-len", "8", "--iters", "1", "--warmup", "0", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _tiny_config(tmp_path: Path, name: str = "config.json", **changes: object) -> str:
    from asynccache.spec import PRESETS

    path = tmp_path / name
    path.write_text(json.dumps({**PRESETS["tiny"], **changes}))
    return str(path)


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"intermediate_size": -8}, ("'intermediate_size' must be >= 0",)),
        ({"vocab_size": -5}, ("'vocab_size' must be >= 0",)),
        ({"vocab_size": 1}, ("vocab_size of at least 2",)),  # was a ZeroDivisionError in the warm-up
        ({"head_dim": 15}, ("head_dim must be even",)),
        ({"layer_types": ["linear_attention"] * 4}, ("no attention layers",)),
        ({"layer_types": ["full_attention"] * 4}, ("no recurrent layers",)),  # storage stored nothing
    ],
)
def test_multiturn_refuses_a_config_it_cannot_run_before_any_mode(
    tmp_path: Path, changes: dict[str, object], needles: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TINY_MULTITURN, "--preset", _tiny_config(tmp_path, **changes), "--modes", "no-offload"]) == 2
    captured = capsys.readouterr()
    assert "mode no-offload" not in captured.out and "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(n in lines[0] for n in needles), captured.err


@pytest.mark.parametrize(("content", "needle"), [(b"[1, 2]", "not a JSON object"), (b"\xff\xfe{}", "utf-8")])
def test_multiturn_refuses_a_config_file_that_is_no_json_object(
    tmp_path: Path, content: bytes, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_bytes(content)
    assert main([*TINY_MULTITURN, "--preset", str(tmp_path / "config.json")]) == 2
    _one_line_error(capsys, needle)


def test_multiturn_refuses_a_host_budget_of_a_later_mode_before_any_mode_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A host budget too small for one item was refused when its mode started, after the modes
    before it ran (their results lost)."""
    assert main([*TINY_MULTITURN, "--modes", "no-offload,kv-offload", "--host-kv-bytes", "100"]) == 2
    captured = capsys.readouterr()
    assert "mode no-offload" not in captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "mode kv-offload" in lines[0] and "does not hold one item" in lines[0]


def test_multiturn_takes_a_config_path_of_any_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config file whose name does not end in .json was taken for a preset's name."""
    argv = ["bench", "multiturn", "--clients", "1", "--rounds", "1", "--request-len", "4", "--output-len", "1",
            "--modes", "no-offload", "--preset", _tiny_config(tmp_path, "tiny_config")]  # fmt: skip
    assert main(argv) == 0
    assert "no-offload" in capsys.readouterr().out


def test_a_preset_name_wins_over_a_file_of_that_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asynccache.bench.options import spec_from_preset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("not a config")
    assert spec_from_preset("tiny", page_size=4).model_id == "tiny"


def test_a_storage_the_backend_refuses_is_found_before_any_mode_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --storage URI, or a file:// root that is a regular file, is refused before the
    warm-up and the modes without storage run (and not taken for a run of misses)."""
    a_file = Path(__file__).resolve().as_uri()
    for storage, needle in (("bogus://x", "unknown storage scheme"), (a_file, "is not a directory")):
        assert main([*TINY_MULTITURN, "--modes", "no-offload,kv+mamba+storage", "--storage", storage]) == 2
        captured = capsys.readouterr()
        assert "mode no-offload" not in captured.out
        assert len(captured.err.splitlines()) == 1 and needle in captured.err


def test_empty_modes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY_MULTITURN, "--modes", ","]) == 2
    assert "no mode" in capsys.readouterr().err


def test_from_json_of_another_benchmark_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"modes": {}}))
    for bench in ("trace", "prefix"):
        assert main(["bench", bench, "--from-json", str(other)]) == 2
        _one_line_error(capsys, "is not a result of this benchmark")


def test_trace_progress_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "trace", "--trace", str(_trace(tmp_path)), "--block-size", "8", "--spec", "tiny",
            "--device-budget", "64KiB", "--budgets", "64KiB", "--storage-budgets", "0", "--policies", "ends/lru",
            "--jobs", "1", "--engine", "sync"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "[1/1]" in captured.err and "[1/1]" not in captured.out


def test_multiturn_over_a_store_an_earlier_run_filled_measures_this_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = (tmp_path / "store").as_uri()
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        argv = [*TINY_MULTITURN, "--modes", "kv+mamba+storage", "--storage", store, "--json", str(out)]
        assert main(argv) == 0
        runs.append(json.loads(out.read_text())["modes"]["kv+mamba+storage"])
    capsys.readouterr()
    first, second = runs
    assert second["hit_rate"] == pytest.approx(first["hit_rate"])
    assert second["hit_rate"] <= second["ideal_hit_rate"] + 1e-9
    assert second["rounds"][0]["hit_rate"] == 0.0  # round 0 is cold in every run


def test_multiturn_storage_option_refused_at_first_use_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``direct_io=true`` where the filesystem refuses O_DIRECT is found when the store is
    opened: one error line and status 2, not a run of misses with status 0."""
    from storage_backends import disk_jobs

    monkeypatch.setattr(disk_jobs, "probe_direct", lambda path: "O_DIRECT refused")
    out = tmp_path / "r.json"
    argv = [*TINY_MULTITURN, "--modes", "kv+mamba+storage", "--storage-option", "direct_io=true", "--json", str(out)]
    assert main(argv) == 2
    _one_line_error(capsys, "direct_io=True", "O_DIRECT refused")
    assert not out.exists()


def test_multiturn_reads_storage_in_reader_processes_as_the_threads_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The storage mode through reader processes (the default on CUDA, an option here) hits
    what the worker threads hit, and the result names the backend's options."""
    runs = {}
    for procs in (0, 2):
        out = tmp_path / f"procs{procs}.json"
        argv = [*TINY_MULTITURN, "--modes", "kv+mamba+storage", "--storage-option", f"read_processes={procs}",
                "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        runs[procs] = json.loads(out.read_text())["modes"]["kv+mamba+storage"]
    capsys.readouterr()
    assert runs[2]["storage_options"] == {"read_processes": 2}
    assert runs[0]["storage_options"] == {"read_processes": 0}
    assert runs[2]["cached_by_tier"] == runs[0]["cached_by_tier"]
    assert runs[2]["cached_by_tier"]["storage"] > 0


def test_prefix_over_a_storage_dir_an_earlier_run_filled_starts_cold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "prefix", "--preset", "small", "--prefix-tokens", "64", "--new-tokens", "8", "--page-size", "8",
            "--device", "cpu", "--repeats", "1", "--pairs", "1", "--storage-dir", str(tmp_path / "disk")]  # fmt: skip
    for i in range(2):
        out = tmp_path / f"p{i}.json"
        assert main([*argv, "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["cached_tokens_repeats"]["cold"] == [0]
        assert res["cached_tokens_repeats"]["cold_short"] == res["cached_tokens_repeats"]["cold_shorter"] == [0]
    capsys.readouterr()


def test_tree_sizes_given_twice_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--sizes 64,64 printed two rows but its JSON, keyed by size, kept one."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "tree", "--preset", "tiny", "--sizes", "64,128,64", "--tree-pages", "100", "--repeats", "1"])
    assert info.value.code == 2
    assert "--sizes: given more than once: 64" in capsys.readouterr().err


def test_overlap_prefix_too_large_for_the_pools_is_a_typed_error(capsys: pytest.CaptureFixture[str]) -> None:
    """The pools refuse a prefix this machine cannot hold before any token list is built (it was
    a MemoryError building the list)."""
    argv = ["bench", "overlap", "--preset", "tiny", "--device", "cpu", "--prefix-tokens", "64000000000000",
            "--repeats", "1"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: CapacityError" in err


@pytest.mark.parametrize("argv", [["--cuda-graphs", "both"], ["--cuda-graphs", "off"], ["--chunk-size", "0"]])
def test_speed_graphs_off_the_gpu_or_a_bad_chunk_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from asynccache.reference import speed

    try:
        code = speed.main(["--preset", "tiny", "--seq-len", "8", "--iters", "1", "--warmup", "0", "--device", "cpu", *argv])
    except SystemExit as e:  # argparse's refusal
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err or "--chunk-size" in err
