"""``/v1/egress``: the sandbox's egress status, and replacing its policy while it runs."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import EgressPolicy, routes

from .base import RouteGroup, json_response


class EgressRoutes(RouteGroup):
    """GET the status; PUT an ``EgressPolicy`` (applies to the next connection)."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(routes.EGRESS, g(self.get_egress), methods=["GET"]),
            Route(routes.EGRESS, g(self.put_egress), methods=["PUT"]),
        ]

    async def get_egress(self, request: Request) -> Response:
        egress = self.service.egress
        # Counts every decision the gateways made before this request.
        await asyncio.to_thread(egress.sync)
        return json_response(egress.status())

    async def put_egress(self, request: Request) -> Response:
        policy = await self.read_message(request, EgressPolicy)
        # Plumbing a link and waiting for the gateways' confirmation block.
        return json_response(await asyncio.to_thread(self.service.egress.replace, policy))


__all__ = ["EgressRoutes"]
