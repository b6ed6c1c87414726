"""``RunnerClient``: the only code that speaks HTTP to a runner, one method per route.

Every method maps 1:1 onto one runner route and sends through the client's one
``RunnerConnection`` (pooled ``httpx.AsyncClient``, injectable transport and
auth, bearer token, protocol check on first contact, error maps, redaction).
The higher layers (``SandboxHandle``, ``SandboxManager``, ``ExecutionService``)
are built on it. What the routes move has its own modules: ``transfers``
(``CheckpointStream``, ``InputPayload``, file routes; their methods are
``transfer_routes.TransferRoutes``, a base class), ``apps`` (process and port
routes, ``WebSocketUpgrade``; their methods are ``app_routes.AppRoutes``, a base
class) and ``errors`` (the error maps).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable

import anyio
import httpx

from sandcell_protocol import (
    EgressPolicy,
    EgressStatus,
    ExecuteRequest,
    ExecuteResult,
    Health,
    ProtocolError,
    ResultEvent,
    StreamEvent,
    decode,
    decode_event,
    routes,
)

from ..errors import SandboxTimeoutError, SandboxUnavailableError
from .answers import DEFAULT_CAPS, AnswerCaps, read_bounded, read_lines
from .app_routes import AppRoutes
from .apps import WebSocketUpgrade
from .connection import RunnerConnection, new_request_id
from .contexts import RunnerContexts
from .transfer_routes import TransferRoutes
from .transfers import CheckpointEncoding, CheckpointStream, InputPayload

__all__ = [
    "CheckpointEncoding",
    "CheckpointStream",
    "InputPayload",
    "RunnerClient",
    "WebSocketUpgrade",
]

EXECUTE_MARGIN_S = 10.0
"""Read-timeout slack past a job's own deadline: the runner still reaps and collects."""


