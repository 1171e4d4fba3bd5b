"""The tree's protocol error.

:class:`TreeError` — misuse of the tree's protocol: unlocking below zero, finishing an unknown
plan, beginning a load from a match that no longer describes the tree, aborting a copy that
other data already depends on. Bad arguments (misaligned positions, wrong index counts) raise
:class:`asynccache.errors.ConfigError` instead.
"""

from __future__ import annotations

from asynccache.errors import AsyncCacheError

__all__ = ["TreeError"]


class TreeError(AsyncCacheError, RuntimeError):
    """The tree was driven out of its protocol (a bug in the caller)."""
