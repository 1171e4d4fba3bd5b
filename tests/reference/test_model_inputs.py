"""What the reference model refuses or normalises before it computes: specs whose state does not
fit their recurrent geometry, checkpoints written for another model (recorded geometry,
model_id), weights that are no weights or do not survive the cast, sharded checkpoints, and
batch inputs of the wrong types or integer types that hash by identity."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from asynccache.errors import ConfigError
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.presets import PRESETS
from asynccache.reference import ForwardBatch, HybridModel, SequenceInput
from asynccache.reference.weights import GEOMETRY_KEYS, WEIGHT_DTYPES, read_checkpoint
from asynccache.spec import HybridSpec

SPEC = HybridSpec.preset("tiny", page_size=4)


def _logits(model: HybridModel, ids: torch.Tensor, *, spec: HybridSpec = SPEC) -> torch.Tensor:
    kv, st = DeviceKVPool(spec, 8), DeviceMambaPool(spec, 2)
    s = SequenceInput(token_ids=ids, start=0, kv_page_indices=torch.arange(8), state_slot=0)
    return asyncio.run(model.forward(ForwardBatch((s,)), kv, st))


def _tokens(n: int = 20) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(1))


# ---- the spec's state components against its linear geometry --------------------------------
def test_conv_state_shape_must_follow_the_conv_kernel() -> None:
    spec = dataclasses.replace(SPEC, linear=dataclasses.replace(SPEC.linear, conv_kernel=2))
    assert spec.state_components[0].shape == (128, 3)
    with pytest.raises(ConfigError, match=r"'conv' has shape \(128, 3\).*needs \(128, 1\)"):
        HybridModel(spec)


def test_ssm_state_shape_must_follow_the_heads() -> None:
    conv, ssm = SPEC.state_components
    spec = dataclasses.replace(
        SPEC,
        linear=dataclasses.replace(SPEC.linear, head_k_dim=16, head_dim=16),
        state_components=(conv, dataclasses.replace(ssm, shape=(4, 8, 32))),
    )
    with pytest.raises(ConfigError, match=r"'ssm' has shape \(4, 8, 32\).*needs \(4, 16, 16\)"):
        HybridModel(spec)


# ---- checkpoint metadata: geometry and model_id ------------------------------------------------
def _spec_a() -> HybridSpec:
    return HybridSpec.from_hf_config(PRESETS["tiny"], model_id="model-A")  # 2 key heads × 16


def test_saved_file_records_the_geometry(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    HybridModel(_spec_a()).save_safetensors(path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["model_id"] == "model-A"
    assert (meta["linear_num_key_heads"], meta["linear_key_head_dim"], meta["linear_conv_kernel_dim"]) == ("2", "16", "4")
    assert set(GEOMETRY_KEYS) <= set(meta)


def test_another_key_head_split_is_refused(tmp_path: Path) -> None:
    """1 key head × 32 has every tensor shape of 2 × 16: only the metadata tells them apart."""
    path = tmp_path / "a.safetensors"
    HybridModel(_spec_a()).save_safetensors(path)
    other = HybridSpec.from_hf_config(
        {**PRESETS["tiny"], "linear_num_key_heads": 1, "linear_key_head_dim": 32}, model_id="model-A"
    )
    with pytest.raises(ConfigError, match=r"linear_num_key_heads=2 \(the spec: 1\), linear_key_head_dim=16"):
        HybridModel.from_safetensors(other, path)
    with pytest.raises(ConfigError, match="geometry"):  # not a model_id matter: no opting out
        HybridModel.from_safetensors(other, path, check_model_id=False)


def test_another_model_id_is_refused_unless_opted_out(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    src = HybridModel(_spec_a(), seed=5)
    src.save_safetensors(path)
    renamed = dataclasses.replace(_spec_a(), model_id="model-B")
    with pytest.raises(ConfigError, match="model_id 'model-A', not the spec's 'model-B'.*check_model_id=False"):
        HybridModel.from_safetensors(renamed, path)
    loaded = HybridModel.from_safetensors(renamed, path, check_model_id=False)
    for (name, p), q in zip(src.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert HybridModel.from_safetensors(_spec_a(), path).spec.model_id == "model-A"


def test_a_file_without_metadata_loads_by_shapes(tmp_path: Path) -> None:
    """A Hugging Face-style file (only ``format``) is checked by its tensors alone."""
    path = tmp_path / "hf.safetensors"
    src = HybridModel(_spec_a(), seed=2)
    save_file({n: p.contiguous() for n, p in src.named_parameters()}, str(path), metadata={"format": "pt"})
    other = HybridSpec.from_hf_config(
        {**PRESETS["tiny"], "linear_num_key_heads": 1, "linear_key_head_dim": 32}, model_id="model-B"
    )
    loaded = HybridModel.from_safetensors(other, path)
    assert torch.equal(loaded.lm_head.weight, src.lm_head.weight)


# ---- tensors that are no weights, or do not survive the cast ----------------------------------
def _tensors() -> dict[str, torch.Tensor]:
    return {n: p.clone() for n, p in HybridModel(SPEC, seed=0).named_parameters()}


def test_a_cast_that_overflows_is_refused() -> None:
    t = _tensors()
    t["model.norm.weight"] = torch.full((64,), 1e5).to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"'model.norm.weight' does not fit torch.float16.*torch.bfloat16"):
        HybridModel(SPEC, dtype=torch.float16, weights=t)
    HybridModel(SPEC, dtype=torch.float32, weights=t)  # fits fp32
    t["model.norm.weight"] = torch.full((64,), 1e3)  # fits fp16
    model = HybridModel(SPEC, dtype=torch.float16, weights=t)
    assert bool(torch.isfinite(model.model.norm.weight).all())


def test_a_tensor_that_is_already_non_finite_is_not_blamed_on_the_cast() -> None:
    t = _tensors()
    t["model.norm.weight"][0] = float("inf")
    model = HybridModel(SPEC, dtype=torch.float16, weights=t)
    assert torch.isinf(model.model.norm.weight[0])


@pytest.mark.parametrize("name", ["float4_e2m1fn_x2", "float8_e8m0fnu", "float8_e4m3fnuz", "complex64"])
def test_dtypes_that_are_no_weights_are_refused(name: str, tmp_path: Path) -> None:
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    t = _tensors()
    if dtype.itemsize == 1 and name.startswith("float4"):
        t["model.norm.weight"] = torch.zeros(64, dtype=torch.uint8).view(dtype)
    else:
        t["model.norm.weight"] = torch.zeros(64).to(dtype)
    with pytest.raises(ConfigError, match=rf"'model.norm.weight' is torch.{name}, not a floating-point weight"):
        HybridModel(SPEC, weights=t)
    if name in ("float4_e2m1fn_x2", "float8_e8m0fnu"):  # as a safetensors file too
        path = tmp_path / "w.safetensors"
        save_file(t, str(path))
        with pytest.raises(ConfigError, match=rf"torch.{name}"):
            HybridModel.from_safetensors(SPEC, path)


def test_weight_dtypes_load() -> None:
    assert torch.float8_e4m3fn in WEIGHT_DTYPES and torch.float64 in WEIGHT_DTYPES
    src = _tensors()
    for dtype in WEIGHT_DTYPES:
        model = HybridModel(SPEC, weights={n: p.to(dtype) for n, p in src.items()})
        torch.testing.assert_close(model.lm_head.weight, src["lm_head.weight"].to(dtype).float())


def test_weights_of_other_types_are_refused() -> None:
    t: dict[str, object] = dict(_tensors())
    t["model.norm.weight"] = [1.0] * 64
    with pytest.raises(ConfigError, match="'model.norm.weight' is a list, not a torch.Tensor"):
        HybridModel(SPEC, weights=t)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mapping of parameter names to tensors"):
        HybridModel(SPEC, weights="model.safetensors")  # type: ignore[arg-type]


# ---- sharded checkpoints ------------------------------------------------------------------------
def _shard(tmp_path: Path, *, extra: dict[str, str] | None = None) -> tuple[HybridModel, Path]:
    """A sharded copy of a saved model: two shards and an index (names alternating)."""
    src = HybridModel(SPEC, seed=7)
    src.save_safetensors(tmp_path / "full.safetensors")
    t = load_file(str(tmp_path / "full.safetensors"))
    with safe_open(str(tmp_path / "full.safetensors"), "pt") as f:
        meta = f.metadata()
    (tmp_path / "full.safetensors").unlink()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, members in shards.items():
        save_file({k: t[k] for k in members}, str(tmp_path / shard), metadata=meta)
        weight_map |= dict.fromkeys(members, shard)
    weight_map |= extra or {}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return src, index


@pytest.mark.parametrize("how", ["folder", "index"])
def test_sharded_checkpoint_loads(how: str, tmp_path: Path) -> None:
    src, index = _shard(tmp_path)
    loaded = HybridModel.from_safetensors(SPEC, tmp_path if how == "folder" else index)
    for (name, p), q in zip(src.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q), name
    _, meta = read_checkpoint(index)
    assert meta["model_id"] == SPEC.model_id  # the shards' metadata is checked too
    with pytest.raises(ConfigError, match="model_id"):
        HybridModel.from_safetensors(dataclasses.replace(SPEC, model_id="other"), index)


def test_sharded_checkpoint_refuses_inconsistent_shards(tmp_path: Path) -> None:
    _, index = _shard(tmp_path)
    first = tmp_path / "model-00001-of-00002.safetensors"
    t = load_file(str(first))
    name = min(t)
    # the same tensor in the second shard too
    second = tmp_path / "model-00002-of-00002.safetensors"
    t2 = load_file(str(second))
    save_file({**t2, name: t[name]}, str(second))
    with pytest.raises(ConfigError, match=rf"holds tensor '{name}', but the index puts it in 'model-00001"):
        HybridModel.from_safetensors(SPEC, index)
    save_file(t2, str(second))
    # a tensor the index lists but its shard lacks
    save_file({k: v for k, v in t.items() if k != name}, str(first))
    with pytest.raises(ConfigError, match=rf"missing from their shards: \['{name}'\]"):
        HybridModel.from_safetensors(SPEC, index)


def test_sharded_checkpoint_refuses_a_malformed_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ConfigError, match="not a sharded safetensors index"):
        HybridModel.from_safetensors(SPEC, tmp_path)
    index.write_text("{")
    with pytest.raises(ConfigError, match="cannot read sharded checkpoint index"):
        HybridModel.from_safetensors(SPEC, index)
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(ConfigError, match="not a file name in the index's folder"):
        HybridModel.from_safetensors(SPEC, index)


def test_a_folder_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holds neither model.safetensors nor model.safetensors.index.json"):
        HybridModel.from_safetensors(SPEC, tmp_path)


# ---- batch inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [torch.tensor(10), np.int64(10)], ids=["tensor", "numpy"])
def test_snapshot_positions_of_other_integer_types_are_written(key: object) -> None:
    model = HybridModel(SPEC)
    kv, st = DeviceKVPool(SPEC, 4), DeviceMambaPool(SPEC, 3)
    assert st.buffer is not None
    st.buffer.fill_(0xFF)
    s = SequenceInput(
        token_ids=_tokens(10), start=0, kv_page_indices=torch.arange(3), state_slot=0, snapshots={key: torch.tensor(1)}
    )
    assert s.snapshots == {10: 1} and all(type(x) is int for x in (*s.snapshots, *s.snapshots.values()))
    asyncio.run(model.forward(ForwardBatch((s,)), kv, st))
    for layer in SPEC.mamba_layer_ids:
        state = st.state(layer)
        assert torch.equal(state["ssm"][1], state["ssm"][0]) and torch.equal(state["conv"][1], state["conv"][0])


def test_tensor_slots_compare_by_value() -> None:
    """Two sequences given the same working slot as two tensors still share it: refused."""
    model = HybridModel(SPEC)
    kv, st = DeviceKVPool(SPEC, 8), DeviceMambaPool(SPEC, 3)
    seqs = tuple(
        SequenceInput(token_ids=_tokens(4), start=torch.tensor(0), kv_page_indices=torch.tensor([i]), state_slot=torch.tensor(0))
        for i in range(2)
    )
    assert type(seqs[0].state_slot) is int and type(seqs[0].start) is int
    with pytest.raises(ConfigError, match="share a working state slot"):
        asyncio.run(model.forward(ForwardBatch(seqs), kv, st))


def test_a_snapshot_position_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="snapshot position 8 is given twice"):
        SequenceInput(
            token_ids=_tokens(10), start=0, kv_page_indices=torch.arange(3), state_slot=0, snapshots={8: 1, torch.tensor(8): 2}
        )


def test_inputs_that_are_not_tensors_are_refused() -> None:
    model = HybridModel(SPEC)
    kv, st = DeviceKVPool(SPEC, 4), DeviceMambaPool(SPEC, 2)
    bad = [
        ({"token_ids": [1, 2, 3], "kv_page_indices": torch.arange(1)}, "token_ids must be a 1-D int64 torch.Tensor, got list"),
        ({"token_ids": torch.arange(3), "kv_page_indices": [0]}, "kv_page_indices must be a 1-D int64 torch.Tensor, got list"),
    ]
    for kwargs, message in bad:
        s = SequenceInput(start=0, state_slot=0, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=message):
            asyncio.run(model.forward(ForwardBatch((s,)), kv, st))
    with pytest.raises(ConfigError, match="snapshots must be a mapping"):
        SequenceInput(token_ids=torch.arange(3), start=0, kv_page_indices=torch.arange(1), state_slot=0, snapshots=[(2, 1)])  # type: ignore[arg-type]


def test_loaded_model_computes_what_was_saved(tmp_path: Path) -> None:
    """The checks leave a faithful round trip alone."""
    src = HybridModel(SPEC, seed=3)
    path = tmp_path / "m.safetensors"
    src.save_safetensors(path)
    ids = _tokens()
    assert torch.equal(_logits(HybridModel.from_safetensors(SPEC, path), ids), _logits(src, ids))
