"""``/health`` (the one route without the token: load balancers and the orchestrator's
first contact) and ``/v1/languages``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import Language, Languages, routes

from .base import RouteGroup, json_response


class HealthRoutes(RouteGroup):
    """What the runner is and what it offers."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(routes.HEALTH, g(self.get_health, auth=False), methods=["GET"]),
            Route(routes.LANGUAGES, g(self.get_languages), methods=["GET"]),
        ]

    async def get_health(self, request: Request) -> Response:
        return json_response(self.service.health())

    async def get_languages(self, request: Request) -> Response:
        return json_response(
            Languages(
                languages=[
                    Language(
                        name=spec.name,
                        version=spec.version,
                        contexts=spec.name in self.service.contexts.languages,
                    )
                    for spec in self.service.languages.values()
                ]
            )
        )


__all__ = ["HealthRoutes"]
