"""Code contexts on ``sandcell serve`` (bearer API key; errors are ``ErrorBody``).

    POST   /v1/run                                    RunCall -> ContextRunResult
                                                      (NDJSON ContextEvents with
                                                      Accept: application/x-ndjson)
    GET    /v1/sessions/{id}/contexts                 ContextList (the warm sandbox's)
    POST   /v1/sessions/{id}/contexts                 ContextCreate -> 201 ContextInfo
    DELETE /v1/sessions/{id}/contexts/{cid}           204
    POST   /v1/sessions/{id}/contexts/{cid}/restart   ContextInfo (a fresh interpreter)
    POST   /v1/sessions/{id}/contexts/{cid}/interrupt ContextInfo (SIGINT to the cell)

An adapter: each route translates onto ``ExecutionService.run_code`` or its
``contexts``. A session is this tenant's only once ``/v1/exec`` or ``/v1/run``
named it through this process (the serve app's session index); any other
answers exactly as a missing one (404).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from sandcell_protocol import (
    ErrorBody,
    ErrorCode,
    ExecuteRequest,
    ProtocolError,
    decode,
    encode,
    error_body,
    is_runtime_session_id,
    routes,
    runtime_session_id,
)
from sandcell_protocol import contexts as cx

from ..errors import RunnerRequestError, SandboxNotFoundError
from ..sessions.execution import ExecutionService, Identity
from .errors import JSON_MEDIA_TYPE, Endpoint, guarded, read_body
from .idempotency import IDEMPOTENCY_KEY_HEADER, Idempotency, idempotency_key
from .stream import Turn

__all__ = ["ContextRoutes"]

log = logging.getLogger(__name__)

Remember = Callable[[str, str, str, str], Awaitable[None]]
"""(session id, namespace, user id, hint): index a session this tenant named."""
Owns = Callable[[str, str], Awaitable[bool]]
"""(namespace, session id): whether that tenant named the session (else it is unknown)."""


class _NoSuchSession(Exception):
    """An unknown session, or another tenant's: answered alike."""


def context_error(exc: BaseException) -> tuple[int, ErrorBody] | None:
    """The context routes' own answers; ``None``: the service's common mapping."""
    if isinstance(exc, _NoSuchSession):
        return 404, error_body(ErrorCode.NOT_FOUND, "no such session")
    if isinstance(exc, RunnerRequestError) and exc.code == "not_found":
        return 404, error_body(ErrorCode.NOT_FOUND, "no such context")
    if isinstance(exc, SandboxNotFoundError):
        return 404, error_body(ErrorCode.NOT_FOUND, "the session has no warm sandbox")
    return None


def _execute_request(call: cx.RunCall) -> ExecuteRequest:
    """The runner's part of a ``RunCall``."""
    fields = msgspec.structs.asdict(call)
    for name in ("user_id", "runtime_session_hint", "context_id", "egress"):
        del fields[name]
    return ExecuteRequest(**fields)


