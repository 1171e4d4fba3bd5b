"""A copy's cost to the compute beside it (``asynccache bench transfer``, ``python -m
kernels.tune``): the slowdown of bf16 matmuls next to one long copy, and what the matmul's
kernel occupies on an SM. CUDA only.

Primitives:

- ``gemm_slowdown(src, dst, src_indices, dst_indices, *, ctas, n, copy_seconds, tuning=,
  rounds=, method=)`` — ``t_concurrent / t_alone − 1`` of ``n³`` matmuls beside the copy (the
  Triton kernel capped at ``ctas`` CTAs, or the copy engines).
- ``gemm_kernel_footprint(n)`` — name, grid, block, registers and shared memory of the kernel
  an ``n³`` bf16 matmul runs (from the profiler's trace).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

import torch

from asynccache.pools.base import ItemPool

__all__ = ["gemm_kernel_footprint", "gemm_slowdown"]


def gemm_slowdown(
    src: ItemPool,
    dst: ItemPool,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    ctas: int,
    n: int,
    copy_seconds: float,
    tuning: object | None = None,
    rounds: int = 3,
    method: str = "triton",
) -> float:
    """Relative slowdown of ``n³`` bf16 matmuls next to one long copy (the Triton kernel capped
    at ``ctas`` CTAs, or with ``method="dma"`` the copy engines).

    The copy is the same call launched back to back (a copy may not write an item twice, so
    the index lists are not repeated), enqueued on another stream before the matmuls and sized
    to outlast them threefold, so it runs the whole time, as during a long load-back; that it
    did outlast them is checked with events (the copy is made longer and the round repeated
    otherwise). Returns ``t_concurrent / t_alone − 1`` (medians).
    """
    from kernels.dma_copy import launch_dma
    from kernels.triton_copy import launch_copy

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def gemms(k: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(gemm_stream):
            start.record()
            for _ in range(k):
                torch.mm(a, b, out=c)
            end.record()
        return start, end

    gemms(3)
    torch.cuda.synchronize()
    s, e = gemms(4)
    torch.cuda.synchronize()
    one_gemm_s = s.elapsed_time(e) / 4e3
    k = max(4, int(0.02 / one_gemm_s))  # ~20 ms of matmuls
    repeat = max(1, int(3 * k * one_gemm_s / copy_seconds) + 1)
    alone: list[float] = []
    together: list[float] = []
    while len(together) < rounds:
        s, e = gemms(k)
        torch.cuda.synchronize()
        t_alone = s.elapsed_time(e)
        copy_start, copy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(copy_stream):
            copy_start.record()
            for _ in range(repeat):
                if method == "dma":
                    launch_dma(src, dst, src_indices, dst_indices, stream=copy_stream)
                else:
                    launch_copy(
                        src, dst, src_indices, dst_indices,
                        max_ctas=ctas, stream=copy_stream, tuning=tuning,  # type: ignore[arg-type]
                    )  # fmt: skip
            copy_end.record()
        s, e = gemms(k)
        torch.cuda.synchronize()
        if copy_start.elapsed_time(copy_end) < copy_start.elapsed_time(e):
            if repeat > 64 * (1 + int(3 * k * one_gemm_s / copy_seconds)):
                raise RuntimeError("the copy keeps ending before the matmuls: cannot measure the slowdown")
            repeat *= 2  # the matmuls outlasted the copy: measure again with a longer copy
            continue
        alone.append(t_alone)
        together.append(s.elapsed_time(e))
    return statistics.median(together) / statistics.median(alone) - 1.0


def gemm_kernel_footprint(n: int) -> dict[str, object]:
    """Name, grid, block, registers and shared memory of the kernel an ``n³`` bf16 matmul runs
    (from the profiler's trace): what a copy CTA has to fit beside on an SM."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.mm(a, a)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [ev for ev in events if ev.get("cat") == "kernel"]
    if not kernels:
        return {"error": "no kernel in the profiler trace"}
    kernel = max(kernels, key=lambda ev: ev.get("dur", 0))
    args = kernel.get("args", {})
    keys = ("grid", "block", "registers per thread", "shared memory", "blocks per SM", "warps per SM")
    return {"name": str(kernel.get("name", ""))[:120], **{key: args.get(key) for key in keys}}