class RunnerClient(AppRoutes, TransferRoutes):
    """An HTTP client of one runner. Use as ``async with`` or call ``close()``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        transport: httpx.AsyncBaseTransport | None = None,
        auth: httpx.Auth | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        new_request_id: Callable[[], str] = new_request_id,
        caps: AnswerCaps = DEFAULT_CAPS,
    ) -> None:
        self._conn = RunnerConnection(
            base_url,
            token=token,
            transport=transport,
            auth=auth,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            clock=clock,
            new_request_id=new_request_id,
            caps=caps,
        )
        self.contexts = RunnerContexts(self._conn)
        """The code-context routes (``/v1/session/contexts``)."""

    @property
    def base_url(self) -> str:
        """The runner's base URL (without credentials or query)."""
        return self._conn.base_url

    @property
    def connection(self) -> RunnerConnection:
        """The connection every route goes through (its httpx client, auth, redactor)."""
        return self._conn

    def __repr__(self) -> str:
        return f"RunnerClient(base_url={self.base_url!r})"

    async def __aenter__(self) -> RunnerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool; idempotent."""
        await self._conn.close()

    @property
    def is_closed(self) -> bool:
        """Whether ``close()`` has run: a closed client sends nothing more."""
        return self._conn.is_closed

    # -- health ---------------------------------------------------------------

    async def health(self) -> Health:
        """``GET /health`` with the token (the whole ``Health``); checks the protocol major
        every time."""
        return await self._conn.fetch_health(timeout_s=None)

    async def wait_ready(
        self, *, timeout_s: float, interval_s: float = 0.05, attempt_s: float = 2.0
    ) -> Health:
        """Poll ``/health`` until the runner says ``ok``, each try given up after ``attempt_s``.

        ``SandboxUnavailableError`` at the deadline. A quarantined runner never
        recovers and a protocol mismatch never heals: both raise at once.

        A runner whose listening socket was bound before it started (the local
        provider's) has every connection accepted by the kernel at once, answered
        or not: a try that gives up closes its connection, but its request still
        sits in the backlog for the runner to serve once it is up, one per
        ``attempt_s``. Such a caller passes ``attempt_s=timeout_s``: one try, which
        the backlog holds until the runner answers or the deadline ends it.
        """
        deadline = self._conn.clock() + timeout_s
        last = "no answer"
        while True:
            remaining = deadline - self._conn.clock()
            if remaining <= 0:
                raise SandboxUnavailableError(
                    f"runner at {self.base_url} not ready in {timeout_s:.1f}s: {last}"
                )
            try:
                health = await self._conn.fetch_health(
                    timeout_s=max(min(remaining, attempt_s), 0.01)
                )
            except (SandboxUnavailableError, SandboxTimeoutError) as exc:
                last = str(exc)
            else:
                if health.status == "ok":
                    return health
                if health.status == "quarantined":
                    raise SandboxUnavailableError(f"runner at {self.base_url} is quarantined")
                last = f"status {health.status}"
            await anyio.sleep(min(interval_s, max(deadline - self._conn.clock(), 0)))

    # -- execute --------------------------------------------------------------

    def _execute_read_s(self, request: ExecuteRequest, timeout_s: float | None) -> float:
        if timeout_s is not None:
            return timeout_s
        return max(self._conn.timeout_s, request.timeout_ms / 1000 + EXECUTE_MARGIN_S)

    async def execute(
        self,
        request: ExecuteRequest,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ExecuteResult:
        """``POST /v1/execute``; the read timeout defaults past the job's own deadline."""
        read_s = self._execute_read_s(request, timeout_s)
        response = await self._conn.request(
            "POST",
            routes.EXECUTE,
            session_id=session_id,
            message=request,
            read_timeout_s=read_s,
            max_bytes=lambda caps: caps.execute_bytes(request),
        )
        return self._conn.decode(response, ExecuteResult)

    async def execute_stream(
        self,
        request: ExecuteRequest,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``POST /v1/execute`` as NDJSON: output chunks as produced, then one ``ResultEvent``.

        Close the iterator (``contextlib.aclosing``) when leaving early.
        """
        read_s = self._execute_read_s(request, timeout_s)
        response = await self._conn.request(
            "POST",
            routes.EXECUTE,
            session_id=session_id,
            message=request,
            extra_headers={"Accept": routes.NDJSON},
            read_timeout_s=read_s,
            stream=True,
        )
        # The result line holds the whole ExecuteResult; the job's own deadline (plus
        # the margin) bounds the time the runner may take to send it all.
        cap = self._conn.caps.execute_bytes(request)
        where = f"POST {routes.EXECUTE}"
        try:
            with self._conn.mapping(response.request):
                if not response.headers.get("content-type", "").startswith(routes.NDJSON):
                    # A peer that ignored Accept answered one ExecuteResult.
                    body = await read_bounded(
                        response,
                        max_bytes=cap,
                        budget_s=read_s,
                        clock=self._conn.clock,
                        where=where,
                    )
                    yield ResultEvent(result=_decode_result(body))
                    return
                seen_result = False
                lines = read_lines(
                    response,
                    max_line_bytes=cap,
                    budget_s=read_s,
                    clock=self._conn.clock,
                    where=where,
                )
                async for line in lines:
                    if line.strip():
                        event = _decode_event(line)
                        seen_result = isinstance(event, ResultEvent)
                        yield event
            if not seen_result:
                raise SandboxUnavailableError(f"POST {routes.EXECUTE}: stream ended before result")
        finally:
            await response.aclose()

    # -- session ----------------------------------------------------------------

    async def release_session(self, *, session_id: str) -> None:
        """``DELETE /v1/session``: wipe the session workspace and unbind the runner."""
        await self._conn.request("DELETE", routes.SESSION, session_id=session_id)

    # -- egress ---------------------------------------------------------------

    async def egress(self) -> EgressStatus:
        """``GET /v1/egress``: the sandbox's egress policy, mechanism and counters."""
        response = await self._conn.request("GET", routes.EGRESS)
        return self._conn.decode(response, EgressStatus)

    async def set_egress(self, policy: EgressPolicy) -> EgressStatus:
        """``PUT /v1/egress``: replace the policy; it decides the next connection."""
        response = await self._conn.request("PUT", routes.EGRESS, message=policy)
        return self._conn.decode(response, EgressStatus)


def _decode_result(body: bytes) -> ExecuteResult:
    try:
        return decode(body, ExecuteResult)
    except ProtocolError as exc:
        raise SandboxUnavailableError(f"POST {routes.EXECUTE}: malformed answer: {exc}") from None


def _decode_event(line: bytes) -> StreamEvent:
    try:
        return decode_event(line)
    except ProtocolError as exc:
        raise SandboxUnavailableError(f"POST {routes.EXECUTE}: malformed event: {exc}") from None
