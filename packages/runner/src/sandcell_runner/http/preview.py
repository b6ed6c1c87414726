"""``/v1/session/ports/{port}/{path}``: the preview of a server in the session.

HTTP is proxied to the port in the session's network namespace (``preview/proxy.py``);
a ``POST`` to the injected reporter's path records a browser error instead.
WebSocket comes one of two ways, with the same checks: as a ``websocket`` scope
when uvicorn has a WebSocket library (relayed message by message,
``preview/ws_relay.py``), else as a plain upgrade request, which
``RunnerStarlette`` takes before the middleware stack and tunnels byte for byte
(``preview/ws_tunnel.py``). Session-bound and behind the token like every route;
none takes the session lock. Each relay holds a slot under the runner's cap for its
kind (``preview/relays.py``) from its checks until it ends; past a cap, ``503 busy``
before any upstream connection is made.
"""

from __future__ import annotations

import re
import socket
import urllib.parse

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from sandcell_protocol import app_messages as am
from sandcell_protocol import routes

from ..apps.runtime_errors import from_browser
from ..errors import AppNotRespondingError, BadRequestError, RunnerError
from ..preview.inject import reporter_prefix
from ..preview.proxy import HOP_BY_HOP, RUNNER_ONLY
from ..preview.relays import RelaySlot
from ..preview.ws_relay import UpstreamRefusedError, connect_upstream, relay
from ..preview.ws_tunnel import can_take_over, handshake
from .base import RouteGroup, error_response

_BROWSER_ERRORS = b"/" + am.BROWSER_ERRORS_PATH.encode()
_CHANGES = b"/" + am.PREVIEW_CHANGES_PATH.encode()
_PROXIED_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_PORT_PATH_RE = re.compile(r"(\d{1,5})(/.*)?", re.DOTALL)


class PreviewRoutes(RouteGroup):
    """The proxy, the WebSocket relay and the upgrade tunnel to a session's ports."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route(am.SESSION_PORTS, self.guarded(self.proxy), methods=_PROXIED_METHODS),
            WebSocketRoute(am.SESSION_PORTS, self.websocket),
        ]

    async def proxy(self, request: Request) -> Response:
        _, app = await self.bound_app(request)
        port = _port(int(request.path_params["port"]))
        target = _target(request.scope, port)
        if request.method == "POST" and target.split(b"?", 1)[0] == _BROWSER_ERRORS:
            report = await self.read_message(request, am.RuntimeErrorReport)
            app.errors.record(from_browser(report))
            return Response(status_code=204)
        if request.method == "GET" and target.split(b"?", 1)[0] == _CHANGES:
            return Response(
                b'{"version":%d}' % app.files_version,
                media_type="application/json",
                headers={"cache-control": "no-store"},
            )
        if app.upstream is None:
            raise BadRequestError(self._no_preview())
        # Claimed before the body is read: waiting requests hold their bodies too.
        slot = self.service.apps.relays.requests.claim(app.session_id)
        try:
            body = await self.read_body(request)
            forwarded = request.headers.get(am.FORWARDED_PREFIX_HEADER)
            response = await app.upstream.forward(
                port=port,
                method=request.method,
                target=target,
                request_headers=request.headers.raw,
                body=body,
                script_prefix=reporter_prefix(forwarded, port),
                # Read before the app answers, so a write while it renders still reloads.
                files_version=(
                    app.files_version if request.headers.get(am.LIVE_RELOAD_HEADER) != "0" else None
                ),
            )
        except BaseException:
            slot.release()
            raise
        return _Releasing(response, slot)

    def _no_preview(self) -> str:
        return self.service.apps.preview_unavailable or (
            "preview unavailable: this runner cannot create network namespaces (needs root)"
        )

    async def _upstream_socket(self, request: Request) -> tuple[int, socket.socket, RelaySlot]:
        """Checks of an upgrade to a preview port: the port, a socket connected to it and
        the relay's slot (the caller releases it; ``BusyError`` past the cap)."""
        state, app = await self.bound_app(request)
        path = request.scope["path"][len(routes.SESSION_PORTS_PREFIX) :]
        match = _PORT_PATH_RE.fullmatch(path)
        if match is None:
            raise BadRequestError("expected /v1/session/ports/{port}/{path}")
        port = _port(int(match.group(1)))
        if app.upstream is None or state.netns is None:
            raise BadRequestError(self._no_preview())
        slot = self.service.apps.relays.websockets.claim(state.session_id)
        try:
            return port, await state.netns.connect(port), slot
        except (OSError, TimeoutError):
            slot.release()
            raise AppNotRespondingError(
                f"the app did not answer: nothing is listening on port {port}"
            ) from None
        except BaseException:
            slot.release()
            raise

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

        slot: RelaySlot | None = None

        async def prepare(request: Request) -> Response:
            nonlocal slot
            if not can_take_over(send):
                raise BadRequestError("WebSocket proxying needs the runner's own uvicorn server")
            port, sock, slot = await self._upstream_socket(request)
            answer = await handshake(
                sock,
                method=scope["method"],
                port=port,
                target=_target(scope, port),
                request_headers=self._forwarded(scope),
            )
            slot.on_abort(answer.abort)
            return answer

        try:
            response = await self.guarded(prepare)(Request(scope, receive, send))
            await response(scope, receive, send)
        finally:
            if slot is not None:
                slot.release()

    async def websocket(self, websocket: WebSocket) -> None:
        """A ``websocket`` scope to a preview port: a relay to the upstream's own WebSocket."""
        scope = websocket.scope
        slot: RelaySlot | None = None
        try:
            try:
                request = Request({**scope, "type": "http", "method": "GET"})
                self.authorize(request)
                port, sock, slot = await self._upstream_socket(request)
                upstream, subprotocol = await connect_upstream(
                    sock,
                    port=port,
                    target=_target(scope, port),
                    request_headers=self._forwarded(scope),
                )
            except RunnerError as exc:
                await _deny(websocket, error_response(exc), reason=str(exc))
                return
            except UpstreamRefusedError as refused:
                answer = Response(refused.body, status_code=refused.status)
                answer.raw_headers = [
                    (k, v)
                    for k, v in refused.headers
                    if k not in HOP_BY_HOP and k != b"content-length"
                ]
                answer.raw_headers.append((b"content-length", str(len(refused.body)).encode()))
                await _deny(websocket, answer, reason=str(refused))
                return
            slot.on_abort(upstream.abort)
            await relay(websocket, upstream, subprotocol)
        finally:
            # However the relay ended (either side closed or dropped, an error).
            if slot is not None:
                slot.release()


class _Releasing(Response):
    """``response`` sent as it is; ``slot`` released once it is sent, failed or cancelled
    (a ``BackgroundTask`` does not run when the client leaves mid-stream)."""

    def __init__(self, response: Response, slot: RelaySlot) -> None:
        # Not Response.__init__: nothing is rendered here, ``response`` has it all.
        self._response = response
        self._slot = slot
        self.status_code = response.status_code
        self.raw_headers = response.raw_headers
        self.background: BackgroundTask | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._response(scope, receive, send)
        finally:
            self._slot.release()


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


__all__ = ["PreviewRoutes"]
