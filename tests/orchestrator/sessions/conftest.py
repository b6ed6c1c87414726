"""Fixtures for the execution path: real local runners, real Redis, a real S3 endpoint."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import InProcessRegistry, RedisRegistry, SessionRegistry
from sandcell_orchestrator.sessions.execution import ExecutionService
from sandcell_orchestrator.snapshots import (
    DirectorySnapshotStore,
    S3SnapshotStore,
    SnapshotStore,
)
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.conftest import BUCKET, S3_ACCESS, S3_SECRET, S3Server

__all__ = ["BUCKET", "S3_ACCESS", "S3_SECRET", "S3Server"]


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    with traversable_dir("orch-") as root:
        yield root


@pytest.fixture(params=["directory", "s3"])
async def store(request: pytest.FixtureRequest, runtime_dir: Path) -> AsyncIterator[SnapshotStore]:
    backend: SnapshotStore
    if request.param == "directory":
        backend = DirectorySnapshotStore(runtime_dir / "snapshots")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        backend = S3SnapshotStore(server.settings(f"t-{uuid.uuid4().hex}"))
    async with backend:
        yield backend


@pytest.fixture
async def dir_store(runtime_dir: Path) -> AsyncIterator[SnapshotStore]:
    async with DirectorySnapshotStore(runtime_dir / "snapshots") as backend:
        yield backend


@pytest.fixture(params=["memory", "redis"])
async def registry(request: pytest.FixtureRequest) -> AsyncIterator[SessionRegistry]:
    backend: SessionRegistry
    if request.param == "memory":
        backend = InProcessRegistry()
    else:
        url: str = request.getfixturevalue("redis_url")
        backend = RedisRegistry.from_url(url, prefix=f"exec-{uuid.uuid4().hex}:")
    yield backend
    await backend.close()


@dataclass
class Stack:
    provider: LocalProvider
    store: SnapshotStore
    registry: SessionRegistry
    runtime_dir: Path

    def service(self, **kwargs: object) -> ExecutionService:
        return ExecutionService(
            provider=self.provider,
            registry=self.registry,
            store=self.store,
            **kwargs,  # type: ignore[arg-type]
        )


@pytest.fixture
async def local_provider(
    runtime_dir: Path, dir_store: SnapshotStore
) -> AsyncIterator[LocalProvider]:
    provider = LocalProvider(LocalSettings(runtime_dir=runtime_dir / "rt"))
    yield provider
    await provider.close()
    for child in (runtime_dir / "rt").iterdir():
        await provider.destroy(child.name)


async def current_key(service: ExecutionService, session_id: str) -> str:
    """The checkpoint a restore of ``session_id`` would read (the record's, else the store's)."""
    key = await service.manager.current_checkpoint(session_id)
    assert key is not None, "the session has no checkpoint"
    return key


def runner_pids(runtime_dir: Path) -> list[int]:
    """Runner processes whose workspace root lies under ``runtime_dir``."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmdline = " ".join(process.info["cmdline"] or [])
            environ = process.info["environ"] or {}
        except psutil.Error:
            continue
        if "sandcell_runner" in cmdline and str(runtime_dir) in environ.get(
            "SANDCELL_WORKSPACE_ROOT", ""
        ):
            found.append(process.info["pid"])
    return found
