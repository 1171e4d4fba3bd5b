"""CUDA graphs of the recurrent decoder layers, for passes of up to a few thousand tokens.

A pass of a few tokens (a decode step, the last chunk of a prompt whose prefix was cached) is
bound by the host: a Gated DeltaNet layer issues ~70 operators, each a trip through the
dispatcher, plus two per 64-token chunk of its recurrence. So is a prefill chunk of up to ~2k
tokens on a fast GPU: on an H200 the hybrid-3b preset's 1,024-token pass takes ~47 ms of GPU
time and ~100 ms of host time eagerly (docs/benchmarks.md, "Reference model prefill").
:class:`LayerGraphs` captures each recurrent :class:`DecoderLayer` (norm → gated DeltaNet →
residual → norm → MLP → residual) once per *pass shape* and replays it: one launch per layer
instead of hundreds. Attention layers stay eager (their key spans change every step).

Primitives:

- :class:`LayerGraphs` — the graphs of one model, by pass shape, least recently used dropped
  past ``max_shapes`` shapes or ``max_total_tokens`` tokens (a shape's memory grows with its
  tokens).
- :class:`GraphedPass` — one pass bound to its shape's graphs: ``run(layer, h, …)``.

A pass shape is the number of rows the recurrent layers compute and, per recurrent group, its
length, size, row range, which members start a sequence, how many emit a snapshot and whether it
is padded: everything the layer's Python branches on. Segments padded to bucket lengths
(``asynccache.reference.padding``, the model's default on CUDA) make shapes repeat across
prompts of new lengths; the hidden rows are scattered into the padded layout before a replay and
gathered back after it. Graphs are kept per state pool (a graph writes the addresses it was
captured with) and dropped when the pool is garbage-collected. The group's index tensors
(working slots, fresh mask, snapshot members and slots) are copied into the shape's static
buffers once per pass; the hidden state is copied into the static input before each replay.
Graphs are captured on a side stream with thread-local capture mode (the controller's threads
keep issuing copies meanwhile) and replayed on the caller's stream, so a replay is ordered after
``counter.wait(layer)`` exactly as the eager layer is.

A shape is computed eagerly the first ``eager_runs`` times it is seen (a one-off shape never
pays a capture) and replayed from then on. Capturing passes of one sequence padded to a bucket
length at their first sighting instead was tried and not kept (docs/benchmarks.md, run BQ): it
saves one eager pass per bucket over a process's life, but a first sighting then costs up to
1.8 × an eager pass. A server that wants a prompt's first pass replayed from the start captures
those shapes before it serves (``HybridModel.warm_up``; the reference scheduler's
``SchedulerConfig.warm_up_tokens``). A replay launches the kernels the eager run launches with the same shapes, so
it computes the same bits (checked by ``tests/gpu/test_layer_graphs_gpu.py``); a capture that
fails leaves the shape eager for good.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import OrderedDict

import torch

from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference.context import GdnGroup, PassContext
from asynccache.reference.layers import DecoderLayer
from asynccache.reference.padding import BUCKET_MAX_TOKENS, run_recurrent_layer

__all__ = ["MAX_SEEN_SHAPES", "GraphedPass", "LayerGraphs"]

log = logging.getLogger("asynccache.reference")

_Shape = tuple[int, tuple[tuple[int, int, int, int, bool, bool, int, bool], ...]]
_Key = tuple[int, _Shape]  # (id of the state pool, pass shape)

#: Shapes seen but not captured yet that are remembered (the oldest forgotten past this): a
#: server sees a new shape for nearly every prefill's last chunk.
MAX_SEEN_SHAPES = 4096


def pass_shape(ctx: PassContext) -> _Shape:
    """Everything a recurrent layer's Python branches on, for ``ctx``."""
    groups = tuple(
        (
            g.length,
            g.num_seqs,
            g.row_begin,
            g.row_end,
            g.all_fresh,
            g.fresh is not None,
            0 if g.snapshot_index is None else int(g.snapshot_index.numel()),
            g.pads is not None,
        )
        for g in ctx.gdn_groups
    )
    return ctx.recurrent_tokens, groups


