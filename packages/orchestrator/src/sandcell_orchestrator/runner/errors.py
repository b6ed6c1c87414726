"""How a runner's answers and transport failures become orchestrator errors.

Two maps, each total over what it translates (tests assert both):

``ERROR_CODE_MAP``      every ``sandcell_protocol.ErrorCode`` → one ``SandcellError`` class
``TRANSPORT_ERROR_MAP`` httpx's ``RequestError`` tree → one ``SandboxError`` class

and the secret hygiene at the same boundary: a ``Redactor`` that scrubs secret
values from any text before it becomes part of an exception message, and a
``HeaderGuard`` that keeps an unsendable credential out of httpcore's own logs.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping
from types import MappingProxyType

import httpx
import msgspec

from sandcell_protocol import ErrorBody, ErrorCode, ProtocolError, decode, headers

from ..errors import (
    ArchiveRejectedError,
    ConfigError,
    ContextLostError,
    InputMissingError,
    ProtocolMismatchError,
    RunnerRequestError,
    SandboxError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SandcellError,
    SessionBusyError,
    SessionConflictError,
    SessionRequiredError,
)

__all__ = [
    "refused_before_sending",
    "ERROR_CODE_MAP",
    "TRANSPORT_ERROR_MAP",
    "HeaderGuard",
    "Redactor",
    "error_from_response",
    "map_transport_errors",
    "transport_error_class",
]

ERROR_CODE_MAP: Mapping[ErrorCode, type[SandcellError]] = MappingProxyType(
    {
        ErrorCode.BAD_REQUEST: RunnerRequestError,
        ErrorCode.UNAUTHORIZED: RunnerRequestError,
        ErrorCode.NOT_FOUND: RunnerRequestError,
        ErrorCode.METHOD_NOT_ALLOWED: RunnerRequestError,
        ErrorCode.PAYLOAD_TOO_LARGE: RunnerRequestError,
        ErrorCode.UNSUPPORTED_LANGUAGE: RunnerRequestError,
        ErrorCode.INVALID_PATH: RunnerRequestError,
        ErrorCode.SESSION_CONFLICT: SessionConflictError,
        ErrorCode.SESSION_BUSY: SessionBusyError,
        ErrorCode.SESSION_REQUIRED: SessionRequiredError,
        ErrorCode.QUARANTINED: SandboxUnavailableError,
        ErrorCode.INPUT_MISSING: InputMissingError,
        ErrorCode.ARCHIVE_REJECTED: ArchiveRejectedError,
        ErrorCode.PROTOCOL_MISMATCH: ProtocolMismatchError,
        ErrorCode.BUSY: SandboxUnavailableError,
        ErrorCode.CONTEXT_LOST: ContextLostError,
        # Codes of serve's own routes (app previews, idempotency); a runner never sends them.
        ErrorCode.APP_NOT_RESPONDING: RunnerRequestError,
        ErrorCode.IDEMPOTENCY_KEY_REUSED: RunnerRequestError,
        ErrorCode.IDEMPOTENCY_IN_FLIGHT: RunnerRequestError,
        # Not retryable on the wire; RunnerRequestError keeps the code so the
        # caller can still choose to recycle the sandbox.
        ErrorCode.INTERNAL: RunnerRequestError,
    }
)
"""The one orchestrator exception each runner ``ErrorCode`` becomes."""

TRANSPORT_ERROR_MAP: Mapping[type[httpx.RequestError], type[SandboxError]] = MappingProxyType(
    {
        # The runner accepted the request and went quiet: the job may still run.
        httpx.ReadTimeout: SandboxTimeoutError,
        # Never reached, or stopped reading: nothing ran, a new sandbox may serve.
        httpx.ConnectTimeout: SandboxUnavailableError,
        httpx.WriteTimeout: SandboxUnavailableError,
        httpx.PoolTimeout: SandboxUnavailableError,
        httpx.TimeoutException: SandboxUnavailableError,
        httpx.NetworkError: SandboxUnavailableError,
        httpx.RemoteProtocolError: SandboxUnavailableError,
        httpx.ProxyError: SandboxUnavailableError,
        httpx.UnsupportedProtocol: SandboxUnavailableError,
        httpx.DecodingError: SandboxUnavailableError,
        httpx.TooManyRedirects: SandboxUnavailableError,
        # We built a request h11 refuses (a bad header value): retrying cannot help.
        httpx.LocalProtocolError: SandboxError,
        httpx.ProtocolError: SandboxUnavailableError,
        httpx.TransportError: SandboxUnavailableError,
    }
)
"""httpx failures, most specific class first when resolved along the MRO."""

_SPLIT_RE = re.compile(r"[\s\x00-\x1f\x7f]+")
_MIN_SECRET_CHARS = 4
"""Shorter values would scrub ordinary words; no real credential is this short."""
REDACTED = "[redacted]"


class Redactor:
    """Replaces every known secret value in a text with ``[redacted]``.

    It learns values from outgoing request headers (``SECRET_HEADERS``), so a
    credential added by an injected ``httpx.Auth`` or transport is scrubbed too
    once it has been on one request.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        for secret in secrets:
            self.add(secret)

    def __repr__(self) -> str:
        return f"Redactor(<{len(self._secrets)} secrets>)"

    def add(self, secret: str) -> None:
        """Remember ``secret``, and each of its whitespace-separated pieces.

        Pieces catch ``value`` of a ``Scheme value`` credential, and a value that
        reaches a message escaped (``repr`` turns a newline into two characters).
        """
        candidates = {secret.strip(), *_SPLIT_RE.split(secret)}
        new = {c for c in candidates if len(c) >= _MIN_SECRET_CHARS} - self._secrets
        if new:
            self._secrets |= new
            # Longest first, so a full "Bearer x" wins over its own "x".
            ordered = sorted(self._secrets, key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(s) for s in ordered))

    def learn(self, request_headers: httpx.Headers) -> None:
        """Remember the values of every secret header on an outgoing request."""
        for name, value in request_headers.items():
            if name.lower() in headers.SECRET_HEADERS:
                self.add(value)

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(REDACTED, text)


