"""Routes of a session's app features: processes, logs, preview, runtime errors, analysis.

All are session-bound (``X-Runtime-Session-Id`` required, sessions enabled) and
need the bearer token, like every route. Only starting a process and running the
analysis take the session lock (they use the workspace); listing, logs, stdin,
stopping and the preview do not, so a dev server stays reachable while a long
command runs in the same session.

WebSocket to a preview port comes one of two ways, with the same checks: as a
``websocket`` scope when uvicorn has a WebSocket library (relayed message by
message, ``preview_wsrelay.py``), else as a plain upgrade request, which
``RunnerStarlette`` takes before the middleware stack and tunnels byte for byte
(``preview_ws.py``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from sandcell_protocol import app_messages as am
from sandcell_protocol import encode, headers, routes

from ..apps import logfilter
from ..apps.manager import SessionApp
from ..apps.runtime_errors import from_browser
from ..errors import BadRequestError, BusyError, RunnerError
from ..preview.inject import reporter_prefix
from ..preview.proxy import HOP_BY_HOP, RUNNER_ONLY
from ..preview.ws_relay import UpstreamRefusedError, connect_upstream, relay
from ..preview.ws_tunnel import can_take_over, handshake, is_upgrade
from ..workspace.session import SessionState

if TYPE_CHECKING:
    from .app import RunnerApp

log = logging.getLogger(__name__)

_TAG_RE = re.compile(am.PROCESS_TAG_PATTERN)
_BROWSER_ERRORS = b"/" + am.BROWSER_ERRORS_PATH.encode()
_MAX_LOG_LINES = 10_000
_MAX_STDIN_BYTES = 1024 * 1024
_PROXIED_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_PORT_PATH_RE = re.compile(r"(\d{1,5})(/.*)?", re.DOTALL)


class AppRoutes:
    """Handlers bound to a ``RunnerApp``."""

    def __init__(self, app: RunnerApp) -> None:
        self.app = app
        self.service = app.service
        self.sessions = app.service.sessions
        self.apps = app.service.apps

    def routes(self) -> list[BaseRoute]:
        g = self.app.guarded
        return [
            Route(routes.SESSION_PROCESSES, g(self.post_process), methods=["POST"]),
            Route(routes.SESSION_PROCESSES, g(self.list_processes), methods=["GET"]),
            Route(am.SESSION_PROCESS, g(self.delete_process), methods=["DELETE"]),
            Route(am.SESSION_PROCESS_LOGS, g(self.get_logs), methods=["GET"]),
            Route(am.SESSION_PROCESS_STDIN, g(self.post_stdin), methods=["POST"]),
            Route(routes.SESSION_RUNTIME_ERRORS, g(self.post_runtime_error), methods=["POST"]),
            Route(routes.SESSION_RUNTIME_ERRORS, g(self.get_runtime_errors), methods=["GET"]),
            Route(routes.SESSION_RUNTIME_ERRORS, g(self.delete_runtime_errors), methods=["DELETE"]),
            Route(routes.SESSION_ANALYSIS, g(self.get_analysis), methods=["GET"]),
            Route(am.SESSION_PORTS, g(self.proxy), methods=_PROXIED_METHODS),
            WebSocketRoute(am.SESSION_PORTS, self.websocket),
        ]

    # -- plumbing -------------------------------------------------------------

    def _session_id(self, request: Request) -> str:
        self.sessions.require_enabled()
        session_id = self.sessions.check_header(request.headers.get(headers.RUNTIME_SESSION_ID))
        if session_id is None:
            raise BadRequestError(f"{headers.RUNTIME_SESSION_ID} header is required")
        return session_id

    async def _session(self, request: Request) -> tuple[SessionState, SessionApp]:
        state = await self.sessions.bind(self._session_id(request))
        return state, self.apps.get(state)

    @staticmethod
    def _tag(request: Request) -> str:
        tag = str(request.path_params["tag"])
        if not _TAG_RE.match(tag):
            raise BadRequestError("process tag must match ^[A-Za-z0-9._-]{1,64}$")
        return tag

    # -- processes ------------------------------------------------------------------

    async def post_process(self, request: Request) -> Response:
        session_id = self._session_id(request)
        start = await self.app.read_message(request, am.ProcessStart)
        async with self.sessions.locked(session_id) as state:
            app = self.apps.get(state)
            info = await app.processes.start(start, self.apps.target(state))
        return self.app.json(info, 201)

    async def list_processes(self, request: Request) -> Response:
        _, app = await self._session(request)
        return self.app.json(am.ProcessList(processes=app.processes.list()))

    async def delete_process(self, request: Request) -> Response:
        _, app = await self._session(request)
        return self.app.json(await app.processes.stop(self._tag(request)))

    async def post_stdin(self, request: Request) -> Response:
        _, app = await self._session(request)
        tag = self._tag(request)
        data = await self.app.read_body(request, max_bytes=_MAX_STDIN_BYTES)
        close = request.query_params.get("eof") in ("1", "true")
        await app.processes.write_stdin(tag, data, close=close)
        return Response(status_code=204)

    async def get_logs(self, request: Request) -> Response:
        _, app = await self._session(request)
        tag = self._tag(request)
        buffer = app.processes.buffer(tag)
        follow = request.query_params.get("follow") in ("1", "true")
        count = _int_param(request, "lines", default=10 if follow else 100)
        pattern = request.query_params.get("filter")
        if pattern is not None:
            logfilter.validate_pattern(pattern)
        snapshot = buffer.snapshot()
        mask = None
        if pattern is not None:
            mask = await logfilter.match_lines(pattern, snapshot.texts)
        tail = snapshot.tail(count, mask)
        if not follow:
            return self.app.json(am.LogLines(tag=tag, lines=tail.lines, truncated=tail.truncated))
        follower = buffer.follow()

        async def stream() -> AsyncIterator[bytes]:
            for line in tail.lines:
                yield encode(am.LogLine(line=line)) + b"\n"
            lines = follower.lines()
            if pattern is not None:
                lines = logfilter.filter_stream(pattern, lines)
            try:
                async for line in lines:
                    yield encode(am.LogLine(line=line)) + b"\n"
            finally:
                follower.close()

        return StreamingResponse(stream(), media_type=routes.NDJSON)

    # -- runtime errors -----------------------------------------------------------

    async def post_runtime_error(self, request: Request) -> Response:
        _, app = await self._session(request)
        report = await self.app.read_message(request, am.RuntimeErrorReport)
        app.errors.record(from_browser(report))
        return Response(status_code=204)

    async def get_runtime_errors(self, request: Request) -> Response:
        _, app = await self._session(request)
        raw = request.query_params.get("since")
        since = None
        if raw is not None:
            try:
                since = float(raw)
            except ValueError:
                raise BadRequestError("since must be a number of epoch seconds") from None
        return self.app.json(am.RuntimeErrors(errors=app.errors.since(since)))

    async def delete_runtime_errors(self, request: Request) -> Response:
        _, app = await self._session(request)
        app.errors.clear()
        return Response(status_code=204)

    # -- analysis -------------------------------------------------------------------

    async def get_analysis(self, request: Request) -> Response:
        session_id = self._session_id(request)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.service.job_slot())
            workspace = await stack.enter_async_context(self.service.session_workspace(session_id))
            result = await self.apps.analyzer.analyse(workspace)
        return self.app.json(result)

    # -- preview --------------------------------------------------------------------

    async def proxy(self, request: Request) -> Response:
        _, app = await self._session(request)
        port = _port(int(request.path_params["port"]))
        target = _target(request.scope, port)
        if request.method == "POST" and target.split(b"?", 1)[0] == _BROWSER_ERRORS:
            report = await self.app.read_message(request, am.RuntimeErrorReport)
            app.errors.record(from_browser(report))
            return Response(status_code=204)
        if app.upstream is None:
            raise BadRequestError(self._no_preview())
        body = await self.app.read_body(request)
        forwarded = request.headers.get(am.FORWARDED_PREFIX_HEADER)
        return await app.upstream.forward(
            port=port,
            method=request.method,
            target=target,
            request_headers=request.headers.raw,
            body=body,
            script_prefix=reporter_prefix(forwarded, port),
        )

    def _no_preview(self) -> str:
        return self.apps.preview_unavailable or (
            "preview unavailable: this runner cannot create network namespaces (needs root)"
        )

    async def _upstream_socket(self, request: Request) -> tuple[int, socket.socket]:
        """Checks of a WebSocket to a preview port; the port and a socket connected to it."""
        state, app = await self._session(request)
        path = request.scope["path"][len(routes.SESSION_PORTS_PREFIX) :]
        match = _PORT_PATH_RE.fullmatch(path)
        if match is None:
            raise BadRequestError("expected /v1/session/ports/{port}/{path}")
        port = _port(int(match.group(1)))
        if app.upstream is None or state.netns is None:
            raise BadRequestError(self._no_preview())
        try:
            return port, await state.netns.connect(port)
        except (OSError, TimeoutError):
            raise BusyError(f"nothing is listening on port {port} in the session yet") from None

    @staticmethod
    def _forwarded(scope: Scope) -> list[tuple[bytes, bytes]]:
        return [
            (name, value)
            for name, value in scope["headers"]
            if name not in RUNNER_ONLY
            and (name not in HOP_BY_HOP or name in (b"connection", b"upgrade"))
        ]

    async def upgrade(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A plain ``Upgrade`` request to a preview port: relayed, tunnelled on ``101``."""

        async def prepare(request: Request) -> Response:
            if not can_take_over(send):
                raise BadRequestError("WebSocket proxying needs the runner's own uvicorn server")
            port, sock = await self._upstream_socket(request)
            return await handshake(
                sock,
                method=scope["method"],
                port=port,
                target=_target(scope, port),
                request_headers=self._forwarded(scope),
            )

        response = await self.app.guarded(prepare)(Request(scope, receive, send))
        await response(scope, receive, send)

    async def websocket(self, websocket: WebSocket) -> None:
        """A ``websocket`` scope to a preview port: a relay to the upstream's own WebSocket."""
        scope = websocket.scope
        try:
            request = Request({**scope, "type": "http", "method": "GET"})
            self.app.authorize(request)
            port, sock = await self._upstream_socket(request)
            upstream, subprotocol = await connect_upstream(
                sock, port=port, target=_target(scope, port), request_headers=self._forwarded(scope)
            )
        except RunnerError as exc:
            # app.py imports this module; its error shape is reused, not copied.
            from .app import error_response

            await _deny(websocket, error_response(exc), reason=str(exc))
            return
        except UpstreamRefusedError as refused:
            answer = Response(refused.body, status_code=refused.status)
            answer.raw_headers = [
                (k, v) for k, v in refused.headers if k not in HOP_BY_HOP and k != b"content-length"
            ]
            answer.raw_headers.append((b"content-length", str(len(refused.body)).encode()))
            await _deny(websocket, answer, reason=str(refused))
            return
        await relay(websocket, upstream, subprotocol)


