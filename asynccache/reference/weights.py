"""Weights of the reference model: seeded random initialisation and safetensors I/O.

Primitives:

- :func:`init_random_` — fill every parameter from one seeded generator on the model's device
  (same seed + device + dtype → same weights; CPU and CUDA generators differ).
- :func:`load_tensors_` — copy a ``{name: tensor}`` mapping into the model after checking that the
  names and shapes are exactly the model's (casting to the model's dtype).
- :func:`save_safetensors` / :func:`read_safetensors` — a flat safetensors file with
  Hugging Face-style names (``model.layers.3.linear_attn.A_log``, ``lm_head.weight``).

Initialisation keeps the residual stream and the logits O(1) at any size: embeddings N(0, 1),
input projections N(0, 1/fan_in), output projections additionally shrunk by √(2·layers), norms
one, ``A_log = log U(1, 16)`` and ``dt_bias`` the inverse softplus of a log-uniform step in
[1e-3, 1e-1] (Mamba's choice), so recurrent layers keep memory over hundreds of tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from os import PathLike

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from asynccache.errors import ConfigError

__all__ = ["init_random_", "load_tensors_", "read_safetensors", "save_safetensors"]

_RESIDUAL_OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
_INPUT_PROJ = ("qkv_proj.weight", "in_proj_qkvz.weight", "in_proj_ba.weight", "gate_up_proj.weight", "lm_head.weight")


@torch.no_grad()
def init_random_(model: nn.Module, *, seed: int, num_layers: int) -> None:
    """Fill every parameter of ``model`` (in ``named_parameters`` order) from ``seed``."""
    params = list(model.named_parameters())
    device = params[0][1].device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in params:
        p.copy_(_init_value(name, p, gen, num_layers))


def _init_value(name: str, p: torch.Tensor, gen: torch.Generator, num_layers: int) -> torch.Tensor:
    shape, device = p.shape, p.device

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo

    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith(_RESIDUAL_OUT):
        return normal(1.0 / math.sqrt(shape[1] * 2 * num_layers))
    if name.endswith(_INPUT_PROJ):
        return normal(1.0 / math.sqrt(shape[1]))
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith("A_log"):
        return uniform(1.0, 16.0).log()
    if name.endswith("dt_bias"):
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(dt)
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    raise ConfigError(f"no initialisation rule for parameter {name!r}")


@torch.no_grad()
def load_tensors_(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters (cast to its dtype); names and shapes must
    match exactly, and the tensors be floating point."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ConfigError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model wants {tuple(p.shape)}")
        if not t.is_floating_point():  # floats are cast to the model's dtype; integers are not weights
            raise ConfigError(f"checkpoint tensor {name!r} is {t.dtype}, not a floating-point weight")
        p.copy_(t)


def save_safetensors(model: nn.Module, path: str | PathLike[str], *, metadata: Mapping[str, str] | None = None) -> None:
    """Write every parameter of ``model`` (on CPU, in its dtype) to a safetensors file."""
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})


def read_safetensors(path: str | PathLike[str], *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, loaded onto ``device``."""
    dev = torch.device(device)
    where = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
    try:
        with safe_open(str(path), framework="pt", device=where) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"cannot read safetensors checkpoint {path}: {e}") from e
