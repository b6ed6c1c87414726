"""E2B's API on ``sandcell serve``: the control plane and envd, so E2B's SDKs run unchanged.

One adapter (DESIGN rule 7): ``control.py`` (``/e2b``, its routes in ``*_routes.py``)
and ``envd.py`` (``/e2b/sandbox``, routed by ``E2b-Sandbox-Id``) translate E2B's wire onto
``E2bSandboxes`` (``sandboxes.py``), which holds sandboxes as ``SandboxManager``
sessions, listed in the registry's E2B table (so any worker serves any sandbox);
envd's RPCs are served from the generated Connect code the ``e2b`` package ships.
``hosts.py`` maps E2B's production form (``api.{domain}``, ``{port}-{id}.{domain}``,
routed by ``Host``) onto the same prefixes.

Wiring into the serve app::

    install_e2b_routes(app, settings, services=lambda: service.services,
                       namespace_of_key=service.keys.namespace_of_key,
                       idempotency=service.idempotency)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount

from ..bootstrap import Services
from ..config import OrchestratorSettings
from ..errors import SandcellError
from ..serve.idempotency import Idempotency
from ..serve.lifespans import run_in_lifespan
from .control import ControlPlane
from .envd import EnvdApp
from .errors import e2b_route_error_response
from .hosts import E2bHostRouting
from .sandboxes import E2bSandboxes
from .signing import ACCESS_LOG_SECRET_PARAMETERS

__all__ = ["ACCESS_LOG_SECRET_PARAMETERS", "E2bService", "install_e2b_routes"]

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 0.5


class E2bService:
    """The E2B surface's state: its sandbox table, made in the app's lifespan."""

    def __init__(
        self,
        *,
        max_running_per_tenant: int = 32,
        max_snapshots_per_tenant: int = 100,
        keep_at_exit: bool = False,
    ) -> None:
        self._max_running = max_running_per_tenant
        self._max_snapshots = max_snapshots_per_tenant
        self._keep_at_exit = keep_at_exit
        self._sandboxes: E2bSandboxes | None = None

    @property
    def sandboxes(self) -> E2bSandboxes:
        if self._sandboxes is None:
            raise RuntimeError("the E2B API is not started (its lifespan has not run)")
        return self._sandboxes

    @contextlib.asynccontextmanager
    async def running(self, services: Services) -> AsyncIterator[E2bSandboxes]:
        """Serve sandboxes on ``services`` for the block; after it, every sandbox is killed
        unless they outlive this worker (a distributed registry: other workers serve them)."""
        sandboxes = E2bSandboxes(
            services.manager,
            max_running_per_tenant=self._max_running,
            max_snapshots_per_tenant=self._max_snapshots,
            keep_at_exit=self._keep_at_exit,
        )
        self._sandboxes = sandboxes
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._expire_forever, sandboxes)
                try:
                    yield sandboxes
                finally:
                    group.cancel_scope.cancel()
        finally:
            self._sandboxes = None
            await sandboxes.aclose()

    @staticmethod
    async def _expire_forever(sandboxes: E2bSandboxes) -> None:
        while True:
            await anyio.sleep(EXPIRY_INTERVAL_S)
            try:
                await sandboxes.expire()
            except SandcellError as exc:
                log.warning("e2b timeout sweep failed: %s", exc)
            except Exception:
                log.exception("e2b timeout sweep failed")


def install_e2b_routes(
    app: Starlette,
    settings: OrchestratorSettings,
    *,
    services: Callable[[], Services],
    namespace_of_key: Callable[[str | None], str],
    idempotency: Idempotency | None = None,
) -> E2bService:
    """Add ``/e2b`` and ``/e2b/sandbox`` to ``app``; run the sandboxes in its lifespan.

    ``idempotency`` (the serve app's) is what the code interpreter's ``/execute``
    claims an ``Idempotency-Key`` on; None: it is not honoured there.

    With ``SANDCELL_E2B_DOMAIN`` set, requests for ``api.{domain}`` and
    ``{port}-{id}.{domain}`` are routed there by ``Host`` as well;
    ``SANDCELL_E2B_MAX_SANDBOXES`` caps each tenant's running sandboxes,
    ``SANDCELL_E2B_MAX_SNAPSHOTS`` its snapshots.
    """
    service = E2bService(
        max_running_per_tenant=settings.serve.e2b_max_running,
        max_snapshots_per_tenant=settings.serve.e2b_max_snapshots,
        keep_at_exit=settings.distributed_registry,
    )
    domain = settings.serve.e2b_domain
    control = ControlPlane(
        lambda: service.sandboxes, namespace_of_key=namespace_of_key, domain=domain
    )
    # envd first: /e2b/sandbox/... must not reach the control plane's /e2b routes.
    envd = EnvdApp(lambda: service.sandboxes, idempotency=idempotency)
    app.router.routes.append(Mount("/e2b/sandbox", app=envd))
    app.router.routes.extend(control.routes("/e2b"))
    if domain is not None:
        app.add_middleware(E2bHostRouting, domain=domain)
    _answer_unrouted_as_e2b(app, prefix="/e2b")
    app.state.e2b = service
    run_in_lifespan(app, lambda: service.running(services()))
    return service


def _answer_unrouted_as_e2b(app: Starlette, *, prefix: str) -> None:
    """The app's 404 and 405 for a path under ``prefix`` in E2B's error shape (an SDK
    parses ``message`` from it); every other path keeps the app's own handler."""
    fallback = app.exception_handlers.get(HTTPException)

    async def handler(request: Request, exc: Exception) -> Response:
        path = request.url.path
        if isinstance(exc, HTTPException) and (path == prefix or path.startswith(prefix + "/")):
            return e2b_route_error_response(request, exc)
        if fallback is None:
            raise exc
        answer = fallback(request, exc)
        if inspect.isawaitable(answer):
            answer = await answer
        assert isinstance(answer, Response)
        return answer

    app.add_exception_handler(HTTPException, handler)
