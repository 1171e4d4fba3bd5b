"""What a request needs of the device pools, against what they hold: the scheduler's checks
before it allocates (``asynccache.reference.admit``).

Primitives:

- :func:`load_states` — the device state slots a match's load takes (the node's, for a
  boundary state on the host only);
- :func:`fits_beside` — whether eviction could make room for a request beside the running ones;
- :func:`check_fits` — a :class:`CapacityError` for a request the empty device could not hold;
- :func:`no_room_error` — the error of a request that found no room with nothing running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from asynccache.errors import CapacityError
from asynccache.reference.requests import Request, device_pages_needed

if TYPE_CHECKING:
    from asynccache.cache import HybridCache

__all__ = ["check_fits", "fits_beside", "load_states", "no_room_error"]


def load_states(match: Any) -> int:
    """Device state slots the load of ``match`` (None: no match) takes besides the request's."""
    return match.num_load_states if match is not None and match.needs_load else 0


def fits_beside(cache: HybridCache, running: Sequence[Request], req: Request, match: Any) -> bool:
    """False when the device could not take ``req`` even with everything evicted that the
    ``running`` requests do not hold: its new pages (those of its match already on the device
    are not new) beyond the pages outside the running requests' page tables, or its working
    slot (and a host hit's state slot) beyond the slots outside their working and snapshot
    slots. Allocating then would evict every cached prefix the tree can give up, for nothing.
    (Pages and slots pinned otherwise — a copy in flight — are not counted: True does not
    promise room.)"""
    page = cache.spec.page_size
    held = [r.kv_pages for r in running if r.kv_pages is not None]
    held_pages = int(torch.unique(torch.cat(held)).numel()) if held else 0
    on_device = match.num_device_tokens // page if match is not None else 0
    if device_pages_needed(req.total_len, page) - on_device > cache.device_kv.num_items - held_pages:
        return False
    held_slots = sum(1 + len(r.snapshots) for r in running)
    return 1 + load_states(match) <= cache.device_mamba.num_items - held_slots


def check_fits(cache: HybridCache, prompt_len: int, max_new_tokens: int) -> None:
    """A :class:`CapacityError` for a request the device pools could not hold even empty — the
    pages of every position it computes or finds cached (its working state slot is the least a
    slot pool holds): admission would evict the whole device tier at each attempt before
    failing it."""
    kv, states, page = cache.device_kv, cache.device_mamba, cache.spec.page_size
    pages = device_pages_needed(prompt_len + max_new_tokens, page)
    if pages > kv.num_items:
        raise CapacityError(
            f"a request of {prompt_len} prompt + {max_new_tokens} new tokens needs {pages} device KV pages "
            f"({page} tokens each) and 1 state slot; the device pools hold {kv.num_items} pages "
            f"and {states.num_items} slots in all"
        )


def no_room_error(cache: HybridCache, req: Request) -> CapacityError:
    """The error of a request that admission found no room for, with nothing running, no copy
    in flight to free any and no attempt left that eviction made progress in: what it needs,
    what the device pools have free, and where the rest is — kept by the cache (its locked
    part apart) or in use otherwise (outside the tree: pages a failed load retired, indices
    someone allocated and kept)."""
    kv, states = cache.device_kv, cache.device_mamba
    pages = device_pages_needed(req.total_len, cache.spec.page_size)
    tree = cache.tree.stats()
    other_pages = kv.num_items - kv.num_free - tree.device_kv_pages
    other_slots = states.num_items - states.num_free - tree.device_states
    return CapacityError(
        f"request does not fit in the device pools: {len(req.prompt)} prompt + {req.max_new_tokens} new tokens "
        f"need {pages} KV pages (a cached prefix's included) and 1 state slot; {kv.num_free} of {kv.num_items} "
        f"pages and {states.num_free} of {states.num_items} slots are free; the cache keeps "
        f"{tree.device_kv_pages} pages ({tree.device_locked_pages} of them locked or in a copy) and "
        f"{tree.device_states} slots, and {other_pages} pages and {other_slots} slots are in use outside it"
    )
