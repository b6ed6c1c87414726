"""The Docker provider against a real engine: container shape, isolation, cleanup, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.errors import (
    CheckpointError,
    ConfigError,
    RunnerAnswerError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from sandcell_orchestrator.providers import open_provider
from sandcell_orchestrator.providers.base import SESSION_LABEL, ResourceLimits, SandboxSpec
from sandcell_orchestrator.providers.docker import DockerProvider, sandbox_session_id
from sandcell_orchestrator.providers.docker_settings import DockerSettings
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import ExecuteRequest, Limits, RunStatus, checkpoint_key, runtime_session_id
from tests.fixtures.cancelling import cancel_twice

from .conftest import RUN_ID, RUN_LABEL, Engine, MakeProvider

UUID_LABEL = "sandcell.uuid"


def _with(spec: SandboxSpec, **labels: str) -> SandboxSpec:
    return dataclasses.replace(spec, labels={**spec.labels, **labels})


async def test_container_shape(engine: Engine, provider: DockerProvider, spec: SandboxSpec) -> None:
    """Labels, limits, ulimits, a loopback-only random port, the minimum privileges."""
    session = runtime_session_id("docker", "user", "shape")
    sandbox_uuid = uuid.uuid4().hex
    handle = await provider.create(
        _with(spec, **{SESSION_LABEL: session, UUID_LABEL: sandbox_uuid})
    )
    try:
        info = await engine.inspect(handle.sandbox_id)
        assert info is not None
        labels = info["Config"]["Labels"]
        assert labels["sandcell.sandbox"] == "1"
        assert labels[UUID_LABEL] == sandbox_uuid
        assert labels[SESSION_LABEL] == session
        assert labels[RUN_LABEL] == RUN_ID
        host = info["HostConfig"]
        assert host["Memory"] == 1024 * 1024 * 1024
        assert host["PidsLimit"] == 512
        assert host["NanoCpus"] == 1_000_000_000
        assert host["Privileged"] is False
        # SYS_ADMIN for nsjail, NET_ADMIN for the runner's egress links; nothing else.
        assert {cap.removeprefix("CAP_") for cap in host["CapAdd"]} == {"SYS_ADMIN", "NET_ADMIN"}
        ulimits = {u["Name"].removeprefix("RLIMIT_").lower(): u for u in host["Ulimits"]}
        assert ulimits["nofile"]["Hard"] == provider._settings.nofile
        assert ulimits["nproc"]["Hard"] == provider._settings.nproc
        (binding,) = info["NetworkSettings"]["Ports"]["8080/tcp"]
        assert binding["HostIp"] == "127.0.0.1"
        assert handle.endpoint == f"http://127.0.0.1:{binding['HostPort']}"
        token = next(
            e.partition("=")[2]
            for e in info["Config"]["Env"]
            if e.startswith("SANDCELL_RUNNER_TOKEN=")
        )
        assert len(token) >= 32
        assert token not in repr(handle) + repr(handle.runner) + repr(provider)
        assert all(token not in value for value in labels.values())
        assert handle.session_id == session
    finally:
        await handle.close()
        await provider.destroy(handle.sandbox_id)
    assert await engine.inspect(handle.sandbox_id) is None


def _env(info: dict[str, Any]) -> dict[str, str]:
    return dict(entry.partition("=")[::2] for entry in info["Config"]["Env"])


async def test_the_runners_jobs_get_the_containers_cpus(
    engine: Engine, make_provider: MakeProvider, spec: SandboxSpec
) -> None:
    """The runner's one job quota follows the container's CPUs (its own default is one
    core): from the spec, else the provider's setting; an operator's runner_env wins."""
    two = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits, cpus=2.0))
    for provider, sandbox, quota in (
        (make_provider(), two, "2000"),
        (make_provider(cpus=0.5), dataclasses.replace(spec, limits=ResourceLimits()), "500"),
        (make_provider(runner_env={"SANDCELL_RUNNER_CPU_MILLICORES": "700"}), two, "700"),
    ):
        handle = await provider.create(sandbox)
        try:
            info = await engine.inspect(handle.sandbox_id)
            assert info is not None
            assert _env(info)["SANDCELL_RUNNER_CPU_MILLICORES"] == quota
            assert info["HostConfig"]["NanoCpus"] == int((sandbox.limits.cpus or 0.5) * 1e9)
            # The runner took it (it refuses a bad value at start-up) and runs jobs.
            done = await handle.runner.execute(ExecuteRequest(language="bash", code="echo up"))
            assert done.stdout == "up\n", done.stderr
        finally:
            await handle.close()
            await provider.destroy(handle.sandbox_id)


_SPAWN_HELPER_ARGS = """
from pathlib import Path
for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
    try:
        argv = cmdline.read_bytes().decode().split("\\0")[:-1]
    except OSError:
        continue
    if len(argv) > 3 and argv[3].endswith("/spawnd.py"):
        print("helper:", *argv[4:])
