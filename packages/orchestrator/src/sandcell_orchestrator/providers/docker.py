"""The ``docker`` provider: one sandbox = one runner container, via the Docker Engine API.

Lifecycle: ``create`` = create + start a container from the runner image (a fresh
per-sandbox token in its environment, the runner port published on 127.0.0.1 at
a port the engine picks, resource limits, the privileges nsjail needs), then the
runner's ``/health``; a container that never gets healthy is removed, not
orphaned. ``destroy`` = force-remove (a missing container is fine).
``pause_resume`` is False: the manager suspends a session by checkpointing its
runner into the snapshot store and destroying the container, and resumes it in a
new container it restores into. ``dead_sandboxes`` (``Remains``) lists the
containers of this deployment (its ``sandcell.scope`` label) that no longer serve
a session, for the sweeper to remove the ones no record names.

Isolation is runc's, so ``SANDCELL_ENV=production`` needs an explicit
``SANDCELL_DOCKER_ALLOW_PRODUCTION=1``. Privileges, and why: images/README.md.

``connect`` works from any orchestrator process: the runner token is read back
from the container's configuration (``Config.Env``). The engine is trusted here:
whoever can inspect a container can also exec into it, so the token is no more
exposed than the sandbox itself.

Each handle's ``session_id`` is the ``sandcell.session_id`` label of the spec (the
manager sets it) when present, else ``"rt_" + sha256(b"sandbox\\0" + container id)``:
deterministic, so a new provider instance derives the same one. The label is
stored on the container so ``connect`` recovers it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio

from ..errors import (
    ConfigError,
    ProtocolMismatchError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from ..handle import SandboxHandle
from ..runner.answers import DEFAULT_CAPS, AnswerCaps
from ..runner.client import RunnerClient
from ..to_the_end import to_the_end
from .base import (
    SESSION_LABEL,
    SandboxCapabilities,
    SandboxSpec,
    sandbox_session_id,
)
from .docker_api import EngineAPIError, EngineClient
from .docker_containers import (
    RUNNER_PORT,
    SANDBOX_LABEL,
    SCOPE_LABEL,
    UUID_LABEL,
    EngineTraits,
    RunnerContainer,
    container_from,
    labels_of,
    privileges,
)
from .docker_settings import RESERVED_ENV, DockerSettings

__all__ = ["PROVIDER_NAME", "DockerProvider", "DockerSettings", "sandbox_session_id"]

log = logging.getLogger(__name__)

PROVIDER_NAME = "docker"
_CONTAINER_ID = re.compile(r"[0-9a-f]{12,64}")
_READY_SLICE_S = 1.0
"""How often a readiness wait checks that the container is still running."""
_LOG_TAIL_CHARS = 1500


class DockerProvider:
    """Sandboxes as runner containers on a Docker (or podman) engine."""

    name = PROVIDER_NAME
    capabilities = SandboxCapabilities(pause_resume=False)

    def __init__(
        self,
        settings: DockerSettings,
        *,
        engine: EngineClient | None = None,
        answer_caps: AnswerCaps = DEFAULT_CAPS,
    ) -> None:
        self._settings = settings
        # The runner is in the tenant's container: these bound what it makes us read.
        self._answer_caps = answer_caps
        self._engine = engine or EngineClient(
            settings.docker_host, timeout_s=settings.api_timeout_s
        )
        self._traits: EngineTraits | None = None
        self._traits_lock = anyio.Lock()

    def __repr__(self) -> str:
        return f"DockerProvider(docker_host={self._settings.docker_host!r})"

    # -- SandboxProvider ------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        image = spec.image or self._settings.image
        body, token = self._container_body(spec, image, await self._engine_traits())
        for attempt in range(3):
            container_id = await self._create(body, image)
            handle: SandboxHandle | None = None
            try:
                await self._start(container_id, image)
                handle = self._handle(await self._running(container_id, token=token))
                await self._wait_ready(handle, container_id, token=token)
            except BaseException as exc:
                # To its end: under an anyio shield only, a second native cancellation
                # stopped the removal and the container ran on with no one to remove it.
                await to_the_end(self._discard(handle, container_id))
                if not isinstance(exc, _PortConflictError):
                    raise
                log.info("docker: port conflict starting a runner (attempt %d)", attempt + 1)
                continue
            return handle
        raise SandboxUnavailableError("docker: could not publish the runner port (port conflicts)")

    async def connect(self, sandbox_id: str) -> SandboxHandle:
        if not _CONTAINER_ID.fullmatch(sandbox_id):
            raise SandboxNotFoundError(f"docker sandbox {sandbox_id[:80]!r}: not a container id")
        with _engine_errors():
            info = await self._engine.inspect_container(sandbox_id)
        if info is None or labels_of(info).get(SANDBOX_LABEL) != "1":
            raise SandboxNotFoundError(f"docker sandbox {sandbox_id[:12]} is gone")
        if not info.get("State", {}).get("Running"):
            raise SandboxNotFoundError(f"docker sandbox {sandbox_id[:12]} is not running")
        return self._handle(container_from(info))

    async def destroy(self, sandbox_id: str) -> None:
        if not _CONTAINER_ID.fullmatch(sandbox_id):
            return  # never ours: nothing to remove
        with _engine_errors():
            info = await self._engine.inspect_container(sandbox_id)
            if info is None:
                return
            if labels_of(info).get(SANDBOX_LABEL) != "1":
                log.warning("docker: not removing %s: not a sandcell container", sandbox_id[:12])
                return
            await self._engine.remove_container(sandbox_id)

    async def close(self) -> None:
        """Close the engine client; containers and handles live on. Idempotent."""
        await self._engine.close()

    # -- Remains ----------------------------------------------------------------

    async def dead_sandboxes(self) -> dict[str, float]:
        """This deployment's containers that serve no one (``Remains``): id -> age in s.

        Of the containers labelled with this provider's scope: the stopped ones (their
        runner is gone), and the running ones of a session (a runner no record may
        name: its worker was killed between launch and record write, or the record
        went with a wiped Redis). The sweeper keeps those a record names and those
        still young enough to be starting. A running container of no session (a
        stateless run) is left alone: it lives only as long as its one job. Another
        deployment's containers, and any without a scope, are never listed.
        """
        scope = self._settings.scope
        if scope is None:
            return {}
        with _engine_errors():
            listed = await self._engine.list_containers({SANDBOX_LABEL: "1", SCOPE_LABEL: scope})
        now = time.time()
        found: dict[str, float] = {}
        for item in listed:
            container_id = str(item.get("Id", ""))
            labels = item.get("Labels") or {}
            if not _CONTAINER_ID.fullmatch(container_id) or labels.get(SCOPE_LABEL) != scope:
                continue
            running = str(item.get("State", "")).lower() == "running"
            if running and SESSION_LABEL not in labels:
                continue
            try:
                created = float(item.get("Created", now))
            except (TypeError, ValueError):
                created = now  # unknown age: young, so kept this round
            # Whole seconds: the age reads up to 1 s short, never long.
            found[container_id] = max(0.0, now - created - 1.0)
        return found

    # -- creating -------------------------------------------------------------

    def _container_body(
        self, spec: SandboxSpec, image: str, traits: EngineTraits
    ) -> tuple[dict[str, Any], str]:
        """The create body and the fresh runner token inside it."""
        reserved = sorted(RESERVED_ENV.intersection(spec.env))
        if reserved:
            raise ConfigError(f"SandboxSpec.env: {reserved[0]} is set by the docker provider")
        token = secrets.token_urlsafe(32)
        env = {
            # The runner's jobs share one CPU quota, by default one core: the container's
            # own share instead, or a sandbox given two CPUs would run its code on one.
            # An operator's runner_env or the spec's env may still set another.
            "SANDCELL_RUNNER_CPU_MILLICORES": str(max(10, round(self._cpus(spec) * 1000))),
            **self._settings.runner_env,
            **spec.env,
            "SANDCELL_RUNNER_TOKEN": token,
            "SANDCELL_RUNNER_HOST": "0.0.0.0",  # noqa: S104  # inside the container's netns
            "SANDCELL_RUNNER_PORT": str(RUNNER_PORT),
            "SANDCELL_RUNNER_SESSIONS": "1",
        }
        sandbox_uuid = spec.labels.get(UUID_LABEL) or uuid.uuid4().hex
        labels = {key: value for key, value in spec.labels.items() if key.startswith("sandcell.")}
        labels.update({SANDBOX_LABEL: "1", UUID_LABEL: sandbox_uuid})
        labels.pop(SCOPE_LABEL, None)  # the deployment's, never a spec's
        if self._settings.scope is not None:
            labels[SCOPE_LABEL] = self._settings.scope
        port = f"{RUNNER_PORT}/tcp"
        body: dict[str, Any] = {
            "Image": image,
            "Env": [f"{key}={value}" for key, value in env.items()],
            "Labels": labels,
            "ExposedPorts": {port: {}},
            # We poll /health ourselves; podman's healthcheck timers need systemd.
            "Healthcheck": {"Test": ["NONE"]},
            "StopTimeout": 2,
            "HostConfig": {
                "PortBindings": {port: [{"HostIp": "127.0.0.1", "HostPort": ""}]},
                "Ulimits": [
                    {
                        "Name": "nofile",
                        "Soft": self._settings.nofile,
                        "Hard": self._settings.nofile,
                    },
                    {"Name": "nproc", "Soft": self._settings.nproc, "Hard": self._settings.nproc},
                ],
                **self._limits(spec),
                **privileges(self._settings.privileges, traits),
            },
        }
        if self._settings.network:
            body["HostConfig"]["NetworkMode"] = self._settings.network
        return body, token

    def _limits(self, spec: SandboxSpec) -> dict[str, int]:
        memory_mib = spec.limits.memory_mib or self._settings.memory_mib
        cpus = self._cpus(spec)
        return {
            "Memory": memory_mib * 1024 * 1024,
            # Equal to Memory: no swap on top of the limit.
            "MemorySwap": memory_mib * 1024 * 1024,
            "PidsLimit": spec.limits.pids or self._settings.pids,
            "NanoCpus": int(cpus * 1e9),
        }

    def _cpus(self, spec: SandboxSpec) -> float:
        return spec.limits.cpus or self._settings.cpus

    async def _engine_traits(self) -> EngineTraits:
        if self._traits is None:
            async with self._traits_lock:
                if self._traits is None:
                    with _engine_errors():
                        version = await self._engine.version()
                        info = await self._engine.info()
                    components = version.get("Components") or []
                    names = " ".join(str(c.get("Name", "")) for c in components)
                    options = " ".join(str(o) for o in info.get("SecurityOptions") or [])
                    self._traits = EngineTraits(
                        podman="podman" in names.lower(),
                        apparmor="name=apparmor" in options,
                        selinux="name=selinux" in options,
                    )
        return self._traits

    async def _create(self, body: dict[str, Any], image: str) -> str:
        try:
            return await self._engine.create_container(body)
        except EngineAPIError as exc:
            if exc.status == 404 or "no such image" in exc.message.lower():
                raise ConfigError(
                    f"SANDCELL_DOCKER_IMAGE: image {image!r} not found in the docker engine at"
                    f" {self._settings.docker_host} (build it: scripts/build-runner-image)"
                ) from None
            raise _engine_error(exc, f"creating a container from {image!r}") from None

    async def _start(self, container_id: str, image: str) -> None:
        try:
            await self._engine.start_container(container_id)
        except EngineAPIError as exc:
            lowered = exc.message.lower()
            if "already allocated" in lowered or "address already in use" in lowered:
                raise _PortConflictError(exc.message) from None
            raise _engine_error(exc, f"starting a container from {image!r}") from None

    async def _running(self, container_id: str, *, token: str) -> RunnerContainer:
        with _engine_errors():
            info = await self._engine.inspect_container(container_id)
        if info is None:
            raise SandboxUnavailableError(f"docker container {container_id[:12]} vanished on start")
        container = container_from(info)
        if container.token != token:
            raise SandboxUnavailableError("docker: the container's runner token did not round-trip")
        return container

    async def _wait_ready(self, handle: SandboxHandle, container_id: str, *, token: str) -> None:
        """Poll ``/health`` until ok; fail fast (with the log tail) if the container exits."""
        deadline = anyio.current_time() + self._settings.ready_timeout_s
        while True:
            remaining = deadline - anyio.current_time()
            try:
                await handle.runner.wait_ready(timeout_s=max(min(_READY_SLICE_S, remaining), 0.01))
            except ProtocolMismatchError:
                raise
            except SandboxUnavailableError as exc:
                with _engine_errors():
                    info = await self._engine.inspect_container(container_id)
                running = info is not None and bool(info.get("State", {}).get("Running"))
                if running and anyio.current_time() < deadline:
                    continue
                tail = await self._log_tail(container_id, token=token)
                why = "exited" if not running else f"not ready in {self._settings.ready_timeout_s}s"
                raise SandboxUnavailableError(
                    f"docker runner container {container_id[:12]} {why}: {exc}; log tail:\n{tail}"
                ) from None
            return

    async def _log_tail(self, container_id: str, *, token: str) -> str:
        """The container's last lines (the runner never prints its token; belt and braces)."""
        text = await self._engine.container_logs(container_id)
        return text.replace(token, "[redacted]")[-_LOG_TAIL_CHARS:]

    async def _discard(self, handle: SandboxHandle | None, container_id: str) -> None:
        """A container we made and failed to start: its client closed, the container removed."""
        if handle is not None:
            await handle.close()
        await self._remove_quietly(container_id)

    async def _remove_quietly(self, container_id: str) -> None:
        """Best-effort removal of a container we made; never raises (the caller runs it
        ``to_the_end`` when cancellation must not stop it)."""
        try:
            await self._engine.remove_container(container_id)
        except (EngineAPIError, SandboxUnavailableError) as exc:
            log.warning("docker: could not remove container %s: %s", container_id[:12], exc)

    def _handle(self, container: RunnerContainer) -> SandboxHandle:
        return SandboxHandle(
            sandbox_id=container.container_id,
            provider=self.name,
            runner=RunnerClient(container.url, token=container.token, caps=self._answer_caps),
            session_id=container.session_id,
            endpoint=container.url,
        )


class _PortConflictError(SandboxUnavailableError):
    """The engine could not publish the runner port; a new container gets another."""


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """An engine answer no caller handled becomes ``SandboxUnavailableError``."""
    try:
        yield
    except EngineAPIError as exc:
        raise _engine_error(exc, exc.operation) from None


def _engine_error(exc: EngineAPIError, doing: str) -> SandboxUnavailableError:
    return SandboxUnavailableError(f"docker engine error while {doing}: {exc.status} {exc.message}")
