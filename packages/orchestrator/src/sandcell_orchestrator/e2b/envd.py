"""envd under ``/e2b/sandbox``: one ASGI app for every sandbox, routed by headers.

The SDK (with ``E2B_SANDBOX_URL``) sends every sandbox's envd traffic to one
URL, naming the sandbox in ``E2b-Sandbox-Id`` and the port in
``E2b-Sandbox-Port``; ``X-Access-Token`` carries the sandbox's envd token (or, on
``/files`` without one, a signed URL's ``signature``: ``signing.py``). This app
checks the sandbox and token once (a missing sandbox, a paused one's RPCs, another
tenant's, a wrong token and a wrong signature answer alike: E2B's proxy's 502), then
hands the request to:

    /health                    204
    /files                     GET, POST (envd_http.py)
    /process.Process/…         the generated Connect app (process.py)
    /filesystem.Filesystem/…   the generated Connect app (filesystem.py)

Port 49983 is envd; port 49999 is the code interpreter (``interpreter.py``), which
also takes the sandbox's traffic token (``E2B-Traffic-Access-Token``: the
``e2b-code-interpreter`` SDK sends no envd token on its context calls). Any other
port is a server in the sandbox (``ports.py``), over HTTP and WebSocket.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .envd_http import read_file, write_files
from .errors import E2bError, e2b_error_response, sandbox_gone_response
from .filesystem import filesystem_app
from .interpreter import INTERPRETER_PORT, interpreter_route
from .ports import SandboxPorts, user_port
from .process import process_app
from .sandboxes import E2bSandbox, E2bSandboxes
from .signing import file_signature

if TYPE_CHECKING:
    from connectrpc.request import RequestContext

    from ..serve.idempotency import Idempotency

__all__ = ["ENVD_PORT", "EnvdApp", "SANDBOX_ID_HEADER", "SANDBOX_PORT_HEADER"]

ENVD_PORT = 49983
SANDBOX_ID_HEADER = "e2b-sandbox-id"
SANDBOX_PORT_HEADER = "e2b-sandbox-port"
ACCESS_TOKEN_HEADER = "x-access-token"  # noqa: S105 (a header name)
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"  # noqa: S105 (a header name)


class EnvdApp:
    """The envd surface of every sandbox in one ``E2bSandboxes`` table."""

    def __init__(
        self, sandboxes: Callable[[], E2bSandboxes], *, idempotency: Idempotency | None = None
    ) -> None:
        self._sandboxes = sandboxes
        self._idempotency = idempotency
        self._rpc: dict[str, ASGIApp] = {
            "/process.Process/": process_app(self._sandbox_of),
            "/filesystem.Filesystem/": filesystem_app(self._sandbox_of),
        }
        self._ports = SandboxPorts(sandboxes)

    async def _lookup(self, request: Request, path: str) -> E2bSandbox | None:
        headers = request.headers
        token = headers.get(ACCESS_TOKEN_HEADER)
        # As envd: a signature is read only where a URL can carry one and no token was
        # sent (a token, when sent, decides alone).
        signed = None
        if path == "/files" and not token:
            signed = file_signature(request.method, request.query_params)
        return await self._sandboxes().for_envd(
            headers.get(SANDBOX_ID_HEADER), token, signed=signed
        )

    def _sandbox_of(self, ctx: RequestContext[object, object]) -> E2bSandbox:
        # The request's own lookup (``__call__``) read the row and opened the handle.
        headers = ctx.request_headers
        found = self._sandboxes().known_for_envd(
            headers.get(SANDBOX_ID_HEADER), headers.get(ACCESS_TOKEN_HEADER)
        )
        if found is None:
            raise ConnectError(Code.UNAVAILABLE, "The sandbox was not found")
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return
        headers = Headers(scope=scope)
        port = headers.get(SANDBOX_PORT_HEADER, str(ENVD_PORT))
        own = user_port(port)
        if own is not None and own not in (ENVD_PORT, INTERPRETER_PORT):
            if scope["type"] == "websocket":
                await self._ports.websocket(own, scope, receive, send)
            else:
                await self._ports.http(own, scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # envd serves none
            return
        request = Request(scope, receive)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        sandbox_id = request.headers.get(SANDBOX_ID_HEADER)
        if port == str(INTERPRETER_PORT):
            await self._interpreter(request, path, scope, receive, send)
            return
        try:
            sandbox = await self._lookup(request, path)
        except E2bError as exc:  # a malformed or an expired signature
            await e2b_error_response(exc)(scope, receive, send)
            return
        if sandbox is None or port != str(ENVD_PORT):
            await sandbox_gone_response(sandbox_id)(scope, receive, send)
            return
        for prefix, app in self._rpc.items():
            if path.startswith(prefix):
                await app(scope, receive, send)
                return
        handler = _HTTP_ROUTES.get((request.method, path))
        if handler is None:
            await _no_route(request.method, path)(scope, receive, send)
            return
        try:
            response = await handler(request, sandbox)
        except Exception as exc:
            response = e2b_error_response(exc)
        await response(scope, receive, send)

    async def _interpreter(
        self, request: Request, path: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        headers = request.headers
        sandbox = await self._sandboxes().for_envd(
            headers.get(SANDBOX_ID_HEADER),
            headers.get(ACCESS_TOKEN_HEADER),
            traffic_token=headers.get(TRAFFIC_TOKEN_HEADER),
        )
        if sandbox is None:
            await sandbox_gone_response(headers.get(SANDBOX_ID_HEADER))(scope, receive, send)
            return
        found = interpreter_route(request.method, path, idempotency=self._idempotency)
        if found is None:
            await _no_route(request.method, path)(scope, receive, send)
            return
        handler, params = found
        scope["path_params"] = params
        try:
            response = await handler(Request(scope, receive), sandbox)
        except Exception as exc:
            response = e2b_error_response(exc)
        await response(scope, receive, send)


def _no_route(method: str, path: str) -> Response:
    """A route envd (or the interpreter) does not serve: 404 with a code, as every error."""
    return e2b_error_response(E2bError(404, "not_found", f"no route {method} {path[:100]}"))


async def _health(_request: Request, sandbox: E2bSandbox) -> Response:
    if sandbox.handle is None:
        return sandbox_gone_response(sandbox.sandbox_id)
    return Response(status_code=204)


_HTTP_ROUTES: dict[tuple[str, str], Callable[[Request, E2bSandbox], Awaitable[Response]]] = {
    ("GET", "/health"): _health,
    ("GET", "/files"): read_file,
    ("POST", "/files"): write_files,
}
