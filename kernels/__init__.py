"""Page / state-slot copies between device and host pools.

``copy_items`` copies a list of (source index → destination index) items between two pools for a
range of layers, whatever their layouts (layer_first / page_first) and devices. On CUDA it
chooses per call (``method=``, default ``"auto"``: ``kernels.api.select_method``) between one
Triton kernel launch (``kernels.triton_copy``; pinned host memory addressed directly by the GPU,
at most ``max_ctas`` CTAs, default ``DEFAULT_MAX_CTAS``) and CUDA memcpys on the copy engines
(``kernels.dma_copy``: planned by ``kernels.dma_plan``, issued by ``kernels.dma_engines`` over
``kernels.cudart``; no SMs, for items of at least
``DMA_MIN_RUN_BYTES``); on CPU tensors it runs the torch-indexing path. ``layer_copier`` is the
same copy validated (and, on the copy engines, planned) once and issued a layer per call, for
layer-by-layer loads; ``PoolPair`` makes the checks of two pools once for many such copiers.
``kernels.plan`` holds the launch arithmetic, the measured per-direction tunings and the DMA
threshold; ``kernels.testing`` the copy conformance helpers the tests share; ``python -m
kernels.tune`` re-measures the tunings (``--dma``: the DMA engines and threshold) on a GPU.
"""

from kernels.api import (
    COPY_METHODS,
    LayerCopy,
    PoolBufferLike,
    PoolPair,
    copy_items,
    layer_copier,
    select_method,
    validate_copy,
)
from kernels.plan import DEFAULT_MAX_CTAS, DMA_MIN_RUN_BYTES

__all__ = [
    "COPY_METHODS",
    "DEFAULT_MAX_CTAS",
    "DMA_MIN_RUN_BYTES",
    "LayerCopy",
    "PoolBufferLike",
    "PoolPair",
    "copy_items",
    "layer_copier",
    "select_method",
    "validate_copy",
]
