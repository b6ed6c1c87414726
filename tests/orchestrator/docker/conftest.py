"""Fixtures for the Docker provider: a real engine (podman's Docker-compatible API).

``scripts/services`` starts ``podman system service`` and builds the runner image
(``scripts/services-podman``), exporting ``SANDCELL_TEST_DOCKER_HOST`` and
``SANDCELL_TEST_DOCKER_IMAGE``. Run by hand without them, the session starts its
own podman service (and builds or finds the cached image) when podman is
installed, and fails otherwise: a Docker suite that silently skipped would pass
while proving nothing about the provider.

Every container a test makes carries ``sandcell.test-run=<this run>``; whatever a
failed test left behind is removed at the end of the session, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandcell_orchestrator.providers.base import ResourceLimits, SandboxSpec
from sandcell_orchestrator.providers.docker import DockerProvider, DockerSettings
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from tests.orchestrator.provider_contract import ContractTarget

ROOT = Path(__file__).resolve().parents[3]
HOST_ENV = "SANDCELL_TEST_DOCKER_HOST"
IMAGE_ENV = "SANDCELL_TEST_DOCKER_IMAGE"
RUN_LABEL = "sandcell.test-run"
RUN_ID = uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Engine:
    """A running engine and the runner image in it."""

    docker_host: str
    image: str

    @property
    def socket_path(self) -> str:
        return self.docker_host.removeprefix("unix://")

    def client(self) -> httpx.AsyncClient:
        """A raw Engine API client, for looking behind the provider's back."""
        return httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket_path),
            base_url="http://docker/v1.41",
            timeout=30,
        )

    async def containers(self, **labels: str) -> list[dict[str, Any]]:
        """Containers (running or not) carrying all ``labels``."""
        filters = json.dumps({"label": [f"{key}={value}" for key, value in labels.items()]})
        async with self.client() as client:
            response = await client.get("/containers/json", params={"all": "1", "filters": filters})
            response.raise_for_status()
            found: list[dict[str, Any]] = response.json()
            return found

    async def inspect(self, container_id: str) -> dict[str, Any] | None:
        async with self.client() as client:
            response = await client.get(f"/containers/{container_id}/json")
            if response.status_code == 404:
                return None
            response.raise_for_status()
            info: dict[str, Any] = response.json()
            return info

    async def exec(self, container_id: str, argv: list[str]) -> str:
        """What ``argv`` run in the container prints (stdout and stderr, on a terminal)."""
        async with self.client() as client:
            made = await client.post(
                f"/containers/{container_id}/exec",
                json={"Cmd": argv, "AttachStdout": True, "AttachStderr": True, "Tty": True},
            )
            made.raise_for_status()
            started = await client.post(
                f"/exec/{made.json()['Id']}/start", json={"Detach": False, "Tty": True}
            )
            started.raise_for_status()
            return started.text


def _ping(socket_path: str) -> bool:
    # Probe the socket ourselves first: httpcore leaks the socket of a refused unix
    # connect, and the ResourceWarning surfaces in whichever test runs next.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(socket_path)
        except OSError:
            return False
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=2) as client:
            return client.get("http://docker/_ping").status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _private_podman() -> Iterator[Engine]:
    """Our own ``podman system service`` (stopped by its pid) and the runner image."""
    directory = ROOT / ".test-services" / f"podman-pytest-{os.getpid()}"
    directory.mkdir(parents=True, exist_ok=True)
    socket_path = directory / "podman.sock"
    conf = directory / "containers.conf"
    subprocess.run(
        [
            "bash",
            "-c",
            'source "$0"; _sandcell_podman_conf "$1"',
            ROOT / "scripts/services-podman",
            conf,
        ],
        check=True,
    )
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    with (directory / "service.log").open("ab") as log:
        process = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{socket_path}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 15
        while not _ping(str(socket_path)):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"podman system service did not start; see {directory}/service.log")
            time.sleep(0.1)
        built = subprocess.run(
            [ROOT / "scripts/build-runner-image", "--engine", "podman", "--rootfs"],
            env=env,
            stdout=subprocess.PIPE,
            check=False,
        )
        if built.returncode != 0:
            pytest.fail("scripts/build-runner-image failed (its output is above)")
        yield Engine(f"unix://{socket_path}", built.stdout.decode().strip().splitlines()[-1])
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        shutil.rmtree(directory, ignore_errors=True)


def _remove_leftovers(engine: Engine) -> None:
    filters = json.dumps({"label": [f"{RUN_LABEL}={RUN_ID}"]})
    with httpx.Client(transport=httpx.HTTPTransport(uds=engine.socket_path), timeout=30) as client:
        base = "http://docker/v1.41"
        listed = client.get(f"{base}/containers/json", params={"all": "1", "filters": filters})
        for container in listed.json() if listed.status_code == 200 else []:
            client.delete(f"{base}/containers/{container['Id']}", params={"force": "true"})


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The engine under test: the one ``scripts/services`` started, or a private one."""
    host = os.environ.get(HOST_ENV, "").strip()
    image = os.environ.get(IMAGE_ENV, "").strip()
    if host:
        if not image:
            pytest.fail(f"{HOST_ENV} is set but {IMAGE_ENV} is not (scripts/services sets both)")
        found = Engine(host, image)
        if not _ping(found.socket_path):
            pytest.fail(f"{HOST_ENV}={host}: the engine does not answer /_ping")
        try:
            yield found
        finally:
            _remove_leftovers(found)
        return
    if shutil.which("podman") is None:
        pytest.fail(
            f"{HOST_ENV} is not set and podman is not installed: run the tests through"
            " scripts/test (scripts/services starts podman), or install podman and runc"
        )
    with _private_podman() as started:
        try:
            yield started
        finally:
            _remove_leftovers(started)


@pytest.fixture
def settings(engine: Engine) -> DockerSettings:
    return DockerSettings(image=engine.image, docker_host=engine.docker_host)


@pytest.fixture
def spec(engine: Engine) -> SandboxSpec:
    """A small sandbox, labelled with this test run."""
    return SandboxSpec(
        image=engine.image,
        labels={RUN_LABEL: RUN_ID},
        limits=ResourceLimits(memory_mib=1024, pids=512, cpus=1.0),
    )


@pytest.fixture
def store(tmp_path: Path) -> DirectorySnapshotStore:
    return DirectorySnapshotStore(tmp_path / "snapshots")


MakeProvider = Callable[..., DockerProvider]


@pytest.fixture
async def make_provider(settings: DockerSettings) -> AsyncIterator[MakeProvider]:
    """New provider instances over the engine; closed after the test."""
    made: list[DockerProvider] = []

    def make(**changes: Any) -> DockerProvider:
        chosen = DockerSettings(**{**_fields(settings), **changes}) if changes else settings
        provider = DockerProvider(chosen)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.close()


@pytest.fixture
async def provider(make_provider: MakeProvider) -> DockerProvider:
    return make_provider()


@pytest.fixture
async def target(
    make_provider: MakeProvider, store: DirectorySnapshotStore, spec: SandboxSpec
) -> AsyncIterator[ContractTarget]:
    contract = ContractTarget(make_provider=make_provider, store=store, spec=spec)
    yield contract
    await contract.close()


def _fields(settings: DockerSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in DockerSettings.__dataclass_fields__}
