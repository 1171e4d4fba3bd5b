"""A prompt's first pass captured before serving: the reference scheduler's warm-up
(``SchedulerConfig.warm_up_tokens``).

A split restore's head is a prompt's first pass — one sequence from position 0, no snapshot —
of a length the process has rarely computed. The recurrent layers' CUDA graphs
(``asynccache.reference.graphs``) capture a shape at its second sighting, so such a head ran
eagerly or paid the capture (docs/followups.md, item 17). :func:`warm_up_first_passes` computes
that pass at every bucket length (``asynccache.reference.padding``) until its graphs are
captured, as a server captures its graphs at start, on device pages and a slot it takes from the
cache and gives back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from asynccache.cache import HybridCache
from asynccache.errors import CapacityError
from asynccache.reference.model import HybridModel
from asynccache.reference.padding import bucket_lengths

__all__ = ["warm_up_first_passes"]


async def warm_up_first_passes(
    model: HybridModel, cache: HybridCache, max_tokens: int, *, device_idle: Callable[[], Awaitable[None]]
) -> int:
    """``model.warm_up`` at every bucket length up to ``max_tokens`` (at most the graphs' own
    bound), on device pages and a slot taken from ``cache`` and given back once ``device_idle``
    says the passes' kernels have run; returns the layer graphs captured. Nothing to do (0) for
    a model without graphs or bucket passes: without buckets a first pass's own length would
    not meet the bucket lengths' graphs. A :class:`CapacityError` when the device pools have no
    room for the longest pass (nothing taken)."""
    graphs = model.layer_graphs
    if graphs is None or not model.bucket_passes:
        return 0
    lengths = bucket_lengths(min(max_tokens, graphs.max_tokens))
    if not lengths:
        return 0
    page = cache.spec.page_size
    alloc = cache.tree.alloc_device(-(-lengths[-1] // page), 1)
    if alloc is None:
        raise CapacityError(f"the device pools have no room for a warm-up pass of {lengths[-1]} tokens")
    try:
        return await model.warm_up(
            cache.device_kv,
            cache.device_mamba,
            lengths=lengths,
            kv_page_indices=alloc.kv_indices,
            state_slot=int(alloc.state_slots[0]),
        )
    finally:
        await device_idle()  # the passes' kernels use the pages until they have run
        cache.controller._free(alloc.kv_indices, alloc.state_slots, device=True)
