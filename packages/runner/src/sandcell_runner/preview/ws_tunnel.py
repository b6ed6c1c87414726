"""An ``Upgrade`` request through the preview as a raw byte tunnel after the handshake.

uvicorn speaks the ASGI ``websocket`` scope only with a WebSocket library
installed (the runner declares ``websockets``; ``ws_relay.py`` serves that
case). Without one (an image built without it, ``ws="none"``) or for any other
protocol (``Upgrade: h2c``…), the upgrade arrives as a plain HTTP request, and
ASGI has no way to hand the connection over. So such a request to a preview port
is taken before Starlette's middleware: the request head goes upstream (minus the
runner's own headers), and if the server answers ``101`` the client's transport
is switched to a protocol that pipes bytes both ways until either side closes.
Any other answer is relayed as a plain response and the connection is not taken.

Taking the transport relies on uvicorn's HTTP protocols (httptools and h11),
whose ``send`` is bound to a cycle holding it; under another server the tunnel
answers with an error rather than misbehave. uvicorn still logs "Unsupported
upgrade request" for each such request: it parses the head before the app runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import BusyError

_HEAD_LIMIT = 64 * 1024
_BODY_LIMIT = 1024 * 1024
_PAUSE_AT = 1024 * 1024


def is_upgrade(scope: Scope) -> bool:
    """Whether an HTTP request asks to switch protocols (``Connection: upgrade``)."""
    connection = b""
    upgrade = b""
    for name, value in scope.get("headers", ()):
        if name == b"connection":
            connection = value.lower()
        elif name == b"upgrade":
            upgrade = value
    return bool(upgrade) and b"upgrade" in connection


def _transport_of(send: Send) -> asyncio.Transport | None:
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    return transport if isinstance(transport, asyncio.Transport) else None


class _ClientSide(asyncio.Protocol):
    """The client's connection after the switch: bytes go to ``upstream``."""

    def __init__(
        self, transport: asyncio.Transport, original: Any, upstream: asyncio.StreamWriter
    ) -> None:
        self._transport = transport
        self._original = original
        self._upstream = upstream
        self.closed = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self._drain: asyncio.Task[None] | None = None

    def data_received(self, data: bytes) -> None:
        if self._upstream.is_closing():
            return
        self._upstream.write(data)
        if self._upstream.transport.get_write_buffer_size() > _PAUSE_AT and self._drain is None:
            self._transport.pause_reading()
            self._drain = asyncio.ensure_future(self._resume_after_drain())

    async def _resume_after_drain(self) -> None:
        with contextlib.suppress(OSError):
            await self._upstream.drain()
        self._drain = None
        if not self._transport.is_closing():
            self._transport.resume_reading()

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self.writable.set()
        # Lets uvicorn forget the connection and mark its request cycle disconnected.
        with contextlib.suppress(Exception):
            self._original.connection_lost(exc)


def can_take_over(send: Send) -> bool:
    """Whether this server's connection can be taken for a tunnel."""
    return _transport_of(send) is not None


class Handshake(Response):
    """The upstream's answer to an upgrade request, answered as the ASGI response."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        status: int,
        head: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        super().__init__(status_code=status)
        self._reader = reader
        self._writer = writer
        self._head = head
        self._upstream_headers = headers

    def abort(self) -> None:
        """Close the upstream from outside: the tunnel (or the relayed answer) ends."""
        self._writer.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A ``101`` becomes a tunnel; anything else is relayed as a plain response."""
        try:
            transport = _transport_of(send)
            if self.status_code == 101 and transport is not None:
                await _pipe(transport, self._head, self._reader, self._writer)
                return
            body = await read_body(self._reader, self._upstream_headers)
            status = 502 if self.status_code == 101 else self.status_code
            answer = Response(body, status_code=status)
            answer.raw_headers = [
                (k, v)
                for k, v in self._upstream_headers
                if k not in (b"connection", b"transfer-encoding", b"content-length", b"upgrade")
            ]
            answer.raw_headers.append((b"content-length", str(len(body)).encode()))
            await answer(scope, receive, send)
        finally:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()


async def handshake(
    sock: socket.socket,
    *,
    method: str,
    port: int,
    target: bytes,
    request_headers: Iterable[tuple[bytes, bytes]],
) -> Handshake:
    """Send an upgrade request on ``sock`` (connected) and read the response head."""
    reader, writer = await asyncio.open_connection(sock=sock, limit=_HEAD_LIMIT)
    head = [method.encode() + b" " + target + b" HTTP/1.1", b"host: localhost:%d" % port]
    head += [name + b": " + value for name, value in request_headers]
    writer.write(b"\r\n".join(head) + b"\r\n\r\n")
    try:
        async with asyncio.timeout(10):
            await writer.drain()
            response_head = await reader.readuntil(b"\r\n\r\n")
        status, headers = parse_head(response_head)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        writer.close()
        raise BusyError(f"port {port} did not answer the upgrade request") from None
    except BusyError:
        writer.close()
        raise
    return Handshake(reader, writer, status, response_head, headers)


async def _pipe(
    transport: asyncio.Transport,
    response_head: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    client = _ClientSide(transport, transport.get_protocol(), writer)
    transport.set_protocol(client)
    transport.write(response_head)
    transport.resume_reading()

    async def downstream() -> None:
        while data := await reader.read(65536):
            if transport.is_closing():
                return
            transport.write(data)
            await client.writable.wait()

    pump = asyncio.ensure_future(downstream())
    closed = asyncio.ensure_future(client.closed.wait())
    try:
        await asyncio.wait({pump, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pump.cancel()
        transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await client.closed.wait()
        closed.cancel()
        with contextlib.suppress(BaseException):
            await pump


def parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    try:
        status = int(parts[1])
    except (IndexError, ValueError):
        raise BusyError("upstream sent a malformed response") from None
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    return status, headers


async def read_body(reader: asyncio.StreamReader, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The body of a refused upgrade: by Content-Length, else what comes before EOF."""
    length = dict(headers).get(b"content-length")
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(5):
            if length is not None and length.isdigit():
                return await reader.readexactly(min(int(length), _BODY_LIMIT))
            while sum(map(len, chunks)) < _BODY_LIMIT and (data := await reader.read(65536)):
                chunks.append(data)
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    except (TimeoutError, OSError):
        pass
    return b"".join(chunks)[:_BODY_LIMIT]


__all__ = ["Handshake", "can_take_over", "handshake", "is_upgrade", "parse_head", "read_body"]
