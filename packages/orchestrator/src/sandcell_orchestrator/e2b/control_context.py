"""What every control-plane route shares: the caller's tenant, its sandbox, the answers.

``ControlContext`` resolves a request to its tenant (the API key in ``X-API-KEY``,
or as a bearer key) and to one of that tenant's sandboxes, so every lookup is
scoped by tenant before it is resolved; ``guarded`` turns whatever a route raises
into E2B's error body.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import encode

from ..serve.errors import Endpoint, answered
from .errors import E2bError, e2b_error_response
from .sandboxes import E2bSandbox, E2bSandboxes
from .wire import SandboxCreated

__all__ = [
    "ENVD_VERSION",
    "ControlContext",
    "guarded",
    "iso",
    "json_response",
    "page_limit",
]

ENVD_VERSION = "0.6.4"
"""The envd version announced: the SDK enables every feature served here from it."""

_JSON = "application/json"
_MAX_LIMIT = 100


def iso(epoch_s: float) -> str:
    """``epoch_s`` as the RFC 3339 time (UTC) E2B's bodies carry."""
    return datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC).isoformat()


def json_response(
    value: object, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``value`` encoded as a JSON answer."""
    return Response(encode(value), status_code=status, media_type=_JSON, headers=headers)


def page_limit(request: Request) -> int:
    """A listing's ``limit`` (1..100, default 100); anything else is a 400."""
    raw_limit = request.query_params.get("limit") or str(_MAX_LIMIT)
    # ASCII digits, few of them: ``isdigit`` alone takes '²' (which ``int`` refuses)
    # and other scripts' digits, and ``int`` refuses a string of over 4300 digits.
    digits = raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 3
    if not digits or not 1 <= int(raw_limit) <= _MAX_LIMIT:
        raise E2bError(400, "bad_request", f"limit: must be 1..{_MAX_LIMIT}")
    return int(raw_limit)


def guarded(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` answering any exception it raises as E2B's error body."""
    return answered(endpoint, e2b_error_response)


@dataclass(frozen=True, kw_only=True)
class ControlContext:
    """The sandbox table the routes serve, how a key names its tenant, and the domain
    announced to the SDK."""

    sandboxes: Callable[[], E2bSandboxes]
    namespace_of_key: Callable[[str | None], str]
    domain: str | None

    def owner(self, request: Request) -> str:
        """The tenant the request's API key names."""
        key = request.headers.get("x-api-key")
        if key is None:
            scheme, _, credential = request.headers.get("authorization", "").partition(" ")
            key = credential if scheme.lower() == "bearer" else None
        return self.namespace_of_key(key)

    async def one(self, request: Request) -> E2bSandbox:
        """The caller's sandbox named by the path's ``sandbox_id`` (another tenant's
        answers as a missing one)."""
        owner = self.owner(request)
        return await self.sandboxes().get(str(request.path_params["sandbox_id"]), owner=owner)

    def created(self, sandbox: E2bSandbox) -> SandboxCreated:
        """What a create, connect, resume or fork answers for ``sandbox``."""
        return SandboxCreated(
            templateID=sandbox.template_id,
            alias=sandbox.alias,
            sandboxID=sandbox.sandbox_id,
            clientID="sandcell",
            envdVersion=ENVD_VERSION,
            envdAccessToken=sandbox.access_token,
            trafficAccessToken=sandbox.traffic_token,
            domain=self.domain,
        )
