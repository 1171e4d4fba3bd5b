"""Page / state-slot copy kernels between device and host pools.

``copy_items`` copies a list of (source index → destination index) items between two pools for
a range of layers, whatever their layouts (layer_first / page_first) and devices. On CUDA it
launches Triton kernels (one launch per call); on CPU tensors it runs the torch-indexing path.
"""

from kernels.api import PoolBufferLike, copy_items, validate_copy

__all__ = ["PoolBufferLike", "copy_items", "validate_copy"]
