"""The runner's HTTP surface (Starlette). Every route but /health needs the bearer token."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sandcell_protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ExecuteRequest,
    Health,
    Language,
    Languages,
    ProtocolError,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
    check_compatible,
    decode,
    encode,
    encode_event,
    error_body,
    headers,
    routes,
)
from sandcell_protocol import ProtocolMismatchError as WireMismatch

from .. import __version__
from ..errors import (
    BadRequestError,
    BusyError,
    PayloadTooLargeError,
    ProtocolMismatchError,
    RunnerError,
    UnauthorizedError,
)
from ..executor import PreparedRequest
from ..service import RunnerService
from .apps import AppRoutes, RunnerStarlette
from .session import SessionRoutes

log = logging.getLogger(__name__)

JSON = "application/json"
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


def json_response(value: Any, status: int = 200) -> Response:
    return Response(encode(value), status_code=status, media_type=JSON)


def error_response(exc: RunnerError) -> Response:
    body = error_body(exc.code, str(exc) or exc.code.value, retryable=exc.retryable)
    response = json_response(body, exc.http_status)
    if isinstance(exc, BusyError):
        response.headers[headers.RETRY_AFTER] = str(exc.retry_after_s)
    return response


class RunnerApp:
    """Routes bound to one ``RunnerService``."""

    def __init__(self, service: RunnerService) -> None:
        self.service = service
        token = service.settings.token
        self._token = token.encode() if token is not None else None

    # -- plumbing -------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        """Bearer token (constant-time) and, when sent, a compatible protocol major."""
        if self._token is not None:
            given = request.headers.get(headers.AUTHORIZATION, "")
            if not given.startswith(headers.BEARER_PREFIX):
                raise UnauthorizedError("missing bearer token")
            candidate = given[len(headers.BEARER_PREFIX) :].encode()
            if not hmac.compare_digest(candidate, self._token):
                raise UnauthorizedError("invalid bearer token")
        peer = request.headers.get(headers.PROTOCOL)
        if peer is not None:
            try:
                check_compatible(peer)
            except WireMismatch as exc:
                raise ProtocolMismatchError(str(exc)) from None

    async def read_body(self, request: Request, *, max_bytes: int | None = None) -> bytes:
        """The request body, refused with 413 as soon as it passes the cap."""
        cap = max_bytes or self.service.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise PayloadTooLargeError(f"body larger than {cap} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise PayloadTooLargeError(f"body larger than {cap} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_message(self, request: Request, type_: type[T]) -> T:
        body = await self.read_body(request)
        try:
            return decode(body, type_)
        except ProtocolError as exc:
            raise BadRequestError(str(exc)) from None

    def json(self, value: Any, status: int = 200) -> Response:
        return json_response(value, status)

    def guarded(self, handler: Handler, *, auth: bool = True) -> Handler:
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    self.authorize(request)
                return await handler(request)
            except RunnerError as exc:
                return error_response(exc)

        return endpoint

    # -- routes ---------------------------------------------------------------

    def health(self) -> Health:
        service = self.service
        sessions = service.sessions
        return Health(
            status="quarantined" if sessions.quarantined else "ok",
            protocol=PROTOCOL_VERSION,
            runner_version=__version__,
            session_id=sessions.bound.session_id if sessions.bound else None,
            warmup=service.warmup.state,
            languages=sorted(service.languages),
            warnings=list(service.warnings),
        )

    async def get_health(self, request: Request) -> Response:
        return json_response(self.health())

    async def get_languages(self, request: Request) -> Response:
        return json_response(
            Languages(
                languages=[
                    Language(name=spec.name, version=spec.version)
                    for spec in self.service.languages.values()
                ]
            )
        )

    async def post_execute(self, request: Request) -> Response:
        sessions = self.service.sessions
        session_id = sessions.check_header(request.headers.get(headers.RUNTIME_SESSION_ID))
        sessions.require_not_quarantined()
        execute_request = await self.read_message(request, ExecuteRequest)
        prepared = self.service.executor.prepare(execute_request)
        if routes.NDJSON in request.headers.get("accept", ""):
            return await self._stream_execute(prepared, session_id)
        result = await self.service.execute(prepared, session_id=session_id)
        return json_response(result)

    async def _stream_execute(self, prepared: PreparedRequest, session_id: str | None) -> Response:
        service = self.service
        stack = contextlib.AsyncExitStack()
        try:
            workspace = await service.begin(prepared, session_id=session_id, stack=stack)
        except BaseException:
            await stack.aclose()
            raise
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()

        def on_output(name: str, data: bytes) -> None:
            queue.put_nowait((name, data))

        task = asyncio.ensure_future(
            service.executor.run_in(prepared, workspace, on_output=on_output)
        )
        task.add_done_callback(lambda _: queue.put_nowait(None))

        async def events() -> AsyncIterator[bytes]:
            decoders = {
                "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
            }
            try:
                while (item := await queue.get()) is not None:
                    name, data = item
                    text = decoders[name].decode(data)
                    if text:
                        yield encode_event(_event(name, text))
                for name, decoder in decoders.items():
                    if tail := decoder.decode(b"", final=True):
                        yield encode_event(_event(name, tail))
                yield encode_event(ResultEvent(result=task.result()))
            finally:
                if not task.done():
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await stack.aclose()

        return StreamingResponse(events(), media_type=routes.NDJSON)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        service = self.service
        service.warmup.start()
        reaper = asyncio.create_task(service.reaper_loop(), name="sandcell-reaper")
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await service.warmup.stop()
            await service.shutdown()

    def build(self) -> Starlette:
        g = self.guarded
        s = SessionRoutes(self)
        a = AppRoutes(self)
        return RunnerStarlette(
            routes=[
                Route(routes.HEALTH, g(self.get_health, auth=False), methods=["GET"]),
                Route(routes.LANGUAGES, g(self.get_languages), methods=["GET"]),
                Route(routes.EXECUTE, g(self.post_execute), methods=["POST"]),
                Route(routes.SESSION_CHECKPOINT, g(s.get_checkpoint), methods=["GET"]),
                Route(routes.SESSION_RESTORE, g(s.post_restore), methods=["POST"]),
                Route(routes.SESSION, g(s.delete_session), methods=["DELETE"]),
                Route(routes.SESSION_FILES, g(s.get_file), methods=["GET"]),
                Route(routes.SESSION_FILES, g(s.put_file), methods=["PUT"]),
                Route(routes.SESSION_FILES, g(s.delete_file), methods=["DELETE"]),
                Route(routes.INPUTS_PROBE, g(s.post_probe), methods=["POST"]),
                Route(routes.INPUTS, g(s.post_inputs), methods=["POST"]),
                *a.routes(),
            ],
            upgrade=a.upgrade,
            lifespan=self.lifespan,
            exception_handlers={
                404: _not_found,
                405: _method_not_allowed,
                500: _internal,
            },
        )


def _event(name: str, text: str) -> StdoutEvent | StderrEvent:
    return StdoutEvent(data=text) if name == "stdout" else StderrEvent(data=text)


async def _not_found(request: Request, exc: Exception) -> Response:
    return json_response(error_body(ErrorCode.NOT_FOUND, "no such route"), 404)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return json_response(error_body(ErrorCode.BAD_REQUEST, "method not allowed"), 405)


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response(error_body(ErrorCode.INTERNAL, "internal error"), 500)


def create_app(service: RunnerService) -> Starlette:
    """The ASGI app of a runner."""
    return RunnerApp(service).build()
