"""DockerSettings: read from an environment mapping, validated, production-guarded."""

from __future__ import annotations

import pytest

from sandcell_orchestrator.errors import ConfigError
from sandcell_orchestrator.providers.docker_settings import (
    DEFAULT_DOCKER_HOST,
    DEFAULT_IMAGE,
    DockerSettings,
)


def test_defaults_from_an_empty_environment() -> None:
    """Nothing set: the default socket and image, sane limits, minimal privileges."""
    settings = DockerSettings.from_env({})
    assert settings.docker_host == DEFAULT_DOCKER_HOST == "unix:///var/run/docker.sock"
    assert settings.image == DEFAULT_IMAGE
    assert settings.network is None
    assert settings.privileges == "cap-sys-admin"
    assert settings.runner_env == {}
    assert settings.scope is None  # a registry of one process: no remains removed


def test_the_scope_is_named_or_one_per_shared_registry() -> None:
    """Workers on one registry share a scope whatever credentials they use; another
    registry (or another database in it) is another deployment."""
    named = DockerSettings.from_env(
        {"SANDCELL_DOCKER_SCOPE": "prod-eu", "SANDCELL_REGISTRY_URL": "redis://r:6379/0"}
    )
    assert named.scope == "prod-eu"
    a = DockerSettings.from_env({"SANDCELL_REGISTRY_URL": "redis://:pw-one@redis.internal:6379/0"})
    b = DockerSettings.from_env({"SANDCELL_REGISTRY_URL": "redis://:pw-two@redis.internal:6379/0"})
    other_db = DockerSettings.from_env({"SANDCELL_REGISTRY_URL": "redis://redis.internal:6379/1"})
    assert a.scope is not None
    assert a.scope == b.scope
    assert "pw-one" not in a.scope
    assert a.scope.startswith("reg-")
    assert other_db.scope not in (None, a.scope)
    assert DockerSettings.from_env({"SANDCELL_REGISTRY_URL": "memory://"}).scope is None


def test_every_variable_is_read() -> None:
    env = {
        "SANDCELL_DOCKER_IMAGE": "registry.example/runner:1",
        "DOCKER_HOST": "unix:///run/podman/podman.sock",
        "SANDCELL_DOCKER_NETWORK": "sandboxes",
        "SANDCELL_DOCKER_PRIVILEGES": "no-caps",
        "SANDCELL_DOCKER_MEMORY_MIB": "512",
        "SANDCELL_DOCKER_PIDS": "256",
        "SANDCELL_DOCKER_CPUS": "0.5",
        "SANDCELL_DOCKER_NOFILE": "4096",
        "SANDCELL_DOCKER_NPROC": "2048",
        "SANDCELL_DOCKER_READY_TIMEOUT_S": "12",
        "SANDCELL_DOCKER_API_TIMEOUT_S": "7",
        "SANDCELL_RUNNER_MAX_JOBS": "4",
        "SANDCELL_RUNNER_TOKEN": "never-passed-through-0123456789",
    }
    settings = DockerSettings.from_env(env)
    assert settings.image == "registry.example/runner:1"
    assert settings.docker_host == "unix:///run/podman/podman.sock"
    assert settings.network == "sandboxes"
    assert settings.privileges == "no-caps"
    assert (settings.memory_mib, settings.pids, settings.cpus) == (512, 256, 0.5)
    assert (settings.nofile, settings.nproc) == (4096, 2048)
    assert (settings.ready_timeout_s, settings.api_timeout_s) == (12.0, 7.0)
    # Runner tuning passes through; the token is the provider's to mint.
    assert settings.runner_env == {"SANDCELL_RUNNER_MAX_JOBS": "4"}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DOCKER_HOST", "tcp://127.0.0.1:2375"),
        ("DOCKER_HOST", "unix://relative.sock"),
        ("SANDCELL_DOCKER_MEMORY_MIB", "lots"),
        ("SANDCELL_DOCKER_MEMORY_MIB", "8"),
        ("SANDCELL_DOCKER_CPUS", "-1"),
        ("SANDCELL_DOCKER_PRIVILEGES", "root"),
        ("SANDCELL_DOCKER_ALLOW_PRODUCTION", "maybe"),
        ("SANDCELL_DOCKER_SCOPE", "two words"),
        ("SANDCELL_DOCKER_SCOPE", "x" * 65),
    ],
)
def test_a_bad_value_names_its_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        DockerSettings.from_env({name: value})


def test_a_refused_docker_host_is_echoed_without_its_credentials() -> None:
    with pytest.raises(ConfigError, match="DOCKER_HOST") as caught:
        DockerSettings.from_env({"DOCKER_HOST": "tcp://admin:S3CR3T-engine@10.0.0.5:2376"})
    assert "tcp://10.0.0.5:2376" in str(caught.value)
    assert "S3CR3T" not in str(caught.value)
    assert "admin" not in str(caught.value)


def test_production_needs_an_explicit_allowance() -> None:
    """runc isolation only: SANDCELL_ENV=production refuses without the opt-in."""
    with pytest.raises(ConfigError, match="SANDCELL_DOCKER_ALLOW_PRODUCTION"):
        DockerSettings.from_env({"SANDCELL_ENV": "production"})
    with pytest.raises(ConfigError, match="SANDCELL_DOCKER_ALLOW_PRODUCTION"):
        DockerSettings(production=True)
    allowed = DockerSettings.from_env(
        {"SANDCELL_ENV": "production", "SANDCELL_DOCKER_ALLOW_PRODUCTION": "1"}
    )
    assert allowed.production
    assert allowed.runner_env == {"SANDCELL_ENV": "production"}


def test_the_provider_owns_the_runner_token_and_address() -> None:
    with pytest.raises(ConfigError, match="SANDCELL_RUNNER_PORT"):
        DockerSettings(runner_env={"SANDCELL_RUNNER_PORT": "9999"})
