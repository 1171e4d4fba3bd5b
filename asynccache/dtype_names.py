"""Names of the torch dtypes a spec, a config or a command line may give.

Primitives:

- :func:`dtype_from_name` — ``"bfloat16"``, ``"fp32"``, ``torch.float16`` … as a torch dtype;
  an unknown name is a :class:`~asynccache.errors.SpecError` listing the known ones.
"""

from __future__ import annotations

import torch

from asynccache.errors import SpecError

__all__ = ["dtype_from_name"]

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Map ``"bfloat16"``, ``"fp32"``, ``torch.float16`` … to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.").lower()
    try:
        return _DTYPES[key]
    except KeyError:
        raise SpecError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None
