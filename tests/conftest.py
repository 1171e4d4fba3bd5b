"""Shared test configuration: uvloop for async tests (debug mode is set in pyproject), the `gpu` marker."""

from __future__ import annotations

import pytest
import torch
import uvloop

HAS_CUDA = torch.cuda.is_available()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
