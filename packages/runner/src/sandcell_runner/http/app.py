"""The runner's ASGI app: every route group on one Starlette, and the runner's lifespan.

Every route but ``/health`` needs the bearer token. Unknown routes, wrong methods
and unhandled errors answer the protocol's error body like every other error.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import ErrorCode, error_body

from ..service import RunnerService
from .apps import AppRoutes
from .base import RunnerStarlette, json_response
from .contexts import ContextRoutes
from .egress import EgressRoutes
from .execute import ExecuteRoutes
from .files import FileRoutes
from .health import HealthRoutes
from .inputs import InputRoutes
from .preview import PreviewRoutes
from .sandbox import SandboxRoutes
from .session import SessionRoutes

log = logging.getLogger(__name__)


def create_app(service: RunnerService) -> Starlette:
    """The ASGI app of a runner."""
    preview = PreviewRoutes(service)
    execute = ExecuteRoutes(service)
    groups = [
        HealthRoutes(service),
        execute,
        SessionRoutes(service),
        FileRoutes(service),
        InputRoutes(service),
        AppRoutes(service),
        ContextRoutes(service),
        SandboxRoutes(service),
        EgressRoutes(service),
        preview,
    ]

    def lifespan(app: Starlette) -> AbstractAsyncContextManager[None]:
        return service.running()

    return RunnerStarlette(
        routes=[route for group in groups for route in group.routes()],
        upgrade=preview.upgrade,
        direct=execute.direct(),
        internal=_internal,
        lifespan=lifespan,
        exception_handlers={
            404: _not_found,
            405: _method_not_allowed,
            500: _internal,
        },
    )


async def _not_found(request: Request, exc: Exception) -> Response:
    return json_response(error_body(ErrorCode.NOT_FOUND, "no such route"), 404)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return json_response(error_body(ErrorCode.BAD_REQUEST, "method not allowed"), 405)


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response(error_body(ErrorCode.INTERNAL, "internal error"), 500)


__all__ = ["create_app"]
