"""Compressed objects on the local disk: the frame codec (byte planes, zstd on the sign-and-exponent
plane), the frame table, and the backend storing KV pages and states as frames — bytes restored
equal bytes saved, fewer bytes on disk, damage detected.

The conformance suite runs on a compressing local disk too (``disk-zstd``), with random bytes
that do not compress; these tests use floating-point data that does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from storage_harness import NAMESPACE, kv_transfer, make_keys, mamba_transfer, slot

from asynccache.errors import ConfigError, ObjectFormatError
from asynccache.pools.host import HostKVPool, MambaPoolHost
from asynccache.spec import PRESETS, HybridSpec
from asynccache.storage import PoolName
from storage_backends import local_disk
from storage_backends.compression import (
    FrameTable,
    decode_frame,
    element_bytes,
    encode_frame,
)
from storage_backends.local_disk import LocalDiskBackend
from storage_backends.object_format import ObjectCodec, ObjectGeometry, PayloadChecksum

pytest.importorskip("zstandard")

#: bf16 KV and conv state, fp32 recurrent state: the shipped models' dtypes at a test size
BF16 = HybridSpec.from_hf_config({**PRESETS["tiny"], "torch_dtype": "bfloat16"}, model_id="tiny-bf16")


def activations(n: int, dtype: torch.dtype, seed: int) -> np.ndarray:
    """``n`` bytes of values shaped like activations (normal, unit scale) as raw bytes."""
    gen = torch.Generator().manual_seed(seed)
    count = n // torch.empty((), dtype=dtype).element_size()
    return torch.randn(count, generator=gen).to(dtype).view(torch.uint8).numpy().copy()


@pytest.mark.parametrize(
    ("dtype", "size"),
    [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4), (torch.float64, 8), (torch.uint8, 1)],
)
@pytest.mark.parametrize("nbytes", [8, 4096, 65536 + 8])
def test_a_frame_decodes_to_its_bytes(dtype: torch.dtype, size: int, nbytes: int) -> None:
    raw = activations(nbytes, dtype, seed=nbytes) if dtype != torch.uint8 else np.arange(nbytes, dtype=np.uint8)
    top, parts = encode_frame(raw, size)
    stored = np.concatenate([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts])
    assert stored.nbytes == top + (size - 1) * (nbytes // size) <= nbytes
    out = np.full(nbytes, 0xAB, dtype=np.uint8)
    decode_frame(stored, top, size, out)
    assert out.tobytes() == raw.tobytes()


def test_floating_point_frames_shrink_and_random_bytes_are_stored_as_they_are() -> None:
    raw = activations(1 << 20, torch.bfloat16, seed=1)
    top, _ = encode_frame(raw, 2)
    assert top < 0.6 * (raw.nbytes // 2)  # sign and exponent take few values
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    top, _ = encode_frame(noise, 2)
    assert top == noise.nbytes // 2  # incompressible: stored as it is, never larger


def test_a_damaged_frame_is_a_format_error() -> None:
    raw = activations(1 << 16, torch.bfloat16, seed=2)
    top, parts = encode_frame(raw, 2)
    stored = np.concatenate([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts])
    out = np.empty_like(raw)
    bad = stored.copy()
    bad[5] ^= 0xFF  # inside zstd's frame header or block
    with pytest.raises(ObjectFormatError):
        decode_frame(bad, top, 2, out)
    with pytest.raises(ObjectFormatError):
        decode_frame(stored[:-1], top, 2, out)
    with pytest.raises(ObjectFormatError):
        decode_frame(stored, 0, 2, out)
    with pytest.raises(ObjectFormatError):
        decode_frame(stored, raw.nbytes, 2, out)


def test_element_sizes_follow_the_dtype_and_the_item() -> None:
    assert element_bytes("bfloat16", 131072) == 2
    assert element_bytes("conv:bfloat16+ssm:float32", 2146304) == 4
    assert element_bytes("float32", 6) == 2  # items that are not whole elements: smaller planes
    assert element_bytes("uint8", 4096) == element_bytes("mystery", 4096) == 1


def test_the_frame_table_checks_its_lengths() -> None:
    table = FrameTable(payload_bytes=10_000, frame_bytes=4096, element_size=2)
    assert table.num_frames == 3 and table.frame_range(2) == (8192, 1808)
    lengths = [100, 2048, 904]
    stored = sum(table.stored_bytes(k, n) for k, n in enumerate(lengths))
    assert table.decode(table.encode(lengths), stored) == lengths
    assert table.stored_offset(lengths, 2) == 100 + 2048 + 2048 + 2048
    with pytest.raises(ObjectFormatError):
        table.decode(table.encode(lengths), stored + 1)  # the file is longer than its frames
    with pytest.raises(ObjectFormatError):
        table.decode(table.encode([0, 2048, 904]), stored - 100)
    with pytest.raises(ObjectFormatError):
        table.decode(table.encode([100, 2049, 904]), stored + 1)


def test_a_codec_that_compresses_names_it_in_the_header() -> None:
    geometry = ObjectGeometry(pool_name="kv", dtype="bfloat16", num_layers=2, item_bytes=8192)
    plain, framed = ObjectCodec("ns"), ObjectCodec("ns", compression="zstd", frame_bytes=4096)
    key = "ab" * 8
    assert framed.header_bytes(geometry, key) >= plain.header_bytes(geometry, key)  # both padded to 64
    assert framed.valid_size(geometry, key, framed.object_bytes(geometry, key))
    assert not framed.valid_size(geometry, key, framed.object_bytes(geometry, key) + 1)
    assert not framed.valid_size(geometry, key, framed.header_bytes(geometry, key))
    header = framed.encode_header(geometry, key, 7, [10, 10, 10, 10])
    with pytest.raises(ObjectFormatError, match="compression"):
        plain.verify_header(header, geometry, key)
    with pytest.raises(ConfigError):
        framed.encode(geometry, key, [np.zeros(16384, dtype=np.uint8)])
    with pytest.raises(ConfigError):
        ObjectCodec("ns", compression="lz4")


def fill_like_activations(kv: HostKVPool, mamba: MambaPoolHost, seed: int) -> None:
    """KV pages of bf16 activations; states of bf16 conv and fp32 recurrent values."""
    for pool, dtype in ((kv, torch.bfloat16), (mamba, torch.float32)):
        assert pool.buffer is not None
        flat = pool.buffer.view(torch.uint8).reshape(-1)
        flat.copy_(torch.from_numpy(activations(flat.numel(), dtype, seed)))
        seed += 1


async def open_compressed(root: Path, layout: str, seed: int | None) -> tuple[LocalDiskBackend, HostKVPool, MambaPoolHost]:
    backend = LocalDiskBackend(f"file://{root}", namespace=BF16.namespace_id, compression="zstd")
    kv = HostKVPool(BF16, num_pages=4, layout=layout, pin=False)
    mamba = MambaPoolHost(BF16, num_slots=4, layout=layout, pin=False)
    if seed is not None:
        fill_like_activations(kv, mamba, seed)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    await backend.register_host_pool_v2(PoolName.MAMBA, mamba)
    return backend, kv, mamba


def stored_payload(backend: LocalDiskBackend, pool: str, keys: list[str]) -> int:
    """Bytes the objects of ``keys`` take on disk, less their headers."""
    geometry = backend._pools[pool][1]
    return sum(
        Path(backend.object_name(pool, k)).stat().st_size - backend.codec.header_bytes(geometry, k) for k in keys
    )


@pytest.mark.parametrize("frame_bytes", [4 << 20, 8192])  # one frame per object; many, read on several jobs
@pytest.mark.parametrize(("src_layout", "dst_layout"), [("page_first", "layer_first"), ("layer_first", "page_first")])
async def test_compressed_objects_restore_exactly_in_fewer_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frame_bytes: int, src_layout: str, dst_layout: str
) -> None:
    monkeypatch.setattr(local_disk, "READ_RANGE_BYTES", frame_bytes)
    keys = make_keys(3, seed="zstd")
    writer, kv, mamba = await open_compressed(tmp_path, src_layout, seed=5)
    assert await writer.batch_set_v2([kv_transfer(keys, [0, 1, 2]), mamba_transfer(keys[2:], [3])]) == [[True] * 3, [True]]
    assert stored_payload(writer, "kv", keys) < 0.8 * 3 * BF16.kv_page_bytes
    assert stored_payload(writer, "mamba", keys[2:]) < BF16.state_bytes
    reader, kv2, mamba2 = await open_compressed(tmp_path, dst_layout, seed=None)
    assert await reader.batch_get_v2([kv_transfer(keys, [2, 0, 1]), mamba_transfer(keys[2:], [1])]) == [[True] * 3, [True]]
    assert [slot(kv2, i) for i in (2, 0, 1)] == [slot(kv, i) for i in (0, 1, 2)]
    assert slot(mamba2, 1) == slot(mamba, 3)
    assert reader.statistics().num_corrupt == 0
    await writer.aclose()
    await reader.aclose()


@pytest.mark.parametrize("where", ["frame", "table", "plane"])
async def test_a_damaged_compressed_object_is_a_miss_and_removed(tmp_path: Path, where: str) -> None:
    keys = make_keys(2, seed="zdamage")
    backend, kv, _ = await open_compressed(tmp_path, "page_first", seed=7)
    await backend.batch_set_v2([kv_transfer(keys, [0, 1])])
    name = Path(backend.object_name(PoolName.KV, keys[0]))
    data = bytearray(name.read_bytes())
    hlen = backend.codec.header_bytes(backend._pools["kv"][1], keys[0])
    table_at = data.index(b";zstd:") + len(";zstd:4194304")  # the frame table follows the descriptor
    at = {"frame": hlen + 20, "table": table_at, "plane": len(data) - 50}[where]
    data[at] ^= 0x10
    name.write_bytes(bytes(data))
    reader, kv2, _ = await open_compressed(tmp_path, "page_first", seed=None)
    assert await reader.batch_get_v2([kv_transfer(keys, [0, 1])]) == [[False, True]]
    assert slot(kv2, 1) == slot(kv, 1)
    assert reader.statistics().num_corrupt == 1
    assert not name.exists()
    await backend.aclose()
    await reader.aclose()


async def test_plain_and_compressed_backends_miss_each_others_objects(tmp_path: Path) -> None:
    keys = make_keys(2, seed="zmix")
    compressed, _, _ = await open_compressed(tmp_path, "page_first", seed=9)
    await compressed.batch_set_v2([kv_transfer(keys[:1], [0])])
    plain = LocalDiskBackend(f"file://{tmp_path}", namespace=BF16.namespace_id)
    kv2 = HostKVPool(BF16, num_pages=4, layout="page_first", pin=False)
    await plain.register_host_pool_v2(PoolName.KV, kv2)
    assert await plain.batch_get_v2([kv_transfer(keys[:1], [0])]) == [[False]]
    await plain.batch_set_v2([kv_transfer(keys[1:], [1])])
    assert await compressed.batch_get_v2([kv_transfer(keys[1:], [1])]) == [[False]]
    await compressed.aclose()
    await plain.aclose()


def test_compression_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="compression"):
        LocalDiskBackend(f"file://{tmp_path}", namespace=NAMESPACE, compression="lz4")
    with pytest.raises(ConfigError, match="direct_io"):
        LocalDiskBackend(f"file://{tmp_path}", namespace=NAMESPACE, compression="zstd", direct_io=True)
    backend = LocalDiskBackend(f"file://{tmp_path}", namespace=NAMESPACE, compression="zstd", direct_io=None)
    assert backend.codec.compression == "zstd"


async def test_the_capacity_counts_what_compressed_objects_take(tmp_path: Path) -> None:
    keys = make_keys(3, seed="zcap")
    backend = LocalDiskBackend(f"file://{tmp_path}", namespace=BF16.namespace_id, compression="zstd",
                               capacity_bytes=1 << 30)
    kv = HostKVPool(BF16, num_pages=4, layout="page_first", pin=False)
    fill_like_activations(kv, MambaPoolHost(BF16, num_slots=1, layout="page_first", pin=False), seed=11)
    await backend.register_host_pool_v2(PoolName.KV, kv)
    assert await backend.batch_set_v2([kv_transfer(keys, [0, 1, 2])]) == [[True] * 3]
    on_disk = sum(Path(backend.object_name(PoolName.KV, k)).stat().st_size for k in keys)
    assert backend.statistics().used_bytes == on_disk < 3 * backend.codec.object_bytes(backend._pools["kv"][1], keys[0])
    assert not backend._written_sizes
    await backend.aclose()


def test_a_flipped_bit_in_a_compressed_plane_never_decodes_unnoticed() -> None:
    """A damaged zstd stream can decode without error into several changed bytes that cancel in
    the payload's linear checksum (two sign bits of one 64-bit lane): zstd's content checksum
    catches those. Every bit position of the compressed plane, flipped one at a time."""
    raw = activations(1 << 15, torch.bfloat16, seed=7)
    top, parts = encode_frame(raw, 2)
    assert top < raw.nbytes // 2
    stored = np.concatenate([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts])
    want = PayloadChecksum()
    want.update(raw)
    out = np.empty_like(raw)
    for pos in range(top):
        for bit in range(8):
            bad = stored.copy()
            bad[pos] ^= 1 << bit
            try:
                decode_frame(bad, top, 2, out)
            except ObjectFormatError:
                continue
            got = PayloadChecksum()
            got.update(out)
            assert out.tobytes() == raw.tobytes() or got.digest() != want.digest(), (pos, bit)


async def test_sizes_are_kept_only_for_a_capacity(tmp_path: Path) -> None:
    keys = make_keys(4, seed="zsizes")
    backend, _, _ = await open_compressed(tmp_path, "page_first", seed=13)
    for i in range(2):
        assert await backend.batch_set_v2([kv_transfer(keys[2 * i : 2 * i + 2], [2 * i, 2 * i + 1])]) == [[True] * 2]
    assert backend.statistics().used_bytes is None and not backend._written_sizes
    await backend.aclose()


async def test_the_capacity_counts_objects_another_writer_stored_at_their_size(tmp_path: Path) -> None:
    keys = make_keys(3, seed="zshared")
    backends = []
    for seed in (15, None):
        backend = LocalDiskBackend(f"file://{tmp_path}", namespace=BF16.namespace_id, compression="zstd",
                                   capacity_bytes=1 << 30)
        kv = HostKVPool(BF16, num_pages=4, layout="page_first", pin=False)
        if seed is not None:
            fill_like_activations(kv, MambaPoolHost(BF16, num_slots=1, layout="page_first", pin=False), seed=seed)
        await backend.register_host_pool_v2(PoolName.KV, kv)
        backends.append(backend)
    first, second = backends
    assert await first.batch_exists_v2(keys, [kv_transfer([])]) is not None  # both have scanned an empty root
    assert await second.batch_exists_v2(keys, [kv_transfer([])]) is not None
    assert await first.batch_set_v2([kv_transfer(keys, [0, 1, 2])]) == [[True] * 3]
    assert await second.batch_set_v2([kv_transfer(keys, [0, 1, 2])]) == [[True] * 3]  # found, not rewritten
    on_disk = sum(Path(first.object_name(PoolName.KV, k)).stat().st_size for k in keys)
    assert first.statistics().used_bytes == second.statistics().used_bytes == on_disk
    assert second.statistics().num_write_skips == 3 and not second._written_sizes
    for backend in backends:
        await backend.aclose()
