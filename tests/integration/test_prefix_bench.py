"""``asynccache bench prefix`` on CPU: every tier serves the whole prefix; bad geometry is refused."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import pytest

from asynccache.bench import prefix, raw_reads
from asynccache.spec import HybridSpec
from asynccache.tiering import RestoreCost
from storage_backends.local_disk import READ_RANGE_BYTES


def bench_args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    prefix.add_arguments(p)
    args = p.parse_args(["--preset", "small", "--prefix-tokens", "64", "--new-tokens", "8", "--page-size", "8"])
    args.device, args.repeats, args.pairs = "cpu", 1, 3
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_every_tier_serves_the_whole_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prefix.json"
    assert prefix.run(bench_args(json_path=str(out), storage_dir=str(tmp_path / "disk"))) == 0
    res = json.loads(out.read_text())
    assert res["cached_tokens"] == {
        "cold": 0, "cold_short": 0, "cold_shorter": 0, "device": 64, "host": 64, "disk_all": 64, "disk_split": 64
    }
    reps = res["ttft_ms_repeats"]
    assert {k: len(v) for k, v in reps.items()} == {
        "cold": 1, "cold_short": 1, "cold_shorter": 1, "device": 3, "host": 3, "disk_all": 1, "disk_split": 1
    }
    assert all(t > 0 for v in reps.values() for t in v)
    pairs = list(zip(reps["device"], reps["host"], strict=True))
    assert res["host_over_device_pairwise"] == pytest.approx(statistics.median(h / d for d, h in pairs))
    assert res["host_minus_device_ms"] == pytest.approx(statistics.median(h - d for d, h in pairs))
    # The link's floor is a CUDA measurement: absent on CPU, not made up.
    assert res["h2d_link_ms"] is None and res["host_optimum_ms"] is None and res["host_over_optimum"] is None
    assert set(res["read_time_correction"]) >= {"alone", "beside_compute", "alone_observed", "beside_compute_observed"}
    # Direct reads: measured where the filesystem allows them (the backend reads through the page
    # cache unless told otherwise), and the best read's optimum is the lowest of the optima.
    if res["raw_disk_direct_refused"] is None:
        assert res["raw_disk_direct_read_gbps"] > 0
    else:
        assert res["raw_disk_direct_read_gbps"] is None
    assert res["storage_direct_io"] is False and res["storage_options"] == {}
    assert res["bucket_passes"] is False  # the model's default on the CPU
    assert res["warmed_graphs"] == 0  # no graphs to capture on the CPU
    assert res["disk_optimum_best_ms"] <= min(res["disk_optimum_ms"], res["disk_optimum_parallel_ms"])
    assert res["disk_split_over_optimum_best"] == pytest.approx(res["ttft_ms"]["disk_split"] / res["disk_optimum_best_ms"])
    # The prefill-time fit goes through the three cold prefills (72, 18 and 4 tokens), and the
    # optimum with the fit's compute is the same minimum as the bench's, recomputed here.
    fit = res["prefill_fit"]
    assert [n for n, _ in fit["prefills_ms"]] == [72, 18, 4]
    assert [t for _, t in fit["prefills_ms"]] == [res["ttft_ms"][k] for k in ("cold", "cold_short", "cold_shorter")]
    cost = RestoreCost.fit(read_bytes_per_s=1.0, prefills=[(n, t / 1e3) for n, t in fit["prefills_ms"]])
    assert fit["tokens_per_s"] == pytest.approx(cost.prefill_tokens_per_s)
    assert fit["s_per_context_token"] == pytest.approx(cost.prefill_s_per_context_token)
    assert fit["s_per_pass"] == pytest.approx(cost.prefill_s_per_pass)
    spec = HybridSpec.preset("small", page_size=8)
    bps = res["raw_disk_parallel_read_gbps"] * 1e9
    want = min(
        max((a * spec.kv_bytes_per_token + (spec.state_bytes if a else 0)) / bps, cost.compute_s(a, 72))
        for a in range(0, 65, 8)
    )
    assert res["disk_optimum_fit_parallel_ms"] == pytest.approx(want * 1e3)
    assert res["disk_split_over_optimum_fit_parallel"] == pytest.approx(
        res["ttft_ms"]["disk_split"] / res["disk_optimum_fit_parallel_ms"]
    )
    # The raw read of only the objects the prefix's request stored (its 9 KV pages and the states
    # at the page before the prompt's end and at the end), and the optimum with it.
    stored = sorted(p.relative_to(tmp_path / "disk") for p in (tmp_path / "disk").rglob("*") if p.is_file())
    assert res["prefix_files"] == 72 // 8 + 2 < len(stored)
    # The same objects read in ranges as the backend cuts them too, and the optimum with each.
    for read, optimum, ratio in (
        ("raw_disk_prefix_parallel_read_gbps", "disk_optimum_prefix_parallel_ms", "disk_split_over_optimum_prefix_parallel"),
        ("raw_disk_prefix_ranges_read_gbps", "disk_optimum_prefix_ranges_ms", "disk_split_over_optimum_prefix_ranges"),
    ):
        assert res[read] > 0
        bps = res[read] * 1e9
        want = min(
            max((a * spec.kv_bytes_per_token + (spec.state_bytes if a else 0)) / bps, (72 - a) / res["prefill_tokens_per_s"])
            for a in range(0, 65, 8)
        )
        assert res[optimum] == pytest.approx(want * 1e3)
        assert res[ratio] == pytest.approx(res["ttft_ms"]["disk_split"] / res[optimum])
    # A ranged read of the prefix's objects before each disk restore: the optimum with their
    # median, and each restore over the optimum with the read just before it.
    paired = res["raw_disk_paired_read_gbps"]
    assert [len(paired["disk_all"]), len(paired["disk_split"])] == [1, 1] and min(paired["disk_all"] + paired["disk_split"]) > 0

    def optimum_ms(gbps: float) -> float:
        bps = gbps * 1e9
        return 1e3 * min(
            max((a * spec.kv_bytes_per_token + (spec.state_bytes if a else 0)) / bps, (72 - a) / res["prefill_tokens_per_s"])
            for a in range(0, 65, 8)
        )

    median_gbps = (paired["disk_all"][0] + paired["disk_split"][0]) / 2
    assert res["disk_optimum_interleaved_ms"] == pytest.approx(optimum_ms(median_gbps))
    assert res["disk_split_over_optimum_interleaved"] == pytest.approx(
        res["ttft_ms"]["disk_split"] / res["disk_optimum_interleaved_ms"]
    )
    for key in ("disk_split", "disk_all"):
        assert res[f"{key}_over_optimum_paired"] == pytest.approx(res["ttft_ms"][key] / optimum_ms(paired[key][0]))
    captured = capsys.readouterr()
    printed = captured.out
    assert "the same ranged reads before each disk restore" in printed
    assert "the prefix's request stored alone, plain reads" in printed
    assert "cut as the backend reads them" in printed
    assert "host/device" in printed and "each tail read beside a head" in printed
    assert "remaining tokens' compute from the fit" in printed
    # Progress: for each of the three cold lengths a warm-up and 1 cold, the populating request,
    # 3 device/host pairs, 1 of each disk case.
    assert captured.err.endswith("15/15 requests\n")
    # A previous run re-reported and plotted without measuring: the same report, and a PNG.
    png = tmp_path / "prefix.png"
    assert prefix.run(bench_args(from_json=str(out), plot=str(png), json_path=None)) == 0
    again = capsys.readouterr().out
    assert again.splitlines()[: len(printed.splitlines())] == printed.splitlines()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bucketed_model_serves_every_tier_too(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    assert prefix.run(bench_args(json_path=str(out), pairs=1, bucket_passes="on")) == 0
    res = json.loads(out.read_text())
    assert res["bucket_passes"] is True
    assert res["cached_tokens"]["device"] == res["cached_tokens"]["host"] == res["cached_tokens"]["disk_all"] == 64


def test_storage_options_reach_the_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from storage_backends.file_io import probe_direct

    if probe_direct(str(tmp_path)) is not None:
        pytest.skip("no direct reads here")
    out = tmp_path / "prefix.json"
    options = ["direct_io=true", "max_concurrency=3"]
    assert prefix.run(bench_args(json_path=str(out), storage_option=options, pairs=1)) == 0
    res = json.loads(out.read_text())
    assert res["storage_options"] == {"direct_io": True, "max_concurrency": 3}
    assert res["storage_direct_io"] is True and res["raw_disk_parallel_threads"] == 3
    # The direct reads served the whole restore; the cost model's choice (restore all, split,
    # recompute) follows the disk speed this run measured (direct reads of a busy machine's disk
    # can be slower than the small model's prefill).
    assert res["cached_tokens"]["disk_all"] == 64
    assert 0 <= res["cached_tokens"]["disk_split"] <= 64
    assert "the backend read direct" in capsys.readouterr().out
    assert prefix.run(bench_args(storage_option=["direct_io=maybe"], pairs=1)) == 2
    assert "direct_io must be" in capsys.readouterr().err


def test_compressed_storage_is_reported_with_its_stored_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("zstandard")
    out = tmp_path / "prefix.json"
    plain = tmp_path / "plain.json"
    assert prefix.run(bench_args(json_path=str(out), storage_option=["compression=zstd"], pairs=1)) == 0
    assert prefix.run(bench_args(json_path=str(plain), pairs=1)) == 0
    res, ref = json.loads(out.read_text()), json.loads(plain.read_text())
    assert res["storage_compressed"] is True and ref["storage_compressed"] is False
    assert res["cached_tokens"]["disk_all"] == res["cached_tokens"]["disk_split"] == 64
    # fp32 activations of the small preset: the exponent planes shrink, the headers do not
    assert 0.5 < res["stored_fraction"] < ref["stored_fraction"] and ref["stored_fraction"] > 1.0
    assert res["disk_optimum_fit_stored_parallel_ms"] <= res["disk_optimum_fit_parallel_ms"]
    assert ref["disk_optimum_fit_stored_parallel_ms"] >= ref["disk_optimum_fit_parallel_ms"]
    assert res["disk_split_over_optimum_fit_stored_parallel"] == pytest.approx(
        res["ttft_ms"]["disk_split"] / res["disk_optimum_fit_stored_parallel_ms"]
    )
    assert "stored objects (compressed) take" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"new_tokens": 9}, "--new-tokens (9) must be between 1 and --page-size (8)"),
        ({"new_tokens": 0}, "--new-tokens (0) must be between 1"),
        ({"prefix_tokens": 68}, "--prefix-tokens (68) must be a multiple of --page-size (8)"),
        ({"repeats": 0}, "--repeats >= 1"),
        ({"pairs": 0}, "--pairs >= 1"),
    ],
)
def test_geometry_that_cannot_hit_the_whole_prefix_is_refused(
    change: dict[str, int], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With new tokens past one page, the state kept before the prompt's end would lie inside
    the new tokens and no request would hit the prefix: the bench says so instead of reporting
    cold times as cache hits."""
    assert prefix.run(bench_args(**change)) == 2
    assert message in capsys.readouterr().err


