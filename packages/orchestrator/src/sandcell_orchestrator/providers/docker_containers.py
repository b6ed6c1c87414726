"""What a runner container is made of, and how one is read back from the engine.

``privileges`` is the HostConfig nsjail needs under each privilege mode (the
reasons are in images/README.md); ``container_from`` recovers port, token and
session id from an inspected container, so ``connect`` works from any process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import SandboxNotFoundError, SandboxUnavailableError
from .base import SESSION_LABEL, sandbox_session_id
from .docker_settings import Privileges

__all__ = [
    "RUNNER_PORT",
    "SANDBOX_LABEL",
    "SCOPE_LABEL",
    "UUID_LABEL",
    "EngineTraits",
    "RunnerContainer",
    "container_from",
    "env_of",
    "labels_of",
    "privileges",
]

RUNNER_PORT = 8080
SANDBOX_LABEL = "sandcell.sandbox"
UUID_LABEL = "sandcell.uuid"
SCOPE_LABEL = "sandcell.scope"
"""The deployment a container belongs to (``DockerSettings.scope``): what its sweeper
may remove."""

# Docker's default masked paths outside /proc (the /proc ones must go: see ``privileges``).
_MASKED_OUTSIDE_PROC = ("/sys/firmware", "/sys/devices/virtual/powercap")


@dataclass(frozen=True, slots=True)
class EngineTraits:
    """What the engine needs told differently (asked once per provider)."""

    podman: bool
    apparmor: bool
    selinux: bool


@dataclass(frozen=True, slots=True)
class RunnerContainer:
    """What a handle needs of a running runner container."""

    container_id: str
    port: int
    token: str = field(repr=False)
    session_id: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def privileges(mode: Privileges, traits: EngineTraits) -> dict[str, Any]:
    """HostConfig for what nsjail needs; the reasons are in images/README.md.

    nsjail mounts a fresh /proc for each job's pid namespace. The kernel allows that
    only if the container's own /proc is fully visible, so the engine's masked and
    read-only /proc paths must go (podman: ``unmask=/proc/*``; Docker: empty
    ``ReadonlyPaths`` and ``MaskedPaths`` without the /proc entries).
    """
    if mode == "privileged":
        return {"Privileged": True, "CgroupnsMode": "private"}
    security_opt: list[str] = []
    config: dict[str, Any] = {}
    if traits.podman:
        security_opt.append("unmask=/proc/*")
    else:
        config["MaskedPaths"] = list(_MASKED_OUTSIDE_PROC)
        config["ReadonlyPaths"] = []
    if traits.apparmor:
        security_opt.append("apparmor=unconfined")  # docker-default denies mount
    if traits.selinux:
        security_opt.append("label=disable")
    if mode == "cap-sys-admin":
        # SYS_ADMIN: mount (tmpfs workspace quotas, cgroup remount) and namespace
        # creation. NET_ADMIN: the runner's egress links (a veth pair and an
        # nftables table per sandbox, in the container's own network namespace).
        # Jobs get neither: nsjail runs them in user namespaces of their own with
        # every capability dropped.
        config["CapAdd"] = ["SYS_ADMIN", "NET_ADMIN"]
    else:
        # No added capability: the default seccomp profile then refuses the
        # namespace flags nsjail needs, so it goes; nsjail's own filter still applies.
        security_opt.append("seccomp=unconfined")
    config["SecurityOpt"] = security_opt
    return config


def labels_of(info: Mapping[str, Any]) -> dict[str, str]:
    """The container's labels."""
    labels = (info.get("Config") or {}).get("Labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def env_of(info: Mapping[str, Any]) -> dict[str, str]:
    """The container's configured environment."""
    pairs = (info.get("Config") or {}).get("Env") or []
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if sep:
            env[key] = value
    return env


def container_from(info: Mapping[str, Any]) -> RunnerContainer:
    """Port, token and session id of an inspected runner container."""
    container_id = str(info.get("Id", ""))
    token = env_of(info).get("SANDCELL_RUNNER_TOKEN")
    if not token:
        raise SandboxNotFoundError(f"docker container {container_id[:12]} has no runner token")
    ports = ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(f"{RUNNER_PORT}/tcp")
    host_port = next(
        (str(b.get("HostPort")) for b in ports or [] if str(b.get("HostPort", "")).isdigit()),
        None,
    )
    if host_port is None:
        raise SandboxUnavailableError(
            f"docker container {container_id[:12]}: runner port {RUNNER_PORT} is not published"
        )
    session_id = labels_of(info).get(SESSION_LABEL) or sandbox_session_id(container_id)
    return RunnerContainer(container_id, int(host_port), token, session_id)