"""


async def test_the_images_runner_starts_jobs_through_the_vfork_path(
    engine: Engine, provider: DockerProvider, spec: SandboxSpec
) -> None:
    """The image carries the spawn helper's compiled vfork path: scripts/build-runner-image
    builds the runner's wheel on the host (the image has no compiler, and built there
    the runner would fall back to forking the helper for every job)."""
    handle = await provider.create(spec)
    try:
        done = await handle.runner.execute(ExecuteRequest(language="bash", code="echo up"))
        assert done.stdout == "up\n", done.stderr
        printed = await engine.exec(
            handle.sandbox_id, ["/opt/sandcell/bin/python", "-c", _SPAWN_HELPER_ARGS]
        )
        # <socket fd> <runner pid> <_vfork extension>: the helper was handed the extension.
        helper = [line.split() for line in printed.splitlines() if line.startswith("helper:")]
        assert len(helper) == 1, printed
        assert len(helper[0]) == 4, printed
        assert helper[0][3].endswith(".so"), printed
    finally:
        await handle.close()
        await provider.destroy(handle.sandbox_id)


async def test_runner_isolation_is_complete(provider: DockerProvider, spec: SandboxSpec) -> None:
    """With CAP_SYS_ADMIN and /proc unmasked the runner reports no weakened isolation:
    jobs run jailed as an unprivileged UID, and per-job memory cgroups catch an OOM."""
    handle = await provider.create(spec)
    try:
        health = await handle.runner.health()
        assert _weakened(health.warnings) == []
        assert {"python", "bash"} <= set(health.languages)
        who = await handle.runner.execute(
            ExecuteRequest(language="bash", code="id -u; cat /proc/1/cmdline | tr '\\0' ' '")
        )
        uid, _, init = who.stdout.partition("\n")
        assert who.status is RunStatus.OK, who.stderr
        assert int(uid) >= 1000
        assert "sandcell" not in init  # a pid namespace of its own: the runner is invisible
        hog = await handle.runner.execute(
            ExecuteRequest(
                language="python",
                code="x = bytearray(400 * 1024 * 1024)",
                limits=Limits(memory_mib=128),
            )
        )
        assert hog.status is RunStatus.MEMORY_LIMIT
    finally:
        await handle.close()
        await provider.destroy(handle.sandbox_id)


@pytest.mark.parametrize("privileges", ["no-caps", "privileged"])
async def test_other_privilege_modes_run_jailed_jobs(
    make_provider: MakeProvider, spec: SandboxSpec, privileges: str
) -> None:
    """The documented alternatives work too; no-caps says what it gives up."""
    provider = make_provider(privileges=privileges)
    handle = await provider.create(spec)
    try:
        health = await handle.runner.health()
        if privileges == "no-caps":
            assert any("cgroups unavailable" in warning for warning in health.warnings)
            assert health.egress == "none"
        else:
            assert _weakened(health.warnings) == []
            assert health.egress == "nftables"
        result = await handle.runner.execute(ExecuteRequest(language="bash", code="id -u"))
        assert result.status is RunStatus.OK, result.stderr
        assert int(result.stdout) >= 1000
    finally:
        await handle.close()
        await provider.destroy(handle.sandbox_id)


async def test_session_id_without_a_label_is_derived_and_recovered(
    make_provider: MakeProvider, spec: SandboxSpec
) -> None:
    """No session label: the id derives from the container id, and a fresh provider's
    connect derives the same one. Two concurrent creates get different ports."""
    provider = make_provider()
    async with anyio.create_task_group() as group:
        handles = []

        async def create() -> None:
            handles.append(await provider.create(spec))

        group.start_soon(create)
        group.start_soon(create)
    try:
        first, second = handles
        assert first.endpoint != second.endpoint
        assert first.session_id == sandbox_session_id(first.sandbox_id)
        connected = await make_provider().connect(first.sandbox_id)
        try:
            assert connected.session_id == first.session_id
            assert connected.endpoint == first.endpoint
            result = await connected.runner.execute(
                ExecuteRequest(language="python", code="print('hi')"),
                session_id=connected.session_id,
            )
            assert result.stdout == "hi\n"
        finally:
            await connected.close()
    finally:
        for handle in handles:
            await handle.close()
            await provider.destroy(handle.sandbox_id)


async def test_a_runner_that_never_gets_healthy_is_removed(
    engine: Engine, make_provider: MakeProvider, spec: SandboxSpec
) -> None:
    """A runner that exits at start-up fails create as soon as it exited (not at the
    readiness deadline), with its log, and no orphan."""
    # The deadline is out of reach: only noticing the exit ends create in time (the
    # guard is generous, a loaded machine starts containers slowly).
    provider = make_provider(ready_timeout_s=3600.0)
    sandbox_uuid = uuid.uuid4().hex
    broken = dataclasses.replace(
        _with(spec, **{UUID_LABEL: sandbox_uuid}), env={"SANDCELL_RUNNER_TIMEOUT_MS": "soon"}
    )
    with anyio.fail_after(600):
        with pytest.raises(SandboxUnavailableError, match="exited") as caught:
            await provider.create(broken)
    assert "SANDCELL_RUNNER_TIMEOUT_MS" in str(caught.value)  # the log tail says why
    assert await engine.containers(**{UUID_LABEL: sandbox_uuid}) == []


async def test_a_cancelled_create_leaves_no_container(
    engine: Engine, provider: DockerProvider, spec: SandboxSpec
) -> None:
    """Cancelled while waiting for /health: the container is removed anyway."""
    sandbox_uuid = uuid.uuid4().hex
    labelled = _with(spec, **{UUID_LABEL: sandbox_uuid})
    with anyio.move_on_after(0.4):
        await provider.create(labelled)
        pytest.fail("create finished before the cancellation; nothing was tested")
    assert await engine.containers(**{UUID_LABEL: sandbox_uuid}) == []


async def test_a_create_cancelled_again_while_it_removes_its_container_removes_it(
    engine: Engine, provider: DockerProvider, spec: SandboxSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while waiting for /health, the create removes its container: under an
    anyio shield only, a second native cancellation stopped the removal and left the
    container running. The removal is held here until the second cancellation came."""
    sandbox_uuid = uuid.uuid4().hex
    labelled = _with(spec, **{UUID_LABEL: sandbox_uuid})
    waiting, removing, go_on = asyncio.Event(), asyncio.Event(), asyncio.Event()
    real_remove = provider._engine.remove_container

    async def never_ready(*_: Any, **__: Any) -> None:
        waiting.set()
        await asyncio.Event().wait()

    async def held_remove(container_id: str) -> bool:
        removing.set()
        await go_on.wait()
        return await real_remove(container_id)

    monkeypatch.setattr(provider, "_wait_ready", never_ready)
    monkeypatch.setattr(provider._engine, "remove_container", held_remove)
    create = asyncio.create_task(provider.create(labelled))
    try:
        await cancel_twice(create, first=waiting, cleaning=removing, go_on=go_on)
        left = await engine.containers(**{UUID_LABEL: sandbox_uuid})
    finally:
        go_on.set()
    assert left == [], "the container was left"


