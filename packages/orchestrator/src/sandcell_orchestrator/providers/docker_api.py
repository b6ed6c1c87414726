"""A thin async client of the Docker Engine API: the few calls the Docker provider makes.

Why not docker-py: it is synchronous (every call would need a worker thread to stay
off the event loop) and drags in ``requests``; the surface we use is seven container
calls plus ping/version/info, each a single JSON request. httpx already speaks HTTP
over a unix socket (``AsyncHTTPTransport(uds=...)``) and is what the rest of the
orchestrator uses, so the transport stays injectable for tests.

Paths are versioned (``/v1.41/...``): Docker 20.10+ and podman's compatibility
layer (4.x) both serve that version.

Errors: transport failures become ``SandboxUnavailableError("docker engine
unreachable at …")``; a non-2xx answer becomes ``EngineAPIError`` (status and the
engine's message) for the provider to translate, since only it knows what a 404
means for the call it made. Request bodies (which carry a runner token) are never
put into a message or a log line.
"""

from __future__ import annotations

import contextlib
import json as json_module
import logging
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from ..errors import ConfigError, SandboxUnavailableError
from ..runner.close_guard import CloseGuard

__all__ = ["API_VERSION", "EngineAPIError", "EngineClient", "parse_docker_host"]

log = logging.getLogger(__name__)

API_VERSION = "v1.41"
_MESSAGE_CHARS = 300


class EngineAPIError(Exception):
    """The engine answered a call with a non-2xx status (internal to the provider)."""

    def __init__(self, operation: str, status: int, message: str) -> None:
        super().__init__(f"{operation}: engine answered {status}: {message}")
        self.operation = operation
        self.status = status
        self.message = message


def parse_docker_host(value: str) -> str:
    """The socket path of a ``unix:///path`` ``DOCKER_HOST``; ``ConfigError`` otherwise.

    Only local unix sockets are supported: a TCP engine needs TLS client
    certificates to be safe, and an engine on another host could not publish the
    runner's port on this host's loopback anyway.
    """
    parts = urlsplit(value.strip())
    if parts.scheme != "unix" or parts.netloc or not parts.path.startswith("/"):
        # Echoed without a user info (tcp://user:password@host): the value is shown so
        # the operator sees what was read, a credential in it is not.
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        raise ConfigError(f"DOCKER_HOST: expected unix:///path/to/docker.sock, got {shown[:100]!r}")
    return parts.path


