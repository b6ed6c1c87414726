"""``RunnerClient``: the only code that speaks HTTP to a runner.

One pooled ``httpx.AsyncClient`` per sandbox. The transport is injectable, so
the same client talks to a runner on loopback, an in-process ASGI app, or a
cloud proxy (with an ``httpx.Auth`` adding the proxy's header). Every method
maps 1:1 onto one runner route; the higher layers (``SandboxHandle``,
``SandboxManager``, ``ExecutionService``) are built on it. The input-cache and
workspace-file routes, and ``CheckpointStream``, live in ``runner_transfers``;
the app routes (processes, logs, diagnostics, the port proxy) in ``runner_apps``.

Secrets: the bearer token and any header an injected auth adds never reach an
exception message, a ``repr`` or a log line; transport errors are re-raised
``from None`` and every message passes through a ``Redactor``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Callable,
    Mapping,
)
from typing import TypeVar

import anyio
import httpx
import msgspec

from sandcell_protocol import (
    PROTOCOL_VERSION,
    ExecuteRequest,
    ExecuteResult,
    Health,
    ProtocolError,
    ResultEvent,
    StreamEvent,
    check_compatible,
    decode,
    decode_event,
    encode,
    headers,
    is_runtime_session_id,
    routes,
)
from sandcell_protocol import ProtocolMismatchError as WireMismatch

from ..errors import (
    ConfigError,
    ProtocolMismatchError,
    SandboxTimeoutError,
    SandboxUnavailableError,
)
from .apps import RunnerApps, WebSocketUpgrade
from .errors import (
    HeaderGuard,
    Redactor,
    error_from_response,
    map_transport_errors,
    refused_before_sending,
)
from .transfers import (
    JSON,
    CheckpointEncoding,
    CheckpointStream,
    InputPayload,
    RunnerTransfers,
)

__all__ = [
    "CheckpointEncoding",
    "CheckpointStream",
    "InputPayload",
    "RunnerClient",
    "WebSocketUpgrade",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

EXECUTE_MARGIN_S = 10.0
"""Read-timeout slack past a job's own deadline: the runner still reaps and collects."""
_B64TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


class _ProtocolOnly(msgspec.Struct):
    """The one ``Health`` field every protocol major must keep, read leniently."""

    protocol: str


def _new_request_id() -> str:
    return uuid.uuid4().hex


