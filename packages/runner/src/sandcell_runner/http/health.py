"""``/health`` (the one route open without the token) and ``/v1/languages``.

Without a bearer token ``/health`` answers only what a load balancer needs
(``HealthSummary``: status and protocol); with the token, the whole ``Health``
(bound session, warmup, languages, warnings). A wrong token is a 401, so a
misconfigured orchestrator learns so at its first contact.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import HealthSummary, Language, Languages, headers, routes

from ..languages import LanguageVersions
from ..service import RunnerService
from .base import RouteGroup, json_response


class HealthRoutes(RouteGroup):
    """What the runner is and what it offers."""

    def __init__(self, service: RunnerService) -> None:
        super().__init__(service)
        self._versions = LanguageVersions(service.languages)

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(routes.HEALTH, g(self.get_health, auth=False), methods=["GET"]),
            Route(routes.LANGUAGES, g(self.get_languages), methods=["GET"]),
        ]

    async def get_health(self, request: Request) -> Response:
        health = self.service.health()
        if self.settings.token is not None and headers.AUTHORIZATION not in request.headers:
            return json_response(HealthSummary(status=health.status, protocol=health.protocol))
        self.authorize(request)
        return json_response(health)

    async def get_languages(self, request: Request) -> Response:
        versions = await self._versions.get()
        return json_response(
            Languages(
                languages=[
                    Language(
                        name=spec.name,
                        version=versions[spec.name],
                        contexts=spec.name in self.service.contexts.languages,
                    )
                    for spec in self.service.languages.values()
                ]
            )
        )


__all__ = ["HealthRoutes"]