class RunnerStarlette(Starlette):
    """Starlette that hands ``Upgrade`` requests under the preview prefix to ``upgrade``
    before its middleware, which would hide the connection a tunnel has to take."""

    def __init__(
        self, *args: Any, upgrade: Callable[[Scope, Receive, Send], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._upgrade = upgrade

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(routes.SESSION_PORTS_PREFIX)
            and is_upgrade(scope)
        ):
            scope["app"] = self
            try:
                await self._upgrade(scope, receive, send)
            except Exception:
                log.exception("preview upgrade failed on %s", scope["path"][:200])
                with contextlib.suppress(Exception):
                    await Response(status_code=500)(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


async def _deny(websocket: WebSocket, response: Response, *, reason: str) -> None:
    """Refuse with an HTTP response where the server can send one, else close (1008)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(response)
    else:
        await websocket.close(code=1008, reason=reason[:120])


def _port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise BadRequestError("port must be 1..65535")
    return port


def _target(scope: Scope, port: int) -> bytes:
    """The request target for upstream: the raw path after the port, and the query."""
    prefix = f"{routes.SESSION_PORTS_PREFIX}{port}"
    raw = scope.get("raw_path") or b""
    if raw.startswith(prefix.encode() + b"/"):
        rest = raw[len(prefix) :]
    else:
        # The client percent-encoded part of the prefix itself: re-encode the decoded rest.
        path = scope["path"]
        slash = path.find("/", len(routes.SESSION_PORTS_PREFIX))
        # No path after the port at all (``…/ports/8080``): the upstream's root.
        rest = urllib.parse.quote(path[slash:]).encode() if slash != -1 else b"/"
    query = scope.get("query_string") or b""
    return rest + (b"?" + query if query else b"")


def _int_param(request: Request, name: str, *, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) > _MAX_LOG_LINES:
        raise BadRequestError(f"{name} must be an integer 0..{_MAX_LOG_LINES}")
    return int(raw)


__all__ = ["AppRoutes", "RunnerStarlette"]
