"""``sandcell serve``: the orchestrator as an HTTP service for control planes.

Routes (JSON bodies are ``sandcell_protocol`` messages; every error is an ``ErrorBody``):

    POST   /v1/exec             ExecCall -> ExecuteResult       bearer API key
                                (Accept: application/x-ndjson: StreamEvent lines, see stream.py;
                                Idempotency-Key: a retry gets the first answer, idempotency.py)
    GET    /v1/sessions         SessionList (this namespace's)  bearer API key
                                (?limit=&after=: a page at a time, session_list.py)
    DELETE /v1/sessions/{id}    204, or 404 if not this tenant's bearer API key
    PUT    /v1/sessions/{id}/egress  EgressPolicy -> EgressStatus  bearer API key
                                (its running sandbox's policy, at once; 404 as DELETE)
    POST   /v1/run, /v1/sessions/{id}/contexts[...]   code contexts (serve/contexts.py)
    GET    /healthz             {"status": "ok"}                no auth
    GET    /metrics             Prometheus text                 no auth (aggregate counters)

Each API key (``SANDCELL_API_KEYS``) maps to a tenant namespace; the namespace
comes from the key, never from the body, so one tenant cannot name another's
session. Session records do not carry a namespace, so ``/v1/exec`` and
``/v1/run`` index each session they are given in the registry's session index
(session id -> namespace, user, hint): with a Redis registry every worker lists
and finds every session, whichever worker ran it. The index is kept in the
snapshot store too (``sessions/owners.py``), so a registry that lost its data
still lists, and deletes, every session whose checkpoint the store holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sandcell_protocol import (
    EgressPolicy,
    ErrorCode,
    ExecCall,
    ExecuteRequest,
    ExecuteResult,
    ProtocolError,
    ResultEvent,
    decode,
    encode,
    encode_event,
    is_runtime_session_id,
    routes,
    runtime_session_id,
)

from ..bootstrap import Services, open_services
from ..config import OrchestratorSettings
from ..errors import ConfigError, SandboxNotFoundError, SandcellError
from ..extras import needs_extra
from ..metrics import render_provider_counters
from ..registry import SessionOwner
from ..sessions.execution import ExecutionService, Identity
from ..sessions.output import OnOutput
from ..stored import StoredDecoder
from .auth import INSECURE_NO_AUTH_ENV, load_api_keys
from .contexts import ContextRoutes
from .errors import (
    JSON_MEDIA_TYPE,
    MAX_BODY_BYTES,
    error_response,
    guarded,
    http_error_response,
    map_error,
    read_body,
)
from .idempotency import Idempotency, IdempotencyConflict, Replay, idempotency_key, replayed
from .redaction import ERROR_LOGGER, quiet_handshakes, redact_access_log
from .session_list import SessionInfo, SessionList, list_sessions, page_of
from .stream import run_until_disconnect, stream_turn, wants_stream

__all__ = [
    "INSECURE_NO_AUTH_ENV",
    "MAX_BODY_BYTES",
    "SessionInfo",
    "SessionList",
    "create_app",
    "map_error",
    "serve",
]

log = logging.getLogger(__name__)


_STORED_RESULT = StoredDecoder(ExecuteResult)


def _replay_exec(stored: Replay, *, stream: bool) -> Response:
    """A stored ``/v1/exec`` answer, in the form this retry asked for."""
    if not stream:
        return Response(stored.body, status_code=stored.status, media_type=JSON_MEDIA_TYPE)
    # Stored by whichever worker ran it: maybe a newer one, with fields this one lacks.
    event = ResultEvent(result=_STORED_RESULT.decode(stored.body))
    return Response(encode_event(event), media_type=routes.NDJSON)


def _execute_request(call: ExecCall) -> ExecuteRequest:
    """The runner's part of an ``ExecCall`` (the runner refuses unknown fields)."""
    fields = msgspec.structs.asdict(call)
    del fields["user_id"], fields["runtime_session_hint"], fields["egress"]
    return ExecuteRequest(**fields)