class RunnerClient(RunnerTransfers, RunnerApps):
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
        new_request_id: Callable[[], str] = _new_request_id,
    ) -> None:
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"runner base_url: expected http(s)://host[:port], got {url.scheme}")
        if not _B64TOKEN_RE.fullmatch(token):
            # Never echo the value: a wrong one is still somebody's secret.
            raise ConfigError("runner token: not a valid bearer token (RFC 6750 b64token)")
        self.base_url = str(url.copy_with(username=None, password=None, query=None))
        self._token = token
        self._timeout_s = timeout_s
        self._clock = clock
        self._new_request_id = new_request_id
        self._redact = Redactor([token, headers.BEARER_PREFIX + token])
        self._compatible = False
        self._contact_lock = anyio.Lock()
        # What a request sent outside httpx (a WebSocket upgrade) could not go through.
        self._transport_injected = transport is not None
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            auth=HeaderGuard(auth),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={headers.PROTOCOL: PROTOCOL_VERSION},
            follow_redirects=False,
            # No proxy variables or .netrc: a token must go only where the caller sent it.
            trust_env=False,
        )

    def __repr__(self) -> str:
        return f"RunnerClient(base_url={self.base_url!r})"

    async def __aenter__(self) -> RunnerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool; idempotent."""
        await self._client.aclose()

    @property
    def is_closed(self) -> bool:
        """Whether ``close()`` has run: a closed client sends nothing more."""
        return self._client.is_closed

    # -- plumbing -------------------------------------------------------------

    async def _request(
        self,
        method: str,
        route: str,
        *,
        session_id: str | None = None,
        message: object = None,
        extra_headers: Mapping[str, str] | None = None,
        read_timeout_s: float | None = None,
        stream: bool = False,
        any_status: bool = False,
        **kwargs: object,
    ) -> httpx.Response:
        """Build (validating first), check the protocol on first contact, send.

        ``any_status``: hand back a non-2xx answer instead of raising (the port proxy).
        """
        request = self._build_request(
            method,
            route,
            session_id=session_id,
            message=message,
            extra_headers=extra_headers,
            read_timeout_s=read_timeout_s,
            **kwargs,
        )
        await self._ensure_compatible()
        return await self._send(request, stream=stream, any_status=any_status)

    def _build_request(
        self,
        method: str,
        route: str,
        *,
        session_id: str | None = None,
        message: object = None,
        extra_headers: Mapping[str, str] | None = None,
        read_timeout_s: float | None = None,
        **kwargs: object,
    ) -> httpx.Request:
        """One request carrying this client's headers (validated first); nothing is sent.

        Ours win over ``extra_headers`` whatever their case: a forwarded header
        cannot replace the token, the session, the protocol or the request id.
        """
        request_headers = httpx.Headers(extra_headers)
        request_headers[headers.REQUEST_ID] = self._new_request_id()
        request_headers[headers.PROTOCOL] = PROTOCOL_VERSION
        request_headers[headers.AUTHORIZATION] = headers.BEARER_PREFIX + self._token
        if session_id is not None:
            if not is_runtime_session_id(session_id):
                raise refused_before_sending(
                    "bad_request", "session_id must match ^rt_[0-9a-f]{64}$"
                )
            request_headers[headers.RUNTIME_SESSION_ID] = session_id
        if message is not None:
            kwargs["content"] = encode(message)
            request_headers.setdefault("Content-Type", JSON)
        if read_timeout_s is not None:
            default = self._client.timeout
            kwargs["timeout"] = httpx.Timeout(
                default.read, connect=default.connect, read=read_timeout_s
            )
        return self._client.build_request(
            method,
            route,
            headers=request_headers,
            **kwargs,  # type: ignore[arg-type]
        )

    def _mapping(self, request: httpx.Request) -> contextlib.AbstractContextManager[None]:
        return map_transport_errors(request, route=request.url.path, redact=self._redact)

    async def _send(
        self, request: httpx.Request, *, stream: bool = False, any_status: bool = False
    ) -> httpx.Response:
        """Send, translating transport failures and non-2xx answers; logs no header.

        ``any_status`` returns every answer as it came (the port proxy's are the app's).
        """
        started = self._clock()
        with self._mapping(request):
            response = await self._client.send(request, stream=stream)
        self._redact.learn(response.request.headers)
        log.debug(
            "runner %s %s -> %d in %.1f ms (request %s)",
            request.method,
            request.url.path,
            response.status_code,
            (self._clock() - started) * 1000,
            request.headers.get(headers.REQUEST_ID),
        )
        if response.is_success or any_status:
            return response
        try:
            with self._mapping(request):
                body = await response.aread()
        finally:
            await response.aclose()
        raise error_from_response(
            method=request.method,
            route=request.url.path,
            status=response.status_code,
            body=body,
            redact=self._redact,
        )

    def _decode(self, response: httpx.Response, type_: type[T]) -> T:
        try:
            return decode(response.content, type_)
        except ProtocolError as exc:
            where = f"{response.request.method} {response.request.url.path}"
            raise SandboxUnavailableError(f"{where}: malformed answer: {exc}") from None

    async def _ensure_compatible(self) -> None:
        if self._compatible:
            return
        async with self._contact_lock:
            if not self._compatible:
                await self._fetch_health(timeout_s=None)

    async def _fetch_health(self, *, timeout_s: float | None) -> Health:
        request = self._client.build_request(
            "GET", routes.HEALTH, headers={headers.REQUEST_ID: self._new_request_id()}
        )
        if timeout_s is not None:
            # Connect included: a poll must not outlive the caller's deadline.
            request.extensions["timeout"] = httpx.Timeout(timeout_s).as_dict()
        response = await self._send(request)
        # Check the version before the full shape: another major may have other fields.
        try:
            peer = msgspec.json.decode(response.content, type=_ProtocolOnly).protocol
        except msgspec.MsgspecError:
            raise SandboxUnavailableError(f"GET {routes.HEALTH}: malformed answer") from None
        try:
            check_compatible(peer)
        except WireMismatch:
            raise ProtocolMismatchError(
                f"runner at {self.base_url} speaks protocol {peer[:32]!r}; this orchestrator"
                f" speaks {PROTOCOL_VERSION!r} (protocol majors must match)"
            ) from None
        health = self._decode(response, Health)
        self._compatible = True
        return health

    # -- health ---------------------------------------------------------------

    async def health(self) -> Health:
        """``GET /health`` (unauthenticated); checks the protocol major every time."""
        return await self._fetch_health(timeout_s=None)

    async def wait_ready(self, *, timeout_s: float, interval_s: float = 0.05) -> Health:
        """Poll ``/health`` until the runner says ``ok``.

        ``SandboxUnavailableError`` at the deadline. A quarantined runner never
        recovers and a protocol mismatch never heals: both raise at once.
        """
        deadline = self._clock() + timeout_s
        last = "no answer"
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise SandboxUnavailableError(
                    f"runner at {self.base_url} not ready in {timeout_s:.1f}s: {last}"
                )
            try:
                health = await self._fetch_health(timeout_s=max(min(remaining, 2.0), 0.01))
            except (SandboxUnavailableError, SandboxTimeoutError) as exc:
                last = str(exc)
            else:
                if health.status == "ok":
                    return health
                if health.status == "quarantined":
                    raise SandboxUnavailableError(f"runner at {self.base_url} is quarantined")
                last = f"status {health.status}"
            await anyio.sleep(min(interval_s, max(deadline - self._clock(), 0)))

    # -- execute --------------------------------------------------------------

    def _execute_read_s(self, request: ExecuteRequest, timeout_s: float | None) -> float:
        if timeout_s is not None:
            return timeout_s
        return max(self._timeout_s, request.timeout_ms / 1000 + EXECUTE_MARGIN_S)

    async def execute(
        self,
        request: ExecuteRequest,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ExecuteResult:
        """``POST /v1/execute``; the read timeout defaults past the job's own deadline."""
        read_s = self._execute_read_s(request, timeout_s)
        response = await self._request(
            "POST", routes.EXECUTE, session_id=session_id, message=request, read_timeout_s=read_s
        )
        return self._decode(response, ExecuteResult)

    async def execute_stream(
        self,
        request: ExecuteRequest,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """``POST /v1/execute`` as NDJSON: output chunks as produced, then one ``ResultEvent``.

        Close the iterator (``contextlib.aclosing``) when leaving early.
        """
        response = await self._request(
            "POST",
            routes.EXECUTE,
            session_id=session_id,
            message=request,
            extra_headers={"Accept": routes.NDJSON},
            read_timeout_s=self._execute_read_s(request, timeout_s),
            stream=True,
        )
        try:
            with self._mapping(response.request):
                if not response.headers.get("content-type", "").startswith(routes.NDJSON):
                    # A peer that ignored Accept answered one ExecuteResult.
                    await response.aread()
                    yield ResultEvent(result=self._decode(response, ExecuteResult))
                    return
                seen_result = False
                async for line in response.aiter_lines():
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
        await self._request("DELETE", routes.SESSION, session_id=session_id)


def _decode_event(line: str) -> StreamEvent:
    try:
        return decode_event(line)
    except ProtocolError as exc:
        raise SandboxUnavailableError(f"POST {routes.EXECUTE}: malformed event: {exc}") from None
