"""The reference hybrid model: attention + Gated DeltaNet layers over the cache's device pools.

Primitives:

- :class:`HybridModel` — built from a :class:`~asynccache.spec.HybridSpec` (Qwen3-Next-shaped:
  attention at ``spec.attention_layer_ids``, Gated DeltaNet at ``spec.mamba_layer_ids``, an
  MLP-only block at any other id), random weights from a seed or loaded from safetensors.
  ``await model.forward(batch, kv_pool, state_pool, counter)`` computes a :class:`ForwardBatch`
  and returns the fp32 logits of each sequence's last new token.
- :class:`SequenceInput`, :class:`ForwardBatch` (from ``asynccache.reference.batch``).

On CUDA, passes of up to 2,048 tokens (decode steps, prefill chunks) replay their recurrent
layers from CUDA graphs (``asynccache.reference.graphs``): the same kernels, one launch per layer.
So that prompts of new lengths replay them too, the recurrent layers compute each pass's segments
padded to bucket lengths (``asynccache.reference.padding``; ``bucket_passes``, on by default on
CUDA).

Structure: embedding → per layer [RMSNorm → attention | gated DeltaNet → residual → RMSNorm →
SwiGLU MLP → residual] → RMSNorm → LM head. Attention layers write the new tokens' K/V into the
paged ``DeviceKVPool`` and read keys ``[0, end)`` from it; recurrent layers resume from the
working slot of the ``DeviceMambaPool`` (zeros when ``start == 0``), write it back and emit
snapshots (conv state: the last ``kernel − 1`` conv inputs in the model dtype; recurrent state:
fp32 ``[v_heads, k_dim, v_dim]``).

Contract with the cache (see docs/architecture.md, "Scheduler conventions"):

- ``await counter.wait(layer_id)`` runs exactly once per cached layer per forward, before that
  layer first reads or writes the pools (global ids; MLP-only ids are not awaited). The working
  slot of a recurrent layer is read only after its wait, so a wait may seed it.
- A forward with snapshots at P computes exactly what forward calls split at P compute (each
  segment runs through all layers before the next; see ``asynccache.reference.batch``), so the
  same inputs with the same segmentation give the same bits, a snapshot at p equals the state a
  call ending at p leaves behind, and a sequence's result does not depend on where its KV pages
  are. With ``pack_sequences=False`` (the default on CPU) every sequence runs alone, so its result
  does not depend on the rest of the batch either; packed (the default on CUDA), sequences of a
  pass share matrix products whose rounding may depend on the batch's shape.
- Recurrent segments of one token use the exact recurrence; longer ones the chunked form with
  chunks starting at the segment start (both fp32; see ``asynccache.reference.gdn``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from os import PathLike

import torch
import torch.nn.functional as F
from torch import nn

from asynccache.errors import ConfigError
from asynccache.layer_counter import LayerTransferCounter
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference.batch import ForwardBatch, SequenceInput, plan_passes
from asynccache.reference.context import build_pass_context
from asynccache.reference.graphs import LayerGraphs
from asynccache.reference.layers import DecoderLayer, RMSNorm
from asynccache.reference.padding import pad_recurrent_rows, run_recurrent_layer
from asynccache.reference.weights import (
    check_checkpoint_metadata,
    checkpoint_metadata,
    init_random_,
    load_tensors_,
    read_checkpoint,
    save_safetensors,
)
from asynccache.spec import HybridSpec

__all__ = [
    "LAUNCH_WINDOW_LAYERS",
    "LAUNCH_WINDOW_MIN_TOKENS",
    "MODEL_DTYPES",
    "MODEL_DTYPE_NAMES",
    "ForwardBatch",
    "HybridModel",
    "SequenceInput",
]

#: The dtypes the model computes in (its weights and activations); anything else is refused.
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Their names as :func:`~asynccache.spec.dtype_from_name` reads them: the command lines'
#: ``--dtype`` choices.
MODEL_DTYPE_NAMES = ("float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half")

#: On CUDA, a pass of at least ``LAUNCH_WINDOW_MIN_TOKENS`` tokens keeps at most this many layers
#: launched ahead of the GPU: before launching more, the forward awaits (in a thread, the GIL
#: released) the end of the layer that many back. Unthrottled, a long prefill runs far ahead of
#: the GPU until the CUDA launch queue is full, and the loop thread then sits inside kernel
#: launches for as long as the GPU needs: nothing else on the loop (storage completions, other
#: requests' admission) runs meanwhile.
LAUNCH_WINDOW_LAYERS = 2
#: Passes below this many tokens are launch-bound on the host and are never throttled.
LAUNCH_WINDOW_MIN_TOKENS = 1024


class _Backbone(nn.Module):
    def __init__(self, spec: HybridSpec, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype=dtype) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, dtype=dtype)


class HybridModel(nn.Module):
    """A hybrid attention + Gated DeltaNet language model computing on the cache's pools.

    ``dtype``: what it computes in, one of :data:`MODEL_DTYPES` (the spec's KV and state
    dtypes, any floating-point ones). ``weights``: a ``{name: tensor}`` mapping to load instead
    of the seeded random init, checked by names, shapes and dtypes only (see
    :meth:`from_safetensors`, which also checks a file's recorded geometry and model_id).
    ``pack_sequences``: compute the sequences of a batch together
    (``None``: on CUDA only). ``cuda_graphs``: replay the recurrent layers of passes of up
    to 2,048 tokens from CUDA graphs (``None``: on CUDA; see ``asynccache.reference.graphs``).
    ``bucket_passes``: the recurrent layers compute segments padded to bucket lengths, so that
    passes of new lengths share graphs (``None``: on CUDA; see ``asynccache.reference.padding``).
    Either way the same segmentation gives the same bits; the two settings round differently.
    """

    def __init__(
        self,
        spec: HybridSpec,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        weights: dict[str, torch.Tensor] | None = None,
        pack_sequences: bool | None = None,
        cuda_graphs: bool | None = None,
        bucket_passes: bool | None = None,
    ) -> None:
        super().__init__()
        _check_spec(spec, dtype)
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.pack_sequences = self.device.type == "cuda" if pack_sequences is None else pack_sequences
        with torch.device("meta"):
            self.model = _Backbone(spec, dtype=dtype)
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=self.device)
        self.requires_grad_(False)
        if weights is None:
            init_random_(self, seed=seed, num_layers=spec.num_layers)
        else:
            load_tensors_(self, weights)
        self._cached_layer_ids = frozenset(spec.cached_layer_ids)
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if use_graphs and self.device.type != "cuda":
            raise ConfigError("cuda_graphs needs a CUDA device")
        #: CUDA graphs of the recurrent layers for passes of up to 2,048 tokens (None: always eager).
        self.layer_graphs: LayerGraphs | None = LayerGraphs() if use_graphs else None
        #: Recurrent layers compute segments padded to bucket lengths (asynccache.reference.padding).
        self.bucket_passes = self.device.type == "cuda" if bucket_passes is None else bucket_passes

    # ---- weights -----------------------------------------------------------------------
    @classmethod
    def from_safetensors(
        cls,
        spec: HybridSpec,
        path: str | PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        pack_sequences: bool | None = None,
        cuda_graphs: bool | None = None,
        bucket_passes: bool | None = None,
        check_model_id: bool = True,
    ) -> HybridModel:
        """Load weights written by :meth:`save_safetensors`, or any checkpoint with the same names
        and shapes (``path``: a safetensors file, a sharded checkpoint's
        ``*.safetensors.index.json``, or a folder holding ``model.safetensors`` or
        ``model.safetensors.index.json``; see :func:`~asynccache.reference.weights.read_checkpoint`).

        Checked, each a :class:`ConfigError`: the tensors' names, shapes and dtypes (see
        :func:`~asynccache.reference.weights.load_tensors_`); then the model geometry the file's
        metadata records (:meth:`save_safetensors` writes it; shapes do not fix all of it, e.g. a
        Gated DeltaNet layer's key heads × key head dim); then the ``model_id`` it records, which
        must be ``spec.model_id`` unless ``check_model_id=False`` (the same weights under another
        name). A file without such metadata, e.g. a Hugging Face checkpoint, is checked by its
        tensors alone."""
        tensors, metadata = read_checkpoint(path, device=device)
        model = cls(
            spec,
            device=device,
            dtype=dtype,
            weights=tensors,
            pack_sequences=pack_sequences,
            cuda_graphs=cuda_graphs,
            bucket_passes=bucket_passes,
        )
        check_checkpoint_metadata(spec, metadata, check_model_id=check_model_id, source=f"checkpoint {path}")
        return model

    def save_safetensors(self, path: str | PathLike[str]) -> None:
        """Write every parameter to ``path`` (safetensors, Hugging Face-style names), with the
        spec's ``model_id`` and model geometry in the file's metadata (which
        :meth:`from_safetensors` checks)."""
        save_safetensors(self, path, metadata=checkpoint_metadata(self.spec))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- forward -----------------------------------------------------------------------
    async def forward(  # type: ignore[override]
        self,
        batch: ForwardBatch,
        kv_pool: DeviceKVPool,
        state_pool: DeviceMambaPool,
        counter: LayerTransferCounter | None = None,
    ) -> torch.Tensor:
        """Compute ``batch``; return fp32 logits ``[num_seqs, vocab]`` of each sequence's last new token.

        Mutates: the KV pages at the new positions, each working slot, each snapshot slot.
        Runs on the caller's current CUDA stream; never synchronises the host. The batch is
        checked first (:func:`~asynccache.reference.batch.plan_passes`; a :class:`ConfigError`):
        token ids, page indices and slots held in host memory against the vocabulary and pools;
        token ids and page indices already on the device are not checked (it would synchronise).
        """
        self._check_pools(kv_pool, state_pool)
        spec = self.spec
        passes = plan_passes(
            batch.sequences,
            page_size=spec.page_size,
            num_pages=kv_pool.num_items,
            num_slots=state_pool.num_items,
            pack=self.pack_sequences,
            vocab_size=spec.vocab_size,
        )
        logits = torch.empty(len(batch.sequences), spec.vocab_size, dtype=torch.float32, device=self.device)
        for pass_index, segments in enumerate(passes):
            ctx = build_pass_context(segments, page_size=spec.page_size, head_dim=spec.head_dim, device=self.device)
            if self.bucket_passes and spec.linear is not None:
                ctx = pad_recurrent_rows(ctx, conv_kernel=spec.linear.conv_kernel)
            h = F.embedding(ctx.token_ids, self.model.embed_tokens.weight)
            graphed = None if self.layer_graphs is None else self.layer_graphs.bind(ctx, h, state_pool)
            window = _LaunchWindow.for_pass(self.device, ctx.token_ids.numel())
            for layer in self.model.layers:
                if pass_index == 0 and counter is not None and layer.layer_id in self._cached_layer_ids:
                    await counter.wait(layer.layer_id)
                if graphed is not None and layer.linear_attn is not None:
                    h = graphed.run(layer, h, ctx, kv_pool, state_pool)
                elif layer.linear_attn is not None:
                    h = run_recurrent_layer(layer, h, ctx, kv_pool, state_pool)
                else:
                    h = layer(h, ctx, kv_pool, state_pool)
                if window is not None:
                    await window.launched()
            if ctx.logit_seq_indices:
                last = self.model.norm(h[ctx.logit_rows])
                logits[list(ctx.logit_seq_indices)] = self.lm_head(last).float()
        return logits

    async def warm_up(
        self,
        kv_pool: DeviceKVPool,
        state_pool: DeviceMambaPool,
        *,
        lengths: Iterable[int],
        kv_page_indices: torch.Tensor,
        state_slot: int,
    ) -> int:
        """Capture the recurrent layers' CUDA graphs of a prompt's first pass at each of
        ``lengths`` tokens before serving, as a server captures its graphs at start: one
        sequence from position 0 with no snapshot (the pass a split restore's head makes),
        computed as often as the graphs take to capture its shape. With ``bucket_passes``, a
        bucket length's graphs serve every first pass padded to it. Overwrites the KV pages
        ``kv_page_indices`` and the slot ``state_slot``; returns the layer graphs captured (0
        without graphs: on CPU there is nothing to warm)."""
        graphs = self.layer_graphs
        wanted = sorted(set(lengths))
        if graphs is None or not wanted:
            return 0
        page = self.spec.page_size
        if wanted[0] < 1 or wanted[-1] > graphs.max_tokens:
            raise ConfigError(f"warm-up lengths must be in [1, {graphs.max_tokens}], got {wanted[0]}…{wanted[-1]}")
        if wanted[-1] > kv_page_indices.numel() * page:
            raise ConfigError(
                f"a warm-up pass of {wanted[-1]} tokens needs {-(-wanted[-1] // page)} KV pages, got {kv_page_indices.numel()}"
            )
        before = graphs.num_captures
        for n in wanted:
            seq = SequenceInput(
                token_ids=torch.zeros(n, dtype=torch.int64),
                start=0,
                kv_page_indices=kv_page_indices[: -(-n // page)],
                state_slot=state_slot,
            )
            for _ in range(graphs.eager_runs + 1):
                await self.forward(ForwardBatch(sequences=(seq,)), kv_pool, state_pool)
        return graphs.num_captures - before

    def _check_pools(self, kv_pool: DeviceKVPool, state_pool: DeviceMambaPool) -> None:
        ks, ss, spec = kv_pool.spec, state_pool.spec, self.spec
        if (ks.attention_layer_ids, ks.page_size, ks.num_kv_heads, ks.head_dim) != (
            spec.attention_layer_ids,
            spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
        ):
            raise ConfigError(f"KV pool geometry does not match the model's spec {spec.model_id!r}")
        if (ss.mamba_layer_ids, ss.state_components) != (spec.mamba_layer_ids, spec.state_components):
            raise ConfigError(f"state pool geometry does not match the model's spec {spec.model_id!r}")
        for pool in (kv_pool, state_pool):
            if not pool.materialized:
                raise ConfigError(f"{pool.name}: the model needs a materialized pool")
            if pool.device.type != self.device.type:
                raise ConfigError(f"{pool.name} is on {pool.device}, the model on {self.device}")


class _LaunchWindow:
    """Keeps a long pass at most ``LAUNCH_WINDOW_LAYERS`` layers ahead of the GPU (see there)."""

    def __init__(self) -> None:
        self._events: deque[torch.cuda.Event] = deque()

    @classmethod
    def for_pass(cls, device: torch.device, num_tokens: int) -> _LaunchWindow | None:
        if device.type != "cuda" or num_tokens < LAUNCH_WINDOW_MIN_TOKENS:
            return None
        return cls()

    async def launched(self) -> None:
        """Mark the end of a layer's launches; wait while the window is full."""
        event = torch.cuda.Event(blocking=True)
        event.record()
        self._events.append(event)
        if len(self._events) > LAUNCH_WINDOW_LAYERS:
            oldest = self._events.popleft()
            if not oldest.query():
                await asyncio.to_thread(oldest.synchronize)


def _check_spec(spec: HybridSpec, dtype: torch.dtype) -> None:
    """What the model can run, else a :class:`ConfigError`: an unsharded spec with positive
    model dimensions, an even ``head_dim`` (rotate-half RoPE) when it has attention layers, a
    floating-point KV and state dtype (an integer one would truncate K/V and states), Gated
    DeltaNet recurrent layers whose state components are ``conv`` ``(conv_dim, conv_kernel - 1)``
    and ``ssm`` ``[v_heads, k_dim, v_dim]`` as ``spec.linear`` derives them, and a model dtype of
    :data:`MODEL_DTYPES`."""
    if dtype not in MODEL_DTYPES:
        names = [str(d).removeprefix("torch.") for d in MODEL_DTYPES]
        raise ConfigError(f"the reference model computes in {names}, not {dtype}")
    if spec.tp_size != 1:
        raise ConfigError("the reference model runs unsharded (tp_size=1)")
    dims = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [f for f in dims if getattr(spec, f) <= 0]
    if missing:
        raise ConfigError(
            f"spec {spec.model_id!r} lacks model dimensions {missing} (each must be > 0, got "
            f"{[getattr(spec, f) for f in missing]})"
        )
    if spec.attention_layer_ids and spec.head_dim % 2:
        raise ConfigError(f"spec {spec.model_id!r}: head_dim must be even (rotate-half RoPE), got {spec.head_dim}")
    cache_dtypes = {"kv_dtype": spec.kv_dtype} if spec.attention_layer_ids else {}
    cache_dtypes.update({f"state component {c.name!r}": c.dtype for c in spec.state_components})
    for what, dt in cache_dtypes.items():
        if not dt.is_floating_point:
            raise ConfigError(f"spec {spec.model_id!r}: {what} must be a floating-point dtype, got {dt}")
    if spec.mamba_layer_ids and (spec.linear is None or spec.linear.kind != "gated_deltanet"):
        raise ConfigError(f"the reference model runs gated_deltanet recurrent layers, not {spec.linear and spec.linear.kind!r}")
    overlap = set(spec.attention_layer_ids) & set(spec.mamba_layer_ids)
    if overlap:
        raise ConfigError(f"layers {sorted(overlap)} are both attention and recurrent; the reference model runs one per layer")
    if not spec.mamba_layer_ids:
        return
    names = [c.name for c in spec.state_components]
    if names != ["conv", "ssm"]:
        raise ConfigError(f"expected state components ['conv', 'ssm'], got {names}")
    # The state pool's items are laid out from the components; the layers compute from the
    # linear geometry. A mismatch would restore states into the wrong shape.
    geo, (conv, ssm) = spec.linear, spec.state_components
    wanted = {"conv": (geo.conv_dim(), geo.conv_kernel - 1), "ssm": tuple(geo.ssm_shape())}
    for c in (conv, ssm):
        if tuple(c.shape) != wanted[c.name]:
            raise ConfigError(
                f"spec {spec.model_id!r}: state component {c.name!r} has shape {tuple(c.shape)}, but its linear "
                f"geometry (conv_kernel={geo.conv_kernel}, {geo.num_k_heads} key heads × {geo.head_k_dim}, "
                f"{geo.num_heads} value heads × {geo.head_dim}) needs {wanted[c.name]}"
            )