class _Service:
    """The app's state: set up in the lifespan, never module-global."""

    def __init__(self, settings: OrchestratorSettings, services: Services | None) -> None:
        self.settings = settings
        self.keys = load_api_keys(settings)
        self._given = services
        self._services = services
        self.idempotency = Idempotency(
            lambda: self.services.registry,
            result_ttl_s=settings.serve.idempotency_ttl_s,
            claim_ttl_s=settings.serve.idempotency_claim_ttl_s,
            # A keyed stateless run's answer is kept in the snapshot store too.
            answers=lambda: self.services.manager.stateless_answers,
        )

    @property
    def services(self) -> Services:
        if self._services is None:
            raise RuntimeError("the service is not started (its lifespan has not run)")
        return self._services

    @property
    def execution(self) -> ExecutionService:
        return self.services.execution

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if self._given is None:
                self._services = await stack.enter_async_context(open_services(self.settings))
            tasks = [asyncio.create_task(self._sweep_forever(), name="sandcell-idle-sweeper")]
            start_pool = getattr(self.services.provider, "start_pool", None)
            if start_pool is not None:
                tasks.append(asyncio.create_task(start_pool(), name="sandcell-warm-pool"))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self._services = self._given

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                swept = await self.execution.sweep_idle(idle_s=self.settings.idle_timeout_s)
            except SandcellError as exc:
                log.warning("idle sweep failed: %s", exc)
            except Exception:
                log.exception("idle sweep failed")
            else:
                if swept:
                    log.info("idle sweep suspended %d session(s)", swept)

    # -- routes -------------------------------------------------------------------

    async def exec(self, request: Request) -> Response:
        namespace = self.keys.namespace(request)
        key = idempotency_key(request)
        body = await read_body(request)
        call = decode(body, ExecCall)
        run = _execute_request(call)
        hint = call.runtime_session_hint
        if hint is not None:
            # Derived here too so a bad user_id is a 400 before any sandbox work,
            # and indexed before the turn so a failed turn's session is deletable.
            session_id = runtime_session_id(namespace, call.user_id, hint)
            await self.remember(session_id, namespace, call.user_id, hint)
        identity = Identity(namespace=namespace, user_id=call.user_id)
        claim = await self.idempotency.claim(
            surface="v1/exec",
            namespace=namespace,
            key=key,
            body=body,
            stateless=self.execution.runs_stateless(hint),
        )
        if isinstance(claim, IdempotencyConflict):
            return claim.response()
        if isinstance(claim, Replay):
            return replayed(_replay_exec(claim, stream=wants_stream(request)))

        def stored(result: ExecuteResult) -> tuple[int, bytes]:
            return 200, encode(result)

        def turn(on_output: OnOutput | None) -> Awaitable[ExecuteResult]:
            # The answer goes with the fenced record write that commits the turn.
            work = self.execution.execute(
                run,
                identity,
                hint=hint,
                on_output=on_output,
                egress=call.egress,
                answer=claim.answering(stored),
                turn_key=claim.key,
            )
            return claim.kept(work, stored=stored)

        # A keyed turn runs to its end even if its caller leaves: the retry gets its
        # answer (a cancelled one would keep the job's writes and run it again).
        detached = key is not None
        if wants_stream(request):
            return await stream_turn(request, turn, detached=detached)
        result = await run_until_disconnect(request, turn(None), detached=detached)
        if result is None:  # the caller left: the turn was cancelled, nobody reads this
            return Response(status_code=499)
        return Response(encode(result), media_type=JSON_MEDIA_TYPE)

    async def set_egress(self, request: Request) -> Response:
        session_id = await self.owned_session(request)
        if session_id is None:
            return error_response(404, ErrorCode.NOT_FOUND, "no such session")
        policy = decode(await read_body(request), EgressPolicy)
        try:
            status = await self.services.manager.set_egress(session_id, policy)
        except SandboxNotFoundError:
            return error_response(404, ErrorCode.NOT_FOUND, "the session has no running sandbox")
        return Response(encode(status), media_type=JSON_MEDIA_TYPE)

    async def egress_status(self, request: Request) -> Response:
        """The session's egress: policy, counters and its latest refused connections."""
        session_id = await self.owned_session(request)
        if session_id is None:
            return error_response(404, ErrorCode.NOT_FOUND, "no such session")
        try:
            status = await self.services.manager.egress_status(session_id)
        except SandboxNotFoundError:
            return error_response(404, ErrorCode.NOT_FOUND, "the session has no running sandbox")
        return Response(encode(status), media_type=JSON_MEDIA_TYPE)

    async def list_sessions(self, request: Request) -> Response:
        namespace = self.keys.namespace(request)
        limit, after = page_of(request)
        listed = await list_sessions(self.services, namespace, limit=limit, after=after)
        return Response(encode(listed), media_type=JSON_MEDIA_TYPE)

    async def destroy_session(self, request: Request) -> Response:
        session_id = await self.owned_session(request)
        if session_id is None:
            # Another tenant's session and an unknown one look alike.
            return error_response(404, ErrorCode.NOT_FOUND, "no such session")
        await self.execution.destroy_session(session_id)
        await self.services.owners.forget(self.keys.namespace(request), session_id)
        return Response(status_code=204)

    async def remember(self, session_id: str, namespace: str, user_id: str, hint: str) -> None:
        """Index a session a tenant named (``/v1/run`` does it like ``/v1/exec``).

        The index is the registry's, so every worker on it lists and finds it, and is
        kept in the snapshot store too, so a wiped registry still lists it
        (``SessionOwners``).
        """
        owner = SessionOwner(session_id=session_id, namespace=namespace, user_id=user_id, hint=hint)
        await self.services.owners.remember(owner)

    async def owns(self, namespace: str, session_id: str) -> bool:
        return await self.services.owners.owns(namespace, session_id)

    async def owned_session(self, request: Request) -> str | None:
        """The path's session id if the caller's tenant owns it, else None: another
        tenant's session answers like a missing one. Authenticates first; a malformed
        id is a 400."""
        namespace = self.keys.namespace(request)
        session_id = str(request.path_params["session_id"])
        if not is_runtime_session_id(session_id):
            raise ProtocolError("session id: must be rt_ followed by 64 hex digits")
        return session_id if await self.owns(namespace, session_id) else None

    async def healthz(self, _request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON_MEDIA_TYPE)

    async def metrics(self, _request: Request) -> Response:
        provider = self.services.provider
        text = self.services.metrics.render() + render_provider_counters(
            provider.name, getattr(provider, "metrics", None)
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(settings: OrchestratorSettings, *, services: Services | None = None) -> Starlette:
    """The Starlette app. It opens (and closes) its own ``Services`` unless given some.

    Raises ``ConfigError`` when no API key is configured (see ``INSECURE_NO_AUTH_ENV``).
    """
    service = _Service(settings, services)
    routes: list[BaseRoute] = [
        Route("/v1/exec", guarded(service.exec), methods=["POST"]),
        Route("/v1/sessions", guarded(service.list_sessions), methods=["GET"]),
        Route("/v1/sessions/{session_id}", guarded(service.destroy_session), methods=["DELETE"]),
        Route("/v1/sessions/{session_id}/egress", guarded(service.set_egress), methods=["PUT"]),
        Route("/v1/sessions/{session_id}/egress", guarded(service.egress_status), methods=["GET"]),
        Route("/healthz", guarded(service.healthz), methods=["GET"]),
        Route("/metrics", guarded(service.metrics), methods=["GET"]),
    ]
    routes += ContextRoutes(
        execution=lambda: service.execution,
        namespace_of=service.keys.namespace,
        remember=service.remember,
        owns=service.owns,
        idempotency=service.idempotency,
    ).routes()
    handlers: dict[Any, Any] = {HTTPException: http_error_response}
    app = Starlette(routes=routes, lifespan=service.lifespan, exception_handlers=handlers)
    # The app-instance API (issue 8) shares the services, keys and lifespan.
    from ..apps.preview import ACCESS_LOG_SECRET_PARAMETERS as PREVIEW_SECRETS
    from ..apps.routes import install_app_routes

    install_app_routes(
        app, settings, services=lambda: service.services, namespace_of=service.keys.namespace
    )
    # Query parameters that carry a credential, which the access log must not keep.
    secret_parameters = [*PREVIEW_SECRETS]
    # E2B's control plane and envd (issue 18), when the e2b extra is installed.
    try:
        with needs_extra("e2b", "the E2B API"):
            from ..e2b import ACCESS_LOG_SECRET_PARAMETERS as E2B_SECRETS
            from ..e2b import install_e2b_routes
    except ConfigError as exc:
        log.info("not serving /e2b: %s", exc)
    else:
        install_e2b_routes(
            app,
            settings,
            services=lambda: service.services,
            namespace_of_key=service.keys.namespace_of_key,
            idempotency=service.idempotency,
        )
        secret_parameters += E2B_SECRETS
    redact_access_log(secret_parameters)
    # A WebSocket's path and query, and its handshake's headers, go to the error logger.
    redact_access_log(secret_parameters, ERROR_LOGGER)
    quiet_handshakes(ERROR_LOGGER)
    # LibreChat's Code Interpreter API (issue 17): an adapter on the same services.
    from .librechat import install_librechat

    librechat = install_librechat(
        app, settings.librechat, keys=service.keys, services=lambda: service.services
    )
    librechat.idempotency = service.idempotency
    return app


def serve(
    settings: OrchestratorSettings, *, host: str | None = None, port: int | None = None
) -> int:
    """Run the app under uvicorn until interrupted; returns the exit code."""
    import uvicorn

    app = create_app(settings)
    # Build (and close) the services once first: a configuration error then is one
    # line from the CLI, not a traceback from uvicorn's lifespan handler.
    asyncio.run(_preflight(settings))
    config = uvicorn.Config(
        app,
        host=host or settings.serve.host,
        port=settings.serve.port if port is None else port,
        lifespan="on",
        proxy_headers=False,
        server_header=False,
        log_config=None,
        # Longer than clients keep idle connections (node >= 19 pools them for 5 s,
        # uvicorn's default is also 5 s): otherwise a client reuses a socket at the
        # moment the server closes it, and its request fails as "socket hang up".
        timeout_keep_alive=75,
    )
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()
    return 0


async def _preflight(settings: OrchestratorSettings) -> None:
    async with open_services(settings):
        pass
