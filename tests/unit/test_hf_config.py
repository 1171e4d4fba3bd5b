"""HF config.json parsing for every supported family, from config dicts written here.

Configs named after a checkpoint carry that checkpoint's public values for the fields the cache
reads; configs named ``*_SHAPED`` follow the public architecture but some values (marked) were
not checked field by field, so their tests check the arithmetic against hand-computed sizes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from asynccache import HybridSpec, SpecError
from asynccache.hf_config import SUPPORTED_MODEL_TYPES

# Qwen/Qwen3-Next-80B-A3B-Instruct (config.json, the fields that matter).
QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
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
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}

# Qwen/Qwen3.5-35B-A3B: multimodal wrapper, the text model nested in text_config with an
# explicit layer_types list (3 Gated DeltaNet layers, then 1 full attention layer).
QWEN3_5_35B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "dtype": "bfloat16",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
    },
    "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 27},
}

# nvidia/Nemotron-H-8B-Base-8K. No head_dim field: attention_head_dim gives it.
NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_hidden_layers": 52,
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attention_head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "vocab_size": 131072,
    "torch_dtype": "bfloat16",
}

# ibm-ai-platform/Bamba-9B: attention named by index (layers 9, 18, 27 of 32). The mamba_*
# head geometry below is the family's usual 128 heads × 64 (8192 = 2 × 4096), n_groups=1.
BAMBA_9B_SHAPED: dict[str, Any] = {
    "model_type": "bamba",
    "num_hidden_layers": 32,
    "attn_layer_indices": [9, 18, 27],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}

# ibm-granite/granite-4.0-h-small: 40 layers, 36 Mamba2 + 4 attention in layer_types. The
# attention positions here are illustrative (one per ten layers).
_GRANITE_ATTN = (5, 15, 25, 35)
GRANITE_4_H_SMALL_SHAPED: dict[str, Any] = {
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 40,
    "layer_types": ["attention" if i in _GRANITE_ATTN else "mamba" for i in range(40)],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "position_embedding_type": "nope",
    "vocab_size": 100352,
    "torch_dtype": "bfloat16",
}

# tiiuae/Falcon-H1-0.5B: 36 layers each running attention and Mamba2 in parallel; 24 Mamba
# heads of 64 (mamba_d_ssm = 1536, not mamba_expand × hidden = 2048), d_state 128.
FALCON_H1_0_5B_SHAPED: dict[str, Any] = {
    "model_type": "falcon_h1",
    "num_hidden_layers": 36,
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_d_ssm": 1536,
    "mamba_n_heads": 24,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "torch_dtype": "bfloat16",
}

# ai21labs/Jamba-v0.1: attention every 8 layers from offset 4, Mamba1 elsewhere.
JAMBA_V0_1: dict[str, Any] = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "mamba_d_conv": 4,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "mamba_dt_rank": 256,
    "num_experts": 16,
    "vocab_size": 65536,
    "torch_dtype": "bfloat16",
}


def make_config(base: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg.update(overrides)
    return cfg


def without(base: dict[str, Any], key: str) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    del cfg[key]
    return cfg


def component(spec: HybridSpec, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    (comp,) = [c for c in spec.state_components if c.name == name]
    return comp.shape, comp.dtype


# ---- Qwen3-Next / Qwen3.5 ---------------------------------------------------------------


def test_qwen3_next_80b_layers_and_sizes() -> None:
    spec = HybridSpec.from_hf_config(QWEN3_NEXT_80B)
    assert spec.num_layers == 48
    assert spec.attention_layer_ids == tuple(range(3, 48, 4))
    assert spec.mamba_layer_ids == tuple(i for i in range(48) if i % 4 != 3)
    assert spec.num_mamba_layers == 36
    assert spec.linear is not None and spec.linear.kind == "gated_deltanet"
    # conv over q,k,v: 2·16·128 + 32·128 = 8192 channels, kernel 4 → 3 columns, bf16.
    assert component(spec, "conv") == ((8192, 3), torch.bfloat16)
    assert component(spec, "ssm") == ((32, 128, 128), torch.float32)
    assert spec.state_item_bytes == 32 * 128 * 128 * 4 + 3 * 8192 * 2 == 2_146_304
    assert spec.state_bytes == 77_266_944
    # 2 KV heads × 256 dims × 64 tokens × (K, V) × bf16
    assert spec.kv_item_bytes == 2 * 64 * 2 * 256 * 2 == 131_072
    assert spec.kv_page_bytes == 12 * 131_072
    assert spec.kv_dtype == torch.bfloat16
    assert (spec.hidden_size, spec.num_attention_heads, spec.vocab_size) == (2048, 16, 151936)


def test_qwen3_next_layer_types_agree_with_full_attention_interval() -> None:
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    cfg = make_config(without(QWEN3_NEXT_80B, "full_attention_interval"), layer_types=types)
    by_list = HybridSpec.from_hf_config(cfg)
    by_interval = HybridSpec.from_hf_config(QWEN3_NEXT_80B)
    assert by_list.attention_layer_ids == by_interval.attention_layer_ids
    assert by_list.mamba_layer_ids == by_interval.mamba_layer_ids
    assert by_list.state_bytes == by_interval.state_bytes


def test_qwen3_5_nested_text_config() -> None:
    spec = HybridSpec.from_hf_config(QWEN3_5_35B_A3B)
    assert spec.num_layers == 40
    assert spec.attention_layer_ids == tuple(range(3, 40, 4))
    assert spec.num_mamba_layers == 30
    assert spec.state_bytes == 30 * 2_146_304 == 64_389_120
    assert spec.kv_page_bytes == 10 * 131_072
    assert spec.kv_dtype == torch.bfloat16
    assert spec.model_id == "qwen3_5_moe_text"


def test_qwen3_5_dtype_given_only_on_the_wrapper_is_used() -> None:
    cfg = copy.deepcopy(QWEN3_5_35B_A3B)
    del cfg["text_config"]["dtype"]
    cfg["dtype"] = "float16"  # Transformers ≥ 4.56 writes "dtype", not "torch_dtype"
    spec = HybridSpec.from_hf_config(cfg)
    assert spec.kv_dtype == torch.float16
    assert component(spec, "conv")[1] == torch.float16
    assert component(spec, "ssm")[1] == torch.float32


def test_qwen3_5_text_config_without_model_type_takes_the_wrapper_type() -> None:
    cfg = copy.deepcopy(QWEN3_5_35B_A3B)
    del cfg["text_config"]["model_type"]
    spec = HybridSpec.from_hf_config(cfg)
    assert spec.model_id == "qwen3_5_moe"
    assert spec.num_mamba_layers == 30


def test_qwen_unknown_layer_types_entry_is_named() -> None:
    cfg = copy.deepcopy(QWEN3_5_35B_A3B)
    cfg["text_config"]["layer_types"][5] = "sliding_attention"
    with pytest.raises(SpecError, match="sliding_attention"):
        HybridSpec.from_hf_config(cfg)


def test_qwen_layer_types_of_wrong_length() -> None:
    cfg = copy.deepcopy(QWEN3_5_35B_A3B)
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:-1]
    with pytest.raises(SpecError, match="39 entries"):
        HybridSpec.from_hf_config(cfg)


def test_qwen_without_layer_types_or_interval() -> None:
    with pytest.raises(SpecError, match="full_attention_interval"):
        HybridSpec.from_hf_config(without(QWEN3_NEXT_80B, "full_attention_interval"))


@pytest.mark.parametrize(
    "field",
    [
        "num_hidden_layers",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_conv_kernel_dim",
        "num_attention_heads",
        "hidden_size",
    ],
)
def test_qwen_missing_field_is_named(field: str) -> None:
    with pytest.raises(SpecError, match=f"missing required field '{field}'"):
        HybridSpec.from_hf_config(without(QWEN3_NEXT_80B, field))


def test_non_integer_field_is_named() -> None:
    with pytest.raises(SpecError, match="'linear_num_value_heads'.*'many'"):
        HybridSpec.from_hf_config(make_config(QWEN3_NEXT_80B, linear_num_value_heads="many"))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"head_dim": float("inf")}, "'head_dim'"),  # json.loads takes Infinity
        ({"intermediate_size": "5120x"}, "'intermediate_size'"),
        ({"intermediate_size": [5120]}, "'intermediate_size'"),
        ({"vocab_size": {"a": 1}}, "'vocab_size'"),
        ({"model_type": ["qwen3_next"]}, "'model_type'"),
        ({"torch_dtype": "float64"}, "'torch_dtype'"),
        # counts and sizes must be positive (a negative one was taken as it was)
        ({"num_attention_heads": -16}, "'num_attention_heads' must be >= 1"),
        ({"hidden_size": -1}, "'hidden_size' must be >= 1"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be >= 1"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be >= 1"),
        ({"linear_num_value_heads": 0}, "'linear_num_value_heads' must be >= 1"),
        ({"linear_conv_kernel_dim": 1}, "'linear_conv_kernel_dim' must be >= 2"),
        # optional sizes may be 0 (absent, unknown), never negative
        ({"intermediate_size": -8}, "'intermediate_size' must be >= 0"),
        ({"vocab_size": -5}, "'vocab_size' must be >= 0"),
    ],
)
def test_malformed_values_are_spec_errors_naming_the_field(change: dict[str, Any], named: str) -> None:
    with pytest.raises(SpecError, match=named):
        HybridSpec.from_hf_config(make_config(QWEN3_NEXT_80B, **change))


@pytest.mark.parametrize(
    ("base", "change", "named"),
    [
        (QWEN3_NEXT_80B, {"num_key_value_heads": 3}, "num_attention_heads=16 is not a multiple of num_key_value_heads=3"),
        (QWEN3_NEXT_80B, {"num_key_value_heads": 32}, "num_attention_heads=16 is not a multiple of num_key_value_heads=32"),
        (QWEN3_NEXT_80B, {"linear_num_value_heads": 24}, "num_heads=24 value heads .* num_k_heads=16"),
        (QWEN3_NEXT_80B, {"linear_num_key_heads": 24}, "num_heads=32 value heads .* num_k_heads=24"),
        (NEMOTRON_H_8B, {"n_groups": 3}, "num_heads=128 SSM heads are not a multiple of n_groups=3"),
        (BAMBA_9B_SHAPED, {"mamba_n_groups": 3}, "num_heads=128 SSM heads are not a multiple of n_groups=3"),
        (JAMBA_V0_1, {"num_attention_heads": 12}, "num_attention_heads=12 is not a multiple of num_key_value_heads=8"),
    ],
)
def test_head_counts_no_model_has_are_refused_with_the_spec(
    base: dict[str, Any], change: dict[str, Any], named: str
) -> None:
    """A config.json whose heads do not group (query heads over KV heads, value heads over key
    heads, Mamba2 heads over groups) fails here, clearly, not later in the model."""
    with pytest.raises(SpecError, match=named):
        HybridSpec.from_hf_config(make_config(base, **change))


def test_the_heads_of_a_model_without_attention_layers_are_not_checked() -> None:
    """Its attention head counts are unused, so they are not checked."""
    cfg = make_config(GRANITE_4_H_SMALL_SHAPED, layer_types=["mamba"] * 40, num_key_value_heads=3)
    assert HybridSpec.from_hf_config(cfg).attention_layer_ids == ()


@pytest.mark.parametrize("tp", [2.0, "2", True])
def test_tp_size_must_be_an_int(tp: object) -> None:
    with pytest.raises(SpecError, match="tp_size must be an int"):
        HybridSpec.from_hf_config(QWEN3_NEXT_80B, tp_size=tp)  # type: ignore[arg-type]


# ---- Nemotron-H ---------------------------------------------------------------------------


def test_nemotron_h_8b_pattern_and_sizes() -> None:
    spec = HybridSpec.from_hf_config(NEMOTRON_H_8B)
    assert spec.num_layers == 52
    assert spec.attention_layer_ids == (7, 18, 29, 40)
    assert spec.mamba_layer_ids == (
        0, 2, 4, 6, 9, 11, 13, 15, 17, 20, 22, 24, 26, 28, 31, 33, 35, 37, 39, 42, 44, 46, 48, 50,
    )  # fmt: skip
    # MLP-only layers ('-') hold no cache at all.
    assert set(spec.cached_layer_ids).isdisjoint({1, 3, 5, 8, 51})
    assert spec.head_dim == 128  # from attention_head_dim
    # conv over x, B, C: 128·64 + 2·8·128 = 10240 channels
    assert component(spec, "conv") == ((10240, 3), torch.bfloat16)
    assert component(spec, "ssm") == ((128, 64, 128), torch.float32)
    assert spec.state_item_bytes == 10240 * 3 * 2 + 128 * 64 * 128 * 4 == 4_255_744
    assert spec.state_bytes == 24 * 4_255_744
    assert spec.kv_item_bytes == 2 * 64 * 8 * 128 * 2 == 262_144
    assert spec.kv_page_bytes == 4 * 262_144


def test_nemotron_h_tp8_shards_heads_and_groups() -> None:
    spec = HybridSpec.from_hf_config(NEMOTRON_H_8B, tp_size=8, tp_rank=7)
    assert spec.num_kv_heads == 1
    assert component(spec, "conv")[0] == (16 * 64 + 2 * 1 * 128, 3)
    assert component(spec, "ssm")[0] == (16, 64, 128)


def test_nemotron_h_groups_that_do_not_shard_raise() -> None:
    # 8 groups over 16 ranks: neither divisible nor a single replicated group.
    with pytest.raises(SpecError, match="n_groups=8.*tp_size=16"):
        HybridSpec.from_hf_config(NEMOTRON_H_8B, tp_size=16)


def test_nemotron_h_pattern_defines_the_layer_count() -> None:
    spec = HybridSpec.from_hf_config(without(NEMOTRON_H_8B, "num_hidden_layers"))
    assert spec.num_layers == 52


def test_nemotron_h_moe_pattern_symbols() -> None:
    cfg = make_config(NEMOTRON_H_8B, hybrid_override_pattern="MEMEM*EME", num_hidden_layers=9)
    spec = HybridSpec.from_hf_config(cfg)
    assert spec.attention_layer_ids == (5,)
    assert spec.mamba_layer_ids == (0, 2, 4, 7)
    assert spec.num_layers == 9


def test_nemotron_h_layer_types_list_of_newer_configs() -> None:
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    types = [kinds[c] for c in NEMOTRON_H_8B["hybrid_override_pattern"]]
    cfg = make_config(without(NEMOTRON_H_8B, "hybrid_override_pattern"), layer_types=types)
    assert HybridSpec.from_hf_config(cfg) == HybridSpec.from_hf_config(NEMOTRON_H_8B)


def test_nemotron_h_alias_field_names() -> None:
    cfg = without(without(NEMOTRON_H_8B, "n_groups"), "conv_kernel")
    cfg.update(mamba_n_groups=8, mamba_d_conv=4)
    assert HybridSpec.from_hf_config(cfg) == HybridSpec.from_hf_config(NEMOTRON_H_8B)


def test_nemotron_h_unknown_pattern_symbol_is_named() -> None:
    with pytest.raises(SpecError, match=r"\['X'\]"):
        HybridSpec.from_hf_config(make_config(NEMOTRON_H_8B, hybrid_override_pattern="M*X-"))


@pytest.mark.parametrize("field", ["mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"])
def test_nemotron_h_missing_field_is_named(field: str) -> None:
    with pytest.raises(SpecError, match=f"'{field}'"):
        HybridSpec.from_hf_config(without(NEMOTRON_H_8B, field))


def test_nemotron_h_without_any_layer_layout() -> None:
    with pytest.raises(SpecError, match="hybrid_override_pattern"):
        HybridSpec.from_hf_config(without(NEMOTRON_H_8B, "hybrid_override_pattern"))


# ---- Bamba / Granite-4.0-H ------------------------------------------------------------------


def test_bamba_attn_layer_indices() -> None:
    spec = HybridSpec.from_hf_config(BAMBA_9B_SHAPED)
    assert spec.attention_layer_ids == (9, 18, 27)
    assert spec.mamba_layer_ids == tuple(i for i in range(32) if i not in (9, 18, 27))
    assert spec.head_dim == 4096 // 32
    assert component(spec, "conv") == ((8192 + 2 * 128, 3), torch.bfloat16)
    assert component(spec, "ssm") == ((128, 64, 128), torch.float32)
    assert spec.state_item_bytes == 8448 * 3 * 2 + 128 * 64 * 128 * 4 == 4_244_992
    assert spec.state_bytes == 29 * 4_244_992
    assert spec.kv_page_bytes == 3 * 262_144


def test_bamba_single_group_is_replicated_on_every_rank() -> None:
    spec = HybridSpec.from_hf_config(BAMBA_9B_SHAPED, tp_size=4)
    # vLLM: n_groups 1 → 1 + (4 - 1) replicated groups, conv dim (8192 + 2·4·128) / 4 = 2304.
    assert component(spec, "conv")[0] == (2048 + 2 * 128, 3)
    assert component(spec, "ssm")[0] == (32, 64, 128)


def test_bamba_unsorted_attn_layer_indices_are_sorted() -> None:
    spec = HybridSpec.from_hf_config(make_config(BAMBA_9B_SHAPED, attn_layer_indices=[27, 9, 18]))
    assert spec.attention_layer_ids == (9, 18, 27)


def test_bamba_attn_layer_index_out_of_range() -> None:
    with pytest.raises(SpecError, match="attn_layer_indices"):
        HybridSpec.from_hf_config(make_config(BAMBA_9B_SHAPED, attn_layer_indices=[9, 32]))


def test_bamba_without_any_layer_layout_names_the_fields() -> None:
    with pytest.raises(SpecError, match="layer_types.*attn_layer_indices"):
        HybridSpec.from_hf_config(without(BAMBA_9B_SHAPED, "attn_layer_indices"))


def test_bamba_mamba_d_head_auto() -> None:
    auto = HybridSpec.from_hf_config(make_config(BAMBA_9B_SHAPED, mamba_d_head="auto"))
    assert auto == HybridSpec.from_hf_config(BAMBA_9B_SHAPED)


def test_bamba_d_head_inconsistent_with_inner_size() -> None:
    with pytest.raises(SpecError, match="mamba_d_head"):
        HybridSpec.from_hf_config(make_config(BAMBA_9B_SHAPED, mamba_d_head=32))


def test_granite_4_h_layer_types() -> None:
    spec = HybridSpec.from_hf_config(GRANITE_4_H_SMALL_SHAPED)
    assert spec.attention_layer_ids == _GRANITE_ATTN
    assert spec.num_mamba_layers == 36
    assert spec.state_bytes == 36 * 4_244_992
    assert spec.kv_page_bytes == 4 * 262_144


def test_granite_unknown_layer_type_is_named() -> None:
    types = list(GRANITE_4_H_SMALL_SHAPED["layer_types"])
    types[0] = "hybrid"
    with pytest.raises(SpecError, match="hybrid"):
        HybridSpec.from_hf_config(make_config(GRANITE_4_H_SMALL_SHAPED, layer_types=types))


def test_granite_layer_types_of_wrong_length() -> None:
    types = GRANITE_4_H_SMALL_SHAPED["layer_types"][:30]
    with pytest.raises(SpecError, match="30 entries"):
        HybridSpec.from_hf_config(make_config(GRANITE_4_H_SMALL_SHAPED, layer_types=types))


def test_granite_all_attention_variant_needs_no_state() -> None:
    cfg = make_config(GRANITE_4_H_SMALL_SHAPED, layer_types=["attention"] * 40)
    spec = HybridSpec.from_hf_config(cfg)
    assert spec.num_mamba_layers == 0
    assert spec.state_components == ()
    assert spec.state_bytes == 0
    assert spec.kv_page_bytes == 40 * 262_144


@pytest.mark.parametrize("field", ["mamba_n_heads", "mamba_d_state"])
def test_granite_missing_field_is_named(field: str) -> None:
    with pytest.raises(SpecError, match=f"'{field}'"):
        HybridSpec.from_hf_config(without(GRANITE_4_H_SMALL_SHAPED, field))


# ---- Falcon-H1 ------------------------------------------------------------------------------


def test_falcon_h1_every_layer_has_both() -> None:
    spec = HybridSpec.from_hf_config(FALCON_H1_0_5B_SHAPED)
    assert spec.attention_layer_ids == tuple(range(36))
    assert spec.mamba_layer_ids == tuple(range(36))
    assert spec.layer_kind(17) == (True, True)
    # inner size from mamba_d_ssm (1536), not mamba_expand × hidden_size (2048)
    assert component(spec, "conv") == ((1536 + 2 * 128, 3), torch.bfloat16)
    assert component(spec, "ssm") == ((24, 64, 128), torch.float32)
    assert spec.state_item_bytes == 1792 * 3 * 2 + 24 * 64 * 128 * 4 == 797_184
    assert spec.state_bytes == 36 * 797_184
    assert spec.kv_item_bytes == 2 * 64 * 2 * 64 * 2 == 32_768
    assert spec.kv_page_bytes == 36 * 32_768


def test_falcon_h1_d_head_auto_comes_from_mamba_d_ssm() -> None:
    spec = HybridSpec.from_hf_config(make_config(FALCON_H1_0_5B_SHAPED, mamba_d_head="auto"))
    assert component(spec, "ssm")[0] == (24, 64, 128)


def test_falcon_h1_inconsistent_mamba_d_ssm_is_named() -> None:
    with pytest.raises(SpecError, match="mamba_d_ssm=2048"):
        HybridSpec.from_hf_config(make_config(FALCON_H1_0_5B_SHAPED, mamba_d_ssm=2048))


def test_falcon_h1_without_mamba_d_ssm_uses_expand_times_hidden() -> None:
    cfg = without(make_config(FALCON_H1_0_5B_SHAPED, mamba_d_head="auto", mamba_n_heads=32), "mamba_d_ssm")
    spec = HybridSpec.from_hf_config(cfg)
    # 2 × 1024 = 2048 inner channels over 32 heads of 64
    assert component(spec, "ssm")[0] == (32, 64, 128)
    assert component(spec, "conv")[0] == (2048 + 2 * 128, 3)


def test_falcon_h1_heads_that_do_not_split_the_inner_size() -> None:
    cfg = without(make_config(FALCON_H1_0_5B_SHAPED, mamba_d_head="auto"), "mamba_d_ssm")
    with pytest.raises(SpecError, match="mamba_n_heads=24"):
        HybridSpec.from_hf_config(cfg)


def test_falcon_h1_tp2() -> None:
    spec = HybridSpec.from_hf_config(FALCON_H1_0_5B_SHAPED, tp_size=2)
    assert spec.num_kv_heads == 1
    assert component(spec, "conv")[0] == (12 * 64 + 2 * 128, 3)
    assert component(spec, "ssm")[0] == (12, 64, 128)


# ---- Jamba ----------------------------------------------------------------------------------


def test_jamba_period_and_offset() -> None:
    spec = HybridSpec.from_hf_config(JAMBA_V0_1)
    assert spec.attention_layer_ids == (4, 12, 20, 28)
    assert spec.num_mamba_layers == 28
    assert spec.linear is not None and spec.linear.kind == "mamba1"
    # Mamba1: d_inner = 2 × 4096
    assert component(spec, "conv") == ((8192, 3), torch.bfloat16)
    assert component(spec, "ssm") == ((8192, 16), torch.float32)
    assert spec.state_item_bytes == 8192 * 3 * 2 + 8192 * 16 * 4 == 573_440
    assert spec.state_bytes == 28 * 573_440
    assert spec.kv_page_bytes == 4 * 262_144


def test_jamba_layers_block_type_matches_period_and_offset() -> None:
    types = ["attention" if i % 8 == 4 else "mamba" for i in range(32)]
    cfg = make_config(without(without(JAMBA_V0_1, "attn_layer_period"), "attn_layer_offset"), layers_block_type=types)
    assert HybridSpec.from_hf_config(cfg) == HybridSpec.from_hf_config(JAMBA_V0_1)


def test_jamba_layers_block_type_unknown_entry_and_length() -> None:
    types = ["attention" if i % 8 == 4 else "mamba" for i in range(32)]
    with pytest.raises(SpecError, match="'expert'"):
        HybridSpec.from_hf_config(make_config(JAMBA_V0_1, layers_block_type=types[:-1] + ["expert"]))
    with pytest.raises(SpecError, match="31 entries"):
        HybridSpec.from_hf_config(make_config(JAMBA_V0_1, layers_block_type=types[:-1]))


def test_jamba_tp_shards_d_inner() -> None:
    spec = HybridSpec.from_hf_config(JAMBA_V0_1, tp_size=4)
    assert component(spec, "conv")[0] == (2048, 3)
    assert component(spec, "ssm")[0] == (2048, 16)
    assert spec.num_kv_heads == 2


def test_jamba_offset_outside_period() -> None:
    with pytest.raises(SpecError, match="attn_layer_offset"):
        HybridSpec.from_hf_config(make_config(JAMBA_V0_1, attn_layer_offset=8))


@pytest.mark.parametrize("field", ["attn_layer_period", "mamba_d_state", "mamba_d_conv"])
def test_jamba_missing_field_is_named(field: str) -> None:
    with pytest.raises(SpecError, match=f"'{field}'"):
        HybridSpec.from_hf_config(without(JAMBA_V0_1, field))


# ---- any family -----------------------------------------------------------------------------


def test_unknown_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(SpecError, match="'llama'") as info:
        HybridSpec.from_hf_config(make_config(QWEN3_NEXT_80B, model_type="llama"))
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(info.value)


def test_missing_model_type() -> None:
    with pytest.raises(SpecError, match="'model_type'"):
        HybridSpec.from_hf_config(without(QWEN3_NEXT_80B, "model_type"))


def test_supported_model_types_cover_the_families() -> None:
    families = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "jamba")
    for model_type in families:
        assert model_type in SUPPORTED_MODEL_TYPES


def test_num_key_value_heads_defaults_to_attention_heads() -> None:
    spec = HybridSpec.from_hf_config(without(JAMBA_V0_1, "num_key_value_heads"))
    assert spec.num_kv_heads == 32


def test_kv_dtype_override_leaves_state_dtypes() -> None:
    spec = HybridSpec.from_hf_config(NEMOTRON_H_8B, kv_dtype="fp8")
    assert spec.kv_dtype == torch.float8_e4m3fn
    assert spec.kv_item_bytes == 2 * 64 * 8 * 128
    assert component(spec, "conv")[1] == torch.bfloat16


def test_unknown_dtype_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="float64x"):
        HybridSpec.from_hf_config(make_config(QWEN3_NEXT_80B, torch_dtype="float64x"))


def test_config_dict_is_not_mutated() -> None:
    cfg = copy.deepcopy(NEMOTRON_H_8B)
    HybridSpec.from_hf_config(cfg, tp_size=2)
    assert cfg == NEMOTRON_H_8B