# h11's field-value grammar: visible characters, inner spaces and tabs only.
_FIELD_VALUE_RE = re.compile(rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")


class HeaderGuard(httpx.Auth):
    """Runs the caller's auth, then refuses header values HTTP cannot carry.

    h11 would refuse them too, but its error quotes the value and httpcore logs
    that error at DEBUG: a credential with a stray newline would end up in a log.
    """

    def __init__(self, inner: httpx.Auth | None) -> None:
        self._inner = inner or httpx.Auth()

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        flow = self._inner.async_auth_flow(request)
        outgoing = await anext(flow)
        while True:
            for name, value in outgoing.headers.raw:
                if not _FIELD_VALUE_RE.fullmatch(value):
                    raise ConfigError(
                        f"request header {name.decode('ascii', 'replace')[:64]!r}:"
                        " the value is not a legal HTTP field value (not shown)"
                    )
            response = yield outgoing
            try:
                outgoing = await flow.asend(response)
            except StopAsyncIteration:
                return


def transport_error_class(exc: httpx.RequestError) -> type[SandboxError]:
    """The orchestrator error an httpx failure becomes (its nearest mapped ancestor)."""
    for cls in type(exc).__mro__:
        mapped = TRANSPORT_ERROR_MAP.get(cls)
        if mapped is not None:
            return mapped
    return SandboxUnavailableError


@contextlib.contextmanager
def map_transport_errors(request: httpx.Request, *, route: str, redact: Redactor) -> Iterator[None]:
    """Re-raise httpx's failures as ``SandboxError``s that carry no header or body.

    Raised ``from None``: the httpx exception holds the request (and so its
    headers), and a chained traceback is one careless log call away from them.
    """
    try:
        yield
    except httpx.RequestError as exc:
        redact.learn(request.headers)
        error_cls = transport_error_class(exc)
        detail = redact(str(exc)) or "no detail"
        raise error_cls(f"{request.method} {route}: {type(exc).__name__}: {detail}") from None


class _LooseDetail(msgspec.Struct):
    code: str
    message: str = ""


class _LooseError(msgspec.Struct):
    """Just enough of an error body from a peer whose codes we do not all know."""

    error: _LooseDetail


def error_from_response(
    *, method: str, route: str, status: int, body: bytes, redact: Redactor
) -> SandcellError:
    """The exception for a non-2xx answer; its message holds route, status, code, message.

    A body that is not an ``ErrorBody`` (a proxy's HTML page, a truncated answer)
    means something other than the runner answered: ``SandboxUnavailableError``.
    A well-formed body with a code this side does not know (a newer minor) is a
    refusal for a 4xx and unavailability for a 5xx.
    """
    where = f"{method} {route}: HTTP {status}"
    try:
        detail = decode(body, ErrorBody).error
    except ProtocolError:
        try:
            loose = msgspec.json.decode(body, type=_LooseError)
        except msgspec.MsgspecError:
            return SandboxUnavailableError(f"{where}: the answer is not a runner error body")
        said = redact(loose.error.message)
        message = f"{where} {loose.error.code[:64]}: {said}"
        if status >= 500:
            return SandboxUnavailableError(message)
        return RunnerRequestError(message, code=loose.error.code[:64], public_detail=said[:500])
    # The runner's own words are about the request (what was refused, and why): the
    # caller's to read. The route and status before them are this side's, for logs.
    said = redact(detail.message)
    message = f"{where} {detail.code.value}: {said}"
    error_cls = ERROR_CODE_MAP[detail.code]
    if issubclass(error_cls, RunnerRequestError):
        return RunnerRequestError(
            message, code=detail.code.value, retryable=detail.retryable, public_detail=said[:500]
        )
    return error_cls(message, public_detail=said[:500])


def refused_before_sending(code: str, message: str) -> RunnerRequestError:
    """A request refused before it left: the same error the runner would have given."""
    return RunnerRequestError(
        f"refused before sending: {message}", code=code, public_detail=message
    )
