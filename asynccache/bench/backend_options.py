"""Backend options on the benchmarks' command lines: a repeatable ``--option KEY=VALUE`` (or
``--storage-option``) read into the keyword options of :func:`~asynccache.storage.open_backend`.

Primitives:

- ``add_option_argument(parser, flag, what, **kwargs)`` — the repeatable flag, its help saying
  how a VALUE reads (``OPTION_VALUES``).
- ``parse_options(pairs)`` — ``["key=value", …]`` → options: integers become ints, other finite
  numbers floats, ``true`` / ``false`` booleans, ``none`` ``None`` (any case), the rest stays
  text; anything but ``KEY=VALUE`` is a :class:`ConfigError`.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from asynccache.errors import ConfigError

__all__ = ["OPTION_VALUES", "add_option_argument", "parse_options"]

#: How ``--option`` / ``--storage-option`` read a VALUE (see :func:`parse_options`), for ``--help``.
OPTION_VALUES = "an integer, a number (2.5), true/false, none (None) or text"


def add_option_argument(parser: argparse.ArgumentParser, flag: str, what: str, **kwargs: Any) -> None:
    """A repeatable ``flag KEY=VALUE`` of backend options (read by :func:`parse_options`); the
    help is ``what`` and how a VALUE reads."""
    parser.add_argument(flag, action="append", default=[], metavar="KEY=VALUE", help=f"{what}. VALUE: {OPTION_VALUES}",
                        **kwargs)  # fmt: skip


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["key=value", …]`` → options for :func:`~asynccache.storage.open_backend`: integers
    become ints, other finite numbers floats, ``true`` / ``false`` booleans, ``none`` ``None``
    (any case), the rest stays text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"a backend option is KEY=VALUE, got {pair!r}")
        options[key] = _option_value(value)
    return options


def _option_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text
