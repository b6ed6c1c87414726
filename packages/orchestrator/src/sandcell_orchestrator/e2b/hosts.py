"""E2B's production addressing, routed by ``Host`` onto the ``/e2b`` prefixes.

With ``E2B_DOMAIN=<domain>`` (and no ``E2B_API_URL``/``E2B_SANDBOX_URL``) the SDK
calls ``https://api.<domain>/…`` for the control plane and
``https://<port>-<sandboxID>.<domain>/…`` for a sandbox's port. Behind a TLS
terminator with a wildcard certificate and wildcard DNS for ``<domain>``, this
middleware rewrites such requests to ``/e2b/…`` and ``/e2b/sandbox/…`` (adding the
``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers), so both forms reach the
same routes. Any other ``Host`` passes through unchanged.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["E2bHostRouting"]

_SANDBOX_HOST_RE = re.compile(r"([0-9]{1,5})-([a-z0-9]{1,64})")


class E2bHostRouting:
    """Pure ASGI middleware: ``Host``-routed E2B requests onto the path-routed ones."""

    def __init__(self, app: ASGIApp, *, domain: str) -> None:
        self.app = app
        self.domain = domain.lower().rstrip(".")

    def _host(self, scope: Scope) -> str:
        for name, value in scope.get("headers", ()):
            if name == b"host":
                host: str = value.decode("latin-1").lower()
                return host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = self._host(scope)
            suffix = "." + self.domain
            if host == "api" + suffix:
                scope = _prefixed(scope, "/e2b")
            elif host.endswith(suffix):
                match = _SANDBOX_HOST_RE.fullmatch(host[: -len(suffix)])
                if match is not None:
                    port, sandbox_id = match.groups()
                    scope = _prefixed(scope, "/e2b/sandbox")
                    headers = [
                        (k, v)
                        for k, v in scope["headers"]
                        if k not in (b"e2b-sandbox-id", b"e2b-sandbox-port")
                    ]
                    headers += [
                        (b"e2b-sandbox-id", sandbox_id.encode()),
                        (b"e2b-sandbox-port", port.encode()),
                    ]
                    scope["headers"] = headers
        await self.app(scope, receive, send)


def _prefixed(scope: Scope, prefix: str) -> Scope:
    scope = dict(scope)
    scope["path"] = prefix + scope["path"]
    raw = scope.get("raw_path")
    if raw is not None:
        scope["raw_path"] = prefix.encode() + raw
    return scope
