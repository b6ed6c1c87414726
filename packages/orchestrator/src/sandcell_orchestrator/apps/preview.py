"""``/preview/{instance_id}/{path}``: HTTP and WebSocket proxy to an instance's dev server.

Requests go to the runner's ``/v1/session/ports/{port}/{path}`` with the runner's
bearer token and session header (never the caller's credentials), and with
``X-Forwarded-Prefix: /preview/<id>/`` so the runner's injected error reporter
posts back through this proxy (``POST /preview/<id>/__sandcell/runtime-errors``
is forwarded like any other path, then wakes the webhook check).

Access: an unguessable per-instance token, accepted as ``?token=`` (and then
stripped before forwarding) or from the ``sandcell_preview`` cookie that the
first tokened response sets: HttpOnly, SameSite=Lax, Path=/preview/<id>/,
Secure when the public URL is https. A missing or wrong token and an unknown
instance get the same 401; the token of an instance that was deleted gets 404.
An app that does not answer in its sandbox is the runner's 502
``app_not_responding``, passed through (the sandbox is fine, the app is not), and so is
its ``503 busy`` past its cap on what it relays at once (for a WebSocket too, where the
server can answer one with a response).

Every request and WebSocket message counts as activity for idle shutdown.
Upstream failures are counted; a run of them is one INFO line (``preview_log``).

Limits worth knowing: previews share the service's origin, so a preview's
scripts can request another preview's path from the same browser (cookie paths
do not isolate scripts); serve mutually untrusted previews from separate hosts.
Apps must use relative URLs (or the forwarded prefix) to stay under the prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from sandcell_protocol import ErrorCode, encode, error_body
from sandcell_protocol.app_messages import (
    BROWSER_ERRORS_PATH,
    FORWARDED_PREFIX_HEADER,
    LIVE_RELOAD_HEADER,
)

from ..errors import SandcellError
from ..runner.port_forward import (
    connect_upstream,
    downstream_response,
    pump,
    refuse,
    stays_in_port_route,
    upstream_headers,
)
from .instance import Instance
from .instances import AppInstances
from .preview_log import Kind, UpstreamFailures

__all__ = ["ACCESS_LOG_SECRET_PARAMETERS", "COOKIE_NAME", "PreviewProxy"]


COOKIE_NAME = "sandcell_preview"
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
ACCESS_LOG_SECRET_PARAMETERS = ("token",)
"""Query parameters the access log must not keep: a first preview request carries its
token in the query (serve/redaction.py redacts them)."""


def _json_error(status: int, code: ErrorCode, message: str) -> Response:
    return Response(
        encode(error_body(code, message)), status_code=status, media_type="application/json"
    )


def _unauthorized() -> Response:
    return _json_error(401, ErrorCode.UNAUTHORIZED, "preview token missing or invalid")


def _forward_path(raw_path: bytes, instance_id: str) -> str | None:
    """The still-encoded path below the prefix, or ``None`` if it could escape it."""
    prefix = f"/preview/{instance_id}/"
    path = raw_path.decode("latin-1")
    if not path.startswith(prefix):
        return None
    rest = path[len(prefix) :]
    return rest if stays_in_port_route(rest) else None


def _forward_query(raw_query: bytes) -> str:
    """The query string without our ``token`` parameter, otherwise byte for byte."""
    parts = raw_query.decode("latin-1").split("&") if raw_query else []
    return "&".join(p for p in parts if p and unquote(p.split("=", 1)[0]) != "token")


def _referer_header(raw: str) -> str:
    """A Referer without our ``token``: a page opened with ``?token=`` names it in every
    request it makes to the preview (Referrer-Policy same-origin), and the app, on the
    untrusted side, must not learn it."""
    base, mark, query = raw.partition("?")
    if not mark:
        return raw
    kept = _forward_query(query.encode("latin-1", "replace"))
    return f"{base}?{kept}" if kept else base


def _cookie_header(raw: str | None) -> str | None:
    """The app's cookies, minus ours."""
    if not raw:
        return None
    kept = [
        c.strip() for c in raw.split(";") if c.strip() and c.strip().split("=", 1)[0] != COOKIE_NAME
    ]
    return "; ".join(kept) or None


