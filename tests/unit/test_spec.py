"""HybridSpec: derived sizes, TP sharding, validation, identity, loading from files, presets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asynccache import HybridSpec, LinearGeometry, SpecError, StateComponent
from asynccache.spec import PRESETS, STATE_ALIGN_BYTES, dtype_from_name, shard_kv_heads

# Qwen/Qwen3-Next-80B-A3B-Instruct (config.json, the fields the cache reads).
QWEN3_NEXT_80B: dict[str, Any] = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}

QWEN3_NEXT_80B_STATE_BYTES = 77_266_944  # 36 × (32·128·128·4 + 3·8192·2)


def make_spec(**overrides: Any) -> HybridSpec:
    """A small hand-built spec: 4 layers, attention on 1 and 3, recurrent on 0 and 2."""
    fields: dict[str, Any] = {
        "model_id": "toy",
        "num_layers": 4,
        "attention_layer_ids": (1, 3),
        "mamba_layer_ids": (0, 2),
        "num_kv_heads": 2,
        "head_dim": 8,
        "kv_dtype": torch.float16,
        "page_size": 4,
        "state_components": (
            StateComponent(name="conv", shape=(5, 3), dtype=torch.bfloat16),  # 30 bytes
            StateComponent(name="ssm", shape=(2, 3, 4), dtype=torch.float32),  # 96 bytes
        ),
    }
    fields.update(overrides)
    return HybridSpec(**fields)


# ---- derived sizes ----------------------------------------------------------------------------


def test_kv_sizes_of_a_hand_built_spec() -> None:
    spec = make_spec()
    assert spec.kv_item_bytes == 2 * 4 * 2 * 8 * 2  # (K,V) × page × heads × dim × fp16
    assert spec.kv_page_bytes == 2 * spec.kv_item_bytes
    assert spec.kv_bytes_per_token == spec.kv_page_bytes // 4
    assert spec.num_attention_layers == 2


def test_state_components_are_aligned() -> None:
    spec = make_spec()
    conv, ssm = spec.state_components
    assert (conv.numel, conv.size_bytes) == (15, 30)
    assert (ssm.numel, ssm.size_bytes) == (24, 96)
    # conv at 0 (30 bytes, padded to 32), ssm at 32 (96 bytes) → 128
    assert spec.state_component_offsets == (0, 32)
    assert spec.state_item_bytes == 128
    assert spec.state_bytes == 2 * 128
    assert all(off % STATE_ALIGN_BYTES == 0 for off in spec.state_component_offsets)


def test_state_item_bytes_pads_the_last_component() -> None:
    spec = make_spec(state_components=(StateComponent(name="only", shape=(3,), dtype=torch.bfloat16),))
    assert spec.state_component_offsets == (0,)
    assert spec.state_item_bytes == 16


def test_qwen3_next_80b_state_bytes_at_tp1() -> None:
    spec = HybridSpec.from_hf_config(QWEN3_NEXT_80B)
    assert spec.state_bytes == QWEN3_NEXT_80B_STATE_BYTES
    assert spec.state_item_bytes == QWEN3_NEXT_80B_STATE_BYTES // 36
    assert spec.kv_item_bytes == 131_072
    assert spec.kv_page_bytes == 12 * 131_072
    assert spec.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2


@pytest.mark.parametrize("tp_size", [2, 4, 8, 16])
def test_qwen3_next_80b_state_shards_evenly(tp_size: int) -> None:
    spec = HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=tp_size)
    assert spec.state_bytes * tp_size == QWEN3_NEXT_80B_STATE_BYTES
    assert spec.state_components[0].shape == (8192 // tp_size, 3)
    assert spec.state_components[1].shape == (32 // tp_size, 128, 128)


def test_qwen3_next_80b_kv_heads_shard_then_replicate() -> None:
    # 2 KV heads: tp=2 gives one each; tp=4 replicates one head on every rank (as vLLM does).
    assert HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=2).num_kv_heads == 1
    tp4 = HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=4)
    assert tp4.num_kv_heads == 1
    assert tp4.kv_item_bytes == 131_072 // 2


def test_page_size_scales_kv_but_not_state() -> None:
    spec = HybridSpec.from_hf_config(QWEN3_NEXT_80B, page_size=16)
    assert spec.page_size == 16
    assert spec.kv_item_bytes == 131_072 // 4
    assert spec.kv_bytes_per_token == HybridSpec.from_hf_config(QWEN3_NEXT_80B).kv_bytes_per_token
    assert spec.state_bytes == QWEN3_NEXT_80B_STATE_BYTES


# ---- TP errors ----------------------------------------------------------------------------------


def test_non_dividing_kv_heads_name_tp_size() -> None:
    with pytest.raises(SpecError, match="num_key_value_heads=2.*tp_size=3"):
        HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=3)


def test_non_dividing_linear_heads_name_tp_size() -> None:
    # 2 KV heads replicate over 32 ranks, but 16 key heads do not split over 32.
    with pytest.raises(SpecError, match="linear_num_key_heads=16.*tp_size=32"):
        HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=32)


@pytest.mark.parametrize("tp_size", [0, -2])
def test_non_positive_tp_size(tp_size: int) -> None:
    with pytest.raises(SpecError, match="tp_size"):
        HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=tp_size)


def test_tp_rank_outside_tp_size() -> None:
    with pytest.raises(SpecError, match="tp_rank=2"):
        HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=2, tp_rank=2)


@pytest.mark.parametrize(
    ("num_kv_heads", "tp_size", "expected"),
    [(8, 1, 8), (8, 2, 4), (8, 8, 1), (8, 16, 1), (2, 4, 1), (1, 8, 1)],
)
def test_shard_kv_heads(num_kv_heads: int, tp_size: int, expected: int) -> None:
    assert shard_kv_heads(num_kv_heads, tp_size) == expected


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), [(8, 3), (6, 4), (4, 6)])
def test_shard_kv_heads_rejects(num_kv_heads: int, tp_size: int) -> None:
    with pytest.raises(SpecError, match=f"tp_size={tp_size}"):
        shard_kv_heads(num_kv_heads, tp_size)


# ---- LinearGeometry ------------------------------------------------------------------------------


def make_mamba2(n_groups: int, num_heads: int = 8) -> LinearGeometry:
    return LinearGeometry(kind="mamba2", num_heads=num_heads, head_dim=16, n_groups=n_groups, state_size=32)


def test_mamba2_groups_shard_when_divisible() -> None:
    geo = make_mamba2(n_groups=4)
    assert geo.groups_per_rank(1) == 4
    assert geo.groups_per_rank(2) == 2
    assert geo.conv_dim(2) == 4 * 16 + 2 * 2 * 32
    assert geo.ssm_shape(2) == (4, 16, 32)


def test_mamba2_single_group_is_replicated() -> None:
    geo = make_mamba2(n_groups=1)
    for tp in (1, 2, 4, 8):
        assert geo.groups_per_rank(tp) == 1
        assert geo.conv_dim(tp) == 8 // tp * 16 + 2 * 32


@pytest.mark.parametrize(("n_groups", "tp_size"), [(2, 4), (3, 2), (8, 16)])
def test_mamba2_groups_that_neither_shard_nor_replicate(n_groups: int, tp_size: int) -> None:
    geo = make_mamba2(n_groups=n_groups, num_heads=48)
    with pytest.raises(SpecError, match=f"n_groups={n_groups}.*tp_size={tp_size}"):
        geo.conv_dim(tp_size)


def test_mamba2_heads_that_do_not_shard() -> None:
    with pytest.raises(SpecError, match="mamba_num_heads=8.*tp_size=3"):
        make_mamba2(n_groups=1).ssm_shape(3)


def test_gated_deltanet_geometry() -> None:
    geo = LinearGeometry(kind="gated_deltanet", num_heads=32, head_dim=128, num_k_heads=16, head_k_dim=128)
    assert geo.conv_dim() == 2 * 16 * 128 + 32 * 128
    assert geo.ssm_shape() == (32, 128, 128)
    assert geo.conv_dim(4) == geo.conv_dim() // 4
    with pytest.raises(SpecError, match="linear_num_key_heads=16.*tp_size=32"):
        geo.conv_dim(32)


def test_mamba1_geometry() -> None:
    geo = LinearGeometry(kind="mamba1", num_heads=1, head_dim=8192, state_size=16)
    assert geo.conv_dim(2) == 4096
    assert geo.ssm_shape(2) == (4096, 16)
    with pytest.raises(SpecError, match="tp_size=3"):
        geo.ssm_shape(3)


def test_linear_geometry_validation() -> None:
    with pytest.raises(SpecError, match="rwkv"):
        LinearGeometry(kind="rwkv", num_heads=1, head_dim=1)
    with pytest.raises(SpecError, match="conv_kernel"):
        LinearGeometry(kind="mamba1", num_heads=1, head_dim=8, state_size=4, conv_kernel=1)
    with pytest.raises(SpecError, match="n_groups"):
        make_mamba2(n_groups=0)
    with pytest.raises(SpecError, match="num_k_heads"):
        LinearGeometry(kind="gated_deltanet", num_heads=4, head_dim=8)


# ---- dtypes --------------------------------------------------------------------------------------


def test_ssm_dtype_override() -> None:
    spec = HybridSpec.from_hf_config(QWEN3_NEXT_80B, ssm_dtype="bfloat16")
    conv, ssm = spec.state_components
    assert ssm.dtype == torch.bfloat16
    assert conv.dtype == torch.bfloat16
    assert spec.state_bytes == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 2)
    assert spec.state_bytes < QWEN3_NEXT_80B_STATE_BYTES


def test_ssm_dtype_accepts_torch_dtypes() -> None:
    by_name = HybridSpec.from_hf_config(QWEN3_NEXT_80B, ssm_dtype="fp16")
    by_dtype = HybridSpec.from_hf_config(QWEN3_NEXT_80B, ssm_dtype=torch.float16)
    assert by_name == by_dtype


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), ("FP32", torch.float32), (torch.int8, torch.int8)],
)
def test_dtype_from_name(name: str | torch.dtype, dtype: torch.dtype) -> None:
    assert dtype_from_name(name) is dtype


def test_dtype_from_name_unknown() -> None:
    with pytest.raises(SpecError, match="complex32"):
        dtype_from_name("complex32")


# ---- validation of hand-built specs --------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"page_size": 0}, "page_size"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"attention_layer_ids": (3, 1)}, "strictly increasing"),
        ({"mamba_layer_ids": (0, 0)}, "strictly increasing"),
        ({"attention_layer_ids": (1, 4)}, "outside num_layers"),
        ({"attention_layer_ids": (), "mamba_layer_ids": ()}, "at least one"),
        ({"state_components": ()}, "state_components"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"num_kv_heads": True}, "num_kv_heads must be an int"),
        ({"head_dim": 2.5}, "head_dim must be an int"),
        ({"kv_dtype": "bfloat16"}, "kv_dtype must be a torch.dtype"),
        ({"state_components": (StateComponent(name="ssm", shape=(-4, 3), dtype=torch.float32),)}, "positive ints"),
        ({"state_components": (StateComponent(name="ssm", shape=(4,), dtype="float32"),)}, "torch.dtype"),
    ],
)
def test_invalid_specs_are_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        make_spec(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 3}, r"num_attention_heads=3 is not a multiple of num_kv_heads=2:"),
        ({"num_attention_heads": 1}, r"num_attention_heads=1 is not a multiple of num_kv_heads=2:"),
        # 8 query heads over 2 ranks of 2 KV heads each (4 KV heads in all): 2 per KV head, fine;
        # 6 give each rank 3 query heads for 2 KV heads
        ({"num_attention_heads": 6, "tp_size": 2}, r"num_kv_heads=2 \(per rank\) × tp_size=2"),
        # one replicated KV head per rank: 6 query heads do not split over 4 ranks
        ({"num_attention_heads": 6, "num_kv_heads": 1, "tp_size": 4}, r"num_attention_heads=6 .* tp_size=4"),
    ],
)
def test_query_heads_that_do_not_group_over_the_kv_heads_are_refused(overrides: dict[str, Any], message: str) -> None:
    """What the reference model refused when built (query heads not a multiple of the KV
    heads) is refused with the spec, and so are query heads that do not split over TP ranks."""
    with pytest.raises(SpecError, match=message):
        make_spec(**overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_attention_heads": 0},  # unknown: nothing to check
        {"num_attention_heads": 2},
        {"num_attention_heads": 8, "tp_size": 2},
        {"num_attention_heads": 8, "num_kv_heads": 1, "tp_size": 8},  # a replicated KV head
        {"num_attention_heads": 3, "attention_layer_ids": ()},  # no attention layers: unused
    ],
)
def test_query_heads_in_whole_groups_are_taken(overrides: dict[str, Any]) -> None:
    make_spec(**overrides)


@pytest.mark.parametrize(
    ("geometry", "message"),
    [
        ({"kind": "gated_deltanet", "num_heads": 3, "head_dim": 8, "num_k_heads": 2, "head_k_dim": 8},
         r"num_heads=3 value heads .* not a multiple of num_k_heads=2"),
        ({"kind": "gated_deltanet", "num_heads": 16, "head_dim": 8, "num_k_heads": 32, "head_k_dim": 8},
         r"num_heads=16 value heads .* not a multiple of num_k_heads=32"),
        ({"kind": "mamba2", "num_heads": 8, "head_dim": 16, "n_groups": 3, "state_size": 32},
         r"num_heads=8 SSM heads are not a multiple of n_groups=3"),
        ({"kind": "mamba2", "num_heads": 8.0, "head_dim": 16, "n_groups": 1, "state_size": 32},
         r"num_heads must be an int, got 8.0"),
        ({"kind": "mamba1", "num_heads": 1, "head_dim": True, "state_size": 16}, r"head_dim must be an int"),
    ],
)  # fmt: skip
def test_recurrent_heads_no_model_has_are_refused(geometry: dict[str, Any], message: str) -> None:
    """Gated DeltaNet value heads come in whole groups per key head, Mamba2 heads per B/C group
    (the reference model refused the former only when built; a float reached the shapes)."""
    with pytest.raises(SpecError, match=message):
        LinearGeometry(**geometry)


def test_spec_is_frozen_and_hashable() -> None:
    spec = make_spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.page_size = 8  # type: ignore[misc]
    assert hash(spec) == hash(make_spec())
    assert {spec, make_spec()} == {spec}


def test_layer_kind_and_cached_layers() -> None:
    spec = make_spec(num_layers=6)
    assert spec.layer_kind(0) == (False, True)
    assert spec.layer_kind(1) == (True, False)
    assert spec.layer_kind(5) == (False, False)
    assert spec.cached_layer_ids == (0, 1, 2, 3)


# ---- identity ------------------------------------------------------------------------------------


def test_namespace_id_is_stable_for_equal_specs() -> None:
    a = HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=2, tp_rank=1)
    b = HybridSpec.from_hf_config(dict(QWEN3_NEXT_80B), tp_size=2, tp_rank=1)
    assert a.namespace_id == b.namespace_id


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp_size": 2, "tp_rank": 1},
        {"tp_size": 2, "tp_rank": 0},
        {"page_size": 32},
        {"model_id": "another-model"},
        {"ssm_dtype": "bfloat16"},
        {"kv_dtype": "fp8"},
    ],
)
def test_namespace_id_differs(kwargs: dict[str, Any]) -> None:
    base = HybridSpec.from_hf_config(QWEN3_NEXT_80B)
    other = HybridSpec.from_hf_config(QWEN3_NEXT_80B, **kwargs)
    assert other.namespace_id != base.namespace_id


def test_namespace_id_differs_between_tp_ranks() -> None:
    ids = {HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=4, tp_rank=r).namespace_id for r in range(4)}
    assert len(ids) == 4


# ---- loading from files ----------------------------------------------------------------------------


def test_from_hf_config_reads_a_config_json_path(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_NEXT_80B))
    spec = HybridSpec.from_hf_config(path)
    assert spec.state_bytes == QWEN3_NEXT_80B_STATE_BYTES
    assert spec == HybridSpec.from_hf_config(str(path))


def test_from_hf_config_reads_a_model_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B))
    spec = HybridSpec.from_hf_config(tmp_path, tp_size=2, model_id="Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert spec.state_bytes == QWEN3_NEXT_80B_STATE_BYTES // 2
    assert spec.model_id == "Qwen/Qwen3-Next-80B-A3B-Instruct"


def test_from_hf_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read HF config"):
        HybridSpec.from_hf_config(tmp_path / "nope.json")
    with pytest.raises(SpecError, match="config.json"):
        HybridSpec.from_hf_config(tmp_path)  # a folder without config.json


def test_from_hf_config_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(SpecError, match="cannot read HF config"):
        HybridSpec.from_hf_config(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"[1, 2, 3]", "not a JSON object but an array"),
        (b'"qwen3_next"', "not a JSON object but a string"),
        (b"null", "not a JSON object but null"),
        (b"7", "not a JSON object but a number"),
        (b"\xff\xfe\x00{}", "cannot read HF config.*utf-8"),
    ],
)
def test_from_hf_config_a_file_that_is_no_json_object(tmp_path: Path, content: bytes, match: str) -> None:
    """Each was an untyped TypeError, ValueError or UnicodeDecodeError."""
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=match):
        HybridSpec.from_hf_config(path)


def test_model_id_defaults_to_name_or_path() -> None:
    cfg = dict(QWEN3_NEXT_80B, _name_or_path="Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert HybridSpec.from_hf_config(cfg).model_id == "Qwen/Qwen3-Next-80B-A3B-Instruct"
    assert HybridSpec.from_hf_config(QWEN3_NEXT_80B).model_id == "qwen3_next"


def test_checkpoints_in_two_folders_with_one_config_never_share_a_namespace(tmp_path: Path) -> None:
    """A base model and its fine-tune often carry the same config.json (the fine-tune's
    ``_name_or_path`` the base's): their stored KV and states must not be served to each other.
    An explicit ``model_id`` shares storage on purpose."""
    cfg = json.dumps(dict(QWEN3_NEXT_80B, _name_or_path="Qwen/Qwen3-Next-80B-A3B-Instruct"))
    folders = [tmp_path / "base", tmp_path / "finetune"]
    for folder in folders:
        folder.mkdir()
        (folder / "config.json").write_text(cfg)
    base, tuned = (HybridSpec.from_hf_config(f) for f in folders)
    assert base.namespace_id != tuned.namespace_id
    assert base.model_id == f"Qwen/Qwen3-Next-80B-A3B-Instruct@{folders[0].resolve()}"
    assert base == HybridSpec.from_hf_config(folders[0] / "config.json")  # the same checkpoint
    shared = [HybridSpec.from_hf_config(f, model_id="qwen3-next-instruct") for f in folders]
    assert shared[0].namespace_id == shared[1].namespace_id


# ---- presets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name: str) -> None:
    spec = HybridSpec.preset(name)
    assert spec.model_id == name
    assert spec.num_mamba_layers > 0 and spec.num_attention_layers > 0
    assert spec.state_bytes == spec.state_item_bytes * spec.num_mamba_layers


def test_qwen3_next_preset_matches_the_public_config() -> None:
    preset = HybridSpec.preset("qwen3-next-80b", tp_size=2)
    from_config = HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=2, model_id="qwen3-next-80b")
    assert preset == from_config
    assert HybridSpec.preset("qwen3-next-80b").state_bytes == QWEN3_NEXT_80B_STATE_BYTES


def test_tiny_preset_is_small_and_fp32() -> None:
    spec = HybridSpec.preset("tiny", page_size=4)
    assert spec.kv_dtype == torch.float32
    assert spec.attention_layer_ids == (1, 3)
    assert spec.mamba_layer_ids == (0, 2)
    assert spec.kv_item_bytes == 2 * 4 * 2 * 16 * 4


def test_unknown_preset_lists_the_known() -> None:
    with pytest.raises(SpecError, match="qwen3-next-80b"):
        HybridSpec.preset("gpt-5")
