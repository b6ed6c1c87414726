"""``sandcell serve``: the orchestrator as an HTTP service for control planes.

Routes (JSON bodies are ``sandcell_protocol`` messages; every error is an ``ErrorBody``):

    POST   /v1/exec             ExecCall -> ExecuteResult       bearer API key
    GET    /v1/sessions         SessionList (this namespace's)  bearer API key
    DELETE /v1/sessions/{id}    204, or 404 if not this tenant's bearer API key
    GET    /healthz             {"status": "ok"}                no auth
    GET    /metrics             Prometheus text                 no auth (aggregate counters)

Each API key (``SANDCELL_API_KEYS``) maps to a tenant namespace; the namespace
comes from the key, never from the body, so one tenant cannot name another's
session. Session records do not carry a namespace, so this service keeps an
in-memory index (session id -> namespace, user, hint) filled by ``/v1/exec``:
``GET``/``DELETE /v1/sessions`` see a session only after an exec through this
process (a restart or another replica forgets it until its next exec).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sandcell_protocol import (
    ERROR_SEMANTICS,
    ErrorBody,
    ErrorCode,
    ExecCall,
    ExecuteRequest,
    ProtocolError,
    checkpoint_key,
    decode,
    encode,
    error_body,
    is_runtime_session_id,
    runtime_session_id,
)
from sandcell_protocol import ProtocolMismatchError as PeerProtocolMismatchError

from .bootstrap import Services, open_services
from .config import OrchestratorSettings
from .errors import (
    CheckpointError,
    ConfigError,
    InputMissingError,
    LockLostError,
    ProtocolMismatchError,
    RegistryError,
    RunnerRequestError,
    SandboxError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SandcellError,
    SessionBusyError,
    SessionConflictError,
    SessionRequiredError,
)
from .execution import ExecutionService, Identity
from .metrics import render_provider_counters

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

INSECURE_NO_AUTH_ENV = "SANDCELL_SERVE_INSECURE_NO_AUTH"
INSECURE_NAMESPACE = "default"
MAX_BODY_BYTES = 32 << 20
"""The largest accepted request body: inline files travel in it, base64-encoded."""
_JSON = "application/json"
# Runner codes that describe the caller's request; any other code the runner
# refused us with is this service's own failure, not the caller's.
_CALLER_CODES = frozenset(
    {
        ErrorCode.BAD_REQUEST,
        ErrorCode.PAYLOAD_TOO_LARGE,
        ErrorCode.UNSUPPORTED_LANGUAGE,
        ErrorCode.INVALID_PATH,
        ErrorCode.QUARANTINED,
        ErrorCode.BUSY,
    }
)


class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One runtime session of the caller's namespace, as ``GET /v1/sessions`` lists it."""

    session_id: str
    user_id: str
    hint: str
    state: str
    """``active`` (a sandbox is warm), ``suspended`` or ``saved`` (a checkpoint only)."""
    has_checkpoint: bool
    updated_at_s: float | None


class SessionList(msgspec.Struct, frozen=True, kw_only=True):
    """The body of ``GET /v1/sessions``."""

    sessions: list[SessionInfo]


@dataclass(frozen=True, slots=True)
class _Owner:
    namespace: str
    user_id: str
    hint: str


class _Unauthorized(Exception):
    pass


class _PayloadTooLarge(Exception):
    pass


class _ApiKeys:
    """Bearer API key -> namespace, compared in constant time over every key."""

    def __init__(self, keys: Mapping[str, str], *, insecure: bool) -> None:
        # Digests have one length, so compare_digest's time says nothing about a
        # key's length either.
        self._digests = [(_digest(key), namespace) for key, namespace in keys.items()]
        self._insecure = insecure

    def __repr__(self) -> str:
        return f"_ApiKeys(<{len(self._digests)} keys>, insecure={self._insecure})"

    def namespace(self, request: Request) -> str:
        if self._insecure:
            return INSECURE_NAMESPACE
        scheme, _, credential = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise _Unauthorized
        offered = _digest(credential.strip())
        found = None
        for digest, namespace in self._digests:
            if hmac.compare_digest(offered, digest) and found is None:
                found = namespace
        if found is None:
            raise _Unauthorized
        return found


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def _api_keys(settings: OrchestratorSettings) -> _ApiKeys:
    """Refuse to serve without keys, unless explicitly told to (never in production)."""
    insecure = settings.env.get(INSECURE_NO_AUTH_ENV, "") == "1"
    if settings.api_keys:
        return _ApiKeys(settings.api_keys, insecure=False)
    if not insecure:
        raise ConfigError(
            f"sandcell serve needs SANDCELL_API_KEYS (key=namespace,...); "
            f"{INSECURE_NO_AUTH_ENV}=1 serves without auth outside production"
        )
    if settings.production:
        raise ConfigError(f"{INSECURE_NO_AUTH_ENV}=1 is refused when SANDCELL_ENV=production")
    log.warning("serving WITHOUT authentication (%s=1)", INSECURE_NO_AUTH_ENV)
    return _ApiKeys({}, insecure=True)


