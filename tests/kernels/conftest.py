"""Fixtures for the copy-kernel tests: a copy of kernels.triton_copy built for Triton's interpreter.

Triton's interpreter up to 3.6 turns a scalar tensor into an ``int`` with ``int(data)``, where
``data`` is a one-element array of one dimension; NumPy 2.4 refuses that conversion, so a kernel
whose loop bounds come from ``tl.program_id`` fails there (triton-lang/triton#9171, fixed in later
Triton releases by squeezing the array first). The fixture makes the same conversion while the
interpreted kernels run, so the tests pass with Triton 3.6 as they do with later releases.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import kernels


def _index_scalars(mp: pytest.MonkeyPatch) -> None:
    """Patch the interpreter's scalar ``__index__`` to squeeze its one-element array first (what
    later Triton releases do), for the interpreters that convert with ``int(data)``."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def patched(tensor: type, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))  # type: ignore[attr-defined]

    mp.setattr(interpreter, "_patch_lang_tensor", patched)


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
        _index_scalars(mp)
        spec = importlib.util.spec_from_file_location("kernels_triton_copy_interpreted", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        mp.setitem(sys.modules, spec.name, module)  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        assert module.interpreting(), "TRITON_INTERPRET was not honoured at decoration time"
        yield module