class _ShapeGraphs:
    """Static buffers and per-layer graphs of one pass shape (all sharing one memory pool)."""

    def __init__(self, ctx: PassContext, hidden: torch.Tensor) -> None:
        self.h_in = hidden.new_empty(ctx.recurrent_tokens, hidden.shape[-1])
        self.groups = tuple(_static_group(g) for g in ctx.gdn_groups)
        self.ctx = dataclasses.replace(ctx, gdn_groups=self.groups)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: tuple[int, int] | None = None
        self.failed = False

    def bind(self, ctx: PassContext) -> None:
        """Copy ``ctx``'s group indices into the static buffers the graphs read."""
        for static, g in zip(self.groups, ctx.gdn_groups, strict=True):
            static.state_slots.copy_(g.state_slots, non_blocking=True)
            if static.fresh is not None:
                assert g.fresh is not None
                static.fresh.copy_(g.fresh, non_blocking=True)
            if static.snapshot_index is not None:
                assert g.snapshot_index is not None and g.snapshot_slots is not None
                assert static.snapshot_slots is not None
                static.snapshot_index.copy_(g.snapshot_index, non_blocking=True)
                static.snapshot_slots.copy_(g.snapshot_slots, non_blocking=True)
            if static.pads is not None:
                assert g.pads is not None and g.conv_tail is not None and static.conv_tail is not None
                static.pads.copy_(g.pads, non_blocking=True)
                static.conv_tail.copy_(g.conv_tail, non_blocking=True)


