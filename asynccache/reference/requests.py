"""What the reference scheduler is configured with, tracks per request and returns.

- :class:`SchedulerConfig`: batch and chunk limits, and whether the cache is used at all;
- :class:`RequestResult`: what a served request reports (prompt and cached tokens per tier,
  output, TTFT, latency, the first token's logits);
- :class:`Phase` and :class:`Request`: a request's place in the scheduler's loop and everything
  the loop holds for it (its pages, working slot, snapshots, pending load or tail restore);
- :func:`prompt_token_ids`: a submitted prompt as an int64 array of token ids, checked;
- :func:`device_pages_needed`: the device KV pages a request holds while it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from asynccache.checks import as_int, check_int
from asynccache.errors import ConfigError

__all__ = ["Phase", "Prompt", "Request", "RequestResult", "SchedulerConfig", "device_pages_needed", "prompt_token_ids"]

_INT64_MAX = int(np.iinfo(np.int64).max)

#: What a request's prompt may be given as: token ids as Python or NumPy integers, an integer
#: array, or a 1-D integer tensor.
Prompt = Iterable[int] | np.ndarray | torch.Tensor


def prompt_token_ids(prompt: Prompt, vocab_size: int) -> np.ndarray:
    """``prompt`` as the request's own 1-D int64 array, else a :class:`ConfigError`: at least
    one token, each an integer (Python or NumPy, an array or a 1-D tensor of an integer dtype;
    not a bool, not a float, which would be truncated) in ``[0, vocab_size)`` (``vocab_size``
    0: unknown, not checked).

    The tree keys, hashes and compares prompts as int64 arrays: a list of 32k Python ints costs
    ~1 ms to convert, which the scheduler then pays once here rather than at every match."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ConfigError(f"a prompt tensor must be 1-D of an integer dtype, got {tuple(prompt.shape)} {prompt.dtype}")
        ids = prompt.detach().to("cpu", torch.int64, copy=True).numpy()
    elif isinstance(prompt, np.ndarray) and prompt.dtype != object:
        if prompt.ndim != 1:
            raise ConfigError(f"a prompt array must be 1-D, got shape {prompt.shape}")
        if prompt.dtype.kind not in "iu":
            raise ConfigError(f"prompt token ids must be integers, got an array of {prompt.dtype}")
        if prompt.dtype.kind == "u" and prompt.size and int(prompt.max()) > _INT64_MAX:
            raise ConfigError(f"prompt token ids must lie in [0, {vocab_size or _INT64_MAX + 1})")
        ids = prompt.astype(np.int64)  # a copy: the request's own
    else:
        try:
            items = list(prompt)
        except TypeError:
            raise ConfigError(f"a prompt is a sequence of token ids, got {type(prompt).__name__}") from None
        if not set(map(type, items)) <= {int}:  # NumPy scalars, 0-d tensors, or not integers
            checked = []
            for t in items:
                n = None if isinstance(t, torch.Tensor) and t.dtype == torch.bool else as_int(t)
                if n is None:
                    raise ConfigError(f"prompt token ids must be integers, got {t!r}")
                checked.append(n)
            items = checked
        try:
            ids = np.array(items, dtype=np.int64)
        except OverflowError:
            raise ConfigError(f"prompt token ids must lie in [0, {vocab_size or _INT64_MAX + 1})") from None
    if not ids.size:
        raise ConfigError("a request needs at least one prompt token")
    if vocab_size and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        raise ConfigError(f"prompt token ids must lie in [0, {vocab_size})")
    return ids


