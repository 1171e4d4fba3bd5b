"""LayerTransferCounter: lets the forward pass await each layer's load-back.

Primitives:

- ``LayerTransferCounter(layer_ids)`` — tracks *global* layer ids (attention and recurrent
  layers share one id space; ids may be sparse, e.g. Nemotron-H's MLP-only layers); an asyncio
  event is made only for a layer awaited before it is marked.
- ``mark_enqueued(layer_id, cuda_event)`` — the controller calls it once that layer's copy has
  been enqueued on the load stream, with the CUDA event recorded after the copy (``None`` on CPU,
  where copies are synchronous).
- ``await wait(layer_id)`` — returns once the layer is enqueued, and makes the caller's current
  CUDA stream wait on the layer's event unless that stream already waits on it (layers copied
  together share one event): one ``cudaStreamWaitEvent`` on raw handles, a few microseconds;
  stream-ordered, the host never synchronises. A layer the counter does not track (nothing to
  load, or another pipeline stage's layer) returns at once. An id may be any integer (a 0-d
  tensor, a NumPy integer); anything else is a :class:`ConfigError`, not an untracked layer.
- ``cuda_event(layer_id)`` — the event recorded after that layer's copy (benchmarks time it:
  ``kernels.cudart.elapsed_ms``); a ``kernels.cudart.CudaEvent`` from the controller, or a
  ``torch.cuda.Event`` where the runtime library does not load.
- ``fail(exc)`` — a failed step releases every waiter with a :class:`TransferError`.

Pipeline parallelism: each stage builds its counter over the global ids of the layers it owns
(``for_layers``), so stage ``k`` never waits for a layer of stage ``k-1`` and the ids the model
uses are the ids the controller marks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from asynccache.checks import as_int
from asynccache.errors import ConfigError, TransferError
from asynccache.streams import CudaEventLike, current_stream, make_wait

__all__ = ["CudaEventLike", "LayerTransferCounter"]


def _layer_id(value: object) -> int:
    """``value`` as a layer id: an integer of any type (``operator.index``), else ConfigError.
    An id of another type would not be found among the tracked ints and count as untracked."""
    n = as_int(value)
    if n is None:
        raise ConfigError(f"a layer id must be an integer, got {value!r}")
    return n


class _State:
    """What a counter and its stage views share: the marks, the waiters, the failure, and the
    last (event, stream) dependency made (the layers of one copy share an event)."""

    __slots__ = ("cuda_events", "error", "last_wait", "waiters")

    def __init__(self) -> None:
        self.cuda_events: dict[int, CudaEventLike | None] = {}  # marked layers
        self.waiters: dict[int, asyncio.Event] = {}  # created on the first wait for an unmarked layer
        self.error: BaseException | None = None
        self.last_wait: tuple[CudaEventLike, object] | None = None


class LayerTransferCounter:
    def __init__(self, layer_ids: Iterable[int] = ()) -> None:
        self._tracked = frozenset(int(i) for i in layer_ids)
        self._state = _State()

    @classmethod
    def completed(cls) -> LayerTransferCounter:
        """A counter for a step with nothing to load: every ``wait`` returns at once."""
        return cls(())

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._tracked))

    def for_layers(self, layer_ids: Iterable[int]) -> LayerTransferCounter:
        """A view restricted to the given global ids (a pipeline stage's layers); shares the
        marks, the waiters and a failure with this counter."""
        view = LayerTransferCounter.__new__(LayerTransferCounter)
        view._tracked = self._tracked & frozenset(int(i) for i in layer_ids)
        view._state = self._state
        return view

    def mark_enqueued(self, layer_id: int, cuda_event: CudaEventLike | None = None) -> None:
        if layer_id not in self._tracked:
            raise KeyError(f"layer {layer_id} is not tracked by this counter {self.layer_ids}")
        state = self._state
        state.cuda_events[layer_id] = cuda_event
        waiter = state.waiters.get(layer_id)
        if waiter is not None:
            waiter.set()

    def is_enqueued(self, layer_id: int) -> bool:
        """True once the layer is marked (or the counter failed, or it is not tracked)."""
        if type(layer_id) is not int:
            layer_id = _layer_id(layer_id)
        state = self._state
        return layer_id not in self._tracked or layer_id in state.cuda_events or state.error is not None

    def cuda_event(self, layer_id: int) -> CudaEventLike | None:
        """The event recorded after ``layer_id``'s copy (``None``: not marked, or on CPU)."""
        if type(layer_id) is not int:
            layer_id = _layer_id(layer_id)
        return self._state.cuda_events.get(layer_id)

    def fail(self, exc: BaseException) -> None:
        """Release every waiter; their ``wait`` raises TransferError from ``exc``."""
        state = self._state
        state.error = exc
        for waiter in state.waiters.values():
            waiter.set()

    async def wait(self, layer_id: int) -> None:
        if type(layer_id) is not int:  # the forward's own ints cost one type check
            layer_id = _layer_id(layer_id)
        if layer_id not in self._tracked:
            return
        state = self._state
        if state.error is None and layer_id not in state.cuda_events:
            waiter = state.waiters.get(layer_id)
            if waiter is None:
                waiter = state.waiters[layer_id] = asyncio.Event()
            await waiter.wait()
        if state.error is not None:
            raise TransferError(f"load of layer {layer_id} failed") from state.error
        cuda_event = state.cuda_events[layer_id]
        if cuda_event is None:
            return
        key, handle = current_stream()
        last = state.last_wait
        if last is not None and last[0] is cuda_event and last[1] == key:
            return  # this stream already waits on this event (a layer of the same copy)
        # Waiting on a finished copy's event costs the GPU nothing; asking first would cost the
        # host a second call.
        make_wait(handle, cuda_event)
        state.last_wait = (cuda_event, key)
