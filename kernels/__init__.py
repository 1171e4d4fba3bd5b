"""Page / state-slot copy kernels between device and host pools.

``copy_items`` copies a list of (source index → destination index) items between two pools for
a range of layers, whatever their layouts (layer_first / page_first) and devices. On CUDA it
launches one Triton kernel per call (``kernels.triton_copy``; pinned host memory addressed
directly by the GPU, at most ``max_ctas`` CTAs, default ``DEFAULT_MAX_CTAS``); on CPU tensors it
runs the torch-indexing path. ``kernels.plan`` holds the launch arithmetic and the measured
per-direction tunings; ``kernels.testing`` the copy conformance helpers the tests share;
``python -m kernels.tune`` re-measures the tunings on a GPU.
"""

from kernels.api import PoolBufferLike, copy_items, validate_copy
from kernels.plan import DEFAULT_MAX_CTAS

__all__ = ["DEFAULT_MAX_CTAS", "PoolBufferLike", "copy_items", "validate_copy"]
