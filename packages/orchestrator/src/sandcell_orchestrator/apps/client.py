"""``AppRunnerClient``: the runner's app routes (processes, diagnostics, ports).

A thin client beside ``RunnerClient``, speaking the same protocol: the bearer
token, ``X-Runtime-Session-Id`` and ``X-Sandcell-Protocol`` on every request,
non-2xx answers mapped through ``runner_errors.error_from_response``, transport
failures through ``map_transport_errors``, the token scrubbed from every error.
It never checks the protocol itself: it is built from a ``SandboxHandle`` whose
``RunnerClient`` has already done so on first contact.

The port proxy (``port_request``/``websocket_target``) is the exception to the
error mapping: whatever the dev server answers is passed through untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterable, Mapping
from typing import Literal, TypeVar

import httpx

from sandcell_protocol import (
    PROTOCOL_VERSION,
    AnalysisResult,
    LogLines,
    ProcessInfo,
    ProcessList,
    ProcessStart,
    ProtocolError,
    RuntimeErrors,
    decode,
    encode,
    headers,
    routes,
)
from sandcell_protocol.app_messages import port_path, process_path

from ..errors import RunnerRequestError, SandboxUnavailableError
from ..handle import SandboxHandle
from ..runner_errors import Redactor, error_from_response, map_transport_errors

__all__ = ["AppRunnerClient"]

T = TypeVar("T")
_JSON = "application/json"
_ANALYSIS_TIMEOUT_S = 180.0


class AppRunnerClient:
    """One runner's app routes, bound to one runtime session. ``close()`` when done."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        session_id: str,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.session_id = session_id
        self._token = token
        self._redact = Redactor([token, headers.BEARER_PREFIX + token])
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            follow_redirects=False,
            # No proxy variables or .netrc: the token goes only to this runner.
            trust_env=False,
        )

    @classmethod
    def for_handle(cls, handle: SandboxHandle) -> AppRunnerClient:
        """A client of ``handle``'s runner, in ``handle``'s session."""
        if handle.session_id is None:
            raise SandboxUnavailableError("app sandboxes need a handle bound to a session")
        runner = handle.runner
        # RunnerClient keeps its token private so nothing logs it; this is the one
        # place that borrows it, to speak to the same runner under the same rules.
        return cls(runner.base_url, token=runner._token, session_id=handle.session_id)

    def __repr__(self) -> str:
        return f"AppRunnerClient(base_url={self.base_url!r})"

    def auth_headers(self) -> dict[str, str]:
        """The headers every runner request carries (secret: never log them)."""
        return {
            headers.AUTHORIZATION: headers.BEARER_PREFIX + self._token,
            headers.RUNTIME_SESSION_ID: self.session_id,
            headers.PROTOCOL: PROTOCOL_VERSION,
            headers.REQUEST_ID: uuid.uuid4().hex,
        }

    async def close(self) -> None:
        """Close the connection pool; idempotent."""
        await self._client.aclose()

    def _check_open(self) -> None:
        # A recovery or shutdown closed this client: the instance moved on or went.
        if self._client.is_closed:
            raise SandboxUnavailableError(
                "this sandbox's client is closed (recovered or shut down)"
            )

    # -- plumbing -----------------------------------------------------------------

    async def _call(
        self,
        method: str,
        route: str,
        *,
        message: object = None,
        params: Mapping[str, str] | None = None,
        read_timeout_s: float | None = None,
    ) -> httpx.Response:
        self._check_open()
        request_headers = self.auth_headers()
        content = None
        if message is not None:
            content = encode(message)
            request_headers["Content-Type"] = _JSON
        request = self._client.build_request(
            method, route, headers=request_headers, content=content, params=params
        )
        if read_timeout_s is not None:
            default = self._client.timeout
            request.extensions["timeout"] = httpx.Timeout(
                default.read, connect=default.connect, read=read_timeout_s
            ).as_dict()
        with map_transport_errors(request, route=route, redact=self._redact):
            response = await self._client.send(request)
        if not response.is_success:
            raise error_from_response(
                method=method,
                route=route,
                status=response.status_code,
                body=response.content,
                redact=self._redact,
            )
        return response

    def _decode(self, response: httpx.Response, type_: type[T]) -> T:
        try:
            return decode(response.content, type_)
        except ProtocolError as exc:
            where = f"{response.request.method} {response.request.url.path}"
            raise SandboxUnavailableError(f"{where}: malformed answer: {exc}") from None

    # -- processes ------------------------------------------------------------------

    async def start_process(self, start: ProcessStart) -> ProcessInfo:
        """``POST /v1/session/processes``: start a tagged background process."""
        response = await self._call("POST", routes.SESSION_PROCESSES, message=start)
        return self._decode(response, ProcessInfo)

    async def processes(self) -> list[ProcessInfo]:
        """``GET /v1/session/processes``."""
        response = await self._call("GET", routes.SESSION_PROCESSES)
        return self._decode(response, ProcessList).processes

    async def process(self, tag: str) -> ProcessInfo | None:
        """The process tagged ``tag``, or ``None``."""
        return next((item for item in await self.processes() if item.tag == tag), None)

    async def stop_process(self, tag: str) -> None:
        """``DELETE /v1/session/processes/{tag}``: TERM, then KILL after the runner's grace."""
        await self._call("DELETE", _tag_path(tag))

    async def logs(
        self, tag: str, *, lines: int | None = None, filter: str | None = None
    ) -> LogLines:
        """``GET …/processes/{tag}/logs``: the last ``lines`` lines matching ``filter``."""
        params: dict[str, str] = {}
        if lines is not None:
            params["lines"] = str(lines)
        if filter is not None:
            params["filter"] = filter
        route = _tag_path(tag, "logs")
        return self._decode(await self._call("GET", route, params=params), LogLines)

    # -- diagnostics ------------------------------------------------------------------

    async def runtime_errors(self, *, since: float | None = None) -> RuntimeErrors:
        """``GET /v1/session/runtime-errors``: deduplicated errors (last seen after ``since``)."""
        params = {"since": repr(since)} if since is not None else None
        response = await self._call("GET", routes.SESSION_RUNTIME_ERRORS, params=params)
        return self._decode(response, RuntimeErrors)

    async def clear_runtime_errors(self) -> None:
        """``DELETE /v1/session/runtime-errors``."""
        await self._call("DELETE", routes.SESSION_RUNTIME_ERRORS)

    async def analysis(self) -> AnalysisResult:
        """``GET /v1/session/analysis``: the project's checkers, run in the jail."""
        response = await self._call(
            "GET", routes.SESSION_ANALYSIS, read_timeout_s=_ANALYSIS_TIMEOUT_S
        )
        return self._decode(response, AnalysisResult)

    # -- ports --------------------------------------------------------------------------

    async def port_request(
        self,
        method: str,
        port: int,
        raw_path: str,
        *,
        query: str,
        request_headers: Mapping[str, str],
        content: AsyncIterable[bytes] | bytes | None = None,
        read_timeout_s: float = 300.0,
    ) -> httpx.Response:
        """Proxy one request to ``port``; a streaming response with the app's status.

        Transport failures still map to ``SandboxUnavailableError``; the caller
        closes the response.
        """
        self._check_open()
        url = self.base_url + port_path(port, raw_path) + (f"?{query}" if query else "")
        request = self._client.build_request(
            method,
            httpx.URL(url),
            headers={**request_headers, **self.auth_headers()},
            content=content,
        )
        default = self._client.timeout
        request.extensions["timeout"] = httpx.Timeout(
            default.read, connect=default.connect, read=read_timeout_s
        ).as_dict()
        with map_transport_errors(request, route=routes.SESSION_PORTS_PREFIX, redact=self._redact):
            return await self._client.send(request, stream=True)

    def websocket_target(self, port: int, raw_path: str, *, query: str) -> str:
        """The ``ws://`` URL of ``raw_path`` on ``port`` (send ``auth_headers()`` with it)."""
        scheme = "wss" if self.base_url.startswith("https:") else "ws"
        rest = self.base_url.split("://", 1)[1]
        target = f"{scheme}://{rest}{port_path(port, raw_path)}"
        return target + (f"?{query}" if query else "")


def _tag_path(tag: str, suffix: Literal["", "logs", "stdin"] = "") -> str:
    try:
        return process_path(tag, suffix)
    except ValueError as exc:
        raise RunnerRequestError(f"refused before sending: {exc}", code="bad_request") from None
