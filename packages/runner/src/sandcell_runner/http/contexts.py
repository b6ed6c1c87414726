"""Routes of the bound session's code contexts (``/v1/session/contexts``).

All are session-bound (``X-Runtime-Session-Id`` required). A run is streamed as
NDJSON when asked (``Accept: application/x-ndjson``), otherwise answered as one
``ContextRunResult``; both render the same ``RunnerService.run_in_context``, and
a refusal before the cell starts (busy, unknown or lost context) is an HTTP
error in both.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from sandcell_protocol import contexts as cx
from sandcell_protocol import encode, routes

from ..cancelling import cancel_and_wait
from ..errors import BadRequestError
from .base import RouteGroup, json_response

_Events = asyncio.Queue[cx.ContextEvent | None]


class ContextRoutes(RouteGroup):
    """Create, list, delete, restart, interrupt and run contexts."""

    def routes(self) -> list[BaseRoute]:
        g = self.guarded
        return [
            Route(cx.SESSION_CONTEXTS, g(self.post_context), methods=["POST"]),
            Route(cx.SESSION_CONTEXTS, g(self.list_contexts), methods=["GET"]),
            Route(cx.SESSION_CONTEXT, g(self.delete_context), methods=["DELETE"]),
            Route(cx.SESSION_CONTEXT_RESTART, g(self.post_restart), methods=["POST"]),
            Route(cx.SESSION_CONTEXT_INTERRUPT, g(self.post_interrupt), methods=["POST"]),
            Route(cx.SESSION_CONTEXT_RUN, g(self.post_run), methods=["POST"]),
        ]

    @staticmethod
    def _context_id(request: Request) -> str:
        context_id = str(request.path_params["context_id"])
        if not cx.is_context_id(context_id):
            raise BadRequestError(f"context id must match {cx.CONTEXT_ID_RULE}")
        return context_id

    async def post_context(self, request: Request) -> Response:
        session_id = self.required_session(request)
        self.sessions.require_not_quarantined()
        create = await self.read_message(request, cx.ContextCreate)
        state = await self.sessions.bind(session_id)
        return json_response(await self.service.contexts.create(state, create), 201)

    async def _bound(self, request: Request) -> str:
        """The session the route names, bound (409 when the runner serves another)."""
        state = await self.sessions.bind(self.required_session(request))
        return state.session_id

    async def list_contexts(self, request: Request) -> Response:
        session_id = await self._bound(request)
        return json_response(cx.ContextList(contexts=self.service.contexts.list(session_id)))

    async def delete_context(self, request: Request) -> Response:
        state = await self.sessions.bind(self.required_session(request))
        await self.service.contexts.delete(state, self._context_id(request))
        return Response(status_code=204)

    async def post_restart(self, request: Request) -> Response:
        session_id = self.required_session(request)
        context_id = self._context_id(request)
        state = await self.sessions.bind(session_id)
        return json_response(await self.service.contexts.restart(state, context_id))

    async def post_interrupt(self, request: Request) -> Response:
        session_id = await self._bound(request)
        context_id = self._context_id(request)
        return json_response(self.service.contexts.interrupt(session_id, context_id))

    async def post_run(self, request: Request) -> Response:
        session_id = self.required_session(request)
        context_id = self._context_id(request)
        run = await self.read_message(request, cx.ContextRun)
        queue: _Events = asyncio.Queue()
        started = asyncio.Event()
        task = asyncio.ensure_future(
            self.service.run_in_context(
                session_id,
                context_id,
                run,
                on_event=queue.put_nowait,
                on_started=started.set,
            )
        )
        task.add_done_callback(lambda _: queue.put_nowait(None))
        begun = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait({task, begun}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await cancel_and_wait(task)
            raise
        finally:
            begun.cancel()
        if not started.is_set():
            task.result()  # the refusal, raised as this request's error
        if routes.NDJSON in request.headers.get("accept", ""):
            return StreamingResponse(_stream(queue, task), media_type=routes.NDJSON)
        events: list[cx.ContextEvent] = []
        try:
            while (event := await queue.get()) is not None:
                events.append(event)
            events.append(task.result())
        finally:
            await cancel_and_wait(task)
        return json_response(cx.gather_events(events))


async def _stream(queue: _Events, task: asyncio.Future[cx.ContextEndEvent]) -> AsyncIterator[bytes]:
    try:
        while (event := await queue.get()) is not None:
            yield encode(event) + b"\n"
        yield encode(task.result()) + b"\n"
    finally:
        await cancel_and_wait(task)


__all__ = ["ContextRoutes"]
