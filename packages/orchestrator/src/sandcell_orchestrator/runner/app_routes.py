"""``RunnerClient``'s app routes: background processes, their logs, diagnostics, ports.

A base class of ``RunnerClient`` (``client.py``), so its callers keep one client with
one method per route; each method sends through the client's ``RunnerConnection``.
What these routes share (timeouts, route builders, ``WebSocketUpgrade``) is in
``apps.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping

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

from .apps import (
    ANALYSIS_TIMEOUT_S,
    PORT_READ_TIMEOUT_S,
    WebSocketUpgrade,
    no_plain_upgrade,
    port_route,
    tag_route,
    upgrade_headers,
    ws_url,
)
from .connection import RunnerConnection

__all__ = ["AppRoutes"]


class AppRoutes:
    """The process, diagnostics and port routes of one runner (``RunnerClient``'s part)."""

    _conn: RunnerConnection

    # -- processes ------------------------------------------------------------

    async def start_process(self, start: ProcessStart, *, session_id: str) -> ProcessInfo:
        """``POST /v1/session/processes``: start a tagged background process."""
        response = await self._conn.request(
            "POST", routes.SESSION_PROCESSES, session_id=session_id, message=start
        )
        return self._conn.decode(response, ProcessInfo)

    async def processes(self, *, session_id: str) -> list[ProcessInfo]:
        """``GET /v1/session/processes``: the session's processes, running or exited."""
        response = await self._conn.request("GET", routes.SESSION_PROCESSES, session_id=session_id)
        return self._conn.decode(response, ProcessList).processes

    async def stop_process(self, tag: str, *, session_id: str) -> None:
        """``DELETE /v1/session/processes/{tag}``: TERM, then KILL after the runner's grace."""
        await self._conn.request("DELETE", tag_route(tag), session_id=session_id)

    async def process_logs(
        self,
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
        response = await self._conn.request(
            "GET", tag_route(tag, "logs"), session_id=session_id, params=params
        )
        return self._conn.decode(response, LogLines)

    # -- diagnostics ----------------------------------------------------------

    async def runtime_errors(self, *, session_id: str, since: float | None = None) -> RuntimeErrors:
        """``GET /v1/session/runtime-errors``: deduplicated errors (last seen after ``since``)."""
        params = {"since": repr(since)} if since is not None else None
        response = await self._conn.request(
            "GET", routes.SESSION_RUNTIME_ERRORS, session_id=session_id, params=params
        )
        return self._conn.decode(response, RuntimeErrors)

    async def clear_runtime_errors(self, *, session_id: str) -> None:
        """``DELETE /v1/session/runtime-errors``."""
        await self._conn.request("DELETE", routes.SESSION_RUNTIME_ERRORS, session_id=session_id)

    async def analysis(self, *, session_id: str) -> AnalysisResult:
        """``GET /v1/session/analysis``: the project's checkers, run in the jail."""
        response = await self._conn.request(
            "GET", routes.SESSION_ANALYSIS, session_id=session_id, read_timeout_s=ANALYSIS_TIMEOUT_S
        )
        return self._conn.decode(response, AnalysisResult)

    # -- ports ----------------------------------------------------------------

    async def port_request(
        self,
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
        return await self._conn.request(
            method,
            port_route(port, raw_path, query),
            session_id=session_id,
            extra_headers=request_headers,
            read_timeout_s=read_timeout_s,
            content=content,
            stream=True,
            any_status=True,
        )

    async def websocket_upgrade(
        self,
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
        if self._conn.transport_injected:
            raise no_plain_upgrade(self._conn.base_url)
        await self._conn.ensure_compatible()
        request = self._conn.build_request(
            "GET",
            port_route(port, raw_path, query),
            session_id=session_id,
            extra_headers=extra_headers,
        )
        auth = self._conn.http.auth
        if auth is not None:
            flow = auth.async_auth_flow(request)
            try:
                request = await anext(flow)
            finally:
                await flow.aclose()
        self._conn.redact.learn(request.headers)
        return WebSocketUpgrade(url=ws_url(request.url), headers=upgrade_headers(request))
