"""``RunnerConnection``: the one HTTP connection of a ``RunnerClient`` to its runner.

Owns the pooled ``httpx.AsyncClient`` (its transport injectable: loopback, an
in-process ASGI app, a cloud proxy with an ``httpx.Auth`` adding its header),
the bearer token, the protocol check on first contact, request ids and the
error maps of ``errors.py``. ``RunnerClient`` sends every route through it;
nothing else builds a runner request.

Secrets: the bearer token and any header an injected auth adds never reach an
exception message, a ``repr`` or a log line; transport errors are re-raised
``from None`` and every message passes through a ``Redactor``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import ssl
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import anyio
import httpx
import msgspec

from sandcell_protocol import (
    PROTOCOL_VERSION,
    Health,
    ProtocolError,
    RunnerLimits,
    check_compatible,
    decode,
    encode,
    headers,
    is_runtime_session_id,
    routes,
)
from sandcell_protocol import ProtocolMismatchError as WireMismatch

from ..errors import (
    AnswerTooLargeError,
    ConfigError,
    ProtocolMismatchError,
    SandboxUnavailableError,
)
from .answers import (
    DEFAULT_CAPS,
    AnswerCaps,
    PastCeiling,
    past_ceiling,
    read_bounded,
    warn_past_ceiling,
)
from .close_guard import CloseGuard
from .errors import (
    HeaderGuard,
    Redactor,
    error_from_response,
    map_transport_errors,
    refused_before_sending,
)

__all__ = ["JSON", "RunnerConnection", "new_request_id"]

log = logging.getLogger(__name__)

T = TypeVar("T")

JSON = "application/json"
_B64TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


class _ProtocolOnly(msgspec.Struct):
    """The one ``Health`` field every protocol major must keep, read leniently."""

    protocol: str


def new_request_id() -> str:
    return uuid.uuid4().hex


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every runner client, made on first use.

    httpx makes a fresh one per client otherwise, loading the CA bundle each
    time: ~50 CPU-ms per ``RunnerClient``, which was most of an acquire from the
    local warm pool and two of them sat on every cold session's path. The same
    settings as httpx's own (certifi's bundle, no SSL_CERT_* variables).
    """
    return httpx.create_ssl_context(trust_env=False)


