"""Typed errors of asynccache.

Hierarchy::

    AsyncCacheError
    ├── ConfigError          bad configuration or input (unknown HF field, bad URI, bad layout)
    │   ├── SpecError        a HybridSpec cannot be built or does not shard
    │   └── TraceFormatError a request trace is unreadable or malformed
    ├── TreeError            the radix tree was driven out of its protocol (a caller bug)
    ├── StaleMatchError      a match's prefix did not arrive: a load it waited for failed or was
    │                        cancelled, or its pages left the device (match again)
    ├── CapacityError        a pool cannot be created or a demanded resource is unavailable
    │   ├── PinningError     pinned host memory was demanded but is not available
    │   └── SharedMemoryError  host memory shared between processes cannot be had
    ├── AllocationError      misuse of an allocator (double free, foreign index)
    ├── TransferError        a copy was rejected before launch or failed
    ├── SchedulerError       the reference scheduler's loop stopped, or it is closed
    ├── ClosedError          the cache is not running: never entered, closed, or shutting down
    └── BackendError         a storage backend failed (I/O, network, timeout)
        └── ObjectFormatError  a stored object is truncated, corrupted or foreign

"No room right now" is not an error: allocators and loaders return ``None``.
"""

from __future__ import annotations


class AsyncCacheError(Exception):
    """Base class of the errors asynccache raises for bad input or state at its public API."""


class ConfigError(AsyncCacheError, ValueError):
    """Invalid configuration or input."""


class SpecError(ConfigError):
    """A HybridSpec cannot be built from the given config, or does not shard."""


class TraceFormatError(ConfigError):
    """A trace file is unreadable, malformed, or breaks the format's invariants."""


class TreeError(AsyncCacheError, RuntimeError):
    """The tree was driven out of its protocol: unlocking below zero, finishing an unknown plan,
    beginning a load from a stale match, aborting a copy other data depends on (a caller bug).
    Bad arguments (misaligned positions, wrong index counts) raise :class:`ConfigError`."""


class StaleMatchError(AsyncCacheError):
    """A match no longer describes the tree: a load into its prefix that it waited for (another
    request's, or its own) failed or was cancelled, so those pages and that state never arrived,
    or they left the device meanwhile. Not a caller bug: release the match's lock and match the
    prompt again."""


class CapacityError(AsyncCacheError):
    """A pool cannot be created with the requested size on this machine."""


class PinningError(CapacityError):
    """Pinned host memory was demanded but is unavailable."""


class SharedMemoryError(CapacityError):
    """Host memory shared between processes cannot be had: the memory file cannot be made or
    mapped, or the CUDA runtime refuses to register (pin) it."""


class AllocationError(AsyncCacheError):
    """An allocator was misused: double free, or an index it never handed out."""


class TransferError(AsyncCacheError):
    """A copy was rejected before launch (bad dtype, layout, index) or failed."""


class ClosedError(AsyncCacheError, RuntimeError):
    """The cache (its controller) takes no operations: it was never entered (``async with``),
    it was closed, or its background work failed and it is shutting down. A ``RuntimeError``
    too, as it was before it had a type of its own."""


class SchedulerError(AsyncCacheError, RuntimeError):
    """The reference scheduler takes no more requests: its loop stopped on an error (the
    ``__cause__``; every request it held failed with that error), or it is closed."""


class BackendError(AsyncCacheError):
    """A storage backend failed: I/O error, network error or timeout."""


class ObjectFormatError(BackendError):
    """A stored object is truncated, corrupted, of another model or of another format version."""
