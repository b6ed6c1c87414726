"""``POST /v1/execute``: one run, answered as one JSON result or streamed as NDJSON.

Both answers render the same ``RunnerService.execute``. The stream sends
``stdout`` / ``stderr`` events as output arrives and the ``result`` event last;
it starts only once the run has begun, so a refusal before the jail runs (busy,
session busy, input missing) is an HTTP error in both renderings.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from sandcell_protocol import (
    ExecuteRequest,
    ExecuteResult,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
    encode_event,
    routes,
)

from ..executor import PreparedRequest
from .base import RouteGroup, json_response

_Output = asyncio.Queue[tuple[str, bytes] | None]


class ExecuteRoutes(RouteGroup):
    """The execute route."""

    def routes(self) -> list[BaseRoute]:
        return [Route(routes.EXECUTE, self.guarded(self.post_execute), methods=["POST"])]

    async def post_execute(self, request: Request) -> Response:
        session_id = self.session_header(request)
        self.sessions.require_not_quarantined()
        prepared = self.service.prepare(await self.read_message(request, ExecuteRequest))
        if routes.NDJSON in request.headers.get("accept", ""):
            return await self._stream(prepared, session_id)
        return json_response(await self.service.execute(prepared, session_id=session_id))

    async def _stream(self, prepared: PreparedRequest, session_id: str | None) -> Response:
        queue: _Output = asyncio.Queue()
        started = asyncio.Event()

        def on_output(name: str, data: bytes) -> None:
            queue.put_nowait((name, data))

        run = asyncio.ensure_future(
            self.service.execute(
                prepared, session_id=session_id, on_output=on_output, on_started=started.set
            )
        )
        run.add_done_callback(lambda _: queue.put_nowait(None))
        begun = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait({run, begun}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await _cancel(run)
            raise
        finally:
            begun.cancel()
        if not started.is_set():
            run.result()  # the refusal, raised as this request's error
        return StreamingResponse(_events(queue, run), media_type=routes.NDJSON)


async def _events(queue: _Output, run: asyncio.Future[ExecuteResult]) -> AsyncIterator[bytes]:
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
        yield encode_event(ResultEvent(result=run.result()))
    finally:
        await _cancel(run)


async def _cancel(run: asyncio.Future[ExecuteResult]) -> None:
    """Cancel the run if it is still going and wait for its cleanup (slot, workspace, lock)."""
    if not run.done():
        run.cancel()
    with contextlib.suppress(BaseException):
        await run


def _event(name: str, text: str) -> StdoutEvent | StderrEvent:
    return StdoutEvent(data=text) if name == "stdout" else StderrEvent(data=text)


__all__ = ["ExecuteRoutes"]