# First match wins; the message is the error's own (orchestrator errors carry no
# secrets) and retryability its class's.
_DIRECT: tuple[tuple[type[Exception] | tuple[type[Exception], ...], int, ErrorCode], ...] = (
    (ProtocolError, 400, ErrorCode.BAD_REQUEST),
    (SessionRequiredError, 400, ErrorCode.SESSION_REQUIRED),
    (SessionBusyError, 409, ErrorCode.SESSION_BUSY),
    (SessionConflictError, 409, ErrorCode.SESSION_CONFLICT),
    (InputMissingError, 400, ErrorCode.INPUT_MISSING),
    ((ProtocolMismatchError, PeerProtocolMismatchError), 502, ErrorCode.PROTOCOL_MISMATCH),
    ((SandboxUnavailableError, LockLostError, RegistryError), 503, ErrorCode.BUSY),
)


def map_error(exc: BaseException) -> tuple[int, ErrorBody]:
    """The HTTP status and ``ErrorBody`` an exception becomes; total over exceptions."""
    if isinstance(exc, _Unauthorized):
        return 401, error_body(ErrorCode.UNAUTHORIZED, "a valid bearer API key is required")
    if isinstance(exc, _PayloadTooLarge):
        return 413, error_body(
            ErrorCode.PAYLOAD_TOO_LARGE, f"the body exceeds {MAX_BODY_BYTES} bytes"
        )
    for kinds, status, code in _DIRECT:
        if isinstance(exc, kinds):
            retryable = bool(getattr(exc, "retryable", False))
            return status, error_body(code, str(exc), retryable=retryable)
    if isinstance(exc, RunnerRequestError):
        try:
            code = ErrorCode(exc.code)
        except ValueError:
            code = ErrorCode.INTERNAL
        if code in _CALLER_CODES:
            status = ERROR_SEMANTICS[code].http_status
            return status, error_body(code, str(exc), retryable=exc.retryable)
        log.error("the runner refused a request: %s", exc)
        return 500, error_body(ErrorCode.INTERNAL, "internal error")
    if isinstance(exc, SandboxTimeoutError):
        # The sandbox accepted the job and went quiet: its effects are unknown,
        # so this is not a blind-retry case.
        return 504, error_body(
            ErrorCode.BUSY, "the sandbox did not answer in time", retryable=False
        )
    if isinstance(exc, CheckpointError):
        log.error("session state could not be restored: %s", exc)
        return 500, error_body(
            ErrorCode.INTERNAL, "the session's saved state could not be restored"
        )
    if isinstance(exc, SandcellError) and exc.retryable:
        return 503, error_body(ErrorCode.BUSY, str(exc), retryable=True)
    if isinstance(exc, SandboxError):
        log.error("sandbox failure: %s", exc)
        return 503, error_body(ErrorCode.BUSY, "the sandbox failed; retry", retryable=True)
    log.error("unexpected %s", type(exc).__name__, exc_info=exc)
    return 500, error_body(ErrorCode.INTERNAL, "internal error")


