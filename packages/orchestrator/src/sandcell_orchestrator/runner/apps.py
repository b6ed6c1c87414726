"""``RunnerApps``: a runner's app routes (processes, logs, diagnostics, the port proxy).

A mixin of ``RunnerClient``, like ``RunnerTransfers``: every call goes through
the client's ``_request`` (bearer token, ``X-Runtime-Session-Id``, protocol,
request id; the protocol checked on first contact), so through the one pooled
``httpx.AsyncClient`` with its transport, the injected ``httpx.Auth`` (behind
``HeaderGuard``), the error maps and the ``Redactor``. It holds no state, token
or header of its own.

Where these routes differ from the rest of ``RunnerClient``:

- The port proxy (``port_request``) hands back the app's answer, any status;
  only transport failures are mapped.
- A WebSocket upgrade cannot travel through httpx. ``websocket_upgrade`` gives
  its ``ws(s)://`` URL and the headers to send with it, the injected auth's
  included: it runs the client's auth over the equivalent HTTP request and
  keeps what the auth set. A proxy's refusal cannot be answered by a second
  try there, as it is over HTTP. No upgrade can go through an injected
  *transport*, so one is refused rather than sent around it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import httpx

from sandcell_protocol import (
    AnalysisResult,
    LogLines,
    ProcessInfo,
    ProcessList,
    ProcessStart,
    RuntimeErrors,
    routes,
)
from sandcell_protocol.app_messages import port_path, process_path

from ..errors import RunnerRequestError
from .core import RunnerCore
from .errors import refused_before_sending

__all__ = ["RunnerApps", "WebSocketUpgrade"]


ANALYSIS_TIMEOUT_S = 180.0
"""The project's checkers run in the jail: a big project takes a while."""
PORT_READ_TIMEOUT_S = 300.0

# Set by the WebSocket client itself, or meaningless on an upgrade; a second
# Connection or Host header would break the handshake.
_NOT_FOR_UPGRADE = frozenset(
    {
        "host",
        "connection",
        "upgrade",
        "keep-alive",
        "accept",
        "accept-encoding",
        "user-agent",
        "content-length",
        "content-type",
        "transfer-encoding",
    }
)


@dataclass(frozen=True, slots=True)
class WebSocketUpgrade:
    """Where a WebSocket upgrade goes and the headers it carries (secret: never log them)."""

    url: str
    headers: Mapping[str, str] = field(repr=False)


