"""Credentials on the way to a MicroVM, and keeping them out of every log line.

- ``MicrovmProxyAuth``: an ``httpx.Auth`` that adds the ``X-aws-proxy-auth``
  header from ``CreateMicrovmAuthToken`` to each runner request, re-mints the
  token before it expires, and after a proxy 401/403 re-mints once and resends.
  ``RunnerClient`` takes it as ``auth=`` and never learns it talks to AWS.
- ``ProxyTokenCache``: one VM's current token; one mint at a time.
- ``derive_runner_token``: the runner's own bearer token for one VM, an HMAC of a
  per-launch nonce under the deployment's runner key.
- ``install_log_redaction``: a filter on botocore's and httpx's loggers, whose
  DEBUG output carries request bodies (``runHookPayload`` holds the runner token),
  response bodies (``authToken``) and signed headers.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field

import anyio
import httpx

from ..runner.answers import DEFAULT_CAPS, read_bounded

__all__ = [
    "DEFAULT_PROXY_PORT",
    "PROXY_PORT_HEADER",
    "MicrovmProxyAuth",
    "ProxyToken",
    "ProxyTokenCache",
    "SecretLogFilter",
    "decode_run_hook_payload",
    "derive_runner_token",
    "encode_run_hook_payload",
    "install_log_redaction",
]

PROXY_PORT_HEADER = "X-aws-proxy-port"
"""Selects the port inside the MicroVM; without it the proxy forwards to 8080."""
DEFAULT_PROXY_PORT = 8080
_REFUSED = (401, 403)

Mint = Callable[[], Awaitable[Mapping[str, str]]]
"""Mints a token for one VM: the header map ``CreateMicrovmAuthToken`` returned."""


def derive_runner_token(key: bytes, nonce: str) -> str:
    """The runner bearer token of the VM launched with ``nonce`` (64 hex digits).

    Every worker holding ``key`` derives the same token from the nonce in the
    sandbox id, so no worker has to store, and no registry row has to carry, it.
    """
    message = b"sandcell-microvm-runner-token\x00" + nonce.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class ProxyToken:
    """A minted proxy token: the headers to send and when to replace them (monotonic)."""

    headers: Mapping[str, str] = field(repr=False)
    expires_at: float
    refresh_at: float


class ProxyTokenCache:
    """The current proxy token of one VM, minted on demand and before it expires."""

    def __init__(
        self,
        mint: Mint,
        *,
        lifetime_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mint = mint
        self._lifetime_s = lifetime_s
        # Re-mint a little early: a token that expires in flight fails a long request.
        self._margin_s = min(60.0, lifetime_s * 0.2)
        self._clock = clock
        self._lock = anyio.Lock()
        self._token: ProxyToken | None = None

    def __repr__(self) -> str:
        return f"ProxyTokenCache(lifetime_s={self._lifetime_s})"

    def _fresh(self, token: ProxyToken | None) -> bool:
        return token is not None and self._clock() < token.refresh_at

    async def current(self) -> ProxyToken:
        """A token that is not about to expire (minting one if needed)."""
        token = self._token
        if token is not None and self._fresh(token):
            return token
        async with self._lock:
            token = self._token
            if token is not None and self._fresh(token):
                return token
            return await self._mint_new()

    async def replace(self, stale: ProxyToken) -> ProxyToken:
        """A new token after ``stale`` was refused; concurrent callers share one mint."""
        async with self._lock:
            token = self._token
            if token is not None and token is not stale and self._fresh(token):
                return token
            return await self._mint_new()

    def discard(self, stale: ProxyToken) -> None:
        """Forget ``stale`` so the next request mints a new one."""
        if self._token is stale:
            self._token = None

    async def _mint_new(self) -> ProxyToken:
        # Expiry counts from before the call: the service started its clock then or later.
        started = self._clock()
        minted = dict(await self._mint())
        token = ProxyToken(
            headers=minted,
            expires_at=started + self._lifetime_s,
            refresh_at=started + self._lifetime_s - self._margin_s,
        )
        self._token = token
        return token


class MicrovmProxyAuth(httpx.Auth):
    """Adds a VM's proxy token to each request; async clients only."""

    def __init__(self, tokens: ProxyTokenCache, *, port: int = DEFAULT_PROXY_PORT) -> None:
        self._tokens = tokens
        self._port = port

    def __repr__(self) -> str:
        return f"MicrovmProxyAuth(port={self._port})"

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response]:
        """Minting goes through the event loop; a sync client cannot use this auth."""
        raise RuntimeError("MicrovmProxyAuth works with httpx.AsyncClient only")

    def _apply(self, request: httpx.Request, token: ProxyToken) -> None:
        for name, value in token.headers.items():
            request.headers[name] = value
        # Never left to the caller: a port header that came in with a forwarded
        # request would steer the runner's token to another port.
        if self._port != DEFAULT_PROXY_PORT:
            request.headers[PROXY_PORT_HEADER] = str(self._port)
        else:
            request.headers.pop(PROXY_PORT_HEADER, None)

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        """Send with the cached token; after a proxy refusal, re-mint once and resend."""
        # Judged before sending: a transport may buffer the stream while sending it.
        replayable = isinstance(request.stream, httpx.ByteStream)
        token = await self._tokens.current()
        self._apply(request, token)
        response = yield request
        if response.status_code not in _REFUSED:
            return
        # Bounded: the runner behind the proxy is in the tenant's VM and may answer anything.
        body = await read_bounded(
            response,
            max_bytes=DEFAULT_CAPS.error_bytes,
            budget_s=None,
            clock=time.monotonic,
            where=f"{request.method} {request.url.path}",
        )
        response._content = body  # what ``aread`` leaves: the caller reads it as usual
        if _is_runner_refusal(body):
            # The runner refused its bearer token: a new proxy token would not help.
            return
        if not replayable:
            # A streamed body cannot be sent twice; the next request gets a new token.
            self._tokens.discard(token)
            return
        self._apply(request, await self._tokens.replace(token))
        yield request


