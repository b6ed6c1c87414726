"""E2B's control plane under ``/e2b``: the sandbox lifecycle, as the ``e2b`` SDK calls it.

One router over three groups of routes, each in the module that owns it:

- ``sandbox_routes.py``: ``/v2/sandboxes`` and ``/sandboxes`` (create, the two
  listings), ``/sandboxes/{id}`` (detail, kill, timeout, network, pause, resume)
  and ``/v2/sandboxes/{id}/connect``;
- ``metric_routes.py``: ``/sandboxes/{id}/metrics``;
- ``snapshot_routes.py``: ``/sandboxes/{id}/snapshots``, ``/sandboxes/{id}/fork``,
  ``/snapshots`` and ``/templates/{snapshot id}``.

What they share (the caller's tenant, its sandbox, the JSON answers, the error
guard) is ``control_context.py``. The API key comes in ``X-API-KEY`` (or as a
bearer key) and names the tenant; every lookup is scoped by it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from starlette.routing import BaseRoute

from .control_context import ENVD_VERSION, ControlContext
from .metric_routes import MetricRoutes
from .sandbox_routes import SandboxRoutes
from .sandboxes import E2bSandboxes
from .snapshot_routes import SnapshotRoutes

__all__ = ["ENVD_VERSION", "ControlPlane"]


class _RouteGroup(Protocol):
    def routes(self, prefix: str) -> list[BaseRoute]: ...


class ControlPlane:
    """The control-plane routes over one ``E2bSandboxes`` table."""

    def __init__(
        self,
        sandboxes: Callable[[], E2bSandboxes],
        *,
        namespace_of_key: Callable[[str | None], str],
        domain: str | None,
    ) -> None:
        context = ControlContext(
            sandboxes=sandboxes, namespace_of_key=namespace_of_key, domain=domain
        )
        self._groups: tuple[_RouteGroup, ...] = (
            SandboxRoutes(context),
            MetricRoutes(context),
            SnapshotRoutes(context),
        )

    def routes(self, prefix: str = "/e2b") -> list[BaseRoute]:
        """Every control-plane route under ``prefix``."""
        return [route for group in self._groups for route in group.routes(prefix)]
