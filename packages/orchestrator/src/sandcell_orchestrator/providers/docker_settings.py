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

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from ..env import RUNNER_UNPREFIXED, EnvReader
from ..errors import ConfigError
from .docker_api import parse_docker_host

__all__ = [
    "DEFAULT_DOCKER_HOST",
    "DEFAULT_IMAGE",
    "RESERVED_ENV",
    "DockerSettings",
    "Privileges",
    "default_scope",
]

DEFAULT_IMAGE = "localhost/sandcell-runner:runner-latest"
"""What ``scripts/build-runner-image`` tags its latest runner build."""
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"

Privileges = Literal["cap-sys-admin", "no-caps", "privileged"]
_PRIVILEGES: tuple[Privileges, ...] = ("cap-sys-admin", "no-caps", "privileged")
_SCOPE_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")

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
    runner_env: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold secrets
    scope: str | None = None
    """The deployment this worker's containers belong to (their ``sandcell.scope``
    label): the sweeper removes only its own scope's containers that no record names
    (``DockerProvider.dead_sandboxes``). None: it removes none."""

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
        if self.scope is not None and not _SCOPE_RE.fullmatch(self.scope):
            raise ConfigError(
                "SANDCELL_DOCKER_SCOPE: 1-64 characters of letters, digits, '.', '_' and '-'"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DockerSettings:
        """Read ``SANDCELL_DOCKER_*`` and ``DOCKER_HOST``; ``ConfigError`` names the variable.

        ``SANDCELL_RUNNER_*`` variables (limits, jail settings) and the runner's
        ``RUNNER_UNPREFIXED`` caps pass through to every container unchanged, as for
        the local provider.
        """
        read = EnvReader(env)
        privileges = read.choice("SANDCELL_DOCKER_PRIVILEGES", _PRIVILEGES, "cap-sys-admin")
        passthrough = read.passthrough(
            ("SANDCELL_RUNNER_",), names=("SANDCELL_ENV", *RUNNER_UNPREFIXED), exclude=RESERVED_ENV
        )
        return cls(
            image=read.text("SANDCELL_DOCKER_IMAGE") or DEFAULT_IMAGE,
            docker_host=read.text("DOCKER_HOST") or DEFAULT_DOCKER_HOST,
            network=read.text("SANDCELL_DOCKER_NETWORK"),
            production=read.production(),
            allow_production=read.flag("SANDCELL_DOCKER_ALLOW_PRODUCTION"),
            privileges=privileges,
            memory_mib=read.integer("SANDCELL_DOCKER_MEMORY_MIB", 2048, minimum=64),
            pids=read.integer("SANDCELL_DOCKER_PIDS", 1024, minimum=16),
            cpus=read.number("SANDCELL_DOCKER_CPUS", 1.0, minimum=0.01),
            nofile=read.integer("SANDCELL_DOCKER_NOFILE", 16384, minimum=256),
            nproc=read.integer("SANDCELL_DOCKER_NPROC", 8192, minimum=64),
            ready_timeout_s=read.number("SANDCELL_DOCKER_READY_TIMEOUT_S", 30.0),
            api_timeout_s=read.number("SANDCELL_DOCKER_API_TIMEOUT_S", 30.0),
            runner_env=passthrough,
            scope=read.text("SANDCELL_DOCKER_SCOPE") or default_scope(env),
        )


def default_scope(env: Mapping[str, str]) -> str | None:
    """The scope of a deployment that named none: one per shared registry.

    Workers of one deployment share ``SANDCELL_REGISTRY_URL`` (docs/deployment.md), so
    a hash of where it points (credentials left out) names the deployment; two
    deployments on one engine have two registries. None for a registry of one process
    (unset: a SQLite file per home; ``memory://``): nothing tells two such processes
    apart, so neither removes containers it did not record.
    """
    url = (env.get("SANDCELL_REGISTRY_URL") or "").strip()
    if not url or url == "memory://":
        return None
    parts = urlsplit(url)
    # Not ``parts.port``: it raises on a malformed port, which the registry reports.
    host = parts.netloc.rpartition("@")[2]
    where = f"{parts.scheme}://{host}{parts.path}"
    return "reg-" + hashlib.sha256(where.encode()).hexdigest()[:16]
