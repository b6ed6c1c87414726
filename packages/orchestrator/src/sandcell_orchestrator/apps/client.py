"""``AppRunnerClient``: a runner's app routes, bound to one runtime session.

A thin wrapper over a ``RunnerClient``: each method calls one of the client's
app routes with this session's id, so every request goes through that client's
one httpx pool, its transport, its injected auth (behind ``HeaderGuard``), its
error maps and its redactor. It holds no token and no connection pool of its own.

Ownership. ``for_handle`` borrows the handle's ``RunnerClient``: the handle owns
it, and ``SandboxHandle.close()`` closes it. ``close()`` here only retires this
wrapper: once a recovery or a shutdown has closed it (before closing the old
handle), every call through it fails with ``SandboxUnavailableError``, as it
does once the handle's client is closed. Built from a URL instead
(``AppRunnerClient(base_url, token=..., session_id=...)``, for a runner no handle
holds), it owns the ``RunnerClient`` it made and ``close()`` closes that.

The port proxy (``port_request``) hands back whatever the dev server answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping

import httpx

from sandcell_protocol import (
    AnalysisResult,
    LogLines,
    ProcessInfo,
    ProcessStart,
    RuntimeErrors,
)

from ..errors import SandboxUnavailableError
from ..handle import SandboxHandle
from ..runner.answers import DEFAULT_CAPS, AnswerCaps
from ..runner.apps import PORT_READ_TIMEOUT_S
from ..runner.client import RunnerClient, WebSocketUpgrade

__all__ = ["AppRunnerClient"]


class AppRunnerClient:
    """One runner's app routes in one runtime session. ``close()`` when done."""

    _runner: RunnerClient
    _owns_runner: bool
    _closed: bool
    session_id: str

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        session_id: str,
        transport: httpx.AsyncBaseTransport | None = None,
        auth: httpx.Auth | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        caps: AnswerCaps = DEFAULT_CAPS,
    ) -> None:
        """A client of the runner at ``base_url`` with a ``RunnerClient`` of its own
        (``caps``: its ceiling, as a provider's clients have)."""
        runner = RunnerClient(
            base_url,
            token=token,
            transport=transport,
            auth=auth,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            caps=caps,
        )
        self._bind(runner, session_id=session_id, owns_runner=True)

    @classmethod
    def over(cls, runner: RunnerClient, *, session_id: str) -> AppRunnerClient:
        """App routes sent through ``runner`` in ``session_id``; ``runner`` stays its owner's."""
        client = cls.__new__(cls)
        client._bind(runner, session_id=session_id, owns_runner=False)
        return client

    @classmethod
    def for_handle(cls, handle: SandboxHandle) -> AppRunnerClient:
        """App routes of ``handle``'s runner, in ``handle``'s session, through its client."""
        if handle.session_id is None:
            raise SandboxUnavailableError("app sandboxes need a handle bound to a session")
        return cls.over(handle.runner, session_id=handle.session_id)

    def _bind(self, runner: RunnerClient, *, session_id: str, owns_runner: bool) -> None:
        self._runner = runner
        self._owns_runner = owns_runner
        self._closed = False
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"AppRunnerClient(base_url={self.base_url!r})"

    @property
    def base_url(self) -> str:
        """The runner's base URL."""
        return self._runner.base_url

    @property
    def is_closed(self) -> bool:
        """Whether this wrapper, or the ``RunnerClient`` it sends through, was closed."""
        return self._closed or self._runner.is_closed

    async def close(self) -> None:
        """Retire this client (and close its ``RunnerClient`` if it made it); idempotent."""
        self._closed = True
        if self._owns_runner:
            await self._runner.close()

    def _open_runner(self) -> RunnerClient:
        # A recovery or shutdown closed this client: the instance moved on or went.
        if self.is_closed:
            raise SandboxUnavailableError(
                "this sandbox's client is closed (recovered or shut down)"
            )
        return self._runner

    # -- processes --------------------------------------------------------------

    async def start_process(self, start: ProcessStart) -> ProcessInfo:
        """``POST /v1/session/processes``: start a tagged background process."""
        return await self._open_runner().start_process(start, session_id=self.session_id)

    async def processes(self) -> list[ProcessInfo]:
        """``GET /v1/session/processes``."""
        return await self._open_runner().processes(session_id=self.session_id)

    async def process(self, tag: str) -> ProcessInfo | None:
        """The process tagged ``tag``, or ``None``."""
        return next((item for item in await self.processes() if item.tag == tag), None)

    async def stop_process(self, tag: str) -> None:
        """``DELETE /v1/session/processes/{tag}``: TERM, then KILL after the runner's grace."""
        await self._open_runner().stop_process(tag, session_id=self.session_id)

    async def logs(
        self, tag: str, *, lines: int | None = None, filter: str | None = None
    ) -> LogLines:
        """``GET …/processes/{tag}/logs``: the last ``lines`` lines matching ``filter``."""
        return await self._open_runner().process_logs(
            tag, session_id=self.session_id, lines=lines, filter=filter
        )

    # -- diagnostics --------------------------------------------------------------

    async def runtime_errors(self, *, since: float | None = None) -> RuntimeErrors:
        """``GET /v1/session/runtime-errors``: deduplicated errors (last seen after ``since``)."""
        return await self._open_runner().runtime_errors(session_id=self.session_id, since=since)

    async def clear_runtime_errors(self) -> None:
        """``DELETE /v1/session/runtime-errors``."""
        await self._open_runner().clear_runtime_errors(session_id=self.session_id)

    async def analysis(self) -> AnalysisResult:
        """``GET /v1/session/analysis``: the project's checkers, run in the jail."""
        return await self._open_runner().analysis(session_id=self.session_id)

    # -- ports ----------------------------------------------------------------------

    async def port_request(
        self,
        method: str,
        port: int,
        raw_path: str,
        *,
        query: str,
        request_headers: Mapping[str, str],
        content: AsyncIterable[bytes] | bytes | None = None,
        read_timeout_s: float = PORT_READ_TIMEOUT_S,
    ) -> httpx.Response:
        """Proxy one request to ``port``; a streaming response with the app's status.

        Transport failures still map to ``SandboxUnavailableError``; the caller
        closes the response.
        """
        return await self._open_runner().port_request(
            method,
            port,
            raw_path,
            session_id=self.session_id,
            query=query,
            request_headers=request_headers,
            content=content,
            read_timeout_s=read_timeout_s,
        )

    async def websocket_upgrade(
        self,
        port: int,
        raw_path: str,
        *,
        query: str,
        extra_headers: Mapping[str, str] | None = None,
    ) -> WebSocketUpgrade:
        """URL and headers (the injected auth's included) of a WebSocket upgrade to ``port``."""
        return await self._open_runner().websocket_upgrade(
            port, raw_path, session_id=self.session_id, query=query, extra_headers=extra_headers
        )
