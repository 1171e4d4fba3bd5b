"""Parse Hugging Face ``config.json`` dicts of hybrid models into a :class:`HybridSpec`.

Supported families and the fields read:

==================  ===========================================================================
qwen3_next, qwen3_5  ``layer_types`` ("linear_attention" / "full_attention") or
                    ``full_attention_interval``; ``linear_{num_key_heads,num_value_heads,
                    key_head_dim,value_head_dim,conv_kernel_dim}``. Qwen3.5 nests these in
                    ``text_config``.
nemotron_h          ``hybrid_override_pattern`` (M = Mamba2, * = attention, - = MLP, E = MoE) or
                    the list ``layer_types`` / ``layers_block_type`` of newer configs;
                    ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``
                    (or ``mamba_n_groups``), ``conv_kernel`` (or ``mamba_d_conv``).
bamba, granitemoehybrid  ``layer_types`` ("mamba" / "attention") or ``attn_layer_indices``;
                    ``mamba_{n_heads,d_head,d_state,n_groups,d_conv}``.
falcon_h1           every layer runs attention and Mamba2 in parallel; ``mamba_*`` as Bamba,
                    with ``mamba_d_ssm`` as the Mamba inner size when present.
jamba               ``attn_layer_period`` / ``attn_layer_offset`` (or ``layers_block_type``);
                    Mamba1 ``mamba_{d_state,d_conv,expand}``.
==================  ===========================================================================

Mamba2 inner size is ``mamba_d_ssm`` when given, else ``mamba_expand · hidden_size``;
``mamba_d_head`` may be ``"auto"`` (inner size / heads), as in the Transformers configs, and must
otherwise satisfy ``mamba_d_head · mamba_n_heads == inner size``.

A missing or malformed field raises :class:`SpecError` naming it; an unknown ``model_type``
lists the known ones; unknown layer-type entries are named. Head counts no model has are refused
too: query heads that are not a multiple of the KV heads, Gated DeltaNet value heads that are
not a multiple of its key heads, Mamba2 heads that are not a multiple of its groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from asynccache.errors import SpecError
from asynccache.spec import (
    HybridSpec,
    LinearGeometry,
    StateComponent,
    dtype_from_name,
    shard_kv_heads,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "parse_hf_config"]

#: (number of layers, attention layer ids, recurrent layer ids, recurrent geometry)
_Parsed = tuple[int, list[int], list[int], LinearGeometry]


def _req(cfg: dict[str, Any], key: str, model_type: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise SpecError(f"{model_type} config is missing required field {key!r}")
    return cfg[key]


def _as_int(value: Any, key: str, model_type: str, minimum: int | None = None) -> int:
    if isinstance(value, bool):
        raise SpecError(f"{model_type} config field {key!r} must be an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError):
        raise SpecError(f"{model_type} config field {key!r} must be an integer, got {value!r}") from None
    if out != value and not isinstance(value, str):
        raise SpecError(f"{model_type} config field {key!r} must be an integer, got {value!r}")
    if minimum is not None and out < minimum:
        raise SpecError(f"{model_type} config field {key!r} must be >= {minimum}, got {out}")
    return out


def _req_int(cfg: dict[str, Any], key: str, model_type: str, minimum: int = 1) -> int:
    """A required integer field, at least ``minimum`` (counts and sizes are positive)."""
    return _as_int(_req(cfg, key, model_type), key, model_type, minimum)


def _first_int(
    cfg: dict[str, Any], keys: Sequence[str], model_type: str, default: int | None = None, minimum: int = 1
) -> int:
    """The first of ``keys`` present (aliases of one field), else ``default``, else an error."""
    for key in keys:
        if cfg.get(key) is not None:
            return _as_int(cfg[key], key, model_type, minimum)
    if default is not None:
        return default
    raise SpecError(f"{model_type} config is missing required field {keys[0]!r}")


def _layer_list(types: Any, field: str, known: set[str], model_type: str, num_layers: int | None) -> list[str]:
    if not isinstance(types, (list, tuple)):
        raise SpecError(f"{model_type} config field {field!r} must be a list, got {type(types).__name__}")
    if num_layers is not None and len(types) != num_layers:
        raise SpecError(f"{field} has {len(types)} entries, num_hidden_layers={num_layers}")
    unknown = sorted({str(t) for t in types} - known)
    if unknown:
        raise SpecError(f"unknown {field} entries {unknown} in {model_type} config (known: {sorted(known)})")
    return [str(t) for t in types]


def _qwen_next(cfg: dict[str, Any], mt: str) -> _Parsed:
    n = _req_int(cfg, "num_hidden_layers", mt)
    types = cfg.get("layer_types")
    if types is not None:
        kinds = _layer_list(types, "layer_types", {"linear_attention", "full_attention"}, mt, n)
        attn = [i for i, t in enumerate(kinds) if t == "full_attention"]
    else:
        if cfg.get("full_attention_interval") is None:
            raise SpecError(f"{mt} config is missing required field 'layer_types' or 'full_attention_interval'")
        interval = _req_int(cfg, "full_attention_interval", mt)
        if interval <= 0:
            raise SpecError(f"full_attention_interval must be positive, got {interval}")
        attn = [i for i in range(n) if (i + 1) % interval == 0]
    attn_set = set(attn)
    lin = [i for i in range(n) if i not in attn_set]
    geo = LinearGeometry(
        kind="gated_deltanet",
        num_heads=_req_int(cfg, "linear_num_value_heads", mt),
        head_dim=_req_int(cfg, "linear_value_head_dim", mt),
        num_k_heads=_req_int(cfg, "linear_num_key_heads", mt),
        head_k_dim=_req_int(cfg, "linear_key_head_dim", mt),
        conv_kernel=_req_int(cfg, "linear_conv_kernel_dim", mt, minimum=2),
    )
    return n, attn, lin, geo


def _nemotron_geo(cfg: dict[str, Any], mt: str) -> LinearGeometry:
    # Nemotron-H's mixer: inner size = mamba_num_heads · mamba_head_dim.
    return LinearGeometry(
        kind="mamba2",
        num_heads=_req_int(cfg, "mamba_num_heads", mt),
        head_dim=_req_int(cfg, "mamba_head_dim", mt),
        n_groups=_first_int(cfg, ("n_groups", "mamba_n_groups"), mt),
        state_size=_req_int(cfg, "ssm_state_size", mt),
        conv_kernel=_first_int(cfg, ("conv_kernel", "mamba_d_conv"), mt, minimum=2),
    )


def _mamba2_geo(cfg: dict[str, Any], mt: str) -> LinearGeometry:
    """Bamba / Granite-4.0-H / Falcon-H1 ``mamba_*`` fields."""
    n_heads = _req_int(cfg, "mamba_n_heads", mt)
    if n_heads <= 0:
        raise SpecError(f"mamba_n_heads must be positive, got {n_heads}")
    if cfg.get("mamba_d_ssm") is not None:
        inner_field, inner = "mamba_d_ssm", _as_int(cfg["mamba_d_ssm"], "mamba_d_ssm", mt, 1)
    else:
        expand = _first_int(cfg, ("mamba_expand",), mt, default=2)
        inner_field, inner = "mamba_expand * hidden_size", expand * _req_int(cfg, "hidden_size", mt)
    d_head_raw = cfg.get("mamba_d_head", "auto")
    if d_head_raw is None or d_head_raw == "auto":
        if inner % n_heads:
            raise SpecError(f"mamba_n_heads={n_heads} does not divide the Mamba inner size {inner_field}={inner}")
        d_head = inner // n_heads
    else:
        d_head = _as_int(d_head_raw, "mamba_d_head", mt, 1)
        if d_head * n_heads != inner:
            raise SpecError(
                f"mamba_d_head={d_head} × mamba_n_heads={n_heads} does not match the Mamba inner size "
                f"{inner_field}={inner}"
            )
    return LinearGeometry(
        kind="mamba2",
        num_heads=n_heads,
        head_dim=d_head,
        n_groups=_first_int(cfg, ("mamba_n_groups",), mt, default=1),
        state_size=_req_int(cfg, "mamba_d_state", mt),
        conv_kernel=_first_int(cfg, ("mamba_d_conv",), mt, default=4, minimum=2),
    )


_NEMOTRON_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# Newer Transformers write layer_types with these names; older lists used the legacy ones.
_NEMOTRON_TYPES = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def _nemotron_h(cfg: dict[str, Any], mt: str) -> _Parsed:
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        unknown = sorted(set(str(pattern)) - set(_NEMOTRON_SYMBOLS))
        if unknown:
            raise SpecError(f"unknown symbols {unknown} in hybrid_override_pattern (known: M * - E)")
        kinds = [_NEMOTRON_SYMBOLS[c] for c in str(pattern)]
    else:
        field = "layer_types" if cfg.get("layer_types") is not None else "layers_block_type"
        if cfg.get(field) is None:
            raise SpecError(f"{mt} config is missing required field 'hybrid_override_pattern' (or 'layer_types')")
        kinds = [_NEMOTRON_TYPES[t] for t in _layer_list(cfg[field], field, set(_NEMOTRON_TYPES), mt, None)]
    attn = [i for i, k in enumerate(kinds) if k == "attention"]
    mamba = [i for i, k in enumerate(kinds) if k == "mamba"]
    # The pattern defines the layer count (Transformers treats num_hidden_layers as deprecated here).
    return len(kinds), attn, mamba, _nemotron_geo(cfg, mt)


def _bamba(cfg: dict[str, Any], mt: str) -> _Parsed:
    n = _req_int(cfg, "num_hidden_layers", mt)
    field = next((f for f in ("layer_types", "layers_block_type") if cfg.get(f) is not None), None)
    if field is not None:
        kinds = _layer_list(cfg[field], field, {"mamba", "attention"}, mt, n)
        attn = [i for i, t in enumerate(kinds) if t == "attention"]
    else:
        if cfg.get("attn_layer_indices") is None:
            raise SpecError(f"{mt} config is missing required field 'layer_types' or 'attn_layer_indices'")
        raw = cfg["attn_layer_indices"]
        if not isinstance(raw, (list, tuple)):
            raise SpecError(f"{mt} config field 'attn_layer_indices' must be a list, got {raw!r}")
        attn = sorted({_as_int(i, "attn_layer_indices", mt) for i in raw})
        if attn and not 0 <= attn[0] <= attn[-1] < n:
            raise SpecError(f"attn_layer_indices {attn} outside num_hidden_layers={n}")
    attn_set = set(attn)
    mamba = [i for i in range(n) if i not in attn_set]
    return n, attn, mamba, _mamba2_geo(cfg, mt)


def _falcon_h1(cfg: dict[str, Any], mt: str) -> _Parsed:
    n = _req_int(cfg, "num_hidden_layers", mt)
    return n, list(range(n)), list(range(n)), _mamba2_geo(cfg, mt)


def _jamba(cfg: dict[str, Any], mt: str) -> _Parsed:
    n = _req_int(cfg, "num_hidden_layers", mt)
    types = cfg.get("layers_block_type")
    if types is not None:
        kinds = _layer_list(types, "layers_block_type", {"attention", "mamba"}, mt, n)
        attn = [i for i, t in enumerate(kinds) if t == "attention"]
    else:
        period = _req_int(cfg, "attn_layer_period", mt)
        offset = _req_int(cfg, "attn_layer_offset", mt, minimum=0)
        if period <= 0 or not 0 <= offset < period:
            raise SpecError(f"attn_layer_offset={offset} must lie in [0, attn_layer_period={period})")
        attn = [i for i in range(n) if i % period == offset]
    attn_set = set(attn)
    mamba = [i for i in range(n) if i not in attn_set]
    hidden = _req_int(cfg, "hidden_size", mt)
    geo = LinearGeometry(
        kind="mamba1",
        num_heads=1,
        head_dim=_first_int(cfg, ("mamba_expand",), mt, default=2) * hidden,
        state_size=_req_int(cfg, "mamba_d_state", mt),
        conv_kernel=_req_int(cfg, "mamba_d_conv", mt, minimum=2),
    )
    return n, attn, mamba, geo


_PARSERS: dict[str, Callable[[dict[str, Any], str], _Parsed]] = {
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
    """Build one TP rank's :class:`HybridSpec` from a config dict (see the module docstring)."""
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{name} must be an int, got {value!r}")
    if tp_size <= 0:
        raise SpecError(f"tp_size must be positive, got {tp_size}")
    cfg = dict(cfg)
    outer_type = cfg.get("model_type")
    if isinstance(cfg.get("text_config"), dict):  # Qwen3.5 and other multimodal wrappers
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", outer_type)
        for key in ("torch_dtype", "dtype", "_name_or_path"):
            if inner.get(key) is None and cfg.get(key) is not None:
                inner[key] = cfg[key]
        cfg = inner
    mt = cfg.get("model_type")
    if mt is None:
        raise SpecError("config is missing required field 'model_type'")
    if not isinstance(mt, str):
        raise SpecError(f"config field 'model_type' must be a string, got {mt!r}")
    parser = _PARSERS.get(mt)
    if parser is None:
        raise SpecError(f"unsupported model_type {mt!r}; supported: {list(SUPPORTED_MODEL_TYPES)}")
    num_layers, attn, mamba, geo = parser(cfg, mt)

    num_heads = _req_int(cfg, "num_attention_heads", mt)
    num_kv_heads = _first_int(cfg, ("num_key_value_heads",), mt, default=num_heads)
    if attn and num_heads % num_kv_heads:  # no model groups its query heads unevenly
        raise SpecError(
            f"{mt} config: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads} "
            "(grouped-query attention gives each KV head a whole group of query heads)"
        )
    hidden = _req_int(cfg, "hidden_size", mt)
    if cfg.get("head_dim") is not None or cfg.get("attention_head_dim") is not None:
        head_dim = _first_int(cfg, ("head_dim", "attention_head_dim"), mt)
    else:
        if num_heads <= 0 or hidden % num_heads:
            raise SpecError(
                f"{mt} config has no 'head_dim' and hidden_size={hidden} does not split into {num_heads} heads"
            )
        head_dim = hidden // num_heads
    dtype_key = "torch_dtype" if cfg.get("torch_dtype") else "dtype"
    try:
        model_dtype = dtype_from_name(cfg.get(dtype_key) or "bfloat16")
    except SpecError as e:
        raise SpecError(f"{mt} config field {dtype_key!r}: {e}") from None
    kv_heads = shard_kv_heads(num_kv_heads, tp_size)

    components: tuple[StateComponent, ...] = ()
    if mamba:
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
        kv_dtype=kv_dtype or model_dtype,
        page_size=page_size,
        state_components=components,
        linear=geo if mamba else None,
        tp_size=tp_size,
        tp_rank=tp_rank,
        hidden_size=hidden,
        num_attention_heads=num_heads,
        intermediate_size=_as_int(cfg.get("intermediate_size") or 0, "intermediate_size", mt, 0),
        vocab_size=_as_int(cfg.get("vocab_size") or 0, "vocab_size", mt, 0),
    )
