"""``asynccache bench transfer`` on CPU: a short run that measures the torch path and writes JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asynccache.bench import transfer
from asynccache.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cpu_run_writes_the_documented_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transfer.json"
    args = _args(
        "--device", "cpu", "--sizes", "4096,kv,4100", "--total-mib", "1", "--reps", "2",
        "--states", "1", "--tokens", "128", "--json", str(out),
    )  # fmt: skip
    assert transfer.run(args) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert report["gemm_slowdown"] is None and report["gemm_slowdown_dma"] is None
    assert report["dma_runtime"] is None
    rows = report["results"]
    assert {(r["direction"], r["item_bytes"]) for r in rows} == {
        (d, b) for d in ("h2d", "d2h") for b in (4096, 131072, 4100)
    }
    for r in rows:
        assert set(r) == {"method", "direction", "item_bytes", "num_items", "ctas", "gbps", "ratio"}
        assert r["method"] == "torch"
        assert r["num_items"] == (1 << 20) // r["item_bytes"]
        assert r["ctas"] == 0
        assert r["gbps"] > 0 and r["ratio"] > 0
    (load,) = report["per_layer_load"]
    assert load["launches"] == 48 and load["gbps"] > 0 and load["method"] == "torch" and load["issue_ms"] > 0
    assert load["indices"] == "random"
    printed = capsys.readouterr().out
    assert "torch-indexing path" in printed
    assert "per-layer load" in printed


def test_per_layer_load_with_consecutive_indices(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    args = _args("--device", "cpu", "--sizes", "4096", "--states", "2", "--tokens", "256", "--consecutive",
                 "--json", str(out))  # fmt: skip
    assert transfer.run(args) == 0
    (load,) = json.loads(out.read_text())["per_layer_load"]
    assert load["indices"] == "consecutive" and load["gbps"] > 0


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ConfigError, match="--methods"):
        transfer._methods("triton,cuda")
    assert transfer._methods("dma, triton") == ["dma", "triton"]


def test_unknown_named_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match="huge"):
        transfer.run(_args("--device", "cpu", "--sizes", "huge", "--no-scenario"))


@pytest.mark.parametrize(("option", "value"), [("--ctas", "abc"), ("--ctas", "4,-1"), ("--methods", "bogus")])
def test_ctas_and_methods_are_checked_on_cpu_too(option: str, value: str) -> None:
    with pytest.raises(ConfigError, match=option):
        transfer.run(_args("--device", "cpu", "--sizes", "4096", "--no-scenario", option, value))


def test_tokens_below_the_page_size_are_refused_before_the_run() -> None:
    with pytest.raises(ConfigError, match="--tokens: 63 is smaller than the page size"):
        transfer.run(_args("--device", "cpu", "--preset", "tiny", "--sizes", "4096", "--tokens", "63"))


def test_fill_random_leaves_an_empty_buffer_alone() -> None:
    import torch

    from asynccache.bench.copy_timing import fill_random

    fill_random(torch.empty(0, dtype=torch.uint8), 0)
    fill_random(torch.empty(0, 16, dtype=torch.uint8), 0)
