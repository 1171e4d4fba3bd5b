from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from asynccache.trace.loader import Trace, TraceFormatError, load_trace


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_mooncake_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 1024, "output_length": 7, "hash_ids": [0, 2]},
            {"timestamp": 2000, "input_length": 1, "output_length": 0, "hash_ids": [3]},
        ],
    )
    trace = load_trace(path)
    assert len(trace) == 3
    assert trace.timestamps_s.tolist() == [0.0, 1.5, 2.0]
    assert trace[1].hash_ids == (0, 2) and trace[1].input_length == 1024
    assert trace.hash_ids_of(2).tolist() == [3]
    assert trace.num_prompt_tokens == 2025
    assert trace.num_unique_blocks == 4
    assert len(load_trace(path, limit=2)) == 2
    head = trace.head(1)
    assert len(head) == 1 and head.hash_ids.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0]}], "expected ceil"),
        (
            [
                {"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0]},
                {"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [1]},
            ],
            "backwards",
        ),
        (
            [
                {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]},
                {"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [2, 1]},
            ],
            "prefix-chain",
        ),
        ([{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}], "input_length"),
        ([{"timestamp": 0, "output_length": 1, "hash_ids": [0]}], "not a Mooncake request"),
        ([{"timestamp": 0, "input_length": 10**20, "output_length": 1, "hash_ids": [0]}], "64 bits"),
        ([{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [2**64]}], "64 bits"),
        ([{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}], ">= 0"),
        ([{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "5"}], "must be a list"),
        ([{"timestamp": 0, "input_length": 3.9, "output_length": 1, "hash_ids": [0]}], "integer"),
        ([{"timestamp": "0", "input_length": 10, "output_length": 1, "hash_ids": [0]}], "timestamp must be a number"),
        ([{"timestamp": True, "input_length": 10, "output_length": 1, "hash_ids": [0]}], "timestamp must be a number"),
        (
            [
                {"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0]},
                {"timestamp": float("nan"), "input_length": 10, "output_length": 1, "hash_ids": [1]},
            ],
            "finite",
        ),
    ],
)
def test_malformed_traces_are_rejected(tmp_path: Path, rows: list[dict], message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        load_trace(_write(tmp_path / "bad.jsonl", rows))


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_from_requests_is_columnar() -> None:
    trace = Trace.from_requests([(0.0, 3, 1, [7]), (1.0, 9, 1, [7, 8, 9])], block_size=4)
    assert trace.offsets.tolist() == [0, 1, 4]
    assert trace.hash_ids.dtype == np.int64


def test_bytes_that_are_not_utf8_are_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n\xff\xfe\n')
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(path)


def test_integral_floats_are_taken() -> None:
    from asynccache.trace.loader import _request

    assert _request({"timestamp": 1000, "input_length": 10.0, "output_length": 2, "hash_ids": [0]}) == (1.0, 10, 2, [0])


def test_sizes_that_are_not_whole_bytes_are_refused() -> None:
    """``--storage-budgets 0.4`` became 0: the disk tier vanished from the replay unannounced."""
    from asynccache.errors import ConfigError
    from asynccache.trace.results import parse_size

    assert parse_size("1.5g") == 3 * 2**29 and parse_size("0") == 0 and parse_size("0.5KiB") == 512
    for bad in ("0.4", "1.5b", "0.1KiB"):
        with pytest.raises(ConfigError, match="whole number of bytes"):
            parse_size(bad)


def test_times_count_from_the_first_request(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1_740_000_000_000 + 500 * i, "input_length": 4, "output_length": 1, "hash_ids": [i]}
            for i in range(3)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_trace(path, block_size=4).timestamps_s.tolist() == [0.0, 0.5, 1.0]


def test_json_nested_too_deeply_is_a_format_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}\n' + "[" * 100000 + "]" * 100000 + "\n")
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: .*nested too deeply"):
        load_trace(path, block_size=4)


def test_a_request_the_format_refuses_is_named_by_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}
    path.write_text("\n\n" + json.dumps(good) + "\n\n" + json.dumps({**good, "input_length": 0}) + "\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:5: input_length must be >= 1"):
        load_trace(path, block_size=4)
    # built from tuples, a request is named by its index
    with pytest.raises(TraceFormatError, match=r"^request 1: input_length"):
        Trace.from_requests([(0.0, 4, 1, [0]), (1.0, 0, 1, [1])], block_size=4)