class RunnerConnection:
    """One runner's HTTP connection: build, check, send, map, decode. Close with ``close()``."""

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
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"runner base_url: expected http(s)://host[:port], got {url.scheme}")
        if not _B64TOKEN_RE.fullmatch(token):
            # Never echo the value: a wrong one is still somebody's secret.
            raise ConfigError("runner token: not a valid bearer token (RFC 6750 b64token)")
        self.base_url = str(url.copy_with(username=None, password=None, query=None))
        self._token = token
        self.timeout_s = timeout_s
        self.ceiling = caps
        """The most of each kind of answer this connection ever reads."""
        self.caps = caps
        """How much of each kind of answer this connection reads (``answers.py``): the
        ceiling, or what the runner's ``Health`` stated under it once it stated any."""
        self.stated: RunnerLimits | None = None
        """The limits the runner's ``Health`` stated (protocol 1.3), once it did."""
        self.beyond: tuple[PastCeiling, ...] = ()
        """Which stated limits the ceiling holds lower (``AnswerCaps.beyond``)."""
        self.clock = clock
        self._new_request_id = new_request_id
        self.redact = Redactor([token, headers.BEARER_PREFIX + token])
        self._compatible = False
        self._contact_lock = anyio.Lock()
        # What a request sent outside httpx (a WebSocket upgrade) could not go through.
        self.transport_injected = transport is not None
        # Guarded: a close racing another task's connecting request must not leave
        # that request's connection open (close_guard.py).
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            transport=CloseGuard(
                transport or httpx.AsyncHTTPTransport(verify=_tls_context(), trust_env=False)
            ),
            auth=HeaderGuard(auth),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={headers.PROTOCOL: PROTOCOL_VERSION},
            follow_redirects=False,
            # No proxy variables or .netrc: a token must go only where the caller sent it.
            trust_env=False,
        )

    def __repr__(self) -> str:
        return f"RunnerConnection(base_url={self.base_url!r})"

    async def close(self) -> None:
        """Close the connection pool; idempotent."""
        await self.http.aclose()

    @property
    def is_closed(self) -> bool:
        """Whether ``close()`` has run: a closed client sends nothing more."""
        return self.http.is_closed

    async def request(
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
        max_bytes: int | Callable[[AnswerCaps], int] | None = None,
        **kwargs: object,
    ) -> httpx.Response:
        """Build (validating first), check the protocol on first contact, send.

        ``any_status``: hand back a non-2xx answer instead of raising (the port proxy).
        ``max_bytes``: the cap on this answer's body (``caps.answer_bytes`` if None), or
        how to take it from the caps once the first contact set them from the runner's
        stated limits.
        """
        if not any_status:
            # Answers read here are bounded as they come; a compressed one would be
            # decoded piece by piece (answers.py) but no runner answer needs it.
            extra_headers = httpx.Headers(extra_headers)
            extra_headers.setdefault("Accept-Encoding", "identity")
        request = self.build_request(
            method,
            route,
            session_id=session_id,
            message=message,
            extra_headers=extra_headers,
            read_timeout_s=read_timeout_s,
            **kwargs,
        )
        await self.ensure_compatible()
        cap = max_bytes(self.caps) if callable(max_bytes) else max_bytes
        return await self.send(request, stream=stream, any_status=any_status, max_bytes=cap)

    def build_request(
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
            default = self.http.timeout
            kwargs["timeout"] = httpx.Timeout(
                default.read, connect=default.connect, read=read_timeout_s
            )
        return self.http.build_request(
            method,
            route,
            headers=request_headers,
            **kwargs,  # type: ignore[arg-type]
        )

    @contextlib.contextmanager
    def mapping(self, request: httpx.Request) -> Iterator[None]:
        """httpx's failures as ``SandboxError``s; an answer too large for a ceiling held
        below the runner's own limits as the ``AnswerCeilingError`` naming them."""
        try:
            with map_transport_errors(request, route=request.url.path, redact=self.redact):
                yield
        except AnswerTooLargeError as exc:
            error = past_ceiling(exc, self.caps, self.beyond)
            if error is None:
                raise
            raise error from None

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        any_status: bool = False,
        max_bytes: int | None = None,
    ) -> httpx.Response:
        """Send, translating transport failures and non-2xx answers; logs no header.

        ``any_status`` returns every answer as it came (the port proxy's are the app's).
        Without ``stream`` the body is read here, at most ``max_bytes`` of it
        (``caps.answer_bytes`` if None) within the request's read timeout:
        ``RunnerAnswerError`` past either. A streamed answer is the caller's to bound.
        """
        started = self.clock()
        with self.mapping(request):
            # Always streamed from httpx: its own read of a body has no size limit.
            response = await self.http.send(request, stream=True)
        self.redact.learn(response.request.headers)
        log.debug(
            "runner %s %s -> %d in %.1f ms (request %s)",
            request.method,
            request.url.path,
            response.status_code,
            (self.clock() - started) * 1000,
            request.headers.get(headers.REQUEST_ID),
        )
        if (response.is_success or any_status) and stream:
            return response
        cap = max_bytes if max_bytes is not None else self.caps.answer_bytes
        if not response.is_success and not any_status:
            cap = self.caps.error_bytes
        try:
            with self.mapping(request):
                body = await read_bounded(
                    response,
                    max_bytes=cap,
                    budget_s=_read_timeout(request),
                    clock=self.clock,
                    where=f"{request.method} {request.url.path}",
                )
        finally:
            await response.aclose()
        if response.is_success or any_status:
            # What ``aread`` would have left: ``response.content`` reads as before.
            response._content = body
            return response
        raise error_from_response(
            method=request.method,
            route=request.url.path,
            status=response.status_code,
            body=body,
            redact=self.redact,
        )

    def decode(self, response: httpx.Response, type_: type[T]) -> T:
        try:
            return decode(response.content, type_)
        except ProtocolError as exc:
            where = f"{response.request.method} {response.request.url.path}"
            raise SandboxUnavailableError(f"{where}: malformed answer: {exc}") from None

    async def ensure_compatible(self) -> None:
        if self._compatible:
            return
        async with self._contact_lock:
            if not self._compatible:
                await self.fetch_health(timeout_s=None)

    async def fetch_health(self, *, timeout_s: float | None) -> Health:
        # With the token: the runner's whole Health (its unauthenticated answer is a
        # load balancer's summary, without the bound session or languages).
        request = self.http.build_request(
            "GET",
            routes.HEALTH,
            headers={
                headers.REQUEST_ID: self._new_request_id(),
                headers.AUTHORIZATION: headers.BEARER_PREFIX + self._token,
                "Accept-Encoding": "identity",
            },
        )
        if timeout_s is not None:
            # Connect included: a poll must not outlive the caller's deadline.
            request.extensions["timeout"] = httpx.Timeout(timeout_s).as_dict()
        response = await self.send(request, max_bytes=self.caps.answer_bytes)
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
        health = self.decode(response, Health)
        # An older runner states none: its answers are read by the ceiling, as before.
        stated = health.limits
        if isinstance(stated, RunnerLimits):
            self.stated = stated
            self.caps = self.ceiling.following(stated)
            self.beyond = self.ceiling.beyond(stated)
            warn_past_ceiling(self.beyond)
        else:
            self.caps = self.ceiling
        self._compatible = True
        return health


def _read_timeout(request: httpx.Request) -> float | None:
    """The read timeout ``request`` was sent with: the budget for its whole body."""
    timeout = request.extensions.get("timeout")
    read = timeout.get("read") if isinstance(timeout, dict) else None
    return float(read) if isinstance(read, int | float) else None