def test_from_json_that_cannot_be_read_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        assert prefix.run(bench_args(from_json=str(path))) == 2
        assert f"cannot read {path}" in capsys.readouterr().err


def test_ranged_raw_reads_read_every_byte_of_every_file(tmp_path: Path) -> None:
    """Files above the range size are read as several ranges, the last one short; every byte of
    every file is counted once, whatever the number of threads."""
    sizes = [0, 1, 4096, READ_RANGE_BYTES, READ_RANGE_BYTES + 1, 2 * READ_RANGE_BYTES + 12345]
    files = set()
    for i, n in enumerate(sizes):
        path = tmp_path / f"o{i}"
        path.write_bytes(os.urandom(n))
        files.add(path)
    for threads in (1, 3, 8):
        bps, total = raw_reads.ranged_read_bytes_per_s(tmp_path, files, threads)
        assert total == sum(sizes) and bps > 0


@pytest.mark.parametrize("direct", [None, 1.7])
def test_the_report_names_reader_processes_with_or_without_direct_reads(direct: float | None) -> None:
    from asynccache.bench.prefix_report import _direct_note

    res = {"raw_disk_direct_read_gbps": direct, "raw_disk_direct_refused": "O_DIRECT refused",
           "storage_direct_io": False, "storage_options": {"read_processes": 8}}  # fmt: skip
    assert "in 8 reader processes" in _direct_note(res)
    assert "reader processes" not in _direct_note({**res, "storage_options": {"read_processes": 0}})


def test_from_json_that_is_not_an_object_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for text in ("[1, 2]", '"a result"'):
        path = tmp_path / "r.json"
        path.write_text(text)
        assert prefix.run(bench_args(from_json=str(path))) == 2
        assert "not a JSON object" in capsys.readouterr().err


def test_a_storage_dir_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert prefix.run(bench_args(storage_dir=str(a_file))) == 2
    assert "--storage-dir" in capsys.readouterr().err


def test_a_relative_storage_dir_is_taken_from_the_working_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert prefix.run(bench_args(storage_dir="disk", pairs=1)) == 0
    assert any(p.is_file() for p in (tmp_path / "disk").rglob("*"))
    capsys.readouterr()