def _static_group(g: GdnGroup) -> GdnGroup:
    def clone(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty_like(t)

    return dataclasses.replace(
        g,
        state_slots=torch.empty_like(g.state_slots),
        fresh=clone(g.fresh),
        snapshot_index=clone(g.snapshot_index),
        snapshot_slots=clone(g.snapshot_slots),
        pads=clone(g.pads),
        conv_tail=clone(g.conv_tail),
    )


class LayerGraphs:
    """CUDA graphs of a model's recurrent layers for passes of at most ``max_tokens`` tokens.

    ``eager_runs``: times a shape is computed eagerly before it is captured. ``max_shapes``:
    shapes whose graphs are kept (each holds its layers' intermediate memory, which grows with
    its tokens: ~0.45–0.5 MB a token for the hybrid-3b preset in bf16); ``max_total_tokens``: the
    most tokens the kept shapes may add up to (the least recently used go first; a shape is
    always kept while it is the only one): by default room for a warm-up's 16 bucket lengths up
    to 2,048 tokens (12,288 added up) and the shapes that serving adds.
    """

    def __init__(
        self, *, max_tokens: int = BUCKET_MAX_TOKENS, eager_runs: int = 1, max_shapes: int = 32, max_total_tokens: int = 16384
    ) -> None:
        if max_tokens < 1 or eager_runs < 0 or max_shapes < 1 or max_total_tokens < 1:
            raise ValueError("max_tokens, max_shapes and max_total_tokens must be >= 1 and eager_runs >= 0")
        self.max_tokens = max_tokens
        self.eager_runs = eager_runs
        self.max_shapes = max_shapes
        self.max_total_tokens = max_total_tokens
        self._shapes: OrderedDict[_Key, _ShapeGraphs] = OrderedDict()
        self._seen: dict[_Key, int] = {}
        self._pools: dict[int, weakref.finalize] = {}
        self._stream: torch.cuda.Stream | None = None
        self.num_captures = 0
        self.num_replays = 0

    def bind(self, ctx: PassContext, hidden: torch.Tensor, state_pool: DeviceMambaPool) -> GraphedPass | None:
        """The graphs for ``ctx``'s pass over ``state_pool`` (its indices bound), or ``None``:
        compute it eagerly. A graph holds the addresses of the pool it was captured with, so
        graphs are kept per pool and dropped with it."""
        if hidden.device.type != "cuda" or ctx.recurrent_tokens > self.max_tokens or not ctx.gdn_groups:
            return None
        pool_id = id(state_pool)
        if pool_id not in self._pools:
            self._pools[pool_id] = weakref.finalize(state_pool, self._forget_pool, pool_id)
        shape = (pool_id, pass_shape(ctx))
        entry = self._shapes.get(shape)
        if entry is None:
            seen = self._seen.get(shape, 0)
            if seen < self.eager_runs:
                self._seen[shape] = seen + 1
                if len(self._seen) > MAX_SEEN_SHAPES:
                    del self._seen[next(iter(self._seen))]
                return None
            self._seen.pop(shape, None)
            entry = _ShapeGraphs(ctx, hidden)
            self._shapes[shape] = entry
            while len(self._shapes) > 1 and (
                len(self._shapes) > self.max_shapes or self.total_tokens > self.max_total_tokens
            ):
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(shape)
        if entry.failed:
            return None
        entry.bind(ctx)
        return GraphedPass(self, entry)

    def _forget_pool(self, pool_id: int) -> None:
        """Drop the graphs of a pool that is gone (its id may be reused by a new one)."""
        self._pools.pop(pool_id, None)
        for key in [k for k in self._shapes if k[0] == pool_id]:
            del self._shapes[key]
        for key in [k for k in self._seen if k[0] == pool_id]:
            del self._seen[key]

    @property
    def num_shapes(self) -> int:
        """Shapes whose graphs are kept."""
        return len(self._shapes)

    @property
    def total_tokens(self) -> int:
        """The tokens of the kept shapes, added up."""
        return sum(key[1][0] for key in self._shapes)

    def _capture_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


class GraphedPass:
    """One pass's view of its shape's graphs: ``run`` replays (capturing on first use)."""

    def __init__(self, owner: LayerGraphs, entry: _ShapeGraphs) -> None:
        self._owner = owner
        self._entry = entry

    def run(
        self, layer: DecoderLayer, h: torch.Tensor, ctx: PassContext, kv_pool: DeviceKVPool, state_pool: DeviceMambaPool
    ) -> torch.Tensor:
        """``layer(h, ctx, …)`` through its graph (eagerly if the capture fails)."""
        e = self._entry
        graph = e.graphs.get(layer.layer_id)
        if graph is None and not e.failed:
            graph = self._capture(layer, kv_pool, state_pool)
        if graph is None:
            return run_recurrent_layer(layer, h, ctx, kv_pool, state_pool)
        if ctx.padding is None:
            e.h_in.copy_(h)
        else:
            ctx.padding.pad_into(h, e.h_in)
        graph.replay()
        self._owner.num_replays += 1
        out = e.outputs[layer.layer_id]
        return out if ctx.padding is None else ctx.padding.unpad(out)

    def _capture(
        self, layer: DecoderLayer, kv_pool: DeviceKVPool, state_pool: DeviceMambaPool
    ) -> torch.cuda.CUDAGraph | None:
        e = self._entry
        graph = torch.cuda.CUDAGraph()
        stream = self._owner._capture_stream()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=e.pool, capture_error_mode="thread_local")
                try:
                    out = layer(e.h_in, e.ctx, kv_pool, state_pool)
                finally:
                    graph.capture_end()  # ends the stream's capture whether the layer raised or not
        except RuntimeError as err:  # an operator that cannot be captured: stay eager
            log.warning("layer %d: CUDA graph capture failed, computing eagerly: %s", layer.layer_id, err)
            e.failed = True
            return None
        if e.pool is None:
            e.pool = graph.pool()
        e.graphs[layer.layer_id] = graph
        e.outputs[layer.layer_id] = out
        self._owner.num_captures += 1
        return graph
