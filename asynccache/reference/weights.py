"""Weights of the reference model: seeded random initialisation and safetensors I/O.

Primitives:

- :func:`init_random_` — fill every parameter from one seeded generator on the model's device
  (same seed + device + dtype → same weights; CPU and CUDA generators differ).
- :func:`load_tensors_` — copy a ``{name: tensor}`` mapping into the model after checking that the
  names and shapes are exactly the model's and the dtypes weights' ones (:data:`WEIGHT_DTYPES`),
  casting to the model's dtype; a finite tensor that the cast makes non-finite is refused.
- :func:`save_safetensors` / :func:`read_safetensors` / :func:`read_checkpoint` — a flat
  safetensors file with Hugging Face-style names (``model.layers.3.linear_attn.A_log``,
  ``lm_head.weight``); reading also takes a sharded checkpoint (its
  ``model.safetensors.index.json``, or the folder holding it).
- :func:`checkpoint_metadata` / :func:`check_checkpoint_metadata` — the spec's ``model_id`` and
  model geometry, written into a saved file's metadata and checked against the spec on loading.
  Tensor shapes do not fix every dimension: a Gated DeltaNet layer's key channels
  ``linear_num_key_heads × linear_key_head_dim`` enter its weights only as a product.

Initialisation keeps the residual stream and the logits O(1) at any size: embeddings N(0, 1),
input projections N(0, 1/fan_in), output projections additionally shrunk by √(2·layers), norms
one, ``A_log = log U(1, 16)`` and ``dt_bias`` the inverse softplus of a log-uniform step in
[1e-3, 1e-1] (Mamba's choice), so recurrent layers keep memory over hundreds of tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from os import PathLike
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from asynccache.errors import ConfigError
from asynccache.spec import HybridSpec

__all__ = [
    "GEOMETRY_KEYS",
    "WEIGHT_DTYPES",
    "check_checkpoint_metadata",
    "checkpoint_metadata",
    "init_random_",
    "load_tensors_",
    "read_checkpoint",
    "read_safetensors",
    "save_safetensors",
]

#: The dtypes a checkpoint's tensors may have (cast to the model's dtype on loading): fp16, bf16,
#: fp32, fp64 and the two fp8 weight formats (e4m3fn, e5m2). Others are refused: a scale-only
#: format (``float8_e8m0fnu``) holds no weights, and packed fp4 cannot be cast. A dtype this torch
#: lacks is left out.
WEIGHT_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
)

#: The metadata key naming the weights (the spec's ``model_id``).
_MODEL_ID_KEY = "model_id"
#: A sharded checkpoint's index and the single file, as a folder holds them (Hugging Face's names).
_SINGLE_FILE, _INDEX_FILE = "model.safetensors", "model.safetensors.index.json"

_RESIDUAL_OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
_INPUT_PROJ = ("qkv_proj.weight", "in_proj_qkvz.weight", "in_proj_ba.weight", "gate_up_proj.weight", "lm_head.weight")


@torch.no_grad()
def init_random_(model: nn.Module, *, seed: int, num_layers: int) -> None:
    """Fill every parameter of ``model`` (in ``named_parameters`` order) from ``seed``."""
    params = list(model.named_parameters())
    device = params[0][1].device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in params:
        p.copy_(_init_value(name, p, gen, num_layers))


def _init_value(name: str, p: torch.Tensor, gen: torch.Generator, num_layers: int) -> torch.Tensor:
    shape, device = p.shape, p.device

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo

    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith(_RESIDUAL_OUT):
        return normal(1.0 / math.sqrt(shape[1] * 2 * num_layers))
    if name.endswith(_INPUT_PROJ):
        return normal(1.0 / math.sqrt(shape[1]))
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith("A_log"):
        return uniform(1.0, 16.0).log()
    if name.endswith("dt_bias"):
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(dt)
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    raise ConfigError(f"no initialisation rule for parameter {name!r}")


@torch.no_grad()
def load_tensors_(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters (cast to its dtype); names and shapes must
    match exactly, and each tensor be a ``torch.Tensor`` of :data:`WEIGHT_DTYPES`. A finite
    tensor that the cast makes non-finite (beyond fp16's range, say) is a :class:`ConfigError`
    (one ``isfinite`` reduction per tensor, and one host synchronisation in all)."""
    if not isinstance(tensors, Mapping):
        raise ConfigError(
            f"weights must be a mapping of parameter names to tensors, got {type(tensors).__name__} "
            "(HybridModel.from_safetensors reads a file)"
        )
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    finite = []
    for name, p in params.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"checkpoint tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != tuple(p.shape):
            raise ConfigError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model wants {tuple(p.shape)}")
        if t.dtype not in WEIGHT_DTYPES:  # floats are cast to the model's dtype; others are not weights
            names = [str(dt).removeprefix("torch.") for dt in WEIGHT_DTYPES]
            raise ConfigError(f"checkpoint tensor {name!r} is {t.dtype}, not a floating-point weight dtype ({names})")
        p.copy_(t)
        finite.append(torch.isfinite(p).all())
    if not finite:
        return
    for (name, p), ok in zip(params.items(), torch.stack(finite).tolist(), strict=True):
        t = tensors[name]
        if not ok and bool(torch.isfinite(t).all()):
            raise ConfigError(
                f"checkpoint tensor {name!r} does not fit {p.dtype}: its finite {t.dtype} values overflow when cast "
                "(load the model in a wider dtype)"
            )


