"""``/v1/inputs/probe`` and ``/v1/inputs``: which inputs the cache lacks, and pushing them.

Neither needs a session; when the request names one, the runner binds to it
first, as every session-naming call does.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import (
    InputProbe,
    InputProbeResult,
    InputUploadResult,
    ProtocolError,
    routes,
    validate_workspace_path,
)

from ..errors import InvalidPathError
from .base import RouteGroup, json_response


class InputRoutes(RouteGroup):
    """Probe and upload of the input cache."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(routes.INPUTS_PROBE, g(self.post_probe), methods=["POST"]),
            Route(routes.INPUTS, g(self.post_inputs), methods=["POST"]),
        ]

    async def _bind_if_named(self, request: Request) -> None:
        session_id = self.session_header(request)
        if session_id is not None:
            await self.sessions.bind(session_id)

    async def post_probe(self, request: Request) -> Response:
        await self._bind_if_named(request)
        probe = await self.read_message(request, InputProbe)
        for ref in probe.refs:
            try:
                validate_workspace_path(ref.name)
            except ProtocolError as exc:
                raise InvalidPathError(f"invalid file name {ref.name[:200]!r}: {exc}") from None
        missing = await asyncio.to_thread(self.service.inputs.missing, list(probe.refs))
        return json_response(InputProbeResult(missing=missing))

    async def post_inputs(self, request: Request) -> Response:
        await self._bind_if_named(request)
        stored = await self.service.inputs.ingest(
            request.stream(),
            request.headers.get("content-type", ""),
            max_total_bytes=self.settings.input_max_object_bytes,
        )
        return json_response(InputUploadResult(stored=stored))


__all__ = ["InputRoutes"]
