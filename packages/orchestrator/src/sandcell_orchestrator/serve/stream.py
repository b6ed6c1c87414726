"""``POST /v1/exec`` answered as it runs: NDJSON events, and a turn that ends with its caller.

With ``Accept: application/x-ndjson`` the answer is a stream of the protocol's
``StreamEvent`` lines: ``{"type": "stdout"|"stderr", "data": …}`` as the job
produces output, ``{"type": "egress_refused", "name": …, "address": …, "port": …,
"reason": …, "transport": …, "at_ms": …}`` for each connection the sandbox's egress
policy refused the job (at most 20 a turn, then one ``{"type": "egress_omitted",
"count": N}``), then exactly one ``{"type": "result", "result": ExecuteResult}``
last. A turn refused before it produced anything (a busy session, a bad
request) is answered as usual, with its status and ``ErrorBody``; a failure after
output began ends the stream with one ``ErrorBody`` line instead of the result.

Either way the turn is tied to its caller: when the client disconnects, the turn
is cancelled (the job is stopped and the session keeps the state of its last
completed turn; see ``ExecutionService``), the same rule as a CLI's Ctrl-C.
A turn called with an ``Idempotency-Key`` (``detached``) is not: its client has
said it will retry, so the turn runs to its end and its answer is kept for the
retry. Cancelling it instead would keep what its job wrote (the interrupted-turn
rule) while the retry ran the job again: the turn applied twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandcell_protocol import (
    ExecuteResult,
    ResultEvent,
    TurnEvent,
    encode,
    encode_event,
    routes,
)

from ..sessions.output import OnOutput
from .errors import map_error

__all__ = ["ClientGoneError", "Turn", "run_until_disconnect", "stream_turn", "wants_stream"]

T = TypeVar("T")
_Item = TurnEvent | None


class ClientGoneError(Exception):
    """The turn was cancelled because its client disconnected."""


class Turn(Generic[T]):
    """A turn running in its own task, cancellable only through an anyio scope.

    A native ``task.cancel()`` passes through anyio's shields, so a second one
    (Starlette cancelling a response task, a generator awaiting the task) could
    cut the turn's own cleanup short: recycling its sandbox, releasing its
    session. Cancelling the scope lets that cleanup run to its end.
    """

    def __init__(self, work: Awaitable[T]) -> None:
        self._scope = anyio.CancelScope()
        self.task: asyncio.Task[T] = asyncio.ensure_future(self._run(work))

    async def _run(self, work: Awaitable[T]) -> T:
        with self._scope:
            return await work
        raise ClientGoneError("the client disconnected; the turn was cancelled")

    def cancel(self) -> None:
        self._scope.cancel()

    async def finish(self, *, detached: bool = False) -> None:
        """Cancel the turn if it still runs (``detached``: let it end on its own) and wait
        for its cleanup, whatever happens here."""
        if not detached:
            self.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({self.task})
        if not self.task.cancelled():
            self.task.exception()  # retrieved: whoever needed it has read it by now


def wants_stream(request: Request) -> bool:
    """Whether the caller asked for NDJSON (``Accept: application/x-ndjson``)."""
    return routes.NDJSON in request.headers.get("accept", "")


async def run_until_disconnect(
    request: Request, work: Awaitable[T], *, detached: bool = False
) -> T | None:
    """Await ``work``; ``None`` once it was cancelled because the client went away.

    ``detached``: a client that goes away does not cancel it (a keyed call).
    The body has been read, so the next ASGI message is ``http.disconnect``.
    """
    turn = Turn(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait(
            {turn.task} if detached else {turn.task, watcher},
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        watcher.cancel()
        if not turn.task.done():
            await turn.finish()
    try:
        return turn.task.result()
    except ClientGoneError:
        return None


async def stream_turn(
    request: Request,
    turn: Callable[[OnOutput], Awaitable[ExecuteResult]],
    *,
    detached: bool = False,
) -> Response:
    """Run ``turn(on_output)``, answered as NDJSON once it has output (or has ended).

    ``detached``: a client that goes away does not cancel the turn (a keyed call).
    """
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    running = Turn(turn(queue.put_nowait))
    running.task.add_done_callback(lambda _: queue.put_nowait(None))
    # Starlette notices a gone client only when a write fails (ASGI 2.4), and a
    # quiet job writes nothing: watch for the disconnect ourselves.
    watcher = asyncio.ensure_future(_disconnected(request))
    if not detached:
        watcher.add_done_callback(lambda done: None if done.cancelled() else running.cancel())
    try:
        first = await queue.get()
    except BaseException:
        watcher.cancel()
        await running.finish(detached=detached)
        raise
    if first is None and running.task.exception() is not None:
        watcher.cancel()
        if isinstance(running.task.exception(), ClientGoneError):
            # Gone before any output: nobody reads an answer (not a server error).
            return Response(status_code=499)
        running.task.result()  # refused before any output: the usual status and ErrorBody
    return StreamingResponse(
        _lines(first, queue, running, watcher, detached=detached), media_type=routes.NDJSON
    )


async def _lines(
    first: _Item,
    queue: asyncio.Queue[_Item],
    running: Turn[ExecuteResult],
    watcher: asyncio.Future[None],
    *,
    detached: bool,
) -> AsyncIterator[bytes]:
    # A disconnect cancels the turn (the watcher) or this generator (a failed
    # write): either way the finally waits for the turn's cleanup.
    try:
        item = first
        while item is not None:
            yield encode_event(item)
            item = await queue.get()
        try:
            result = running.task.result()
        except ClientGoneError:
            return
        except Exception as exc:
            yield encode(map_error(exc)[1]) + b"\n"
            return
        yield encode_event(ResultEvent(result=result))
    finally:
        watcher.cancel()
        await running.finish(detached=detached)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
