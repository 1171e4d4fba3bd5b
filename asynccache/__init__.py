"""asynccache: an asyncio hierarchical prefix cache for hybrid (attention + Mamba) models."""

from asynccache.errors import (
    AllocationError,
    AsyncCacheError,
    BackendError,
    CapacityError,
    ClosedError,
    ConfigError,
    ObjectFormatError,
    PinningError,
    SchedulerError,
    SharedMemoryError,
    SpecError,
    StaleMatchError,
    TraceFormatError,
    TransferError,
    TreeError,
)
from asynccache.spec import HybridSpec, LinearGeometry, StateComponent

__all__ = [
    "AllocationError",
    "AsyncCacheError",
    "BackendError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "HybridSpec",
    "LinearGeometry",
    "ObjectFormatError",
    "PinningError",
    "SchedulerError",
    "SharedMemoryError",
    "SpecError",
    "StaleMatchError",
    "StateComponent",
    "TraceFormatError",
    "TransferError",
    "TreeError",
]

__version__ = "0.1.0"
