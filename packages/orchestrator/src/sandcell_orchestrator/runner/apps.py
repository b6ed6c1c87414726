"""What ``RunnerClient``'s app routes (processes, logs, diagnostics, the port proxy) share.

Every app route goes through the client's ``RunnerConnection`` (bearer token,
``X-Runtime-Session-Id``, protocol, request id; the protocol checked on first
contact), so through the one pooled ``httpx.AsyncClient`` with its transport,
the injected ``httpx.Auth`` (behind ``HeaderGuard``), the error maps and the
``Redactor``.

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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import httpx

from sandcell_protocol.app_messages import port_path, process_path

from ..errors import RunnerRequestError
from .errors import refused_before_sending

__all__ = [
    "ANALYSIS_TIMEOUT_S",
    "PORT_READ_TIMEOUT_S",
    "WebSocketUpgrade",
    "no_plain_upgrade",
    "port_route",
    "tag_route",
    "upgrade_headers",
    "ws_url",
]


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


def tag_route(tag: str, suffix: Literal["", "logs", "stdin"] = "") -> str:
    try:
        return process_path(tag, suffix)
    except ValueError as exc:
        raise refused_before_sending("bad_request", str(exc)) from None


def port_route(port: int, raw_path: str, query: str) -> str:
    try:
        route = port_path(port, raw_path)
    except ValueError as exc:
        raise refused_before_sending("bad_request", str(exc)) from None
    return route + (f"?{query}" if query else "")


def ws_url(url: httpx.URL) -> str:
    return str(url.copy_with(scheme="wss" if url.scheme == "https" else "ws"))


def upgrade_headers(request: httpx.Request) -> dict[str, str]:
    return {
        name: value
        for name, value in request.headers.items()
        if name.lower() not in _NOT_FOR_UPGRADE and not name.lower().startswith("sec-websocket-")
    }


def no_plain_upgrade(base_url: str) -> RunnerRequestError:
    why = "would bypass the injected transport this runner is reached through"
    return refused_before_sending("bad_request", f"a WebSocket upgrade to {base_url} {why}")
