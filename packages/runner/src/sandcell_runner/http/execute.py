"""``POST /v1/execute``: one run, answered as one JSON result or streamed as NDJSON.

Both answers render the same ``RunnerService.execute``. The stream sends
``stdout`` / ``stderr`` events as output arrives and the ``result`` event last;
it starts only once the run has begun, so a refusal before the jail runs (busy,
session busy, input missing) is an HTTP error in both renderings.

To a peer that announced protocol 1.2 or later, the stream also carries what the
sandbox's egress policy refused the job while it ran (``egress_refused``, at most
``MAX_EGRESS_EVENTS_PER_TURN``, as the gateway decides them), and the count of
the rest (one ``egress_omitted``) just before the result: the job's namespace is
watched for the turn (``EgressManager.watch``), and once the job has ended its
gateway is asked to report every decision so far (``settle``). An older peer
decodes strictly, so it gets neither; the JSON answer carries none either
(``GET /v1/egress`` has the latest refusals).
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
    EGRESS_EVENTS_SINCE,
    ExecuteRequest,
    ExecuteResult,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
    encode_event,
    headers,
    routes,
    speaks_at_least,
)

from ..cancelling import cancel_and_wait
from ..egress.manager import EgressManager
from ..egress.turn import TurnRefusals
from ..executor import PreparedRequest
from .base import Handler, RouteGroup, json_response

_Output = asyncio.Queue[tuple[str, bytes] | None]
_EGRESS = ("egress", b"")
"""Queued when the turn's ``TurnRefusals`` got a refusal (the events wait there)."""


class ExecuteRoutes(RouteGroup):
    """The execute route."""

    def routes(self) -> list[BaseRoute]:
        return [Route(routes.EXECUTE, self.guarded(self.post_execute), methods=["POST"])]

    def direct(self) -> dict[tuple[str, str], Handler]:
        """The route answered without Starlette's router (``RunnerStarlette``)."""
        return {("POST", routes.EXECUTE): self.guarded(self.post_execute)}

    async def post_execute(self, request: Request) -> Response:
        session_id = self.session_header(request)
        self.sessions.require_not_quarantined()
        prepared = self.service.prepare(await self.read_message(request, ExecuteRequest))
        if routes.NDJSON in request.headers.get("accept", ""):
            egress = speaks_at_least(request.headers.get(headers.PROTOCOL), EGRESS_EVENTS_SINCE)
            return await self._stream(prepared, session_id, egress_events=egress)
        return json_response(await self.service.execute(prepared, session_id=session_id))

    async def _stream(
        self, prepared: PreparedRequest, session_id: str | None, *, egress_events: bool
    ) -> Response:
        queue: _Output = asyncio.Queue()
        started = asyncio.Event()
        loop = asyncio.get_running_loop()
        egress = self.service.egress
        refusals = None
        if egress_events:

            def refused() -> None:  # on the gateway's reader thread
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads
                    loop.call_soon_threadsafe(queue.put_nowait, _EGRESS)

            refusals = egress.watch(session=session_id is not None, notify=refused)

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
            if not started.is_set():
                run.result()  # the refusal, raised as this request's error
        except BaseException:
            try:
                await cancel_and_wait(run)
            finally:
                if refusals is not None:
                    egress.unwatch(refusals)
            raise
        finally:
            begun.cancel()
        events = _events(queue, run, refusals, egress)
        return StreamingResponse(events, media_type=routes.NDJSON)


async def _events(
    queue: _Output,
    run: asyncio.Future[ExecuteResult],
    refusals: TurnRefusals | None,
    egress: EgressManager,
) -> AsyncIterator[bytes]:
    decoders = {
        "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
        "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
    }
    try:
        while (item := await queue.get()) is not None:
            name, data = item
            if name == "egress":
                assert refusals is not None
                for refused in refusals.take():
                    yield encode_event(refused)
                continue
            text = decoders[name].decode(data)
            if text:
                yield encode_event(_event(name, text))
        for name, decoder in decoders.items():
            if tail := decoder.decode(b"", final=True):
                yield encode_event(_event(name, tail))
        if refusals is not None:
            if not run.cancelled() and egress.watched_fd(refusals) is not None:
                # The job's last connections may still be on their way from the gateway.
                await asyncio.to_thread(egress.settle, refusals)
            for refused in refusals.take():
                yield encode_event(refused)
            if (omitted := refusals.omitted()) is not None:
                yield encode_event(omitted)
        yield encode_event(ResultEvent(result=run.result()))
    finally:
        if refusals is not None:
            egress.unwatch(refusals)
        await cancel_and_wait(run)


def _event(name: str, text: str) -> StdoutEvent | StderrEvent:
    return StdoutEvent(data=text) if name == "stdout" else StderrEvent(data=text)


__all__ = ["ExecuteRoutes"]