async def test_missing_image_is_a_config_error(provider: DockerProvider, spec: SandboxSpec) -> None:
    """The message names the image and how to build it."""
    missing = dataclasses.replace(spec, image="localhost/sandcell-no-such-image:none")
    with pytest.raises(ConfigError, match=r"sandcell-no-such-image:none.*build-runner-image"):
        await provider.create(missing)


async def test_destroy_and_connect_leave_foreign_containers_alone(
    engine: Engine, provider: DockerProvider
) -> None:
    """A container without the sandcell label is neither removed nor connected to."""
    async with engine.client() as client:
        created = await client.post(
            "/containers/create",
            json={"Image": engine.image, "Labels": {RUN_LABEL: RUN_ID}},
        )
        created.raise_for_status()
        container_id = created.json()["Id"]
    await provider.destroy(container_id)
    assert await engine.inspect(container_id) is not None
    with pytest.raises(SandboxNotFoundError):
        await provider.connect(container_id)
    # the session teardown removes it (it carries this run's label)


async def test_connect_to_a_stopped_or_missing_sandbox(
    provider: DockerProvider, spec: SandboxSpec
) -> None:
    """Gone means SandboxNotFoundError, also for ids that are not container ids."""
    for bad in ("0" * 64, "../../containers/json", "short"):
        with pytest.raises(SandboxNotFoundError):
            await provider.connect(bad)
        await provider.destroy(bad)


