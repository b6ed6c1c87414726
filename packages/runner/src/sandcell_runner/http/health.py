"""``/health`` (the one route open without the token) and ``/v1/languages``.

Without a bearer token ``/health`` answers only what a load balancer needs
(``HealthSummary``: status and protocol); with the token, the whole ``Health``
(bound session, warmup, languages, warnings, and to a peer of protocol 1.3 or later
the limits that bound this runner's answers). A wrong token is a 401, so a
misconfigured orchestrator learns so at its first contact.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import (
    LIMITS_SINCE,
    HealthSummary,
    Language,
    Languages,
    RunnerLimits,
    headers,
    routes,
    speaks_at_least,
)

from ..config import RunnerSettings
from ..languages import LanguageVersions
from ..service import RunnerService
from .base import RouteGroup, json_response


class HealthRoutes(RouteGroup):
    """What the runner is and what it offers."""

    def __init__(self, service: RunnerService) -> None:
        super().__init__(service)
        self._versions = LanguageVersions(service.languages)
        self._limits = stated_limits(service.settings)

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
        # An older peer decodes Health strictly: a field it does not know fails it.
        if speaks_at_least(request.headers.get(headers.PROTOCOL), LIMITS_SINCE):
            health = msgspec.structs.replace(health, limits=self._limits)
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


def stated_limits(settings: RunnerSettings) -> RunnerLimits:
    """The limits ``Health`` states: what bounds this runner's answers."""
    limits = settings.limits
    return RunnerLimits(
        timeout_ms=limits.timeout_ms,
        max_timeout_ms=limits.max_timeout_ms,
        stdout_bytes=limits.stdout_bytes,
        max_stdout_bytes=limits.max_stdout_bytes,
        stderr_bytes=limits.stderr_bytes,
        max_stderr_bytes=limits.max_stderr_bytes,
        max_body_bytes=settings.max_body_bytes,
        output_inline_bytes=settings.output_inline_bytes,
        max_output_files=settings.max_output_files,
        output_scan_bytes=settings.output_scan_bytes,
        checkpoint_max_bytes=settings.checkpoint_max_bytes,
        input_max_object_bytes=settings.input_max_object_bytes,
    )


__all__ = ["HealthRoutes", "stated_limits"]
