"""A one-line progress bar on stderr for the benchmark commands."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["progress_bar"]


def progress_bar(total: int, unit: str, width: int = 30) -> Callable[[], None]:
    """A function that advances a ``[###...] done/total unit`` bar on stderr by one step per
    call and ends the line at ``total``."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        filled = width * min(done, total) // max(total, 1)
        sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {unit}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return tick
