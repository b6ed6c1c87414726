"""Engine failures become the orchestrator's own errors, with clear messages.

The daemon-down case uses a real (absent) socket; the engine answers that a real
engine only gives under load or misconfiguration come from ``httpx.MockTransport``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from sandcell_orchestrator.errors import (
    ConfigError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.docker import DockerProvider, DockerSettings
from sandcell_orchestrator.providers.docker_api import EngineClient, _demultiplex

CONTAINER_ID = "c0ffee" * 10 + "abcd"
VERSION = {"Components": [{"Name": "Podman Engine"}]}
INFO = {"SecurityOptions": []}

Handler = Callable[[httpx.Request], httpx.Response]


class FakeEngine:
    """Answers the provider's calls; ``override`` replaces one route's answer."""

    def __init__(self, override: dict[str, Handler] | None = None) -> None:
        self.override = override or {}
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/v1.41").replace(CONTAINER_ID, "{id}")
        route = f"{request.method} {path}"
        self.calls.append(route)
        if route in self.override:
            return self.override[route](request)
        answers = {
            "GET /version": httpx.Response(200, json=VERSION),
            "GET /info": httpx.Response(200, json=INFO),
            "POST /containers/create": httpx.Response(201, json={"Id": CONTAINER_ID}),
            "POST /containers/{id}/start": httpx.Response(204),
            "DELETE /containers/{id}": httpx.Response(204),
        }
        return answers.get(route, httpx.Response(404, json={"message": "no such container"}))


def _provider(engine: FakeEngine, tmp_path: Path) -> DockerProvider:
    settings = DockerSettings(docker_host="unix:///fake/docker.sock", image="runner:test")
    client = EngineClient(settings.docker_host, transport=httpx.MockTransport(engine))
    return DockerProvider(settings, engine=client)


def _fail(status: int, message: str) -> Handler:
    return lambda request: httpx.Response(status, json={"message": message})


async def test_daemon_down_is_a_clear_retryable_error(tmp_path: Path) -> None:
    """No socket at DOCKER_HOST: every call says the engine is unreachable, and where."""
    host = f"unix://{tmp_path}/absent/docker.sock"
    provider = DockerProvider(DockerSettings(docker_host=host))
    try:
        with pytest.raises(SandboxUnavailableError, match=f"docker engine unreachable at {host}"):
            await provider.create(SandboxSpec())
        with pytest.raises(SandboxUnavailableError, match="unreachable") as caught:
            await provider.destroy(CONTAINER_ID)
        assert caught.value.retryable
        with pytest.raises(SandboxUnavailableError, match="unreachable"):
            await provider.connect(CONTAINER_ID)
    finally:
        await provider.close()


async def test_missing_image_names_the_image(tmp_path: Path) -> None:
    engine = FakeEngine(
        {"POST /containers/create": _fail(404, "no such image: runner:test: image not known")}
    )
    provider = _provider(engine, tmp_path)
    with pytest.raises(ConfigError, match="'runner:test' not found"):
        await provider.create(SandboxSpec())
    await provider.close()


async def test_port_conflicts_retry_then_fail_without_orphans(tmp_path: Path) -> None:
    """Each attempt's container is removed; after three the error says why."""
    conflict = "driver failed programming: Bind for 127.0.0.1:0: port is already allocated"
    engine = FakeEngine({"POST /containers/{id}/start": _fail(500, conflict)})
    provider = _provider(engine, tmp_path)
    with pytest.raises(SandboxUnavailableError, match="port conflicts"):
        await provider.create(SandboxSpec())
    assert engine.calls.count("POST /containers/create") == 3
    assert engine.calls.count("DELETE /containers/{id}") == 3
    await provider.close()


async def test_other_start_failures_remove_the_container(tmp_path: Path) -> None:
    engine = FakeEngine(
        {"POST /containers/{id}/start": _fail(500, "OCI runtime error: runc create failed")}
    )
    provider = _provider(engine, tmp_path)
    with pytest.raises(SandboxUnavailableError, match="runc create failed"):
        await provider.create(SandboxSpec())
    assert engine.calls[-1] == "DELETE /containers/{id}"
    await provider.close()


async def test_engine_timeouts_and_garbage_are_unavailable(tmp_path: Path) -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    provider = _provider(FakeEngine({"GET /version": timeout}), tmp_path)
    with pytest.raises(SandboxUnavailableError, match="timed out during version"):
        await provider.create(SandboxSpec())
    await provider.close()
    garbage = FakeEngine({"GET /version": lambda request: httpx.Response(200, content=b"<html>")})
    provider = _provider(garbage, tmp_path)
    with pytest.raises(SandboxUnavailableError, match="non-JSON"):
        await provider.create(SandboxSpec())
    await provider.close()


async def test_destroy_tolerates_a_container_already_gone_or_going(tmp_path: Path) -> None:
    labelled = {"Id": CONTAINER_ID, "Config": {"Labels": {"sandcell.sandbox": "1"}}}
    for answer in (
        httpx.Response(404, json={"message": "no such container"}),
        httpx.Response(409, json={"message": "removal of container is already in progress"}),
    ):
        engine = FakeEngine(
            {
                "GET /containers/{id}/json": lambda request: httpx.Response(200, json=labelled),
                "DELETE /containers/{id}": lambda request, answer=answer: answer,
            }
        )
        provider = _provider(engine, tmp_path)
        await provider.destroy(CONTAINER_ID)
        await provider.close()
    provider = _provider(FakeEngine(), tmp_path)  # inspect says 404
    await provider.destroy(CONTAINER_ID)
    with pytest.raises(SandboxNotFoundError):
        await provider.connect(CONTAINER_ID)
    await provider.close()


async def test_an_engine_error_on_remove_is_reported(tmp_path: Path) -> None:
    labelled = {"Id": CONTAINER_ID, "Config": {"Labels": {"sandcell.sandbox": "1"}}}
    engine = FakeEngine(
        {
            "GET /containers/{id}/json": lambda request: httpx.Response(200, json=labelled),
            "DELETE /containers/{id}": _fail(500, "device or resource busy"),
        }
    )
    provider = _provider(engine, tmp_path)
    with pytest.raises(SandboxUnavailableError, match="500 device or resource busy"):
        await provider.destroy(CONTAINER_ID)
    await provider.close()


def test_log_frames_are_demultiplexed() -> None:
    framed = b"\x01\x00\x00\x00\x00\x00\x00\x03out" + b"\x02\x00\x00\x00\x00\x00\x00\x04err\n"
    assert _demultiplex(framed) == b"outerr\n"
    assert _demultiplex(b"plain text") == b"plain text"


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError,
        httpx.ReadError,
        httpx.WriteError,
        httpx.CloseError,
        httpx.RemoteProtocolError,
        httpx.LocalProtocolError,
        httpx.ProxyError,
        httpx.UnsupportedProtocol,
        httpx.ConnectTimeout,
        httpx.ReadTimeout,
        httpx.WriteTimeout,
        httpx.PoolTimeout,
    ],
)
async def test_every_transport_failure_is_unavailable(
    error: type[httpx.TransportError], tmp_path: Path
) -> None:
    """The transport map is total: no httpx error escapes the engine client."""

    def fail(request: httpx.Request) -> httpx.Response:
        raise error("boom", request=request)

    client = EngineClient("unix:///fake/docker.sock", transport=httpx.MockTransport(fail))
    with pytest.raises(SandboxUnavailableError, match="docker engine") as caught:
        await client.ping()
    assert caught.value.retryable
    assert isinstance(caught.value.__cause__, httpx.TransportError)
    await client.close()
