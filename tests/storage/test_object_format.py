"""The object format: header, names, key validation, payload checksum."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_harness import NAMESPACE, OTHER_NAMESPACE, make_keys, make_pools, slot

from asynccache.errors import ConfigError, ObjectFormatError
from asynccache.storage import PoolName
from storage_backends.object_format import (
    FORMAT_VERSION,
    ObjectCodec,
    ObjectGeometry,
    ObjectHeader,
    PayloadChecksum,
    StopRequested,
    object_relpath,
    payload_checksum,
    run_steps,
    slot_buffers,
    validate_key,
)


def geometry(pool_name: PoolName = PoolName.KV, layout: str = "page_first") -> ObjectGeometry:
    kv, mamba = make_pools(2, layout=layout)
    return ObjectGeometry.of_pool(pool_name, kv if pool_name is PoolName.KV else mamba)


def test_header_round_trip_and_size_known_in_advance() -> None:
    codec, key = ObjectCodec(NAMESPACE), make_keys(1)[0]
    geo = geometry()
    header = codec.encode_header(geo, key, 0x0123456789ABCDEF)
    assert len(header) == codec.header_bytes(geo, key) and len(header) % 64 == 0
    decoded = ObjectHeader.decode(header)
    assert decoded.version == FORMAT_VERSION and decoded.key == key and decoded.pool_name == "kv"
    assert (decoded.num_layers, decoded.item_bytes, decoded.dtype) == (geo.num_layers, geo.item_bytes, "float32")
    assert decoded.layout == "page_first" and decoded.payload_sum == 0x0123456789ABCDEF
    assert codec.verify_header(header, geo, key) == 0x0123456789ABCDEF
    assert codec.object_bytes(geo, key) == len(header) + geo.payload_bytes


@pytest.mark.parametrize(
    "problem,match",
    [
        ("namespace", "foreign namespace"),
        ("key", "stored under"),
        ("geometry", "geometry"),
        ("magic", "bad magic"),
        ("short", "truncated header"),
    ],
)
def test_verify_header_names_the_problem(problem: str, match: str) -> None:
    codec, (key, other_key) = ObjectCodec(NAMESPACE), make_keys(2)
    geo = geometry()
    header = bytes(codec.encode_header(geo, key, 7))
    if problem == "namespace":
        header = bytes(ObjectCodec(OTHER_NAMESPACE).encode_header(geo, key, 7))
    elif problem == "key":
        header = bytes(codec.encode_header(geo, other_key, 7))
    elif problem == "geometry":
        header = bytes(codec.encode_header(geometry(PoolName.MAMBA), key, 7))
    elif problem == "magic":
        header = b"XXXX" + header[4:]
    else:
        header = header[:20]
    with pytest.raises(ObjectFormatError, match=match):
        codec.verify_header(header, geo, key)


def test_encode_decode_between_layouts() -> None:
    codec, key = ObjectCodec(NAMESPACE), make_keys(1)[0]
    src, _ = make_pools(2, layout="layer_first", seed=5)
    dst, _ = make_pools(2, layout="page_first", seed=None)
    geo = ObjectGeometry.of_pool(PoolName.KV, src)
    data = codec.encode(geo, key, slot_buffers(src, 1))
    codec.decode_into(data, geo, key, slot_buffers(dst, 0))
    assert slot(dst, 0) == slot(src, 1)
    assert len(slot_buffers(src, 1)) == geo.num_layers and len(slot_buffers(dst, 0)) == 1
    damaged = bytearray(data)
    damaged[-1] ^= 0x80
    with pytest.raises(ObjectFormatError, match="checksum"):
        codec.decode_into(damaged, geo, key, slot_buffers(dst, 1))
    with pytest.raises(ObjectFormatError, match="truncated"):
        codec.decode_into(data[:-1], geo, key, slot_buffers(dst, 1))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_encode_parts_are_the_object_without_a_copy(layout: str) -> None:
    codec, key = ObjectCodec(NAMESPACE), make_keys(1)[0]
    src, _ = make_pools(2, layout=layout, seed=6)
    geo = ObjectGeometry.of_pool(PoolName.KV, src)
    buffers = slot_buffers(src, 1)
    parts = codec.encode_parts(geo, key, buffers)
    assert b"".join(bytes(p) for p in parts) == bytes(codec.encode(geo, key, buffers))
    assert all(part is buf for part, buf in zip(parts[1:], buffers, strict=True))  # the slot itself
    dst, _ = make_pools(2, seed=None)
    codec.decode_into(b"".join(bytes(p) for p in parts), geo, key, slot_buffers(dst, 0))
    assert slot(dst, 0) == slot(src, 1)


def test_a_slot_changed_before_its_parts_are_sent_makes_an_invalid_object() -> None:
    codec, key = ObjectCodec(NAMESPACE), make_keys(1)[0]
    src, _ = make_pools(2, seed=6)
    geo = ObjectGeometry.of_pool(PoolName.KV, src)
    parts = codec.encode_parts(geo, key, slot_buffers(src, 0))
    slot_buffers(src, 0)[0][5] ^= 0x10  # overwritten while the upload is still reading it
    dst, _ = make_pools(2, seed=None)
    with pytest.raises(ObjectFormatError, match="checksum"):
        codec.decode_into(b"".join(bytes(p) for p in parts), geo, key, slot_buffers(dst, 0))


def test_stepwise_codec_runs_one_piece_per_step_and_stops_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from storage_backends import payload_pieces

    monkeypatch.setattr(payload_pieces, "IO_CHUNK_BYTES", 256)
    codec, key = ObjectCodec(NAMESPACE), make_keys(1)[0]
    src, _ = make_pools(2, seed=6)
    geo = ObjectGeometry.of_pool(PoolName.KV, src)
    pieces = -(-geo.payload_bytes // 256)
    data = codec.encode(geo, key, slot_buffers(src, 0))
    dst, _ = make_pools(2, seed=None)
    steps = codec.decode_steps(data, geo, key, slot_buffers(dst, 0))
    assert sum(1 for _ in steps) == pieces - 1  # a step between two pieces
    assert slot(dst, 0) == slot(src, 0)
    parts = run_steps(codec.encode_parts_steps(geo, key, slot_buffers(src, 0)))
    assert b"".join(bytes(p) for p in parts) == bytes(data)
    stop = threading.Event()
    stop.set()
    with pytest.raises(StopRequested):
        codec.decode_into(data, geo, key, slot_buffers(dst, 1), stop)


def test_keys_and_names_are_strict() -> None:
    key = make_keys(1)[0]
    assert validate_key(key) == key
    assert object_relpath("ab" * 16, "kv", key) == f"{'ab' * 16}/kv/{key[:2]}/{key}"
    for bad in ["../x", key.upper(), key + "/", "", 12345, None, "a" * 7]:
        with pytest.raises(ConfigError):
            validate_key(bad)
    with pytest.raises(ConfigError):
        object_relpath("ab", "../kv", key)
    with pytest.raises(ConfigError, match="namespace"):
        ObjectCodec("")


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=20000),
    cuts=st.lists(st.integers(min_value=0, max_value=20000), max_size=6),
)
def test_checksum_does_not_depend_on_how_the_payload_is_cut(data: bytes, cuts: list[int]) -> None:
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    pieces = [np.frombuffer(data[a:b], dtype=np.uint8) for a, b in itertools.pairwise(points)]
    assert payload_checksum(pieces) == payload_checksum([data])


@settings(max_examples=60, deadline=None)
@given(size=st.integers(min_value=1, max_value=3 * 4096 + 17), bit=st.integers(min_value=0, max_value=2**20))
def test_checksum_catches_every_single_bit_flip(size: int, bit: int) -> None:
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    flipped = data.copy()
    pos = bit % (size * 8)
    flipped[pos // 8] ^= np.uint8(1 << (pos % 8))
    assert payload_checksum([data]) != payload_checksum([flipped])


def test_checksum_catches_swapped_blocks_and_zeroed_ranges() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 8 * 4096, dtype=np.uint8)
    swapped = data.copy()
    swapped[:4096], swapped[4096:8192] = data[4096:8192], data[:4096]
    zeroed = data.copy()
    zeroed[5000:9000] = 0
    base = payload_checksum([data])
    assert base != payload_checksum([swapped]) and base != payload_checksum([zeroed])
    check = PayloadChecksum()
    check.update(data[:100])
    first = check.digest()
    check.update(data[100:])
    assert check.digest() == base and first == payload_checksum([data[:100]])


def test_a_slot_larger_than_the_geometry_is_refused_by_name() -> None:
    codec, key = ObjectCodec(NAMESPACE), make_keys(1)[0]
    src, _ = make_pools(2, seed=5)
    geo = ObjectGeometry.of_pool(PoolName.KV, src)
    buffers = [*slot_buffers(src, 1), np.zeros(8, dtype=np.uint8)]
    with pytest.raises(ConfigError, match="more than the geometry"):
        codec.encode(geo, key, buffers)
