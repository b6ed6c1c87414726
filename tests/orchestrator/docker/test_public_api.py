"""What the docker provider modules export, pinned."""

from __future__ import annotations

from sandcell_orchestrator.providers import docker, docker_api
from sandcell_orchestrator.providers.base import NativeSuspend, SandboxProvider


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


async def test_the_provider_satisfies_the_seam() -> None:
    """Structurally a SandboxProvider named "docker", compute only, without a native
    suspend (constructing one contacts nothing)."""
    provider = docker.DockerProvider(docker.DockerSettings())
    assert isinstance(provider, SandboxProvider)
    assert not isinstance(provider, NativeSuspend)
    assert provider.name == docker.PROVIDER_NAME == "docker"
    assert provider.capabilities.pause_resume is False
    await provider.close()