class EngineClient:
    """An HTTP client of one engine socket. Use as ``async with`` or call ``close()``."""

    def __init__(
        self,
        docker_host: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.docker_host = docker_host
        socket_path = parse_docker_host(docker_host)
        self._client = httpx.AsyncClient(
            # The host part is a placeholder: the transport connects to the socket.
            base_url=f"http://docker/{API_VERSION}",
            # Guarded: a close() racing a request still connecting would leave that
            # request's socket open (runner/close_guard.py).
            transport=CloseGuard(transport or httpx.AsyncHTTPTransport(uds=socket_path)),
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            trust_env=False,
        )

    def __repr__(self) -> str:
        return f"EngineClient(docker_host={self.docker_host!r})"

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool; idempotent."""
        await self._client.aclose()

    # -- plumbing -------------------------------------------------------------

    @contextlib.contextmanager
    def _map_transport_errors(self, operation: str) -> Iterator[None]:
        """Every httpx failure on the socket is the engine being unavailable (retryable)."""
        try:
            yield
        except httpx.TimeoutException as exc:
            raise SandboxUnavailableError(
                f"docker engine at {self.docker_host} timed out during {operation}"
            ) from exc
        except httpx.TransportError as exc:
            raise SandboxUnavailableError(
                f"docker engine unreachable at {self.docker_host} during {operation}: "
                f"{type(exc).__name__}: {str(exc)[:_MESSAGE_CHARS]}"
            ) from exc

    async def _call(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        params: Mapping[str, str] | None = None,
        json: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        extensions = {"timeout": httpx.Timeout(timeout_s).as_dict()} if timeout_s else None
        request = self._client.build_request(
            method, path, params=params, json=json, extensions=extensions
        )
        with self._map_transport_errors(operation):
            response = await self._client.send(request)
        log.debug("engine %s %s -> %d", method, request.url.path, response.status_code)
        if response.is_success:
            return response
        raise EngineAPIError(operation, response.status_code, _engine_message(response))

    @staticmethod
    def _json(response: httpx.Response, operation: str) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError:
            raise SandboxUnavailableError(f"{operation}: the engine answered non-JSON") from None
        if not isinstance(body, dict):
            raise SandboxUnavailableError(f"{operation}: the engine answered a non-object")
        return body

    # -- calls ----------------------------------------------------------------

    async def ping(self) -> None:
        """``GET /_ping``."""
        await self._call("GET", "/_ping", operation="ping")

    async def version(self) -> dict[str, Any]:
        """``GET /version``: engine name and versions (podman names itself in Components)."""
        return self._json(await self._call("GET", "/version", operation="version"), "version")

    async def info(self) -> dict[str, Any]:
        """``GET /info``: among others, the engine's ``SecurityOptions`` (apparmor, selinux)."""
        return self._json(await self._call("GET", "/info", operation="info"), "info")

    async def create_container(self, body: Mapping[str, Any], *, name: str | None = None) -> str:
        """``POST /containers/create``; returns the new container's id."""
        params = {"name": name} if name else None
        response = await self._call(
            "POST", "/containers/create", operation="create container", params=params, json=body
        )
        container_id = self._json(response, "create container").get("Id")
        if not isinstance(container_id, str) or not container_id:
            raise SandboxUnavailableError("create container: the engine answered no Id")
        return container_id

    async def start_container(self, container_id: str) -> None:
        """``POST /containers/{id}/start`` (304, already started, counts as success)."""
        await self._call(
            "POST", f"/containers/{_segment(container_id)}/start", operation="start container"
        )

    async def inspect_container(self, container_id: str) -> dict[str, Any] | None:
        """``GET /containers/{id}/json``; ``None`` when there is no such container."""
        try:
            response = await self._call(
                "GET", f"/containers/{_segment(container_id)}/json", operation="inspect container"
            )
        except EngineAPIError as exc:
            if exc.status == 404:
                return None
            raise
        return self._json(response, "inspect container")

    async def list_containers(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """``GET /containers/json?all=true``: every container (running or not) carrying
        all ``labels``, as the engine summarises them (``Id``, ``State``, ``Created``
        in epoch seconds, ``Labels``)."""
        filters = {"label": [f"{key}={value}" for key, value in labels.items()]}
        response = await self._call(
            "GET",
            "/containers/json",
            operation="list containers",
            params={"all": "true", "filters": json_module.dumps(filters)},
        )
        try:
            listed = response.json()
        except ValueError:
            raise SandboxUnavailableError("list containers: the engine answered non-JSON") from None
        if not isinstance(listed, list):
            raise SandboxUnavailableError("list containers: the engine answered a non-list")
        return [item for item in listed if isinstance(item, dict)]

    async def remove_container(self, container_id: str) -> bool:
        """``DELETE /containers/{id}?force=true&v=true``; False when it was already gone.

        Force kills a running container first; ``v`` drops its anonymous volumes.
        """
        try:
            await self._call(
                "DELETE",
                f"/containers/{_segment(container_id)}",
                operation="remove container",
                params={"force": "true", "v": "true"},
            )
        except EngineAPIError as exc:
            if exc.status == 404:
                return False
            # Another remover got there first: the outcome is the same.
            if exc.status == 409 and "in progress" in exc.message:
                return True
            raise
        return True

    async def container_logs(self, container_id: str, *, tail: int = 40) -> str:
        """The last ``tail`` lines of stdout and stderr, decoded; ``""`` when unavailable."""
        try:
            response = await self._call(
                "GET",
                f"/containers/{_segment(container_id)}/logs",
                operation="container logs",
                params={"stdout": "true", "stderr": "true", "tail": str(tail)},
                timeout_s=5.0,
            )
        except (EngineAPIError, SandboxUnavailableError):
            return ""
        return _demultiplex(response.content).decode("utf-8", "replace")


def _segment(value: str) -> str:
    """A path segment: ids and names cannot smuggle ``/`` or ``..`` into the route."""
    return quote(value, safe="")


def _engine_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:_MESSAGE_CHARS]
    if isinstance(body, dict):
        message = body.get("message") or body.get("cause") or ""
        return str(message)[:_MESSAGE_CHARS]
    return str(body)[:_MESSAGE_CHARS]


def _demultiplex(raw: bytes) -> bytes:
    """Strip the 8-byte stream headers of a non-TTY log stream (plain bytes pass as-is)."""
    out = bytearray()
    view = memoryview(raw)
    while len(view) >= 8 and view[0] in (0, 1, 2) and bytes(view[1:4]) == b"\0\0\0":
        size = int.from_bytes(view[4:8], "big")
        out += view[8 : 8 + size]
        view = view[8 + size :]
    out += view
    return bytes(out)
