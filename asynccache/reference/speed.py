"""Prefill throughput of the reference model (cold prompts, no cache), so cache benchmarks can
check that time-to-first-token savings are not inflated by a slow model.

Primitives:

- :class:`PrefillResult` — one measurement (timed iterations, tokens/s, host enqueue time).
- :func:`make_prefill_batch` — ``batch`` random prompts of ``seq_len`` tokens on their own pages and slots.
- :func:`chunk_batches` — such a batch as the forwards of a chunked prefill.
- :func:`prefill_tokens_per_s` — build (or reuse) a model and pools, warm up, time prefills (whole or chunked).

Command line (on a GPU)::

    python -m asynccache.reference.speed --preset hybrid-3b --seq-len 8192 --batch 1 4 8 --profile

Each timed iteration prefills every prompt from position 0 in one forward (no snapshots, so one
pass) — or, with ``--chunk-size N``, in forwards of ``N`` tokens a prompt, each continuing the
one before, as a scheduler's chunked prefill does — and synchronises the device before stopping
the clock. ``enqueue_s`` is the host time until the last ``forward`` returned, before the
synchronisation: close to ``seconds`` means the run is bound by kernel launches, not by the GPU.
``--cuda-graphs off`` computes the recurrent layers eagerly, ``both`` measures eagerly and then
with their CUDA graphs (``asynccache.reference.graphs``; the default ``auto`` uses them on CUDA),
in the same run::

    python -m asynccache.reference.speed --seq-len 8192 --batch 1 --chunk-size 1024 --cuda-graphs both

``--length-step K`` makes every iteration (warm-up included) a prompt of a length not run before,
``seq_len + i·K`` tokens, as a server sees them (tokens/s then counts each iteration's own
tokens); ``--bucket-passes off`` computes the recurrent layers at each segment's own length, and
``both`` measures without and then with padding to bucket lengths
(``asynccache.reference.padding``, the default on CUDA)::

    python -m asynccache.reference.speed --seq-len 1216 --batch 1 --length-step 7 --iters 5 --bucket-passes both
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from asynccache.bench.options import device_name, nonnegative_int, positive_int
from asynccache.errors import ConfigError
from asynccache.pools import DeviceKVPool, DeviceMambaPool
from asynccache.reference.batch import ForwardBatch, SequenceInput
from asynccache.reference.model import MODEL_DTYPE_NAMES, HybridModel
from asynccache.spec import HybridSpec, dtype_from_name

__all__ = ["PrefillResult", "chunk_batches", "main", "make_prefill_batch", "prefill_tokens_per_s"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillResult:
    preset: str
    seq_len: int
    batch: int
    device: str
    dtype: str
    num_parameters: int
    seconds: tuple[float, ...]  # per timed iteration, synchronised
    enqueue_s: tuple[float, ...]  # host time until the last forward returned
    chunk_size: int | None = None  # tokens a prompt per forward (None: the whole prompt)
    cuda_graphs: bool = False  # recurrent layers replayed from CUDA graphs
    bucket_passes: bool = False  # recurrent segments padded to bucket lengths
    length_step: int = 0  # iteration i (warm-up included) prefills seq_len + i·length_step tokens
    warmup: int = 0

    @property
    def lengths(self) -> tuple[int, ...]:
        """The prompt length of each timed iteration."""
        return tuple(self.seq_len + (self.warmup + i) * self.length_step for i in range(len(self.seconds)))

    @property
    def tokens_per_s(self) -> float:
        if not self.length_step:
            return self.batch * self.seq_len / statistics.median(self.seconds)
        return statistics.median(self.batch * n / s for n, s in zip(self.lengths, self.seconds, strict=True))

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "lengths": self.lengths, "tokens_per_s": round(self.tokens_per_s, 1)}


def make_prefill_batch(spec: HybridSpec, seq_len: int, batch: int, *, seed: int = 0) -> ForwardBatch:
    """``batch`` random prompts of ``seq_len`` tokens; sequence i uses slot i and its own pages."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-seq_len // spec.page_size)
    return ForwardBatch(
        sequences=tuple(
            SequenceInput(
                token_ids=torch.randint(0, spec.vocab_size, (seq_len,), generator=gen),
                start=0,
                kv_page_indices=torch.arange(i * pages_per_seq, (i + 1) * pages_per_seq, dtype=torch.int64),
                state_slot=i,
            )
            for i in range(batch)
        )
    )


