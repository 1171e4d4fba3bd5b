"""Argument types shared by the benchmarks: counts that must be positive, lists of them,
positive numbers, seeds and devices this machine has, refused by the parser (a usage error,
exit status 2) rather than failing deep in a run; and the spec a ``--preset`` names."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from asynccache.spec import PRESETS, HybridSpec

__all__ = [
    "MAX_SEED",
    "device_name",
    "distinct_positive_int_list",
    "nonnegative_int",
    "positive_float",
    "positive_int",
    "positive_int_list",
    "seed_int",
    "spec_from_preset",
    "unit_fraction",
]

#: The largest seed: torch's generators take a signed 64-bit one.
MAX_SEED = 2**63 - 1


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0)


def unit_fraction(text: str) -> float:
    """A number in ``[0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def seed_int(text: str) -> int:
    """A seed: an integer in ``[0, MAX_SEED]``."""
    value = _int_at_least(text, 0)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_SEED} (2**63 - 1), got {value}")
    return value


def spec_from_preset(preset: str, *, page_size: int) -> HybridSpec:
    """The spec ``--preset`` names: a preset's name, else an HF config (a path that exists, a
    file of any name or a folder holding ``config.json``, or a name ending in ``.json``)."""
    if preset not in PRESETS and (preset.endswith(".json") or Path(preset).exists()):
        return HybridSpec.from_hf_config(preset, page_size=page_size)
    return HybridSpec.preset(preset, page_size=page_size)


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers (at least one)."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("needs at least one value")
    return [positive_int(t.strip()) for t in items]


def distinct_positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers (at least one), none given twice."""
    values = positive_int_list(text)
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"given more than once: {', '.join(map(str, repeated))}")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def device_name(text: str) -> str:
    """A torch device this machine has: ``cpu``, or ``cuda`` / ``cuda:N`` where CUDA is available
    (returned as given; ``cpu:N`` as ``cpu``)."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text}: the benchmarks run on cpu or cuda")
    return "cpu" if dev.type == "cpu" else text