def device_pages_needed(total_len: int, page_size: int) -> int:
    """Device KV pages a request of ``total_len`` tokens (prompt + ``max_new_tokens``) holds
    while it runs, its cached prefix's included: one per page of the positions it computes or
    finds cached, ``[0, total_len - 1)`` (the last sampled token is never computed)."""
    return -(-(total_len - 1) // page_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_running: int = 8
    chunk_size: int = 512  # prefill tokens per request per step
    max_batch_tokens: int = 4096
    use_cache: bool = True
    #: Seconds a step waits, while other requests run, for the storage probe of the request
    #: next in line (a miss or a split restore then joins this step; a probe that takes longer,
    #: and a whole restore's read, go on while the running requests compute).
    lookup_wait_s: float = 0.01
    #: Share of the host KV pool that the storage lookups of waiting requests beyond the
    #: device's room may bring before those requests are admitted (counted as the pages each
    #: could bring, in arrival order). Their reads then go on while the requests ahead of them
    #: run. 0: a request's lookup starts only once the device could take it.
    lookahead_host_fraction: float = 0.25
    #: Before serving, capture the model's CUDA graphs of a prompt's first pass at every bucket
    #: length up to this many tokens (``HybridModel.warm_up``; 0: none, and nothing to do on a
    #: model without graphs or bucket passes), so that a split restore's head of a length not
    #: seen before replays them instead of computing eagerly (docs/followups.md, item 17).
    warm_up_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_running", "chunk_size", "max_batch_tokens"):
            object.__setattr__(self, name, check_int(f"SchedulerConfig.{name}", getattr(self, name), minimum=1))
        object.__setattr__(
            self, "warm_up_tokens", check_int("SchedulerConfig.warm_up_tokens", self.warm_up_tokens, minimum=0)
        )
        wait = self.lookup_wait_s
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0.0 <= wait < float("inf"):
            raise ConfigError(f"SchedulerConfig.lookup_wait_s must be a finite number >= 0, got {wait!r}")
        share = self.lookahead_host_fraction
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= share <= 1.0:
            raise ConfigError(f"SchedulerConfig.lookahead_host_fraction must be a number in [0, 1], got {share!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestResult:
    request_id: int
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    output_ids: list[int]
    ttft_s: float
    latency_s: float
    first_logits: torch.Tensor


class Phase(str, Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Request:
    request_id: int
    prompt: np.ndarray  # int64, 1-D: what the tree matches and inserts without converting
    max_new_tokens: int
    salt: str
    future: asyncio.Future[RequestResult]
    submitted: float
    phase: Phase = Phase.WAITING
    num_computed: int = 0
    num_cached: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    locked_node: Any = None
    lock_token: int | None = None  # the tree's token of the lock on locked_node
    kv_pages: torch.Tensor | None = None  # device pages for positions [0, capacity)
    own_pages: torch.Tensor | None = None  # the part of kv_pages this request allocated
    state_slot: int = -1
    seed_slot: int | None = None  # cached boundary state to copy into state_slot
    snapshots: dict[int, int] = field(default_factory=dict)
    storage_only: frozenset[int] = frozenset()  # snapshot positions archived to storage only
    tail: Any = None  # a TailRestore still to apply
    load_op: Any = None  # the CacheOperation bringing the request's prefix (and state) to the device
    tail_op: Any = None  # the CacheOperation loading its tail restore into its own pages and slots
    num_restored: int = 0  # tokens a tail restore brought (not computed)
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    first_logits: torch.Tensor | None = None
    cancelled: bool = False
    #: tokens its storage lookup brought past ``lookup_from`` — what the prefetch's result
    #: restored, 0 for a miss, a split restore (counted when applied) or a passed deadline (None:
    #: not looked up yet; one lookup per request, so a request that waits for room does not
    #: repeat it every step)
    storage_tokens: int | None = None
    lookup: asyncio.Task[Any] | None = None  # its storage lookup while it runs, not yet taken
    lookup_from: int = 0  # tokens the tree matched when the lookup started
    lookup_started: float = 0.0  # the event loop's time then
    lookup_tail: Any = None  # a split restore the lookup brought, until admission takes it
    lookahead_pages: int = 0  # host pages its lookup may bring, while it started ahead of room
    #: admitted without its cached prefix: with nothing running and no copy in flight, there was
    #: no room for the prefix's load beside its own pages and slots (it is computed cold instead)
    cold: bool = False

    @property
    def total_len(self) -> int:
        return len(self.prompt) + self.max_new_tokens
