"""Parse Hugging Face ``config.json`` dicts of hybrid models into a :class:`HybridSpec`.

Supported families and the fields read:

==================  ===========================================================================
qwen3_next, qwen3_5  ``layer_types`` ("linear_attention" / "full_attention") or
                    ``full_attention_interval``; ``linear_{num_key_heads,num_value_heads,
                    key_head_dim,value_head_dim,conv_kernel_dim}``. Qwen3.5 nests these in
                    ``text_config``.
nemotron_h          ``hybrid_override_pattern`` (M = Mamba2, * = attention, - = MLP, E = MoE);
                    ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``,
                    ``conv_kernel``.
bamba, granitemoehybrid  ``layer_types`` ("mamba" / "attention") or ``attn_layer_indices``;
                    ``mamba_{n_heads,d_head,d_state,n_groups,d_conv}``.
falcon_h1           every layer runs attention and Mamba2 in parallel; ``mamba_*`` as Bamba.
jamba               ``attn_layer_period`` / ``attn_layer_offset`` (or ``layers_block_type``);
                    Mamba1 ``mamba_{d_state,d_conv,expand}``.
==================  ===========================================================================

A missing field raises :class:`SpecError` naming it; an unknown ``model_type`` lists the known.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asynccache.errors import SpecError
from asynccache.spec import HybridSpec, LinearGeometry, StateComponent, dtype_from_name

__all__ = ["parse_hf_config", "SUPPORTED_MODEL_TYPES"]


def _req(cfg: dict[str, Any], key: str, model_type: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise SpecError(f"{model_type} config is missing required field {key!r}")
    return cfg[key]


def _qwen_next(cfg: dict[str, Any], mt: str) -> tuple[list[int], list[int], LinearGeometry]:
    n = int(_req(cfg, "num_hidden_layers", mt))
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise SpecError(f"layer_types has {len(types)} entries, num_hidden_layers={n}")
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown:
            raise SpecError(f"unknown layer_types entries {unknown} in {mt} config")
        attn = [i for i, t in enumerate(types) if t == "full_attention"]
    else:
        interval = int(_req(cfg, "full_attention_interval", mt))
        attn = [i for i in range(n) if (i + 1) % interval == 0]
    lin = [i for i in range(n) if i not in set(attn)]
    geo = LinearGeometry(
        kind="gated_deltanet",
        num_heads=int(_req(cfg, "linear_num_value_heads", mt)),
        head_dim=int(_req(cfg, "linear_value_head_dim", mt)),
        num_k_heads=int(_req(cfg, "linear_num_key_heads", mt)),
        head_k_dim=int(_req(cfg, "linear_key_head_dim", mt)),
        conv_kernel=int(_req(cfg, "linear_conv_kernel_dim", mt)),
    )
    return attn, lin, geo


def _mamba2_geo(cfg: dict[str, Any], mt: str, prefix: str) -> LinearGeometry:
    if prefix == "nemotron":
        return LinearGeometry(
            kind="mamba2",
            num_heads=int(_req(cfg, "mamba_num_heads", mt)),
            head_dim=int(_req(cfg, "mamba_head_dim", mt)),
            n_groups=int(_req(cfg, "n_groups", mt)),
            state_size=int(_req(cfg, "ssm_state_size", mt)),
            conv_kernel=int(_req(cfg, "conv_kernel", mt)),
        )
    return LinearGeometry(
        kind="mamba2",
        num_heads=int(_req(cfg, "mamba_n_heads", mt)),
        head_dim=int(_req(cfg, "mamba_d_head", mt)),
        n_groups=int(_req(cfg, "mamba_n_groups", mt)),
        state_size=int(_req(cfg, "mamba_d_state", mt)),
        conv_kernel=int(_req(cfg, "mamba_d_conv", mt)),
    )


def _nemotron_h(cfg: dict[str, Any], mt: str) -> tuple[list[int], list[int], LinearGeometry]:
    pattern = str(_req(cfg, "hybrid_override_pattern", mt))
    unknown = sorted(set(pattern) - set("M*-E"))
    if unknown:
        raise SpecError(f"unknown symbols {unknown} in hybrid_override_pattern (known: M * - E)")
    attn = [i for i, c in enumerate(pattern) if c == "*"]
    mamba = [i for i, c in enumerate(pattern) if c == "M"]
    return attn, mamba, _mamba2_geo(cfg, mt, "nemotron")


def _bamba(cfg: dict[str, Any], mt: str) -> tuple[list[int], list[int], LinearGeometry]:
    n = int(_req(cfg, "num_hidden_layers", mt))
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if types is not None:
        unknown = sorted(set(types) - {"mamba", "attention"})
        if unknown:
            raise SpecError(f"unknown layer types {unknown} in {mt} config")
        attn = [i for i, t in enumerate(types) if t == "attention"]
    else:
        attn = [int(i) for i in _req(cfg, "attn_layer_indices", mt)]
    mamba = [i for i in range(n) if i not in set(attn)]
    return attn, mamba, _mamba2_geo(cfg, mt, "bamba")


def _falcon_h1(cfg: dict[str, Any], mt: str) -> tuple[list[int], list[int], LinearGeometry]:
    n = int(_req(cfg, "num_hidden_layers", mt))
    return list(range(n)), list(range(n)), _mamba2_geo(cfg, mt, "bamba")


def _jamba(cfg: dict[str, Any], mt: str) -> tuple[list[int], list[int], LinearGeometry]:
    n = int(_req(cfg, "num_hidden_layers", mt))
    types = cfg.get("layers_block_type")
    if types is not None:
        attn = [i for i, t in enumerate(types) if t == "attention"]
    else:
        period = int(_req(cfg, "attn_layer_period", mt))
        offset = int(_req(cfg, "attn_layer_offset", mt))
        attn = [i for i in range(n) if i % period == offset]
    mamba = [i for i in range(n) if i not in set(attn)]
    hidden = int(_req(cfg, "hidden_size", mt))
    geo = LinearGeometry(
        kind="mamba1",
        num_heads=1,
        head_dim=int(cfg.get("mamba_expand", 2)) * hidden,
        state_size=int(_req(cfg, "mamba_d_state", mt)),
        conv_kernel=int(_req(cfg, "mamba_d_conv", mt)),
    )
    return attn, mamba, geo


_PARSERS: dict[str, Callable[[dict[str, Any], str], tuple[list[int], list[int], LinearGeometry]]] = {
    "qwen3_next": _qwen_next,
    "qwen3_5": _qwen_next,
    "qwen3_5_text": _qwen_next,
    "qwen3_5_moe": _qwen_next,
    "qwen3_5_moe_text": _qwen_next,
    "nemotron_h": _nemotron_h,
    "bamba": _bamba,
    "granitemoehybrid": _bamba,
    "falcon_h1": _falcon_h1,
    "jamba": _jamba,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_PARSERS))


def parse_hf_config(
    cfg: dict[str, Any],
    *,
    tp_size: int,
    tp_rank: int,
    page_size: int,
    ssm_dtype: torch.dtype,
    kv_dtype: torch.dtype | None,
    model_id: str | None,
) -> HybridSpec:
    if tp_size <= 0:
        raise SpecError(f"tp_size must be positive, got {tp_size}")
    outer_type = cfg.get("model_type")
    if isinstance(cfg.get("text_config"), dict):  # Qwen3.5 and other multimodal wrappers
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", outer_type)
        inner.setdefault("torch_dtype", cfg.get("torch_dtype"))
        cfg = inner
    mt = cfg.get("model_type")
    if mt is None:
        raise SpecError("config is missing required field 'model_type'")
    parser = _PARSERS.get(mt)
    if parser is None:
        raise SpecError(f"unsupported model_type {mt!r}; supported: {list(SUPPORTED_MODEL_TYPES)}")
    attn, mamba, geo = parser(cfg, mt)

    num_layers = int(cfg.get("num_hidden_layers") or len(cfg.get("hybrid_override_pattern", "")))
    num_heads = int(_req(cfg, "num_attention_heads", mt))
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    hidden = int(_req(cfg, "hidden_size", mt))
    head_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // num_heads)
    model_dtype = dtype_from_name(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    kv_dtype = kv_dtype or model_dtype
    kv_heads = num_kv_heads // tp_size if num_kv_heads % tp_size == 0 else None
    if kv_heads is None:
        raise SpecError(f"num_key_value_heads={num_kv_heads} is not divisible by tp_size={tp_size}")

    components = (
        StateComponent(name="conv", shape=(geo.conv_dim(tp_size), geo.conv_kernel - 1), dtype=model_dtype),
        StateComponent(name="ssm", shape=geo.ssm_shape(tp_size), dtype=ssm_dtype),
    )
    return HybridSpec(
        model_id=model_id or str(cfg.get("_name_or_path") or mt),
        num_layers=num_layers,
        attention_layer_ids=tuple(attn),
        mamba_layer_ids=tuple(mamba),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        page_size=page_size,
        state_components=components,
        linear=geo,
        tp_size=tp_size,
        tp_rank=tp_rank,
        hidden_size=hidden,
        num_attention_heads=num_heads,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        vocab_size=int(cfg.get("vocab_size") or 0),
    )
