"""Fixtures of the end-to-end tests: a SeaweedFS S3 server (shared with the storage suite's
harness code) and its credentials in the environment; the device a reference model runs on."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "storage"))
from storage_harness import SeaweedServer


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[SeaweedServer]:
    server = SeaweedServer(bucket="asynccache-e2e")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_uri(monkeypatch: pytest.MonkeyPatch, seaweedfs_server: SeaweedServer) -> str:
    for name, value in seaweedfs_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return seaweedfs_server.uri(f"e2e-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def model_device(request: pytest.FixtureRequest) -> str:
    """Each model test runs on CPU (fp32) and, where there is one, on a CUDA GPU (bf16)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return str(request.param)
