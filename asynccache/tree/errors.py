"""The tree's protocol error (defined with the others in :mod:`asynccache.errors`)."""

from __future__ import annotations

from asynccache.errors import TreeError

__all__ = ["TreeError"]