class PreviewProxy:
    """The preview routes; ``instances`` is read per request (it exists once serving)."""

    def __init__(
        self,
        instances: Callable[[], AppInstances],
        *,
        on_browser_report: Callable[[], None] = lambda: None,
        failures: UpstreamFailures | None = None,
    ) -> None:
        self._instances = instances
        self._on_browser_report = on_browser_report
        self._failures = failures or UpstreamFailures()

    def routes(self) -> list[BaseRoute]:
        """Starlette routes: the prefix redirect, HTTP, and WebSocket."""
        return [
            Route("/preview/{instance_id}", self.redirect, methods=_METHODS),
            Route("/preview/{instance_id}/{path:path}", self.http, methods=_METHODS),
            WebSocketRoute("/preview/{instance_id}/{path:path}", self.websocket),
        ]

    def _authorize(
        self, instance_id: str, query_token: str | None, cookie: str | None
    ) -> tuple[Instance | None, bool]:
        instances = self._instances()
        if query_token:
            found = instances.authorize_preview(instance_id, query_token)
            if found is not None:
                return found, True
        return instances.authorize_preview(instance_id, cookie), False

    def _refused(self, instance_id: str, token: str | None) -> Response:
        # A token that was this instance's before it was deleted: the instance is gone.
        # Anything else stays the one 401, so ids cannot be probed without a token.
        if self._instances().was_deleted(instance_id, token):
            return _json_error(
                404, ErrorCode.NOT_FOUND, "this app instance is gone (deleted, or shut down idle)"
            )
        return _unauthorized()

    def _failed(self, instance_id: str, kind: Kind, what: str, exc: BaseException) -> None:
        metrics = self._instances().manager.metrics
        self._failures.failed(instance_id, kind, what, type(exc).__name__, metrics)

    async def redirect(self, request: Request) -> Response:
        """``/preview/<id>`` → ``/preview/<id>/`` (query kept), so relative URLs resolve."""
        target = f"/preview/{request.path_params['instance_id']}/"
        if request.url.query:
            target += "?" + request.url.query
        return RedirectResponse(target, status_code=307)

    async def http(self, request: Request) -> Response:
        """Proxy one HTTP request to the instance's preview port."""
        instance_id = request.path_params["instance_id"]
        instance, via_query = self._authorize(
            instance_id, request.query_params.get("token"), request.cookies.get(COOKIE_NAME)
        )
        if instance is None:
            return self._refused(
                instance_id, request.query_params.get("token") or request.cookies.get(COOKIE_NAME)
            )
        path = _forward_path(
            request.scope.get("raw_path") or request.url.path.encode(), instance_id
        )
        if path is None:
            return _json_error(400, ErrorCode.INVALID_PATH, "preview path may not contain . or ..")
        instances = self._instances()
        instances.touch(instance)
        forwarded = upstream_headers(request.headers)
        if "referer" in forwarded:
            forwarded["referer"] = _referer_header(forwarded["referer"])
        cookies = _cookie_header(request.headers.get("cookie"))
        if cookies:
            forwarded["cookie"] = cookies
        forwarded[FORWARDED_PREFIX_HEADER.lower()] = instance.preview_prefix
        forwarded[LIVE_RELOAD_HEADER.lower()] = "1" if instance.manifest.live_reload else "0"
        forwarded["x-forwarded-proto"] = request.url.scheme
        if "host" in request.headers:
            forwarded["x-forwarded-host"] = request.headers["host"]
        has_body = request.method not in ("GET", "HEAD") or "content-length" in request.headers
        try:
            upstream = await instance.runner.port_request(
                request.method,
                instance.manifest.preview_port,
                path,
                query=_forward_query(request.scope.get("query_string", b"")),
                request_headers=forwarded,
                content=request.stream() if has_body else None,
            )
        except SandcellError as exc:
            self._failed(instance.instance_id, "http", "upstream failed", exc)
            return _json_error(
                502, ErrorCode.BUSY, "the instance's sandbox did not answer; retry shortly"
            )
        self._failures.succeeded(instance.instance_id, "http")
        response = downstream_response(upstream)
        if via_query:
            response.set_cookie(
                COOKIE_NAME,
                instance.preview_token,
                path=instance.preview_prefix,
                httponly=True,
                samesite="lax",
                secure=instances.settings.public_url.startswith("https:"),
            )
            # The URL carries the token: keep it out of Referer headers to other sites.
            response.headers["referrer-policy"] = "same-origin"
        if request.method == "POST" and path == BROWSER_ERRORS_PATH:
            self._on_browser_report()
        return response

    async def websocket(self, websocket: WebSocket) -> None:
        """Proxy a WebSocket (dev-server hot reload) to the instance's preview port."""
        instance_id = websocket.path_params["instance_id"]
        instance, _ = self._authorize(
            instance_id, websocket.query_params.get("token"), websocket.cookies.get(COOKIE_NAME)
        )
        raw_path = websocket.scope.get("raw_path") or websocket.url.path.encode()
        path = _forward_path(raw_path, instance_id) if instance is not None else None
        if instance is None or path is None:
            await websocket.close(code=1008)
            return
        instances = self._instances()
        instances.touch(instance)
        # Imported here: only WebSocket previews need the library.
        from websockets.exceptions import WebSocketException

        try:
            upgrade = await instance.runner.websocket_upgrade(
                instance.manifest.preview_port,
                path,
                query=_forward_query(websocket.scope.get("query_string", b"")),
                extra_headers={FORWARDED_PREFIX_HEADER: instance.preview_prefix},
            )
        except SandcellError as exc:
            self._failed(instance_id, "websocket", "no websocket upstream", exc)
            await websocket.close(code=1011)
            return
        subprotocols = websocket.scope.get("subprotocols") or None
        try:
            upstream = await connect_upstream(upgrade, subprotocols)
        except (OSError, TimeoutError, WebSocketException) as exc:
            # The usual one: the dev server is not listening yet and a hot-reload
            # client retries every second (the runner's 502, InvalidStatus here).
            self._failed(instance_id, "websocket", "websocket upstream failed", exc)
            await refuse(websocket, exc)
            return
        self._failures.succeeded(instance_id, "websocket")
        async with upstream:
            await websocket.accept(subprotocol=upstream.subprotocol)
            await pump(websocket, upstream, touch=lambda: instances.touch(instance))
