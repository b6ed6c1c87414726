"""What every route module shares: auth, bounded bodies, JSON and error answers.

Route modules import this module and ``RunnerService``, never each other, and
``app`` imports the route modules: the HTTP layer has no import cycle. Every
handler is wrapped by ``RouteGroup.guarded``, which checks the bearer token and
turns a ``RunnerError`` into its protocol error body.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.convertors import IntegerConvertor, PathConvertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from sandcell_protocol import (
    ProtocolError,
    check_compatible,
    decode,
    encode,
    error_body,
    headers,
    routes,
)
from sandcell_protocol import ProtocolMismatchError as WireMismatch
from sandcell_protocol.digits import is_ascii_digits

from ..apps.manager import SessionApp
from ..errors import (
    BadRequestError,
    BusyError,
    PayloadTooLargeError,
    ProtocolMismatchError,
    RunnerError,
    UnauthorizedError,
)
from ..preview.ws_tunnel import is_upgrade
from ..service import RunnerService
from ..workspace.session import SessionState

log = logging.getLogger(__name__)

JSON = "application/json"
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]
Upgrade = Callable[[Scope, Receive, Send], Awaitable[None]]


def json_response(value: Any, status: int = 200) -> Response:
    return Response(encode(value), status_code=status, media_type=JSON)


def error_response(exc: RunnerError) -> Response:
    """The protocol error body of ``exc`` (with ``Retry-After`` when the runner is busy)."""
    body = error_body(exc.code, str(exc) or exc.code.value, retryable=exc.retryable)
    response = json_response(body, exc.http_status)
    if isinstance(exc, BusyError):
        response.headers[headers.RETRY_AFTER] = str(exc.retry_after_s)
    return response


class RouteGroup:
    """Base of each route module's handlers: the service and the plumbing every route uses."""

    def __init__(self, service: RunnerService) -> None:
        self.service = service
        self.sessions = service.sessions
        self.settings = service.settings
        token = service.settings.token
        self._token = token.encode() if token is not None else None

    def routes(self) -> list[BaseRoute]:
        """This group's routes, each handler wrapped by ``guarded``."""
        raise NotImplementedError

    def authorize(self, request: Request) -> None:
        """Bearer token (constant-time) and, when sent, a compatible protocol major."""
        if self._token is not None:
            given = request.headers.get(headers.AUTHORIZATION, "")
            if not given.startswith(headers.BEARER_PREFIX):
                raise UnauthorizedError("missing bearer token")
            candidate = given[len(headers.BEARER_PREFIX) :].encode()
            if not hmac.compare_digest(candidate, self._token):
                raise UnauthorizedError("invalid bearer token")
        peer = request.headers.get(headers.PROTOCOL)
        if peer is not None:
            try:
                check_compatible(peer)
            except WireMismatch as exc:
                raise ProtocolMismatchError(str(exc)) from None

    def guarded(self, handler: Handler, *, auth: bool = True) -> Handler:
        """``handler`` behind the token check, its ``RunnerError`` answered as a protocol error."""

        async def endpoint(request: Request) -> Response:
            self.service.note_request()
            try:
                if auth:
                    self.authorize(request)
                return await handler(request)
            except RunnerError as exc:
                return error_response(exc)

        return endpoint

    async def read_body(self, request: Request, *, max_bytes: int | None = None) -> bytes:
        """The request body, refused with 413 as soon as it passes the cap."""
        cap = max_bytes or self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and is_ascii_digits(declared) and int(declared) > cap:
            raise PayloadTooLargeError(f"body larger than {cap} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise PayloadTooLargeError(f"body larger than {cap} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_message(self, request: Request, type_: type[T]) -> T:
        """The body decoded as a protocol message; a malformed one is a 400."""
        body = await self.read_body(request)
        try:
            return decode(body, type_)
        except ProtocolError as exc:
            raise BadRequestError(str(exc)) from None

    def session_header(self, request: Request) -> str | None:
        """The ``X-Runtime-Session-Id`` the request names, checked against the binding."""
        return self.sessions.check_header(request.headers.get(headers.RUNTIME_SESSION_ID))

    def required_session(self, request: Request) -> str:
        """The session a session-bound route acts on: sessions enabled, header present."""
        self.sessions.require_enabled()
        session_id = self.session_header(request)
        if session_id is None:
            raise BadRequestError(f"{headers.RUNTIME_SESSION_ID} header is required")
        return session_id

    async def bound_app(self, request: Request) -> tuple[SessionState, SessionApp]:
        """The session a session-bound route names, bound, and its app state."""
        state = await self.sessions.bind(self.required_session(request))
        return state, self.service.apps.get(state)


class _PathInt(IntegerConvertor):
    """The protocol's ``{pid:int}`` and ``{port:int}`` path parameters, at most as many
    digits as ``int()`` parses: Starlette's own converter matches any run of digits and
    its ``int()`` then raises in the router (a 500) past 4300 of them. Longer matches no
    route: a 404."""

    regex = "[0-9]{1,4300}"


class _FilePath(PathConvertor):
    """The file routes' ``{path:file_path}``: every character, a newline too. Starlette's
    ``path`` converter is ``.*``, whose ``.`` stops at a newline: ``files/a%0Ab`` matched
    no route (a 404 even for a write) and ``files/a%0A`` matched as ``a`` (``$`` matches
    before a final newline), another file. What a name may not hold (NUL, ``..``, a
    backslash) is the path validation's to refuse, with a 400 naming why; the ports
    routes keep ``path``, which forwards raw paths."""

    regex = "(?s:.*)"


# Before any route is built (routes compile their converters when made).
register_url_convertor("int", _PathInt())
register_url_convertor("file_path", _FilePath())


class RunnerStarlette(Starlette):
    """Starlette that hands ``Upgrade`` requests under the preview prefix to ``upgrade``
    before its middleware, which would hide the connection a tunnel has to take, and
    answers the ``direct`` routes without its router and middleware.

    ``direct`` maps ``(method, path)`` of exact, parameterless routes to their handlers
    (already ``guarded``), with ``internal`` answering what they raise. Why: for
    ``POST /v1/execute`` the router's match over every route and the two middleware
    layers, each wrapping ``send``, were ~8 % of the runner's Python per request
    (cProfile at 16 clients, issue #21); what they add (404 and 405, the 500 answer)
    an exact route needs only the last of, kept here.
    """

    def __init__(
        self,
        *args: Any,
        upgrade: Upgrade,
        direct: dict[tuple[str, str], Handler] | None = None,
        internal: Callable[[Request, Exception], Awaitable[Response]],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._upgrade = upgrade
        self._direct = direct or {}
        self._internal = internal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._direct.get((scope["method"], scope["path"]))
            if handler is not None:
                await self._answer(handler, scope, receive, send)
                return
            if scope["path"].startswith(routes.SESSION_PORTS_PREFIX) and is_upgrade(scope):
                scope["app"] = self
                try:
                    await self._upgrade(scope, receive, send)
                except Exception:
                    log.exception("preview upgrade failed on %s", scope["path"][:200])
                    with contextlib.suppress(Exception):
                        await Response(status_code=500)(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _answer(self, handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
        """What the router and ``ServerErrorMiddleware`` do for a route: the handler's
        response, or the ``internal`` answer when it raised. An error while the response
        is sent comes after its start (a streamed body's generator runs only then), so
        it is the server's to log, with the connection dropped, as before."""
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            response = await self._internal(request, exc)
        await response(scope, receive, send)
