"""A sandbox's own servers: E2B's ``https://<port>-<sandboxID>.<domain>/…`` (``get_host``).

Any ``E2b-Sandbox-Port`` other than envd's (49983) and the code interpreter's (49999)
names a port a process in the sandbox listens on (a dev server started with
``commands.run(..., background=True)``). Requests and WebSockets go to the runner's
``/v1/session/ports/{port}/…``, which connects inside the sandbox's jail
(``runner/port_forward.py`` has what is forwarded and what is not).

Access: the sandbox's traffic token in ``E2b-Traffic-Access-Token`` (the SDK's
``sandbox.traffic_access_token``), or nothing when the sandbox was created with
``network.allowPublicTraffic: true``. E2B's default is public; sandcell's is the token,
as a sandbox reaches out only when its creator asked. A missing, paused or foreign
sandbox, a wrong token and a bad port all get E2B's proxy answer (502, "not found");
a port nothing listens on is the runner's 502 ``app_not_responding``. Past the runner's
cap on what it relays at once (``SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS`` / ``_REQUESTS``)
a request or WebSocket gets its ``503 busy``, passed on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from sandcell_protocol.digits import is_ascii_digits

from ..errors import SandcellError
from ..handle import SandboxHandle
from ..runner.port_forward import (
    connect_upstream,
    downstream_response,
    pump,
    refuse,
    stays_in_port_route,
    upstream_headers,
)
from .errors import E2bError, e2b_error_response, sandbox_gone_response
from .sandboxes import E2bSandbox, E2bSandboxes

__all__ = ["SandboxPorts", "user_port"]

log = logging.getLogger(__name__)

_ROUTING_HEADERS = frozenset(
    {"e2b-sandbox-id", "e2b-sandbox-port", "e2b-traffic-access-token", "x-access-token"}
)
"""Ours, never the app's."""


def user_port(raw: str | None) -> int | None:
    """The port a header names, if it is one (1..65535, digits only)."""
    if raw is None or not is_ascii_digits(raw, max_length=5):
        return None
    port = int(raw)
    return port if 1 <= port <= 65535 else None


def _forward_path(scope: Scope) -> str | None:
    """The still-encoded path under the mount, without its leading slash; None if it
    could leave the runner's ports route."""
    root = scope.get("root_path", "").encode()
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    rest = raw.removeprefix(root).decode("latin-1").removeprefix("/")
    return rest if stays_in_port_route(rest) else None


class SandboxPorts:
    """HTTP and WebSocket forwarding to the servers in every sandbox of one table."""

    def __init__(self, sandboxes: Callable[[], E2bSandboxes]) -> None:
        self._sandboxes = sandboxes

    async def _reached(self, headers: Headers) -> tuple[E2bSandbox, SandboxHandle] | None:
        """The sandbox the headers name and its handle, if this caller may reach it and
        it runs (a paused one has no handle)."""
        sandbox = await self._sandboxes().for_port(
            headers.get("e2b-sandbox-id"), headers.get("e2b-traffic-access-token")
        )
        if sandbox is None or sandbox.handle is None:
            return None
        return sandbox, sandbox.handle

    async def http(self, port: int, scope: Scope, receive: Receive, send: Send) -> None:
        """Forward one request to ``port`` in the sandbox the headers name."""
        request = Request(scope, receive)
        headers = request.headers
        reached = await self._reached(headers)
        if reached is None:
            await sandbox_gone_response(headers.get("e2b-sandbox-id"))(scope, receive, send)
            return
        sandbox, handle = reached
        path = _forward_path(scope)
        if path is None:
            refused = E2bError(400, "bad_request", "a path may not contain . or .. segments")
            await e2b_error_response(refused)(scope, receive, send)
            return
        forwarded = upstream_headers(headers, dropped=_ROUTING_HEADERS)
        if "cookie" in headers:
            forwarded["cookie"] = headers["cookie"]  # no cookie of ours to strip here
        if "host" in headers:
            forwarded["x-forwarded-host"] = headers["host"]
        forwarded["x-forwarded-proto"] = request.url.scheme
        has_body = request.method not in ("GET", "HEAD") or "content-length" in headers
        try:
            upstream = await handle.runner.port_request(
                request.method,
                port,
                path,
                session_id=handle.session_id or sandbox.session_id,
                query=scope.get("query_string", b"").decode("latin-1"),
                request_headers=forwarded,
                content=request.stream() if has_body else None,
            )
        except SandcellError as exc:
            response: Response = e2b_error_response(exc)
        else:
            response = downstream_response(upstream)
        await response(scope, receive, send)

    async def websocket(self, port: int, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay a WebSocket to ``port`` in the sandbox the headers name."""
        websocket = WebSocket(scope, receive, send)
        reached = await self._reached(websocket.headers)
        path = _forward_path(scope)
        if reached is None or path is None:
            await websocket.close(code=1008)
            return
        sandbox, handle = reached
        # Imported here: only WebSocket forwarding needs the library.
        from websockets.exceptions import WebSocketException

        try:
            upgrade = await handle.runner.websocket_upgrade(
                port,
                path,
                session_id=handle.session_id or sandbox.session_id,
                query=scope.get("query_string", b"").decode("latin-1"),
            )
            upstream = await connect_upstream(upgrade, scope.get("subprotocols") or None)
        except (SandcellError, OSError, TimeoutError, WebSocketException) as exc:
            # Mostly a server not listening yet, whose client retries.
            log.info(
                "e2b sandbox %s port %d: no websocket upstream: %r", sandbox.sandbox_id, port, exc
            )
            await refuse(websocket, exc)
            return
        async with upstream:
            await websocket.accept(subprotocol=upstream.subprotocol)
            await pump(websocket, upstream, touch=lambda: None)