def test_sandcell_exec_with_the_docker_provider(engine: Engine, tmp_path: Path) -> None:
    """The documented command: two `sandcell exec` calls share a session's files."""
    env = {
        **os.environ,
        "SANDCELL_HOME": str(tmp_path / "home"),
        "SANDCELL_PROVIDER": "docker",
        "DOCKER_HOST": engine.docker_host,
        "SANDCELL_DOCKER_IMAGE": engine.image,
    }
    cli = [sys.executable, "-m", "sandcell_orchestrator", "exec", "--session", "demo"]
    first = subprocess.run(
        [*cli, "open('answer.txt', 'w').write(str(6 * 7))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert first.returncode == 0, first.stderr
    second = subprocess.run(
        [*cli, "print(open('answer.txt').read())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "42"


async def test_a_failed_restore_leaves_no_container(
    engine: Engine, provider: DockerProvider, spec: SandboxSpec, store: DirectorySnapshotStore
) -> None:
    """Restoring a corrupt checkpoint: the runner rejects it, the new container is removed."""

    async def garbage() -> AsyncIterator[bytes]:
        yield b"this is not a checkpoint archive" * 100

    session = runtime_session_id("docker", "user", f"corrupt-{uuid.uuid4().hex}")
    await store.put(checkpoint_key(session, 1), garbage(), max_bytes=1 << 20)
    sandbox_uuid = uuid.uuid4().hex
    manager = SandboxManager(provider, InProcessRegistry(), store)
    with pytest.raises(CheckpointError):
        async with manager.hold(session) as hold:
            await manager.attach(hold, _with(spec, **{UUID_LABEL: sandbox_uuid}))
    assert await engine.containers(**{UUID_LABEL: sandbox_uuid}) == []


def _weakened(warnings: list[str]) -> list[str]:
    """Warnings but the one a container gets today: no loop devices for workspace images
    (its workspaces are tmpfs, as before; docs/isolation.md, "Workspace storage")."""
    return [w for w in warnings if not w.startswith("workspace images unavailable")]


async def test_the_runner_is_read_up_to_the_configured_ceiling(
    settings: DockerSettings, spec: SandboxSpec
) -> None:
    """``open_provider`` with the settings' ``SANDCELL_ANSWER_*`` ceiling: the runner in
    the container (the tenant's side) is read by it, not by the defaults."""
    ceiling = OrchestratorSettings.from_env(
        {"HOME": "/nonexistent", "SANDCELL_ANSWER_MAX_BODY_BYTES": str(1 << 20)}
    ).answer_caps
    provider = open_provider(settings, answer_caps=ceiling)
    try:
        session = runtime_session_id("docker", "user", "ceiling")
        handle = await provider.create(_with(spec, **{SESSION_LABEL: session}))
        try:
            assert handle.runner.connection.ceiling == ceiling
            make = "open('big', 'wb').write(bytes(2 << 20))"
            done = await handle.runner.execute(
                ExecuteRequest(language="python", code=make), session_id=session
            )
            assert done.status == RunStatus.OK, done.stderr
            with pytest.raises(RunnerAnswerError, match=f"exceeds {(1 << 20) + (64 << 10)} bytes"):
                await handle.runner.read_file("big", session_id=session)
        finally:
            await handle.close()
            await provider.destroy(handle.sandbox_id)
    finally:
        await provider.close()
