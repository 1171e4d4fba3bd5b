"""LayerTransferCounter: lets the forward pass await each layer's load-back.

Primitives:

- ``LayerTransferCounter(layer_ids)`` — one asyncio event per *global* layer id (attention and
  recurrent layers share one id space; ids may be sparse, e.g. Nemotron-H's MLP-only layers).
- ``mark_enqueued(layer_id, cuda_event)`` — the controller calls it once that layer's copy has
  been enqueued on the load stream, with the CUDA event recorded after the copy (``None`` on CPU,
  where copies are synchronous).
- ``await wait(layer_id)`` — returns once the layer is enqueued, and makes the caller's current
  CUDA stream wait on the layer's event: stream-ordered, the host never synchronises. A layer the
  counter does not track (nothing to load, or another pipeline stage's layer) returns at once.
- ``fail(exc)`` — a failed step releases every waiter with a :class:`TransferError`.

Pipeline parallelism: each stage builds its counter over the global ids of the layers it owns
(``for_layers``), so stage ``k`` never waits for a layer of stage ``k-1`` and the ids the model
uses are the ids the controller marks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch

from asynccache.errors import TransferError

__all__ = ["LayerTransferCounter"]


class LayerTransferCounter:
    def __init__(self, layer_ids: Iterable[int] = ()) -> None:
        self._events: dict[int, asyncio.Event] = {int(i): asyncio.Event() for i in layer_ids}
        self._cuda_events: dict[int, torch.cuda.Event | None] = {}
        self._error: BaseException | None = None

    @classmethod
    def completed(cls) -> LayerTransferCounter:
        """A counter for a step with nothing to load: every ``wait`` returns at once."""
        return cls(())

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._events))

    def for_layers(self, layer_ids: Iterable[int]) -> LayerTransferCounter:
        """A view restricted to the given global ids (a pipeline stage's layers); shares events."""
        view = LayerTransferCounter.__new__(LayerTransferCounter)
        wanted = set(layer_ids)
        view._events = {i: e for i, e in self._events.items() if i in wanted}
        view._cuda_events = self._cuda_events
        view._error = None
        return view

    def mark_enqueued(self, layer_id: int, cuda_event: torch.cuda.Event | None = None) -> None:
        ev = self._events.get(layer_id)
        if ev is None:
            raise KeyError(f"layer {layer_id} is not tracked by this counter {self.layer_ids}")
        self._cuda_events[layer_id] = cuda_event
        ev.set()

    def is_enqueued(self, layer_id: int) -> bool:
        ev = self._events.get(layer_id)
        return ev is None or ev.is_set()

    def fail(self, exc: BaseException) -> None:
        """Release every waiter; their ``wait`` raises TransferError from ``exc``."""
        self._error = exc
        for ev in self._events.values():
            ev.set()

    async def wait(self, layer_id: int) -> None:
        ev = self._events.get(layer_id)
        if ev is None:
            return
        if not ev.is_set():
            await ev.wait()
        if self._error is not None:
            raise TransferError(f"load of layer {layer_id} failed") from self._error
        cuda_event = self._cuda_events.get(layer_id)
        if cuda_event is not None:
            torch.cuda.current_stream().wait_event(cuda_event)
