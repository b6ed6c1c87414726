"""Forwarding a caller's HTTP request or WebSocket to a port in a sandbox, through its runner.

The runner's ``/v1/session/ports/{port}/…`` reaches a server inside the session's jail
(``sandcell_runner.preview``). Two surfaces put it in front of callers: app previews
(``apps/preview.py``, with their own tokens and cookie) and E2B's sandbox ports
(``e2b/ports.py``). What both need the same way lives here: which request headers never
go upstream (ours, the runner's, hop-by-hop), the path check that keeps a forwarded path
inside the ports route, the response streamed back with the app's cookies, the
WebSocket pump and the refusal of a WebSocket whose upstream failed. Who may forward,
and what extra headers go along, is each surface's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

    from .apps import WebSocketUpgrade

__all__ = [
    "DROPPED_REQUEST_HEADERS",
    "HOP_BY_HOP",
    "WS_MAX_BYTES",
    "connect_upstream",
    "downstream_response",
    "pump",
    "refuse",
    "stays_in_port_route",
    "upstream_headers",
]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {
    # Never forwarded upstream: ours (auth, the runner's protocol headers, the MicroVM
    # proxy's routing and auth) or rebuilt by the surface.
    "host",
    "authorization",
    "cookie",
    "x-runtime-session-id",
    "x-sandcell-protocol",
    "x-request-id",
    "x-forwarded-prefix",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-for",
    "x-aws-proxy-auth",
    "x-aws-proxy-port",
    "x-amz-security-token",
}
WS_MAX_BYTES = 16 << 20


class _QuietHandshake(logging.Filter):
    """websockets logs handshake headers at DEBUG; ours carry the runner's token."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("> ", "< "))


_WS_LOG = logging.getLogger(__name__ + ".websocket")
_WS_LOG.addFilter(_QuietHandshake())


def stays_in_port_route(path: str) -> bool:
    """Whether a still-encoded forwarded path has no ``.`` or ``..`` segment.

    The runner resolves dot segments: ``..`` (however encoded) could climb out of the
    ports route into the runner's own routes, with the runner's token.
    """
    return not any(unquote(part) in (".", "..") for part in path.split("/"))


def upstream_headers(
    headers: Mapping[str, str], *, dropped: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The caller's headers that may reach the app (``dropped``: the surface's own too)."""
    return {
        k: v
        for k, v in headers.items()
        if k.lower() not in DROPPED_REQUEST_HEADERS and k.lower() not in dropped
    }


def downstream_response(upstream: httpx.Response) -> StreamingResponse:
    """The app's answer streamed back byte for byte, each of its cookies kept apart."""
    headers = {
        k: v
        for k, v in upstream.headers.multi_items()
        if k.lower() not in HOP_BY_HOP and k.lower() != "set-cookie"
    }
    response = StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        headers=headers,
        background=BackgroundTask(upstream.aclose),
    )
    for value in upstream.headers.get_list("set-cookie"):
        response.raw_headers.append((b"set-cookie", value.encode("latin-1")))
    return response


async def connect_upstream(
    upgrade: WebSocketUpgrade, subprotocols: list[str] | None
) -> ClientConnection:
    """Open the WebSocket to the runner's port route (raises the library's errors)."""
    # Imported here: only WebSocket forwarding needs the library.
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    return await connect(
        upgrade.url,
        additional_headers=upgrade.headers,
        subprotocols=[Subprotocol(p) for p in subprotocols] if subprotocols else None,
        proxy=None,
        max_size=WS_MAX_BYTES,
        logger=_WS_LOG,
        open_timeout=10,
    )


async def refuse(websocket: WebSocket, failure: BaseException) -> None:
    """Refuse the caller's WebSocket (not accepted yet) whose upstream did not open.

    The runner's ``503 busy`` (its cap on relayed WebSockets, or an app that answered
    the handshake wrongly) goes on as it came: status, JSON body and ``Retry-After``,
    a refusal a client can read and retry on, where the server can answer a WebSocket
    with a response (ASGI's ``websocket.http.response``, uvicorn's). Anything else
    (a silent app, the runner unreachable), or on a server without it: close 1011,
    which the server answers 403. The runner's other answers are about our credentials
    and session, and stay ours.
    """
    from websockets.exceptions import InvalidStatus

    answer = failure.response if isinstance(failure, InvalidStatus) else None
    can_answer = "websocket.http.response" in websocket.scope.get("extensions", {})
    if answer is not None and answer.status_code == 503 and can_answer:
        kept = {"content-type", "retry-after"}
        headers = {k: v for k, v in answer.headers.raw_items() if k.lower() in kept}
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await websocket.send_denial_response(
                Response(bytes(answer.body), status_code=503, headers=headers)
            )
        return
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):
        await websocket.close(code=1011)


async def pump(
    websocket: WebSocket, upstream: ClientConnection, *, touch: Callable[[], None]
) -> None:
    """Relay messages both ways until either side closes; close the caller's with the
    app's code (1011 for an abnormal end)."""

    async def downstream_to_upstream() -> None:
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                touch()
                if message.get("text") is not None:
                    await upstream.send(message["text"])
                elif message.get("bytes") is not None:
                    await upstream.send(message["bytes"])
        except WebSocketDisconnect:
            return

    from websockets.exceptions import ConnectionClosed

    async def upstream_to_downstream() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in upstream:
                touch()
                if isinstance(data, str):
                    await websocket.send_text(data)
                else:
                    await websocket.send_bytes(data)

    tasks = [
        asyncio.create_task(downstream_to_upstream()),
        asyncio.create_task(upstream_to_downstream()),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        code = upstream.close_code or 1000
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await websocket.close(code=code if code != 1006 else 1011)
