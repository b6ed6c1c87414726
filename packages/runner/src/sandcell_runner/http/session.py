"""Routes of the bound session as a whole: its checkpoint out, a restore in, its release."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from sandcell_protocol import headers, is_runtime_session_id, routes

from ..checkpoint.compression import choose_encoding
from ..checkpoint.selection import WorkspaceSelection
from ..errors import BadRequestError
from .base import RouteGroup, json_response

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class SessionRoutes(RouteGroup):
    """Checkpoint, restore and release."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(routes.SESSION_CHECKPOINT, g(self.get_checkpoint), methods=["GET"]),
            Route(routes.SESSION_RESTORE, g(self.post_restore), methods=["POST"]),
            Route(routes.SESSION, g(self.delete_session), methods=["DELETE"]),
        ]

    async def get_checkpoint(self, request: Request) -> Response:
        session_id = self.required_session(request)
        encoding = choose_encoding(request.headers.get("accept-encoding"))
        selection = WorkspaceSelection.parse(
            request.query_params.getlist("include"), request.query_params.getlist("exclude")
        )
        chunks = await self.service.checkpoints.export(
            session_id, encoding=encoding, selection=selection
        )
        media = routes.ZSTD if encoding == "zstd" else routes.GZIP
        return StreamingResponse(chunks, media_type=media)

    async def post_restore(self, request: Request) -> Response:
        session_id = self.required_session(request)
        expected = request.headers.get(headers.CHECKPOINT_SHA256)
        if expected is not None and not _SHA256_RE.fullmatch(expected):
            raise BadRequestError(f"{headers.CHECKPOINT_SHA256} must be 64 lowercase hex digits")
        taken_of = request.headers.get(headers.CHECKPOINT_FROM)
        if taken_of is not None and not is_runtime_session_id(taken_of):
            raise BadRequestError(f"{headers.CHECKPOINT_FROM} must be a runtime session id")
        result = await self.service.checkpoints.restore(
            session_id, request.stream(), expected_sha256=expected, taken_of=taken_of
        )
        return json_response(result)

    async def delete_session(self, request: Request) -> Response:
        self.sessions.require_enabled()
        await self.sessions.release(self.session_header(request))
        return Response(status_code=204)


__all__ = ["SessionRoutes"]
