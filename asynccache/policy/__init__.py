"""Admission, eviction and write policies of the hybrid radix tree (synchronous objects).

Admission (:class:`AdmissionPolicy`): :class:`EndsAdmission` (default),
:class:`EveryPageAdmission`, :class:`BlockGridAdmission`. Eviction (:class:`EvictionPolicy`):
:class:`LRUEviction` (default), :class:`ScoredEviction` as the base of utility-aware orders.
Write (:class:`WritePolicy`): ``write_through`` (default), ``write_through_selective``,
``write_back``.
"""

from asynccache.policy.admission import (
    BlockGridAdmission,
    EndsAdmission,
    EveryPageAdmission,
    end_positions,
)
from asynccache.policy.base import (
    AdmissionContext,
    AdmissionPolicy,
    EvictionPolicy,
    ScoredEviction,
)
from asynccache.policy.lru import LRUEviction
from asynccache.policy.write import WriteMode, WritePolicy

__all__ = [
    "AdmissionContext",
    "AdmissionPolicy",
    "BlockGridAdmission",
    "EndsAdmission",
    "EveryPageAdmission",
    "EvictionPolicy",
    "LRUEviction",
    "ScoredEviction",
    "WriteMode",
    "WritePolicy",
    "end_positions",
]