def _error(exc: BaseException) -> Response:
    status, body = map_error(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(encode(body), status_code=status, media_type=_JSON, headers=headers)


Endpoint = Callable[[Request], Awaitable[Response]]


def _guarded(endpoint: Endpoint) -> Endpoint:
    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:
            return _error(exc)

    return guarded


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _PayloadTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _PayloadTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _execute_request(call: ExecCall) -> ExecuteRequest:
    """The runner's part of an ``ExecCall`` (the runner refuses unknown fields)."""
    fields = msgspec.structs.asdict(call)
    del fields["user_id"], fields["runtime_session_hint"]
    return ExecuteRequest(**fields)


class _Service:
    """The app's state: set up in the lifespan, never module-global."""

    def __init__(self, settings: OrchestratorSettings, services: Services | None) -> None:
        self.settings = settings
        self.keys = _api_keys(settings)
        self._given = services
        self._services = services
        self._owners: dict[str, _Owner] = {}

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
            if start_pool is not None and self.settings.local_pool_size:
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
        call = decode(await _read_body(request), ExecCall)
        run = _execute_request(call)
        hint = call.runtime_session_hint
        if hint is not None:
            # Derived here too so a bad user_id is a 400 before any sandbox work,
            # and indexed before the turn so a failed turn's session is deletable.
            session_id = runtime_session_id(namespace, call.user_id, hint)
            self._owners[session_id] = _Owner(namespace, call.user_id, hint)
        result = await self.execution.execute(
            run, Identity(namespace=namespace, user_id=call.user_id), hint=hint
        )
        return Response(encode(result), media_type=_JSON)

    async def list_sessions(self, request: Request) -> Response:
        namespace = self.keys.namespace(request)
        services = self.services
        sessions: list[SessionInfo] = []
        for session_id, owner in sorted(self._owners.items()):
            if owner.namespace != namespace:
                continue
            record = await services.registry.get(session_id)
            saved = await services.store.exists(checkpoint_key(session_id))
            if record is None and not saved:
                continue
            sessions.append(
                SessionInfo(
                    session_id=session_id,
                    user_id=owner.user_id,
                    hint=owner.hint,
                    state=record.state if record else "saved",
                    has_checkpoint=saved,
                    updated_at_s=record.updated_at_s if record else None,
                )
            )
        return Response(encode(SessionList(sessions=sessions)), media_type=_JSON)

    async def destroy_session(self, request: Request) -> Response:
        namespace = self.keys.namespace(request)
        session_id = request.path_params["session_id"]
        if not is_runtime_session_id(session_id):
            raise ProtocolError("session id: must be rt_ followed by 64 hex digits")
        owner = self._owners.get(session_id)
        if owner is None or owner.namespace != namespace:
            # Another tenant's session and an unknown one look alike.
            return _error_response(404, ErrorCode.NOT_FOUND, "no such session")
        await self.execution.destroy_session(session_id)
        self._owners.pop(session_id, None)
        return Response(status_code=204)

    async def healthz(self, _request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=_JSON)

    async def metrics(self, _request: Request) -> Response:
        provider = self.services.provider
        text = self.services.metrics.render() + render_provider_counters(
            provider.name, getattr(provider, "metrics", None)
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _error_response(status: int, code: ErrorCode, message: str) -> Response:
    return Response(encode(error_body(code, message)), status_code=status, media_type=_JSON)


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error_response(404, ErrorCode.NOT_FOUND, "no such route")
    if exc.status_code == 405:
        return _error_response(405, ErrorCode.BAD_REQUEST, "method not allowed")
    return _error_response(exc.status_code, ErrorCode.BAD_REQUEST, "bad request")


def create_app(settings: OrchestratorSettings, *, services: Services | None = None) -> Starlette:
    """The Starlette app. It opens (and closes) its own ``Services`` unless given some.

    Raises ``ConfigError`` when no API key is configured (see ``INSECURE_NO_AUTH_ENV``).
    """
    service = _Service(settings, services)
    routes = [
        Route("/v1/exec", _guarded(service.exec), methods=["POST"]),
        Route("/v1/sessions", _guarded(service.list_sessions), methods=["GET"]),
        Route("/v1/sessions/{session_id}", _guarded(service.destroy_session), methods=["DELETE"]),
        Route("/healthz", _guarded(service.healthz), methods=["GET"]),
        Route("/metrics", _guarded(service.metrics), methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {HTTPException: _http_error}
    app = Starlette(routes=routes, lifespan=service.lifespan, exception_handlers=handlers)
    # The app-instance API (issue 8) shares the services, keys and lifespan.
    from .apps.routes import install_app_routes

    install_app_routes(
        app, settings, services=lambda: service.services, namespace_of=service.keys.namespace
    )
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
        host=host or settings.serve_host,
        port=settings.serve_port if port is None else port,
        lifespan="on",
        proxy_headers=False,
        server_header=False,
        log_config=None,
    )
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()
    return 0


async def _preflight(settings: OrchestratorSettings) -> None:
    async with open_services(settings):
        pass
