"""The ``asynccache`` command line.

``asynccache bench NAME [options]`` runs one benchmark; each lives in ``asynccache/bench/NAME.py``
and exposes ``add_arguments(parser)`` and ``run(args) -> int``. ``asynccache bench NAME --help``
lists its options.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

from asynccache.errors import AsyncCacheError, ConfigError

BENCHMARKS: dict[str, str] = {
    "transfer": "scattered page/state copies vs contiguous pinned memcpy (H2D, D2H, CTA caps)",
    "tree": "radix tree match_prefix / insert latency for 1k…128k-token prompts",
    "overlap": "forward with layer-by-layer load-back vs prefix on device vs load-all-first",
    "storage": "page-object write/read through a backend vs the raw path of the same URI",
    "multiturn": "multi-turn conversations: hit rate and TTFT per round for each offload mode",
    "prefix": "TTFT of a long cached prefix served from device, host and local disk vs cold prefill",
    "trace": "replay a Mooncake-format trace through the cache under admission/eviction policies",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynccache",
        description="asynccache: a hierarchical prefix cache for hybrid models. "
        "`asynccache bench NAME --help` lists a benchmark's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, help_text in BENCHMARKS.items():
        if importlib.util.find_spec(f"asynccache.bench.{name}") is None:
            continue
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(f"asynccache.bench.{name}")
        module.add_arguments(p)
        outputs = [(flag, a.dest) for a in p._actions for flag in a.option_strings if flag in OUTPUT_OPTIONS]
        p.set_defaults(_module=module, _outputs=outputs)
    return parser


#: The options that name a file a bench writes (whatever their ``dest``), checked before the run.
OUTPUT_OPTIONS = ("--json", "--plot")


def _unwritable_output(args: argparse.Namespace) -> str | None:
    """Why an output path (``--json``, ``--plot``) cannot be written, checked before a run that
    may take minutes; ``None`` when they can. A plot is a PNG: its path ends in ``.png``. A path
    that does not exist yet is created and removed again (the only sure test of a folder that
    the permission bits call writable, such as one of ``/proc``)."""
    for flag, dest in getattr(args, "_outputs", ()):
        path = getattr(args, dest, None)
        if not path:
            continue
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return f"{flag} {path}: no such directory {folder}"
        if os.path.isdir(path):
            return f"{flag} {path}: is a directory"
        if flag == "--plot" and not path.lower().endswith(".png"):
            return f"{flag} {path}: a plot is a PNG, its path must end in .png"
        existed = os.path.exists(path)
        try:
            with open(path, "ab"):
                pass
        except OSError as e:
            return f"{flag} {path}: not writable ({e.strerror})"
        if not existed:
            os.unlink(path)
    return None


def _conflict(args: argparse.Namespace) -> str | None:
    """Options that contradict each other: ``--from-json`` re-reports an earlier result without
    measuring, so there is nothing to write with ``--json``."""
    if getattr(args, "from_json", None) and getattr(args, "json_path", None):
        return "--json: --from-json re-reports an earlier result and measures nothing to write"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. Bad input (:class:`ConfigError` and its kinds, an unwritable output, options
    that contradict each other) is one line on stderr and exit status 2; another of the library's errors is one line and status 1."""
    args = build_parser().parse_args(argv)
    if (why := _conflict(args) or _unwritable_output(args)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        return int(args._module.run(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyError as e:
        if getattr(args, "from_json", None):
            print(f"error: {args.from_json} is not a result of this benchmark (no {e})", file=sys.stderr)
            return 2
        raise
    except AsyncCacheError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
