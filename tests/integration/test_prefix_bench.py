"""``asynccache bench prefix`` on CPU: every tier serves the whole prefix; bad geometry is refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asynccache.bench import prefix


def bench_args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    prefix.add_arguments(p)
    args = p.parse_args(["--preset", "small", "--prefix-tokens", "64", "--new-tokens", "8", "--page-size", "8"])
    args.device, args.repeats = "cpu", 1
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_every_tier_serves_the_whole_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prefix.json"
    assert prefix.run(bench_args(json_path=str(out), storage_dir=str(tmp_path / "disk"))) == 0
    res = json.loads(out.read_text())
    assert res["cached_tokens"] == {"cold": 0, "device": 64, "host": 64, "disk_all": 64, "disk_split": 64}
    assert all(len(v) == 1 and v[0] > 0 for v in res["ttft_ms_repeats"].values())
    assert set(res["read_time_correction"]) >= {"alone", "beside_compute", "alone_observed", "beside_compute_observed"}
    printed = capsys.readouterr().out
    assert "host/device" in printed and "each tail read beside a head" in printed


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"new_tokens": 9}, "--new-tokens (9) must be between 1 and --page-size (8)"),
        ({"new_tokens": 0}, "--new-tokens (0) must be between 1"),
        ({"prefix_tokens": 68}, "--prefix-tokens (68) must be a multiple of --page-size (8)"),
        ({"repeats": 0}, "--repeats >= 1"),
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