class ContextRoutes:
    """The routes, over the service's ``ExecutionService`` and session index."""

    def __init__(
        self,
        *,
        execution: Callable[[], ExecutionService],
        namespace_of: Callable[[Request], str],
        remember: Remember,
        owns: Owns,
        idempotency: Idempotency | None = None,
    ) -> None:
        self._idempotency = idempotency
        self._execution = execution
        self._namespace_of = namespace_of
        self._remember = remember
        self._owns = owns

    def routes(self) -> list[BaseRoute]:
        def g(endpoint: Endpoint) -> Endpoint:
            return guarded(endpoint, extra=context_error)

        base = "/v1/sessions/{session_id}/contexts"
        return [
            Route("/v1/run", g(self.run), methods=["POST"]),
            Route(base, g(self.list_contexts), methods=["GET"]),
            Route(base, g(self.create_context), methods=["POST"]),
            Route(base + "/{context_id}", g(self.delete_context), methods=["DELETE"]),
            Route(base + "/{context_id}/restart", g(self.restart), methods=["POST"]),
            Route(base + "/{context_id}/interrupt", g(self.interrupt), methods=["POST"]),
        ]

    async def _session(self, request: Request) -> str:
        namespace = self._namespace_of(request)
        session_id = str(request.path_params["session_id"])
        if not is_runtime_session_id(session_id):
            raise ProtocolError("session id: must be rt_ followed by 64 hex digits")
        if not await self._owns(namespace, session_id):
            raise _NoSuchSession
        return session_id

    @staticmethod
    def _context_id(request: Request) -> str:
        context_id = str(request.path_params["context_id"])
        if not cx.is_context_id(context_id):
            raise ProtocolError(f"context id: must match {cx.CONTEXT_ID_RULE}")
        return context_id

    @staticmethod
    def _json(value: object, status: int = 200) -> Response:
        return Response(encode(value), status_code=status, media_type=JSON_MEDIA_TYPE)

    # -- routes -------------------------------------------------------------------

    async def run(self, request: Request) -> Response:
        namespace = self._namespace_of(request)
        key = idempotency_key(request)
        body = await read_body(request)
        call = decode(body, cx.RunCall)
        hint = call.runtime_session_hint
        if hint is not None:
            session_id = runtime_session_id(namespace, call.user_id, hint)
            await self._remember(session_id, namespace, call.user_id, hint)
        identity = Identity(namespace=namespace, user_id=call.user_id)
        code = _execute_request(call)
        execution = self._execution()
        if routes.NDJSON not in request.headers.get("accept", ""):

            async def answer() -> Response:
                result = await execution.run_code(
                    code, identity, hint=hint, context_id=call.context_id, egress=call.egress
                )
                return self._json(result)

            if self._idempotency is None:
                return await answer()
            return await self._idempotency.once(
                surface="v1/run", namespace=namespace, key=key, body=body, answer=answer
            )
        if key is not None:
            raise ProtocolError(f"{IDEMPOTENCY_KEY_HEADER} is not taken with an NDJSON /v1/run")
        queue: asyncio.Queue[cx.ContextEvent | None] = asyncio.Queue()
        # A Turn: cancelled only through its anyio scope, whose shields its cleanup
        # (recycling the sandbox, discarding a launch) keeps. A plain task.cancel() and
        # then the gone client's cancellation of the generator awaiting it were two
        # native ones, and the second cut that cleanup short.
        running = Turn(
            execution.run_code(
                code,
                identity,
                hint=hint,
                context_id=call.context_id,
                on_event=queue.put_nowait,
                egress=call.egress,
            )
        )
        running.task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            first = await queue.get()
        except BaseException:
            await running.finish()
            raise
        if first is None:
            # Refused before the cell ran (busy, lost, bad input): an HTTP error.
            running.task.result()
            raise RuntimeError("a context run ended without events")
        return StreamingResponse(_stream(first, queue, running), media_type=routes.NDJSON)

    async def list_contexts(self, request: Request) -> Response:
        session_id = await self._session(request)
        listed = await self._execution().contexts.list(session_id)
        return self._json(cx.ContextList(contexts=listed))

    async def create_context(self, request: Request) -> Response:
        session_id = await self._session(request)
        create = decode(await read_body(request), cx.ContextCreate)
        return self._json(await self._execution().contexts.create(session_id, create), 201)

    async def delete_context(self, request: Request) -> Response:
        session_id = await self._session(request)
        await self._execution().contexts.delete(session_id, self._context_id(request))
        return Response(status_code=204)

    async def restart(self, request: Request) -> Response:
        session_id = await self._session(request)
        info = await self._execution().contexts.restart(session_id, self._context_id(request))
        return self._json(info)

    async def interrupt(self, request: Request) -> Response:
        session_id = await self._session(request)
        info = await self._execution().contexts.interrupt(session_id, self._context_id(request))
        return self._json(info)


async def _stream(
    first: cx.ContextEvent,
    queue: asyncio.Queue[cx.ContextEvent | None],
    running: Turn[cx.ContextRunResult],
) -> AsyncIterator[bytes]:
    try:
        yield encode(first) + b"\n"
        while (event := await queue.get()) is not None:
            yield encode(event) + b"\n"
        # The end event has gone out; the turn's own failure after it (a lost lock
        # while checkpointing) can only be logged.
        if running.task.exception() is not None:
            log.warning("a context run failed after its end event: %s", running.task.exception())
    finally:
        await running.finish()
