"""Fixtures of the storage tests: one SeaweedFS per session (plus private ones for tests that
kill or pause the server) and a ``harness`` parametrized over every backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from storage_harness import (
    DiskHarness,
    Harness,
    MemoryHarness,
    S3Harness,
    SeaweedServer,
)


def serve(server: SeaweedServer) -> Iterator[SeaweedServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedServer]:
    yield from serve(SeaweedServer())


@pytest.fixture
def private_seaweedfs() -> Iterator[SeaweedServer]:
    """A server of this test's own, for tests that kill or pause it."""
    yield from serve(SeaweedServer(bucket="asynccache-private"))


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, seaweedfs: SeaweedServer) -> SeaweedServer:
    """The session server's credentials in the environment (where obstore reads them)."""
    for name, value in seaweedfs.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return seaweedfs


@pytest.fixture(params=["memory", "disk", "disk-zstd", "disk-procs", pytest.param("s3", marks=pytest.mark.s3)])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    h: Harness
    if request.param == "memory":
        h = MemoryHarness()
    elif request.param == "disk":
        h = DiskHarness(tmp_path / "cache")
    elif request.param == "disk-zstd":
        h = DiskHarness(tmp_path / "cache", compression="zstd")
    elif request.param == "disk-procs":
        h = DiskHarness(tmp_path / "cache", read_processes=2)
    else:
        h = S3Harness(request.getfixturevalue("s3_env"))
    try:
        yield h
    finally:
        await h.aclose()