class RunnerApps:
    """Process, log, diagnostics and port routes; a mixin of ``RunnerClient``."""

    # -- processes ------------------------------------------------------------

    async def start_process(
        self: RunnerCore, start: ProcessStart, *, session_id: str
    ) -> ProcessInfo:
        """``POST /v1/session/processes``: start a tagged background process."""
        response = await self._request(
            "POST", routes.SESSION_PROCESSES, session_id=session_id, message=start
        )
        return self._decode(response, ProcessInfo)

    async def processes(self: RunnerCore, *, session_id: str) -> list[ProcessInfo]:
        """``GET /v1/session/processes``: the session's processes, running or exited."""
        response = await self._request("GET", routes.SESSION_PROCESSES, session_id=session_id)
        return self._decode(response, ProcessList).processes

    async def stop_process(self: RunnerCore, tag: str, *, session_id: str) -> None:
        """``DELETE /v1/session/processes/{tag}``: TERM, then KILL after the runner's grace."""
        await self._request("DELETE", _tag_route(tag), session_id=session_id)

    async def process_logs(
        self: RunnerCore,
        tag: str,
        *,
        session_id: str,
        lines: int | None = None,
        filter: str | None = None,
    ) -> LogLines:
        """``GET …/processes/{tag}/logs``: the last ``lines`` lines matching ``filter``."""
        params: dict[str, str] = {}
        if lines is not None:
            params["lines"] = str(lines)
        if filter is not None:
            params["filter"] = filter
        response = await self._request(
            "GET", _tag_route(tag, "logs"), session_id=session_id, params=params
        )
        return self._decode(response, LogLines)

    # -- diagnostics ----------------------------------------------------------

    async def runtime_errors(
        self: RunnerCore, *, session_id: str, since: float | None = None
    ) -> RuntimeErrors:
        """``GET /v1/session/runtime-errors``: deduplicated errors (last seen after ``since``)."""
        params = {"since": repr(since)} if since is not None else None
        response = await self._request(
            "GET", routes.SESSION_RUNTIME_ERRORS, session_id=session_id, params=params
        )
        return self._decode(response, RuntimeErrors)

    async def clear_runtime_errors(self: RunnerCore, *, session_id: str) -> None:
        """``DELETE /v1/session/runtime-errors``."""
        await self._request("DELETE", routes.SESSION_RUNTIME_ERRORS, session_id=session_id)

    async def analysis(self: RunnerCore, *, session_id: str) -> AnalysisResult:
        """``GET /v1/session/analysis``: the project's checkers, run in the jail."""
        response = await self._request(
            "GET", routes.SESSION_ANALYSIS, session_id=session_id, read_timeout_s=ANALYSIS_TIMEOUT_S
        )
        return self._decode(response, AnalysisResult)

    # -- ports ----------------------------------------------------------------

    async def port_request(
        self: RunnerCore,
        method: str,
        port: int,
        raw_path: str,
        *,
        session_id: str,
        query: str,
        request_headers: Mapping[str, str],
        content: AsyncIterable[bytes] | bytes | None = None,
        read_timeout_s: float = PORT_READ_TIMEOUT_S,
    ) -> httpx.Response:
        """Proxy one request to ``port``: a streaming response with the app's status.

        ``raw_path`` (still percent-encoded, no leading slash) and ``query`` are
        sent as they are. Transport failures map as on every route; the caller
        closes the response.
        """
        return await self._request(
            method,
            _port_route(port, raw_path, query),
            session_id=session_id,
            extra_headers=request_headers,
            read_timeout_s=read_timeout_s,
            content=content,
            stream=True,
            any_status=True,
        )

    async def websocket_upgrade(
        self: RunnerCore,
        port: int,
        raw_path: str,
        *,
        session_id: str,
        query: str,
        extra_headers: Mapping[str, str] | None = None,
    ) -> WebSocketUpgrade:
        """The URL and headers of a WebSocket upgrade to ``raw_path`` on ``port``.

        The headers are this client's (token, session, protocol, request id), the
        injected auth's (run on the equivalent ``GET``, through ``HeaderGuard``)
        and ``extra_headers``. ``RunnerRequestError`` if a transport was injected:
        the upgrade would bypass it.
        """
        if self._transport_injected:
            raise _no_plain_upgrade(self)
        await self._ensure_compatible()
        request = self._build_request(
            "GET",
            _port_route(port, raw_path, query),
            session_id=session_id,
            extra_headers=extra_headers,
        )
        auth = self._client.auth
        if auth is not None:
            flow = auth.async_auth_flow(request)
            try:
                request = await anext(flow)
            finally:
                await flow.aclose()
        self._redact.learn(request.headers)
        return WebSocketUpgrade(url=_ws_url(request.url), headers=_upgrade_headers(request))


def _tag_route(tag: str, suffix: Literal["", "logs", "stdin"] = "") -> str:
    try:
        return process_path(tag, suffix)
    except ValueError as exc:
        raise refused_before_sending("bad_request", str(exc)) from None


def _port_route(port: int, raw_path: str, query: str) -> str:
    try:
        route = port_path(port, raw_path)
    except ValueError as exc:
        raise refused_before_sending("bad_request", str(exc)) from None
    return route + (f"?{query}" if query else "")


def _ws_url(url: httpx.URL) -> str:
    return str(url.copy_with(scheme="wss" if url.scheme == "https" else "ws"))


def _upgrade_headers(request: httpx.Request) -> dict[str, str]:
    return {
        name: value
        for name, value in request.headers.items()
        if name.lower() not in _NOT_FOR_UPGRADE and not name.lower().startswith("sec-websocket-")
    }


def _no_plain_upgrade(core: RunnerCore) -> RunnerRequestError:
    why = "would bypass the injected transport this runner is reached through"
    return refused_before_sending("bad_request", f"a WebSocket upgrade to {core.base_url} {why}")
