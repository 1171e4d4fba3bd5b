"""Reference hybrid model and async scheduler: the cache used end to end (demo, benchmarks, tests).

- ``asynccache.reference.model`` — :class:`HybridModel`, :class:`SequenceInput`, :class:`ForwardBatch`.
- ``asynccache.reference.gdn`` — gated delta rule math (recurrent and chunked).
- ``asynccache.reference.speed`` — prefill throughput measurement.
"""

from asynccache.reference.batch import ForwardBatch, SequenceInput
from asynccache.reference.model import HybridModel

__all__ = ["ForwardBatch", "HybridModel", "SequenceInput"]
