"""Typed settings of the ``docker`` provider: how runner containers are made.

Read once at start-up (by ``OrchestratorSettings.from_env``, through the shared
``EnvReader``); the provider takes the settings object. Constructing one validates it (including the
production guard: runc isolation needs ``SANDCELL_DOCKER_ALLOW_PRODUCTION=1``
under ``SANDCELL_ENV=production``), so every ``ConfigError`` names the variable.
Also owned here: the defaults, the privilege modes, and the runner variables
the provider sets itself (``RESERVED_ENV``: neither the environment nor a spec
may set them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..env import EnvReader
from ..errors import ConfigError
from .docker_api import parse_docker_host

__all__ = [
    "DEFAULT_DOCKER_HOST",
    "DEFAULT_IMAGE",
    "RESERVED_ENV",
    "DockerSettings",
    "Privileges",
]

DEFAULT_IMAGE = "localhost/sandcell-runner:runner-latest"
"""What ``scripts/build-runner-image`` tags its latest runner build."""
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"

Privileges = Literal["cap-sys-admin", "no-caps", "privileged"]
_PRIVILEGES: tuple[Privileges, ...] = ("cap-sys-admin", "no-caps", "privileged")

# Variables the provider owns; neither the environment nor a spec may set them.
RESERVED_ENV = frozenset(
    {
        "SANDCELL_RUNNER_TOKEN",
        "SANDCELL_RUNNER_HOST",
        "SANDCELL_RUNNER_PORT",
        "SANDCELL_RUNNER_SESSIONS",
        "SANDCELL_WORKSPACE_ROOT",
        "SANDCELL_INPUT_CACHE_DIR",
    }
)


@dataclass(frozen=True, slots=True)
class DockerSettings:
    """How runner containers are made. Build with ``from_env``; see images/README.md.

    ``nofile``/``nproc`` are set explicitly on every container: engine defaults
    (often 1048576) can exceed the host's hard limits, and runc then cannot start
    the container at all.
    """

    kind: Literal["docker"] = "docker"
    image: str = DEFAULT_IMAGE
    docker_host: str = DEFAULT_DOCKER_HOST
    network: str | None = None
    production: bool = False
    allow_production: bool = False
    privileges: Privileges = "cap-sys-admin"
    memory_mib: int = 2048
    pids: int = 1024
    cpus: float = 1.0
    nofile: int = 16384
    nproc: int = 8192
    ready_timeout_s: float = 30.0
    api_timeout_s: float = 30.0
    runner_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_docker_host(self.docker_host)
        if self.production and not self.allow_production:
            raise ConfigError(
                "SANDCELL_DOCKER_ALLOW_PRODUCTION: the docker provider isolates sandboxes with"
                " runc containers only; set SANDCELL_DOCKER_ALLOW_PRODUCTION=1 to run it under"
                " SANDCELL_ENV=production"
            )
        if not self.image.strip():
            raise ConfigError("SANDCELL_DOCKER_IMAGE: must name an image")
        if self.privileges not in _PRIVILEGES:
            raise ConfigError(
                f"SANDCELL_DOCKER_PRIVILEGES: must be one of {', '.join(_PRIVILEGES)}"
            )
        reserved = sorted(RESERVED_ENV.intersection(self.runner_env))
        if reserved:
            raise ConfigError(f"{reserved[0]}: set by the docker provider itself")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DockerSettings:
        """Read ``SANDCELL_DOCKER_*`` and ``DOCKER_HOST``; ``ConfigError`` names the variable.

        ``SANDCELL_RUNNER_*`` variables (limits, jail settings) pass through to every
        container unchanged, as for the local provider.
        """
        read = EnvReader(env)
        privileges = read.choice("SANDCELL_DOCKER_PRIVILEGES", _PRIVILEGES, "cap-sys-admin")
        passthrough = read.passthrough(
            ("SANDCELL_RUNNER_",), names=("SANDCELL_ENV",), exclude=RESERVED_ENV
        )
        return cls(
            image=read.text("SANDCELL_DOCKER_IMAGE") or DEFAULT_IMAGE,
            docker_host=read.text("DOCKER_HOST") or DEFAULT_DOCKER_HOST,
            network=read.text("SANDCELL_DOCKER_NETWORK"),
            production=read.production(),
            allow_production=read.flag("SANDCELL_DOCKER_ALLOW_PRODUCTION"),
            privileges=privileges,
            memory_mib=int(read.number("SANDCELL_DOCKER_MEMORY_MIB", 2048, minimum=64)),
            pids=int(read.number("SANDCELL_DOCKER_PIDS", 1024, minimum=16)),
            cpus=read.number("SANDCELL_DOCKER_CPUS", 1.0, minimum=0.01),
            nofile=int(read.number("SANDCELL_DOCKER_NOFILE", 16384, minimum=256)),
            nproc=int(read.number("SANDCELL_DOCKER_NPROC", 8192, minimum=64)),
            ready_timeout_s=read.number("SANDCELL_DOCKER_READY_TIMEOUT_S", 30.0),
            api_timeout_s=read.number("SANDCELL_DOCKER_API_TIMEOUT_S", 30.0),
            runner_env=passthrough,
        )
