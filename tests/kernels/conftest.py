"""Fixtures for the copy-kernel tests: a copy of kernels.triton_copy built for Triton's interpreter."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import kernels


@pytest.fixture(scope="module")
def interpreted_copy() -> Iterator[ModuleType]:
    """A fresh import of ``kernels/triton_copy.py`` made while ``TRITON_INTERPRET=1``.

    Triton decides interpreter-or-compiler when ``@triton.jit`` runs, so the variable must be set
    before the module body executes; importing the file under another name leaves the regular
    ``kernels.triton_copy`` (if any) untouched. The variable stays set while the tests run.
    """
    path = Path(kernels.__file__).with_name("triton_copy.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location("kernels_triton_copy_interpreted", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        mp.setitem(sys.modules, spec.name, module)  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        assert module.interpreting(), "TRITON_INTERPRET was not honoured at decoration time"
        yield module
