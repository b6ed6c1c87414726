"""What the docker provider modules export, pinned."""

from __future__ import annotations

from pathlib import Path

from sandcell_orchestrator.providers import docker, docker_api
from sandcell_orchestrator.providers.base import SandboxProvider
from sandcell_orchestrator.snapshots import DirectorySnapshotStore


def test_exports_are_pinned() -> None:
    assert sorted(docker.__all__) == [
        "DockerProvider",
        "DockerSettings",
        "PROVIDER_NAME",
        "sandbox_session_id",
    ]
    assert sorted(docker_api.__all__) == [
        "API_VERSION",
        "EngineAPIError",
        "EngineClient",
        "parse_docker_host",
    ]


async def test_the_provider_satisfies_the_seam(tmp_path: Path) -> None:
    """Structurally a SandboxProvider named "docker" that persists through the store
    (constructing one contacts nothing)."""
    provider = docker.DockerProvider(
        docker.DockerSettings(), store=DirectorySnapshotStore(tmp_path)
    )
    assert isinstance(provider, SandboxProvider)
    assert provider.name == docker.PROVIDER_NAME == "docker"
    assert provider.capabilities.pause_resume is False
    await provider.close()
