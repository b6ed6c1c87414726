"""A code-interpreter cell's answer: E2B's NDJSON lines, and a cell tied to its caller.

One JSON object a line, as E2B's server writes them: ``stdout``/``stderr``
``{text, timestamp}`` (epoch nanoseconds), ``result`` (``text``, ``html``, ``png``…
by MIME type, ``is_main_result``), ``error`` ``{name, value, traceback}``, then
``number_of_executions``.

A cell without an ``Idempotency-Key`` runs while its caller waits
(``watched_stream``): when the client goes away (the SDK's ``timeout`` passed, a
Ctrl-C) the cell is interrupted, as E2B's server interrupts its kernel, so the
context answers the next call with its variables kept instead of staying busy with
an abandoned cell. A keyed cell (``kept_stream``) runs to its end: its client has
said it will retry, and the answer is kept for the retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandcell_protocol import contexts as cx
from sandcell_protocol import encode

from ..errors import SandcellError
from ..serve.idempotency import Claim
from ..serve.stream import Turn

__all__ = ["NDJSON", "Started", "kept_stream", "translate", "watched_stream"]

NDJSON = "application/x-ndjson"
_RESULT_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "text/latex": "latex",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/svg+xml": "svg",
    "application/pdf": "pdf",
    "application/json": "json",
    "application/javascript": "javascript",
}
_SETTLE_S = 5.0
"""How long an interrupted cell of a gone client may take to end before its run is
cancelled (a cell that catches ``KeyboardInterrupt`` and sleeps on)."""


def _line(kind: str, **fields: object) -> bytes:
    return encode({"type": kind, **fields}) + b"\n"


def _text(value: object) -> object:
    """E2B's server's ``text``: a ``repr`` in quotes (a ``str`` result) without them."""
    if isinstance(value, str) and value[:1] in ("'", '"') and value.endswith(value[0]):
        return value[1:-1]
    return value


def translate(event: cx.ContextEvent) -> bytes:
    """One runner event as E2B's line (a lost context: an error line, then the end)."""
    now_ns = time.time_ns()
    if isinstance(event, cx.ContextStdoutEvent):
        return _line("stdout", text=event.data, timestamp=now_ns)
    if isinstance(event, cx.ContextStderrEvent):
        return _line("stderr", text=event.data, timestamp=now_ns)
    if isinstance(event, cx.ContextResultEvent):
        fields: dict[str, object] = {}
        extra: dict[str, object] = {}
        for mime, value in event.data.items():
            field = _RESULT_FIELDS.get(mime)
            if field is None:
                extra[mime] = value  # E2B's ``extra``: a type it has no field for
            else:
                fields[field] = _text(value) if field == "text" else value
        if extra:
            fields["extra"] = extra
        return _line("result", **fields, is_main_result=event.is_main_result)
    if isinstance(event, cx.ContextErrorEvent):
        return _line("error", name=event.name, value=event.value, traceback=event.traceback)
    assert isinstance(event, cx.ContextEndEvent)
    end = _line("number_of_executions", execution_count=event.execution_count)
    if event.context_lost:
        # The cell's own error (if any) came first; this says the interpreter is gone.
        lost = _line(
            "error",
            name="ContextLostError",
            value=event.message or f"the interpreter was lost ({event.status})",
            traceback="",
        )
        return lost + end
    return end


Started = tuple[cx.ContextEvent, AsyncIterator[cx.ContextEvent]]
"""A cell's first event and the rest of its events."""

_Pump = Callable[[Callable[[bytes], None]], Awaitable[None]]
"""Runs a cell, handing each of its lines to the callback."""


def _pump(start: Callable[[], Awaitable[Started]]) -> _Pump:
    async def run(put: Callable[[bytes], None]) -> None:
        first, events = await start()
        put(translate(first))
        try:
            async for event in events:
                put(translate(event))
        finally:
            # Closed in this task, where it was opened (its stream's cancel scopes).
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()

    return run


async def kept_stream(claim: Claim, start: Callable[[], Awaitable[Started]]) -> Response:
    """Run the cell in a task of its own that keeps its answer (every line, joined) for
    the key, and stream its lines as they come.

    The task outlives its caller: a client that leaves has said it will retry, and a
    cell cut short would have run part way while the retry ran it again.
    """
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    pump = _pump(start)

    async def run_all() -> bytes:
        lines: list[bytes] = []

        def put(line: bytes) -> None:
            lines.append(line)
            queue.put_nowait(line)

        await pump(put)
        return b"".join(lines)

    running = Turn(claim.kept(run_all(), stored=lambda answer: (200, answer)))
    task = running.task
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        first = await queue.get()
    except BaseException:
        await running.finish(detached=True)
        raise
    if first is None:
        task.result()  # refused before the cell ran: the usual error answer
        raise RuntimeError("a cell ended without a line")

    async def lines() -> AsyncIterator[bytes]:
        try:
            line: bytes | None = first
            while line is not None:
                yield line
                line = await queue.get()
            task.result()  # a stream cut short (the runner failed) ends in an error
        finally:
            await running.finish(detached=True)

    return StreamingResponse(lines(), media_type=NDJSON)


class _Gone:
    """The client disconnected (a marker among the lines)."""


_GONE = _Gone()


async def _next(queue: asyncio.Queue[bytes | None], watcher: asyncio.Future[None]) -> object:
    """The next line (None: the cell ended), or ``_GONE`` once the client has gone."""
    getter = asyncio.ensure_future(queue.get())
    either: set[asyncio.Future[object]] = {getter, watcher}  # type: ignore[arg-type]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    return _GONE


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def watched_stream(
    request: Request,
    start: Callable[[], Awaitable[Started]],
    *,
    interrupt: Callable[[], Awaitable[object]],
) -> Response:
    """Run the cell while its client is there, streaming its lines; once the client has
    gone (before the first line too: a quiet cell writes nothing), ``interrupt`` it and
    let it end (``_SETTLE_S`` at most, then its run is cancelled)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    running: Turn[None] = Turn(_pump(start)(queue.put_nowait))
    task = running.task
    task.add_done_callback(lambda _: queue.put_nowait(None))
    # Starlette notices a gone client only when a write fails (ASGI 2.4), and a quiet
    # cell writes nothing: the disconnect is watched for here, as ``serve.stream`` does.
    watcher = asyncio.ensure_future(_disconnected(request))

    async def settle() -> None:
        with anyio.CancelScope(shield=True):
            if not task.done():
                with contextlib.suppress(SandcellError):
                    await interrupt()
                with anyio.move_on_after(_SETTLE_S):
                    await asyncio.wait({task})
            await running.finish()

    try:
        first = await _next(queue, watcher)
    except BaseException:
        watcher.cancel()
        await running.finish()
        raise
    if first is _GONE:
        await settle()
        return Response(status_code=499)  # nobody reads it
    if first is None:
        watcher.cancel()
        task.result()  # refused before the cell ran: the usual error answer
        raise RuntimeError("a cell ended without a line")

    async def lines() -> AsyncIterator[bytes]:
        try:
            line = first
            while isinstance(line, bytes):
                yield line
                line = await _next(queue, watcher)
            if line is _GONE:
                await settle()
                return
            task.result()  # a stream cut short (the runner failed) ends in an error
        finally:
            watcher.cancel()
            await running.finish()

    return StreamingResponse(lines(), media_type=NDJSON)
