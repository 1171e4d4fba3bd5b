"""Named hybrid-model configs (the ``config.json`` fields that matter for the cache), so specs,
tests and benchmarks need no model hub: ``HybridSpec.preset(name)``."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

#: Public configs (the fields that matter for the cache), so benchmarks run without a hub.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-next-80b": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "intermediate_size": 5120,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
    # ~3B-parameter Qwen3-Next-shaped dense hybrid used by the reference model on GPU.
    "hybrid-3b": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 32,
        "full_attention_interval": 4,
        "hidden_size": 2560,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "intermediate_size": 9728,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    },
    # Small model for the CPU demo: compute large enough that cache hits show in TTFT.
    "small": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_value_head_dim": 64,
        "linear_num_value_heads": 8,
        "intermediate_size": 1536,
        "vocab_size": 1024,
        "torch_dtype": "float32",
    },
    # Tiny model for CPU tests.
    "tiny": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "torch_dtype": "float32",
    },
}
