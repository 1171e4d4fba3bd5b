"""The command line of ``asynccache bench prefix``: its options (:func:`add_arguments`) and the
check that they can measure what the bench reports (:func:`check_arguments`: a prefix that ends
on a page boundary, new tokens that fit in one page, a storage directory the disk tier can write
to). Both are re-exported by :mod:`asynccache.bench.prefix`, the bench's module.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from asynccache.bench.options import device_name
from asynccache.bench.storage import add_option_argument
from kernels.api import COPY_METHOD_HELP

__all__ = ["add_arguments", "check_arguments"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="hybrid-3b", help="model preset (default hybrid-3b)")
    p.add_argument("--prefix-tokens", type=int, default=32768, help="cached prefix length, a multiple of --page-size")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens after the prefix, 1 … --page-size (default 64)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="repeats of cold and disk (default 5)")
    p.add_argument("--pairs", type=int, default=15, help="alternating device, host repeats (default 15)")
    p.add_argument(
        "--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N"
    )
    p.add_argument("--copy-method", default="auto", help=COPY_METHOD_HELP)
    p.add_argument(
        "--bucket-passes",
        choices=("auto", "on", "off"),
        default="auto",
        help="the model's recurrent segments padded to bucket lengths, so new lengths replay CUDA graphs "
        "(auto: on CUDA; asynccache.reference.padding)",
    )
    p.add_argument(
        "--warm-up-graphs",
        choices=("on", "off"),
        default="on",
        help="capture the CUDA graphs of a prompt's first pass at every bucket length before measuring, as a "
        "server does at start, so a split restore's head replays them (on CUDA with --bucket-passes; "
        "SchedulerConfig.warm_up_tokens)",
    )
    p.add_argument(
        "--storage-dir", default=None, help="local directory for the disk tier, made if missing (default: temp)"
    )
    add_option_argument(
        p,
        "--storage-option",
        "an option of the local-disk backend, repeatable (e.g. direct_io=true, max_concurrency=16, "
        "compression=zstd, read_processes=0: the reader threads instead of the processes the cache uses on CUDA)",
    )
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument(
        "--plot", default=None, help="write a PNG of TTFT per tier and of the device/host pairs to this path (ending in .png)"
    )
    p.add_argument(
        "--from-json",
        default=None,
        help="re-print the table and re-plot a previous --json file instead of measuring (with --plot; --json is refused)",
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot measure what the bench reports (``None`` when they can).

    The prefix must end on a page boundary and the new tokens must fit in one page: the state
    the cache keeps before a prompt's end is at its last page boundary, so that boundary has to
    be the prefix's end for a request with new tokens to hit the whole prefix."""
    if args.page_size < 1 or args.prefix_tokens < args.page_size or args.repeats < 1 or args.pairs < 1:
        return "need --page-size >= 1, --prefix-tokens >= --page-size, --repeats >= 1 and --pairs >= 1"
    if args.prefix_tokens % args.page_size:
        return f"--prefix-tokens ({args.prefix_tokens}) must be a multiple of --page-size ({args.page_size})"
    if not 1 <= args.new_tokens <= args.page_size:
        return (
            f"--new-tokens ({args.new_tokens}) must be between 1 and --page-size ({args.page_size}): the state "
            "kept before a prompt's end is at its last page boundary, which must be the prefix's end"
        )
    if args.storage_dir and os.path.exists(args.storage_dir) and not os.path.isdir(args.storage_dir):
        return f"--storage-dir {args.storage_dir}: not a directory"
    if args.storage_dir:
        # Made (if missing) and written to now: a disk tier that cannot write stores nothing, and
        # the raw reads after the run's measurements failed on it.
        try:
            os.makedirs(args.storage_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.storage_dir):
                pass
        except OSError as e:
            return f"--storage-dir {args.storage_dir}: cannot write there ({e.strerror or e})"
    return None