def chunk_batches(batch: ForwardBatch, chunk_size: int) -> list[ForwardBatch]:
    """``batch``'s prompts (each from position 0) as forwards of ``chunk_size`` tokens a prompt,
    each continuing the one before (a prompt shorter than the others leaves them early)."""
    out = []
    longest = max(s.token_ids.numel() for s in batch.sequences)
    for begin in range(0, longest, chunk_size):
        out.append(
            ForwardBatch(
                sequences=tuple(
                    SequenceInput(
                        token_ids=s.token_ids[begin : begin + chunk_size],
                        start=begin,
                        kv_page_indices=s.kv_page_indices,
                        state_slot=s.state_slot,
                    )
                    for s in batch.sequences
                    if begin < s.token_ids.numel()
                )
            )
        )
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_tokens_per_s(
    preset: str = "hybrid-3b",
    seq_len: int = 8192,
    batch: int = 4,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 1,
    iters: int = 3,
    seed: int = 0,
    model: HybridModel | None = None,
    chunk_size: int | None = None,
    length_step: int = 0,
) -> PrefillResult:
    """Time ``iters`` cold prefills of ``batch × seq_len`` tokens after ``warmup`` untimed ones
    (``chunk_size``: each prompt in forwards of that many tokens, see :func:`chunk_batches`;
    ``length_step``: iteration i, warm-up included, prefills prompts of ``seq_len + i·length_step``
    tokens)."""
    spec = model.spec if model is not None else HybridSpec.preset(preset)
    dev = torch.device(device)
    if model is None:
        model = HybridModel(spec, device=dev, dtype=dtype, seed=seed)
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"chunk_size must be >= 1, got {chunk_size}")
    if length_step < 0:
        raise ConfigError(f"length_step must be >= 0, got {length_step}")
    lengths = [seq_len + i * length_step for i in range(warmup + iters)]
    pages_per_seq = -(-lengths[-1] // spec.page_size)
    kv_pool = DeviceKVPool(spec, batch * pages_per_seq, device=dev)
    state_pool = DeviceMambaPool(spec, batch, device=dev)

    def forwards_of(n: int) -> list[ForwardBatch]:
        fwd_batch = make_prefill_batch(spec, n, batch, seed=seed)
        return [fwd_batch] if chunk_size is None else chunk_batches(fwd_batch, chunk_size)

    built = {n: forwards_of(n) for n in set(lengths)}  # each length's batch built once
    runs = [built[n] for n in lengths]

    async def measure() -> tuple[list[float], list[float]]:
        seconds, enqueue = [], []
        for i, forwards in enumerate(runs):
            _sync(dev)
            t0 = time.perf_counter()
            for fwd in forwards:
                await model.forward(fwd, kv_pool, state_pool)
            t1 = time.perf_counter()
            _sync(dev)
            t2 = time.perf_counter()
            if i >= warmup:
                enqueue.append(t1 - t0)
                seconds.append(t2 - t0)
        return seconds, enqueue

    seconds, enqueue = asyncio.run(measure())
    return PrefillResult(
        preset=spec.model_id,
        seq_len=seq_len,
        batch=batch,
        device=str(dev),
        dtype=str(model.dtype).removeprefix("torch."),
        num_parameters=model.num_parameters,
        seconds=tuple(seconds),
        enqueue_s=tuple(enqueue),
        chunk_size=chunk_size,
        cuda_graphs=model.layer_graphs is not None,
        bucket_passes=model.bucket_passes,
        length_step=length_step,
        warmup=warmup,
    )


def _set_tf32(enabled: bool) -> None:
    """Let fp32 matrix products use TF32 (process-wide; the command line only)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = enabled


def _profile(model: HybridModel, seq_len: int, batch: int, row_limit: int = 30) -> str:
    """A torch profiler table of one prefill, sorted by device time."""
    from torch.profiler import ProfilerActivity, profile

    spec = model.spec
    pages_per_seq = -(-seq_len // spec.page_size)
    kv_pool = DeviceKVPool(spec, batch * pages_per_seq, device=model.device)
    state_pool = DeviceMambaPool(spec, batch, device=model.device)
    fwd_batch = make_prefill_batch(spec, seq_len, batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    async def prefill() -> None:
        await model.forward(fwd_batch, kv_pool, state_pool)

    asyncio.run(prefill())  # warm
    with profile(activities=activities) as prof:
        asyncio.run(prefill())
        _sync(model.device)
    averages = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if model.device.type == "cuda" else ()
    for key in (*keys, "self_cpu_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=row_limit)
        except (AttributeError, KeyError, RuntimeError):
            continue
    return averages.table(row_limit=row_limit)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--preset", default="hybrid-3b")
    parser.add_argument("--seq-len", type=positive_int, default=8192)
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[4])
    parser.add_argument(
        "--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N"
    )
    parser.add_argument("--dtype", default=None, choices=MODEL_DTYPE_NAMES, metavar="DTYPE",
                        help="fp32, bf16 or fp16 (default: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    parser.add_argument("--chunk-size", type=positive_int, default=None,
                        help="prefill each prompt in forwards of this many tokens (default: one forward)")  # fmt: skip
    parser.add_argument("--cuda-graphs", choices=("auto", "off", "both"), default="auto",
                        help="recurrent layers from CUDA graphs: auto (on CUDA), off (eager), both (eager, then graphs)")  # fmt: skip
    parser.add_argument("--bucket-passes", choices=("auto", "off", "both"), default="auto",
                        help="recurrent segments padded to bucket lengths: auto (on CUDA), off, both (off, then on)")  # fmt: skip
    parser.add_argument("--length-step", type=nonnegative_int, default=0,
                        help="iteration i (warm-up included) prefills seq-len + i x this many tokens: "
                        "a length not run before each time (default 0: one length)")  # fmt: skip
    parser.add_argument("--warmup", type=nonnegative_int, default=1)
    parser.add_argument("--iters", type=positive_int, default=3)
    parser.add_argument("--tf32", action="store_true", help="also measure with TF32 fp32 matmuls (recurrent core)")
    parser.add_argument("--profile", action="store_true", help="print a profiler table of one prefill (first batch size)")
    parser.add_argument("--json", default=None, help="append results as JSON lines to this file")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
        dtype = dtype_from_name(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        spec = HybridSpec.preset(args.preset)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cuda_graphs != "auto" and device.type != "cuda":
        print("error: --cuda-graphs off/both needs a CUDA device (there are no graphs on the CPU)", file=sys.stderr)
        return 2
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    model = HybridModel(spec, device=device, dtype=dtype)
    _sync(device)
    print(f"# built {args.preset}: {model.num_parameters / 1e9:.3f} B parameters in {time.perf_counter() - t0:.1f} s", flush=True)

    graphs, buckets = model.layer_graphs, model.bucket_passes
    graph_modes = {"auto": [graphs is not None], "off": [False], "both": [False, True]}[args.cuda_graphs]
    bucket_modes = {"auto": [buckets], "off": [False], "both": [False, True]}[args.bucket_passes]
    variants = [False, True] if args.tf32 else [False]
    results = []
    for tf32, with_graphs, bucketed in itertools.product(variants, graph_modes, bucket_modes):
        _set_tf32(tf32)
        model.layer_graphs = graphs if with_graphs else None
        model.bucket_passes = bucketed
        for batch in args.batch:
            res = prefill_tokens_per_s(
                args.preset,
                args.seq_len,
                batch,
                device=device,
                warmup=args.warmup,
                iters=args.iters,
                model=model,
                chunk_size=args.chunk_size,
                length_step=args.length_step,
            )
            row = {**res.as_dict(), "tf32": tf32}
            results.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    _set_tf32(False)
    model.layer_graphs, model.bucket_passes = graphs, buckets
    if args.profile:
        print(_profile(model, args.seq_len, args.batch[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
