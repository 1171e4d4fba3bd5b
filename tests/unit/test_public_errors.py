"""Every typed error of asynccache.errors is importable from the package and listed in its __all__."""

from __future__ import annotations

import inspect

import pytest

import asynccache
from asynccache import errors

ERRORS = sorted(
    name
    for name, obj in vars(errors).items()
    if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
)


def test_the_errors_module_defines_errors() -> None:
    assert "AsyncCacheError" in ERRORS and "SchedulerError" in ERRORS


@pytest.mark.parametrize("name", ERRORS)
def test_every_error_is_exported_from_the_package(name: str) -> None:
    assert getattr(asynccache, name) is getattr(errors, name)
    assert name in asynccache.__all__


def test_every_error_is_named_in_the_hierarchy() -> None:
    hierarchy = errors.__doc__ or ""
    assert [name for name in ERRORS if f" {name} " not in hierarchy.replace("\n", " ")] == []


def test_from_import_of_scheduler_error() -> None:
    from asynccache import SchedulerError

    assert issubclass(SchedulerError, asynccache.AsyncCacheError)
