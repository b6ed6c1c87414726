"""The app-instance API on ``sandcell serve`` (bearer API key; errors are ``ErrorBody``).

    POST   /v1/instances                     CreateInstance -> InstanceCreated
    GET    /v1/instances                     InstanceList (the caller's namespace)
    GET    /v1/instances/{id}                InstanceInfo
    DELETE /v1/instances/{id}                204: dev server stopped, sandbox destroyed
    POST   /v1/instances/{id}/files          WriteFiles -> FilesWritten
    POST   /v1/instances/{id}/commands       RunCommands -> CommandResults (policy first)
    GET    /v1/instances/{id}/analysis       AnalysisResult
    GET    /v1/instances/{id}/runtime-errors RuntimeErrors (?since=epoch seconds)
    DELETE /v1/instances/{id}/runtime-errors 204
    GET    /v1/instances/{id}/logs           LogLines (?lines=N&filter=regex)
    *      /preview/{id}/{path}              the dev server (preview token, see preview.py)

Wiring into the serve app (``service_app.create_app``)::

    install_app_routes(app, settings, services=lambda: service.services,
                       namespace_of=service.keys.namespace)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import ERROR_SEMANTICS, ErrorBody, ErrorCode, decode, encode

from ..bootstrap import Services
from ..config import OrchestratorSettings
from ..errors import SandcellError
from ..serve.errors import JSON_MEDIA_TYPE, Endpoint, explained, guarded, read_body
from ..serve.lifespans import run_in_lifespan
from .errors import AppRequestError, InstanceStartError
from .instance import Instance
from .instances import AppInstances
from .lifecycle import InstanceSupervisor
from .messages import CreateInstance, InstanceInfo, InstanceList, RunCommands, WriteFiles
from .policy import CommandDeniedError
from .preview import PreviewProxy
from .provision import DEV_TAG
from .settings import AppSettings
from .templates import TemplateError, TemplateNotFoundError, TemplateRegistry
from .webhooks import WebhookSender

__all__ = ["AppService", "install_app_routes"]


# The app errors whose ``public_detail`` is the caller's to read: built from the
# caller's own request, the command policy's words, or the caller's app's output.
_DETAILED = (AppRequestError, CommandDeniedError, TemplateNotFoundError, InstanceStartError)
_REFUSED = "the request was refused"


def app_error(exc: BaseException) -> tuple[int, ErrorBody] | None:
    """The status and body of the app API's own errors; ``None`` for anything else.

    As in ``map_error``, the caller gets a stable code and what failed; the error as
    raised (a template's source or clone URL, a runner's route) goes to the log.
    """
    if isinstance(exc, AppRequestError):
        status, code, says = ERROR_SEMANTICS[exc.code].http_status, exc.code, _REFUSED
    elif isinstance(exc, CommandDeniedError):
        status, code, says = 400, ErrorCode.BAD_REQUEST, "a command was refused"
    elif isinstance(exc, TemplateNotFoundError):
        status, code, says = 400, ErrorCode.BAD_REQUEST, "no such template"
    elif isinstance(exc, InstanceStartError):
        # The template's own failure (its output is the caller's to read), not a bug here.
        status, code, says = 500, ErrorCode.INTERNAL, "the app did not start"
    elif isinstance(exc, TemplateError):
        status, code, says = 500, ErrorCode.INTERNAL, "the template could not be loaded"
    else:
        return None
    return explained(exc, status, code, says, detailed=_DETAILED)


class AppService:
    """The app-instance API's routes and the lifespan that runs its instances."""

    def __init__(
        self,
        settings: OrchestratorSettings,
        *,
        namespace_of: Callable[[Request], str],
        app_settings: AppSettings | None = None,
    ) -> None:
        self.settings = settings
        self.app_settings = app_settings or settings.apps
        self._namespace_of = namespace_of
        self._instances: AppInstances | None = None
        self._supervisor: InstanceSupervisor | None = None
        self.preview = PreviewProxy(lambda: self.instances, on_browser_report=self._poke)

    def __repr__(self) -> str:
        return f"AppService(running={self._instances is not None})"

    @property
    def instances(self) -> AppInstances:
        if self._instances is None:
            raise RuntimeError("the app-instance API is not started (its lifespan has not run)")
        return self._instances

    @property
    def supervisor(self) -> InstanceSupervisor:
        if self._supervisor is None:
            raise RuntimeError("the app-instance API is not started (its lifespan has not run)")
        return self._supervisor

    def _poke(self) -> None:
        if self._supervisor is not None:
            self._supervisor.poke()

    @contextlib.asynccontextmanager
    async def running(self, services: Services) -> AsyncIterator[AppInstances]:
        """Run instances on ``services`` for the block; every instance is shut down after."""
        config = self.app_settings
        async with contextlib.AsyncExitStack() as stack:
            webhooks = None
            if config.webhook_secret is not None:
                webhooks = WebhookSender(
                    secret=config.webhook_secret, allow_nets=config.webhook_allow_nets
                )
                await stack.enter_async_context(webhooks)
            instances = AppInstances(
                services.manager,
                templates=TemplateRegistry(config.templates),
                settings=config,
                webhooks=webhooks,
            )
            stack.push_async_callback(instances.aclose)
            supervisor = InstanceSupervisor(instances)
            await stack.enter_async_context(supervisor.running())
            self._instances, self._supervisor = instances, supervisor
            try:
                yield instances
            finally:
                self._instances = self._supervisor = None

    # -- plumbing --------------------------------------------------------------------

    @staticmethod
    def _guard(endpoint: Endpoint) -> Endpoint:
        return guarded(endpoint, extra=app_error)

    def routes(self) -> list[BaseRoute]:
        """Every route of the API and the preview."""
        guard = self._guard
        base = "/v1/instances"
        one = base + "/{instance_id}"
        return [
            Route(base, guard(self.create), methods=["POST"]),
            Route(base, guard(self.list_instances), methods=["GET"]),
            Route(one, guard(self.info), methods=["GET"]),
            Route(one, guard(self.destroy), methods=["DELETE"]),
            Route(one + "/files", guard(self.write_files), methods=["POST"]),
            Route(one + "/commands", guard(self.run_commands), methods=["POST"]),
            Route(one + "/analysis", guard(self.analysis), methods=["GET"]),
            Route(one + "/runtime-errors", guard(self.runtime_errors), methods=["GET"]),
            Route(one + "/runtime-errors", guard(self.clear_errors), methods=["DELETE"]),
            Route(one + "/logs", guard(self.logs), methods=["GET"]),
            *self.preview.routes(),
        ]

    # -- endpoints ----------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        body = decode(await read_body(request), CreateInstance)
        created = await self.instances.create(body, owner=owner)
        return _json(created, status=201)

    async def list_instances(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        found = [self._info(item) for item in self.instances.owned_by(owner)]
        return _json(InstanceList(instances=found))

    async def info(self, request: Request) -> Response:
        """One instance, with its dev server's state asked of the runner."""
        owner = self._namespace_of(request)
        instance = self.instances.get(_id(request), owner=owner)
        dev_server: Any = "unknown"
        with contextlib.suppress(SandcellError):
            process = await instance.runner.process(DEV_TAG)
            dev_server = process.state if process is not None else "exited"
        return _json(self._info(instance, dev_server=dev_server))

    def _info(self, instance: Instance, *, dev_server: Any = "unknown") -> InstanceInfo:
        # Not a touch: looking at an instance is not using it.
        status: Any = instance.status if instance.status != "stopped" else "degraded"
        return InstanceInfo(
            instance_id=instance.instance_id,
            template=instance.template,
            project_name=instance.project_name,
            status=status,
            dev_server=dev_server,
            idle_s=round(self.instances.clock() - instance.last_active, 3),
        )

    async def destroy(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        await self.instances.destroy(_id(request), owner=owner)
        return Response(status_code=204)

    async def write_files(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        instance_id = _id(request)
        self.instances.get(instance_id, owner=owner)
        body = decode(await read_body(request), WriteFiles)
        return _json(await self.instances.write_files(instance_id, body, owner=owner))

    async def run_commands(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        instance_id = _id(request)
        self.instances.get(instance_id, owner=owner)
        body = decode(await read_body(request), RunCommands)
        return _json(await self.instances.run_commands(instance_id, body, owner=owner))

    async def analysis(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        return _json(await self.instances.analysis(_id(request), owner=owner))

    async def runtime_errors(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        since = _query_number(request, "since", float)
        found = await self.instances.runtime_errors(_id(request), owner=owner, since=since)
        return _json(found)

    async def clear_errors(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        await self.instances.clear_runtime_errors(_id(request), owner=owner)
        return Response(status_code=204)

    async def logs(self, request: Request) -> Response:
        owner = self._namespace_of(request)
        lines = _query_number(request, "lines", int)
        pattern = request.query_params.get("filter")
        found = await self.instances.logs(_id(request), owner=owner, lines=lines, filter=pattern)
        return _json(found)


def install_app_routes(
    app: Starlette,
    settings: OrchestratorSettings,
    *,
    services: Callable[[], Services],
    namespace_of: Callable[[Request], str],
    app_settings: AppSettings | None = None,
) -> AppService:
    """Add the app-instance routes to ``app`` and run its instances inside ``app``'s lifespan.

    ``services`` is called once the app's own lifespan has opened them;
    ``namespace_of`` authenticates a request (bearer API key -> tenant namespace).
    The returned ``AppService`` is also ``app.state.apps``.
    """
    service = AppService(settings, namespace_of=namespace_of, app_settings=app_settings)
    app.router.routes.extend(service.routes())
    app.state.apps = service
    run_in_lifespan(app, lambda: service.running(services()))
    return service


def _id(request: Request) -> str:
    value: str = request.path_params["instance_id"]
    return value


def _json(value: object, *, status: int = 200) -> Response:
    return Response(encode(value), status_code=status, media_type=JSON_MEDIA_TYPE)


def _query_number(request: Request, name: str, kind: type[int] | type[float]) -> Any:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        raise AppRequestError(f"{name}: expected a number, got {raw[:40]!r}") from None
