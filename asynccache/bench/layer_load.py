"""The per-layer load of ``asynccache bench transfer``: the Mamba states and KV tokens of a
spec's pools loaded host → device one ``copy_items`` call per layer, over all layers in order,
as the controller does before a forward pass.

Primitives:

- ``per_layer_load(spec, device, runs, link_gbps, *, states, tokens, consecutive, reps,
  progress)`` — one row per (method, CTA cap) of ``runs`` (then, on CUDA, the automatic choice
  at cap 8): bytes, GB/s, the ratio to ``link_gbps``, the calls, and the host time they take to
  enqueue every layer.
- ``method_label(method, cap)`` — how the tables name such a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from asynccache.bench.copy_timing import UNCAPPED, fill_random, time_median_s
from asynccache.pools.base import PoolLayout
from asynccache.pools.device import DeviceKVPool, DeviceMambaPool
from asynccache.pools.host import HostKVPool, MambaPoolHost
from asynccache.spec import HybridSpec
from kernels.api import copy_items

__all__ = ["method_label", "per_layer_load"]


def per_layer_load(
    spec: HybridSpec,
    device: torch.device,
    runs: list[tuple[str, int]],
    link_gbps: float,
    *,
    states: int | None,
    tokens: int | None,
    consecutive: bool,
    reps: int,
    progress: Callable[[str], None],
) -> list[dict[str, object]]:
    """Per-layer H2D load of ``states`` Mamba states and ``tokens`` tokens of KV, all layers:
    each (method, cap) of ``runs``, then (on CUDA) the automatic choice at cap 8."""
    cuda = device.type == "cuda"
    num_states = states if states is not None else (64 if cuda else 1)
    num_pages = (tokens if tokens is not None else (32768 if cuda else 512)) // spec.page_size
    pin = True if cuda else None
    host_kv = HostKVPool(spec, num_pages=num_pages, layout=PoolLayout.PAGE_FIRST, pin=pin)
    host_mamba = MambaPoolHost(spec, num_slots=num_states, layout=PoolLayout.PAGE_FIRST, pin=pin)
    dev_kv = DeviceKVPool(spec, num_pages, device=device)
    dev_mamba = DeviceMambaPool(spec, num_states, device=device)
    for i, pool in enumerate((host_kv, host_mamba, dev_kv, dev_mamba)):
        fill_random(pool.buffer, 100 + i)
    gen = torch.Generator().manual_seed(3)
    if consecutive:
        kv_idx, st_idx = (torch.arange(num_pages),) * 2, (torch.arange(num_states),) * 2
    else:
        kv_idx = (torch.randperm(num_pages, generator=gen), torch.randperm(num_pages, generator=gen))
        st_idx = (torch.randperm(num_states, generator=gen), torch.randperm(num_states, generator=gen))
    total = num_pages * spec.kv_page_bytes + num_states * spec.state_bytes
    order = "consecutive" if consecutive else "random"
    progress(
        f"per-layer load: {num_states} states + {num_pages * spec.page_size} tokens of KV = {total / 1e9:.2f} GB, "
        f"{order} indices"
    )
    rows: list[dict[str, object]] = []
    if cuda:
        runs = [*runs, ("auto", 8)]
    for method, cap in runs:
        ctas = UNCAPPED if cap == 0 else cap

        def load_all_layers(ctas: int = ctas, method: str = method) -> None:
            for layer_id in range(spec.num_layers):
                if layer_id in spec.attention_layer_ids:
                    src, dst, (si, di) = host_kv, dev_kv, kv_idx
                elif layer_id in spec.mamba_layer_ids:
                    src, dst, (si, di) = host_mamba, dev_mamba, st_idx
                else:
                    continue
                li = src.layer_index(layer_id)
                copy_items(
                    src, dst, si, di, layer_begin=li, layer_end=li + 1, max_ctas=ctas,
                    method=None if method == "torch" else method,
                )  # fmt: skip

        secs = time_median_s(load_all_layers, reps=min(reps, 3) if cuda else 1, device=device)
        t0 = time.perf_counter()
        load_all_layers()  # host time to enqueue every layer (what the caller's thread spends)
        issue_ms = (time.perf_counter() - t0) * 1e3
        if cuda:
            torch.cuda.synchronize(device)
        gbps = total / secs / 1e9
        launches = len(spec.attention_layer_ids) + len(spec.mamba_layer_ids)
        rows.append(
            {
                "method": method, "ctas": cap, "bytes": total, "gbps": gbps, "ratio": gbps / link_gbps,
                "launches": launches, "issue_ms": issue_ms, "indices": order,
            }
        )  # fmt: skip
        progress(
            f"per-layer load, {method_label(method, cap)}: {gbps:.1f} GB/s ({gbps / link_gbps:.2f} of link), "
            f"{issue_ms:.1f} ms to enqueue"
        )
    return rows


def method_label(method: str, cap: int) -> str:
    """How the tables name a (method, CTA cap) run: ``dma``, ``torch``, ``triton cap 8``."""
    if method == "dma":
        return "dma"
    if method == "torch":
        return "torch"
    return f"{method} cap {cap or 'none'}"