def _is_runner_refusal(body: bytes) -> bool:
    """Whether a 401/403 body is the runner's ``ErrorBody`` rather than the proxy's."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return isinstance(error, dict) and isinstance(error.get("code"), str)


# -- log redaction -------------------------------------------------------------------

_REDACTED = "[redacted]"
_AUTH_HEADER_NAMES = r"authorization|x-aws-proxy-auth|x-amz-security-token"
# 'Authorization': b'AWS4-HMAC-SHA256 ...'   "X-aws-proxy-auth": "..."
_HEADER_ITEM_RE = re.compile(
    rf"""(?i)(['"]?(?:{_AUTH_HEADER_NAMES})['"]?\s*:\s*b?)(['"])(?:\\.|(?!\2).)*\2"""
)
# Canonical-request lines of SigV4: "x-amz-security-token:VALUE"
_HEADER_LINE_RE = re.compile(rf"(?im)^((?:{_AUTH_HEADER_NAMES})\s*:).*$")
_SIGNATURE_RE = re.compile(r"(?i)(signature\s*[=:]\s*)[0-9a-f]{16,}")
# JSON bodies (also inside a bytes repr, where quotes inside strings gain backslashes).
_JSON_SECRET_RE = re.compile(
    r'("(?:authToken|runHookPayload)"\s*:\s*)("(?:\\+.|[^"\\])*"|\{[^{}]*\})'
)

_FILTERED_LOGGERS = (
    "botocore.endpoint",
    "botocore.parsers",
    "botocore.auth",
    "botocore.awsrequest",
    "botocore.hooks",
    "botocore.client",
    "botocore.retryhandler",
    "botocore.httpsession",
    "urllib3.connectionpool",
    "httpx",
    "httpcore.connection",
    "httpcore.http11",
)
_MAX_KNOWN_SECRETS = 4096


class SecretLogFilter(logging.Filter):
    """Rewrites a record's message with credentials replaced by ``[redacted]``.

    Two nets: the shapes secrets travel in (auth headers, ``authToken``,
    ``runHookPayload``, SigV4 signatures), and the exact values registered with
    ``remember`` (runner tokens and minted proxy tokens, most recent 4096).
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._known_re: re.Pattern[str] | None = None

    def remember(self, secret: str) -> None:
        """Redact this exact value wherever it appears from now on."""
        if len(secret) < 8:
            return
        with self._lock:
            self._known.pop(secret, None)
            self._known[secret] = None
            while len(self._known) > _MAX_KNOWN_SECRETS:
                self._known.popitem(last=False)
            ordered = sorted(self._known, key=len, reverse=True)
            self._known_re = re.compile("|".join(re.escape(s) for s in ordered))

    def redact(self, text: str) -> str:
        """``text`` with every recognised secret replaced."""
        text = _JSON_SECRET_RE.sub(lambda m: m.group(1) + f'"{_REDACTED}"', text)
        text = _HEADER_ITEM_RE.sub(lambda m: m.group(1) + f"'{_REDACTED}'", text)
        text = _HEADER_LINE_RE.sub(lambda m: m.group(1) + _REDACTED, text)
        text = _SIGNATURE_RE.sub(lambda m: m.group(1) + _REDACTED, text)
        known = self._known_re
        if known is not None:
            text = known.sub(_REDACTED, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        """Replace the message (and drop its args) with the redacted rendering."""
        try:
            message = record.getMessage()
        except Exception:  # a broken record must not break logging
            return True
        redacted = self.redact(message)
        if redacted != message:
            record.msg = redacted
            record.args = None
        return True


_installed: SecretLogFilter | None = None
_install_lock = threading.Lock()


def install_log_redaction() -> SecretLogFilter:
    """Attach the (one, process-wide) filter to the loggers that print request data.

    Loggers are process-wide, so the filter is too; installing twice is a no-op.
    """
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = SecretLogFilter()
            for name in _FILTERED_LOGGERS:
                logging.getLogger(name).addFilter(_installed)
        return _installed


# -- how the runner token reaches a MicroVM ------------------------------------------

RUN_HOOK_PAYLOAD_VERSION = 1


def encode_run_hook_payload(runner_token: str) -> str:
    """RunMicrovm's ``runHookPayload``: what the image's ``/run`` hook hands the runner.

    The payload travels in the authenticated RunMicrovm call and reaches only this
    VM's run hook; the image itself holds no secret.
    """
    return json.dumps(
        {"sandcell": RUN_HOOK_PAYLOAD_VERSION, "runner_token": runner_token},
        separators=(",", ":"),
    )


def decode_run_hook_payload(payload: str) -> str | None:
    """The runner token in a ``runHookPayload``, or None if it carries none."""
    try:
        parsed = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("sandcell") != RUN_HOOK_PAYLOAD_VERSION:
        return None
    token = parsed.get("runner_token")
    return token if isinstance(token, str) and token else None
