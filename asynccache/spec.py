"""Cache geometry of a hybrid model.

Primitives:

- :class:`HybridSpec` — which global layer ids are attention and which are recurrent, the KV page
  geometry and the state geometry, with derived byte sizes. ``HybridSpec.from_hf_config`` reads
  Hugging Face ``config.json`` files of the Qwen3-Next / Qwen3.5, Nemotron-H, Bamba /
  Granite-4.0-H, Jamba and Falcon-H1 families.
- :data:`STATE_ALIGN_BYTES` — the alignment of the components inside one state item (its
  ``state_component_offsets``).

Its parts, importable from here too: :class:`StateComponent`, :class:`LinearGeometry` and
:func:`shard_kv_heads` (``asynccache.layer_geometry``: one recurrent layer's state, the
recurrent dimensions, the KV heads per TP rank), :func:`dtype_from_name`
(``asynccache.dtype_names``) and :data:`PRESETS` (``asynccache.presets``).

Layer ids are *global*: layer ``i`` of the model, whatever its kind. Attention and recurrent ids
may interleave, leave gaps (MLP-only layers) or coincide (Falcon-H1 runs both in one layer).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from asynccache.checks import as_int
from asynccache.dtype_names import dtype_from_name
from asynccache.errors import SpecError
from asynccache.layer_geometry import LinearGeometry, StateComponent, shard_kv_heads
from asynccache.presets import PRESETS

__all__ = ["PRESETS", "HybridSpec", "LinearGeometry", "StateComponent", "dtype_from_name", "shard_kv_heads"]

#: Component offsets inside one state item are aligned to this many bytes so typed views of
#: the byte buffer are legal and copies can use wide words.
STATE_ALIGN_BYTES = 16


def _align(n: int, a: int = STATE_ALIGN_BYTES) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridSpec:
    """Geometry of one TP rank's cache for a hybrid model.

    A *KV page* holds ``page_size`` tokens of K and V for one attention layer; a *state* holds
    every component of one recurrent layer. Pools store both as byte items (see
    ``asynccache.pools``); the sizes below are what one item and one full page/state take.
    """

    model_id: str
    num_layers: int
    attention_layer_ids: tuple[int, ...]
    mamba_layer_ids: tuple[int, ...]
    num_kv_heads: int  # per TP rank
    head_dim: int
    kv_dtype: torch.dtype = torch.bfloat16
    page_size: int = 64
    state_components: tuple[StateComponent, ...] = ()  # per layer, per TP rank
    linear: LinearGeometry | None = None
    tp_size: int = 1
    tp_rank: int = 0
    # Model dimensions used by the reference model and FLOP estimates (0 = unknown).
    hidden_size: int = 0
    num_attention_heads: int = 0  # query heads, unsharded
    intermediate_size: int = 0
    vocab_size: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise SpecError(f"model_id must be a non-empty string, got {self.model_id!r}")
        for name in ("page_size", "tp_size", "tp_rank", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(f"{name} must be an int, got {value!r}")
        if not isinstance(self.kv_dtype, torch.dtype):
            raise SpecError(f"kv_dtype must be a torch.dtype, got {self.kv_dtype!r}")
        for c in self.state_components:
            if not isinstance(c, StateComponent) or not isinstance(c.dtype, torch.dtype):
                raise SpecError(f"state_components must be StateComponents with a torch.dtype, got {c!r}")
            if not c.shape or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in c.shape):
                raise SpecError(f"state component {c.name!r} needs a shape of positive ints, got {c.shape!r}")
        if self.page_size <= 0:
            raise SpecError(f"page_size must be positive, got {self.page_size}")
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise SpecError("num_kv_heads and head_dim must be positive")
        if not 0 <= self.tp_rank < self.tp_size:
            raise SpecError(f"tp_rank={self.tp_rank} outside tp_size={self.tp_size}")
        for name, ids in (("attention", self.attention_layer_ids), ("mamba", self.mamba_layer_ids)):
            if list(ids) != sorted(set(ids)):
                raise SpecError(f"{name}_layer_ids must be strictly increasing, got {ids}")
            if ids and not 0 <= ids[0] <= ids[-1] < self.num_layers:
                raise SpecError(f"{name}_layer_ids {ids} outside num_layers={self.num_layers}")
        if not self.attention_layer_ids and not self.mamba_layer_ids:
            raise SpecError("a spec needs at least one attention or mamba layer")
        if self.mamba_layer_ids and not self.state_components:
            raise SpecError("mamba layers given but no state_components")
        for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            value = as_int(getattr(self, name))
            if value is None or value < 0:
                raise SpecError(f"{name} must be an int >= 0 (0: unknown), got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        self._check_query_heads()

    def _check_query_heads(self) -> None:
        """Query heads (when known) split evenly over the TP ranks, and each rank's into whole
        groups, one per KV head it holds (grouped-query attention): ``num_attention_heads`` a
        multiple of ``num_kv_heads · tp_size``. (A KV head replicated over ranks holds
        ``num_kv_heads = 1``: the query heads need only split over the ranks.)"""
        if not self.attention_layer_ids or not self.num_attention_heads:
            return
        heads, kv, tp = self.num_attention_heads, self.num_kv_heads, self.tp_size
        if heads % (kv * tp) == 0:
            return
        if tp == 1:
            raise SpecError(
                f"num_attention_heads={heads} is not a multiple of num_kv_heads={kv}: grouped-query "
                "attention gives each KV head a whole group of query heads"
            )
        raise SpecError(
            f"num_attention_heads={heads} is not a multiple of num_kv_heads={kv} (per rank) × tp_size={tp}: "
            "each rank needs a whole group of query heads for each KV head it holds"
        )

    # ---- KV geometry -------------------------------------------------------------------
    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_ids)

    @property
    def num_mamba_layers(self) -> int:
        return len(self.mamba_layer_ids)

    @property
    def kv_item_bytes(self) -> int:
        """Bytes of one KV page of one attention layer (K and V)."""
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one KV page across all attention layers."""
        return self.kv_item_bytes * self.num_attention_layers

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_page_bytes // self.page_size

    # ---- state geometry ----------------------------------------------------------------
    @property
    def state_component_offsets(self) -> tuple[int, ...]:
        """Byte offset of each component inside one state item (aligned)."""
        offsets, off = [], 0
        for comp in self.state_components:
            offsets.append(off)
            off = _align(off + comp.size_bytes)
        return tuple(offsets)

    @property
    def state_item_bytes(self) -> int:
        """Bytes of one state of one recurrent layer (components aligned to 16 bytes)."""
        off = 0
        for comp in self.state_components:
            off = _align(off + comp.size_bytes)
        return off

    @property
    def state_bytes(self) -> int:
        """Bytes of one state across all recurrent layers."""
        return self.state_item_bytes * self.num_mamba_layers

    # ---- identity ----------------------------------------------------------------------
    @property
    def namespace_id(self) -> str:
        """Identity of this cache's bytes: model, page size, dtypes and TP shard."""
        comps = ",".join(f"{c.name}:{'x'.join(map(str, c.shape))}:{c.dtype}" for c in self.state_components)
        return (
            f"{self.model_id}|p{self.page_size}|kv{self.num_kv_heads}x{self.head_dim}:{self.kv_dtype}"
            f"|{comps}|tp{self.tp_rank}of{self.tp_size}"
        )

    def layer_kind(self, layer_id: int) -> tuple[bool, bool]:
        """(has attention KV, has recurrent state) for a global layer id."""
        return layer_id in self.attention_layer_ids, layer_id in self.mamba_layer_ids

    @property
    def cached_layer_ids(self) -> tuple[int, ...]:
        """Global ids of every layer that holds cache (attention or recurrent), sorted."""
        return tuple(sorted(set(self.attention_layer_ids) | set(self.mamba_layer_ids)))

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        config: str | PathLike[str] | Mapping[str, Any],
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        page_size: int = 64,
        ssm_dtype: str | torch.dtype = torch.float32,
        kv_dtype: str | torch.dtype | None = None,
        model_id: str | None = None,
    ) -> HybridSpec:
        """Build the spec from a Hugging Face config (a dict, a ``config.json`` path, or a folder).

        The SSM / recurrent state is fp32 unless ``ssm_dtype`` says otherwise; conv states and
        KV use the model's ``torch_dtype`` (bf16 if absent) unless ``kv_dtype`` is given.

        ``model_id`` names the *weights*: it is part of :attr:`namespace_id`, so caches share
        stored KV and states only under one ``model_id``. Without it, a config read from a path
        gets its ``_name_or_path`` (else ``model_type``) ``@`` its folder's absolute path — two
        checkpoints of one architecture (a base model and a fine-tune, whose configs may be
        identical) never share storage; pass the same ``model_id`` to share it across folders or
        machines, and never one name for different weights. A dict's default is its own name
        alone, which names the architecture: pass ``model_id`` with a storage tier. Only
        ``None`` takes the default: an empty or blank ``model_id``, or one that is not a string,
        is a :class:`SpecError` (an empty one would name the architecture alone, even for a
        config read from a folder), as is a ``config`` that is neither a mapping nor a path.
        """
        from asynccache.hf_config import parse_hf_config

        if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
            raise SpecError(f"model_id must be a non-empty string (or None for the default), got {model_id!r}")
        if not isinstance(config, (str, PathLike, Mapping)):
            raise SpecError(
                f"config must be a mapping, or a path to a config.json or its folder, got {type(config).__name__}"
            )
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SpecError(f"cannot read HF config {path}: {e}") from e
            if not isinstance(config, dict):
                kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(config), "a number")
                raise SpecError(f"HF config {path} is not a JSON object but {kind}")
            if model_id is None:
                name = config.get("_name_or_path") or config.get("model_type")
                model_id = f"{name}@{path.resolve().parent}"
        return parse_hf_config(
            dict(config),
            tp_size=tp_size,
            tp_rank=tp_rank,
            page_size=page_size,
            ssm_dtype=dtype_from_name(ssm_dtype),
            kv_dtype=None if kv_dtype is None else dtype_from_name(kv_dtype),
            model_id=model_id,
        )

    @classmethod
    def preset(cls, name: str, **kwargs: Any) -> HybridSpec:
        """A named preset (see :data:`PRESETS`), e.g. ``"qwen3-next-80b"``; ``kwargs`` are those
        of :meth:`from_hf_config` but ``config`` (``model_id`` defaults to ``name``). An unknown
        preset or keyword is a :class:`SpecError`."""
        if not isinstance(name, str) or name not in PRESETS:
            raise SpecError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        unknown = sorted(set(kwargs) - _PRESET_KWARGS)
        if unknown:
            raise SpecError(
                f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for preset {name!r}; "
                f"known: {sorted(_PRESET_KWARGS)}"
            )
        cfg = PRESETS[name]
        kwargs.setdefault("model_id", name)
        return cls.from_hf_config(cfg, **kwargs)


#: The keywords :meth:`HybridSpec.preset` passes on to :meth:`HybridSpec.from_hf_config`.
_PRESET_KWARGS = frozenset(inspect.signature(HybridSpec.from_hf_config).parameters) - {"config"}