def save_safetensors(model: nn.Module, path: str | PathLike[str], *, metadata: Mapping[str, str] | None = None) -> None:
    """Write every parameter of ``model`` (on CPU, in its dtype) to a safetensors file."""
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})


def read_safetensors(path: str | PathLike[str], *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (see :func:`read_checkpoint`), loaded onto ``device``."""
    return read_checkpoint(path, device=device)[0]


def read_checkpoint(
    path: str | PathLike[str], *, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a checkpoint, loaded onto ``device``, and its metadata.

    ``path``: a safetensors file; a sharded checkpoint's index (``*.safetensors.index.json``: a
    ``weight_map`` from tensor names to shard files in its folder), whose shards are merged —
    a tensor in a shard the index does not put it in (in two shards, or in none), a tensor the
    index lists and its shard lacks, or shards whose metadata disagree are refused; or a folder
    holding ``model.safetensors`` or else ``model.safetensors.index.json``. Anything unreadable
    is a :class:`ConfigError`.
    """
    dev = torch.device(device)
    where = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
    file = Path(path)
    if file.is_dir():
        found = [file / name for name in (_SINGLE_FILE, _INDEX_FILE) if (file / name).is_file()]
        if not found:
            raise ConfigError(
                f"checkpoint folder {path} holds neither {_SINGLE_FILE} nor {_INDEX_FILE}: pass a safetensors "
                "file, a sharded checkpoint's *.safetensors.index.json, or a folder holding one of them"
            )
        file = found[0]
    if file.name.endswith(".json"):
        return _read_sharded(file, where)
    return _read_file(file, where)


def _read_file(path: Path, where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt", device=where) as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
            return tensors, dict(f.metadata() or {})
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"cannot read safetensors checkpoint {path}: {e}") from e


def _read_sharded(index_path: Path, where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read sharded checkpoint index {index_path}: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise ConfigError(
            f"{index_path} is not a sharded safetensors index: it needs a non-empty 'weight_map' from tensor names to shard files"
        )
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    meta_from: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise ConfigError(f"{index_path}: shard {shard!r} is not a file name in the index's folder")
        part, meta = _read_file(index_path.parent / shard, where)
        for name in part:
            if weight_map.get(name) != shard:
                listed = weight_map.get(name)
                where_listed = f"the index puts it in {listed!r}" if listed else "the index does not list it"
                raise ConfigError(f"{index_path}: shard {shard!r} holds tensor {name!r}, but {where_listed}")
        for key, value in meta.items():
            if key in metadata and metadata[key] != value:
                raise ConfigError(
                    f"{index_path}: shards {meta_from[key]!r} and {shard!r} disagree on metadata {key!r} "
                    f"({metadata[key]!r} vs {value!r})"
                )
            metadata[key], meta_from[key] = value, shard
        tensors.update(part)
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise ConfigError(f"{index_path}: tensors the index lists are missing from their shards: {absent[:8]}")
    return tensors, metadata


def checkpoint_metadata(spec: HybridSpec) -> dict[str, str]:
    """The metadata a saved checkpoint carries: the spec's ``model_id`` and model geometry
    (what :func:`check_checkpoint_metadata` compares)."""
    return {_MODEL_ID_KEY: spec.model_id, **_geometry(spec)}


#: The geometry keys :func:`checkpoint_metadata` writes (Hugging Face config names where there is
#: one): every model's, an attention layer's (with attention layers), a recurrent layer's (with
#: recurrent layers).
_COMMON_KEYS = ("num_layers", "attention_layer_ids", "mamba_layer_ids", "hidden_size", "intermediate_size", "vocab_size")
_ATTENTION_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim")
_LINEAR_KEYS = (
    "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip
#: Every geometry key :func:`checkpoint_metadata` may write.
GEOMETRY_KEYS = _COMMON_KEYS + _ATTENTION_KEYS + _LINEAR_KEYS


def _geometry(spec: HybridSpec) -> dict[str, str]:
    """The model's dimensions as metadata strings."""
    values: list[object] = [
        spec.num_layers,
        ",".join(map(str, spec.attention_layer_ids)),
        ",".join(map(str, spec.mamba_layer_ids)),
        spec.hidden_size,
        spec.intermediate_size,
        spec.vocab_size,
    ]
    geo = dict(zip(_COMMON_KEYS, values, strict=True))
    if spec.attention_layer_ids:
        geo |= zip(_ATTENTION_KEYS, (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim), strict=True)
    lin = spec.linear
    if spec.mamba_layer_ids and lin is not None:
        dims = (lin.num_k_heads, lin.head_k_dim, lin.num_heads, lin.head_dim, lin.conv_kernel)
        geo |= zip(_LINEAR_KEYS, dims, strict=True)
    return {key: str(value) for key, value in geo.items()}


def check_checkpoint_metadata(
    spec: HybridSpec, metadata: Mapping[str, str], *, check_model_id: bool = True, source: object = "checkpoint"
) -> None:
    """Refuse a checkpoint written for another model (a :class:`ConfigError`).

    Each geometry key of :data:`GEOMETRY_KEYS` that ``metadata`` holds must equal the spec's
    (a key the spec's model lacks, such as a recurrent dimension for an attention-only spec,
    is a mismatch); a ``model_id`` it holds must equal ``spec.model_id`` unless
    ``check_model_id`` is false. Keys it lacks are not checked: a file without this metadata
    (a Hugging Face checkpoint) is checked by its tensors' names and shapes alone.
    """
    want = _geometry(spec)
    wrong = [
        f"{key}={metadata[key]} (the spec: {want.get(key, 'none')})"
        for key in GEOMETRY_KEYS
        if key in metadata and metadata[key] != want.get(key)
    ]
    if wrong:
        raise ConfigError(f"{source} was written for another model geometry than spec {spec.model_id!r}: {', '.join(wrong)}")
    if check_model_id and _MODEL_ID_KEY in metadata and metadata[_MODEL_ID_KEY] != spec.model_id:
        raise ConfigError(
            f"{source} holds the weights of model_id {metadata[_MODEL_ID_KEY]!r}, not the spec's {spec.model_id!r} "
            "(a model_id names the weights a cache's stored KV and states come from); pass check_model_id=False "
            "to load them under the spec's model_id anyway"
        )
