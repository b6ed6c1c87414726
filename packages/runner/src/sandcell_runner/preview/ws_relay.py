"""WebSocket through the preview when the ASGI server speaks WebSocket itself.

With a WebSocket library installed (the runner depends on ``websockets``), uvicorn
completes the client's handshake and hands the app a ``websocket`` scope, so
there is no raw connection to tunnel (``ws_tunnel.py`` covers servers without
one). The app then opens its own WebSocket to the upstream inside the session's
namespace and relays whole messages both ways. The upstream end is a minimal RFC
6455 client (masked frames out, fragments reassembled, pings answered; a masked
frame in or a subprotocol the client did not offer fails it, as the RFC says) rather
than the library's: a dev server that refuses the upgrade often answers in
HTTP/1.0, which a strict client rejects, and the preview relays that answer to
the browser as it came. The upstream's subprotocol is passed on at accept;
compression is not negotiated upstream (the browser's side may still use it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import socket
import struct
from collections.abc import Iterable

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..errors import BusyError
from .ws_tunnel import parse_head, read_body

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# The client's own handshake headers: the relay makes its own upstream.
_HANDSHAKE_HEADERS = frozenset(
    {
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-accept",
        b"connection",
        b"upgrade",
    }
)


class UpstreamRefusedError(Exception):
    """The upstream answered the handshake with something other than ``101``."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.headers = headers
        self.body = body


class UpstreamSocket:
    """The client end of a WebSocket to the upstream server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()

    async def send(self, opcode: int, payload: bytes) -> None:
        size = len(payload)
        if size < 126:
            header = struct.pack(">BB", 0x80 | opcode, 0x80 | size)
        elif size < 65536:
            header = struct.pack(">BBH", 0x80 | opcode, 0x80 | 126, size)
        else:
            header = struct.pack(">BBQ", 0x80 | opcode, 0x80 | 127, size)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if size < 4096 else None
        if masked is None:
            # Large payloads: XOR as big integers instead of byte by byte.
            repeated = (mask * (size // 4 + 1))[:size]
            masked = (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(
                size, "big"
            )
        async with self._lock:
            self._writer.write(header + mask + masked)
            await self._writer.drain()

    async def recv(self) -> tuple[int, bytes]:
        """The next message: (1 text | 2 binary | 8 close, payload); answers pings itself."""
        opcode = 0
        parts: list[bytes] = []
        size = 0
        while True:
            b1, b2 = await self._reader.readexactly(2)
            length = b2 & 0x7F
            if length == 126:
                (length,) = struct.unpack(">H", await self._reader.readexactly(2))
            elif length == 127:
                (length,) = struct.unpack(">Q", await self._reader.readexactly(8))
            if length > _MAX_MESSAGE_BYTES or size + length > _MAX_MESSAGE_BYTES:
                raise BusyError("upstream WebSocket message too large")
            if b2 & 0x80:
                # RFC 6455 5.1: a client must fail a connection on a masked server frame
                # (browsers do). Unmasking one byte by byte took the runner's event loop
                # ~1.5 s per 16 MiB frame, CPU that is not the job's.
                raise BusyError("upstream WebSocket frame is masked")
            payload = await self._reader.readexactly(length)
            frame_op = b1 & 0x0F
            if frame_op == 9:
                await self.send(10, payload)
                continue
            if frame_op == 10:
                continue
            if frame_op == 8:
                return 8, payload
            if frame_op != 0:
                opcode = frame_op
            parts.append(payload)
            size += len(payload)
            if b1 & 0x80:
                return opcode, b"".join(parts)

    def abort(self) -> None:
        """Close the connection from outside the relay: its reads end, and so does it."""
        self._writer.close()

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


async def connect_upstream(
    sock: socket.socket,
    *,
    port: int,
    target: bytes,
    request_headers: Iterable[tuple[bytes, bytes]],
) -> tuple[UpstreamSocket, str | None]:
    """Handshake with the upstream on ``sock``; returns it and its chosen subprotocol."""
    request_headers = list(request_headers)
    reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024)
    key = base64.b64encode(os.urandom(16))
    head = [
        b"GET " + target + b" HTTP/1.1",
        b"host: localhost:%d" % port,
        b"upgrade: websocket",
        b"connection: Upgrade",
        b"sec-websocket-key: " + key,
        b"sec-websocket-version: 13",
    ]
    head += [k + b": " + v for k, v in request_headers if k not in _HANDSHAKE_HEADERS]
    writer.write(b"\r\n".join(head) + b"\r\n\r\n")
    try:
        async with asyncio.timeout(10):
            await writer.drain()
            response = await reader.readuntil(b"\r\n\r\n")
        status, header_list = parse_head(response)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        writer.close()
        raise BusyError(f"port {port} did not answer the WebSocket handshake") from None
    except BusyError:
        writer.close()
        raise
    if status != 101:
        body = await read_body(reader, header_list)
        writer.close()
        raise UpstreamRefusedError(status, header_list, body)
    headers = dict(header_list)
    accept = base64.b64encode(hashlib.sha1(key + _GUID).digest())  # noqa: S324 - RFC 6455
    if headers.get(b"sec-websocket-accept") != accept:
        writer.close()
        raise BusyError(f"port {port} answered the WebSocket handshake wrongly")
    protocol = headers.get(b"sec-websocket-protocol")
    if protocol is not None and protocol not in _offered_subprotocols(request_headers):
        # RFC 6455 4.1: only one the client offered (a browser fails anything else). Passed
        # on unchecked, a value that is not a token made the accept below raise: a 500.
        writer.close()
        raise BusyError(f"port {port} answered the WebSocket handshake wrongly")
    return UpstreamSocket(reader, writer), protocol.decode("latin-1") if protocol else None


def _offered_subprotocols(request_headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The subprotocols the client offered (uvicorn checked they are tokens)."""
    return {
        item.strip()
        for name, value in request_headers
        if name == b"sec-websocket-protocol"
        for item in value.split(b",")
    }


async def relay(websocket: WebSocket, upstream: UpstreamSocket, subprotocol: str | None) -> None:
    """Accept the client and relay messages until either side closes."""
    await websocket.accept(subprotocol=subprotocol)

    async def client_to_upstream() -> None:
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    code = int(message.get("code") or 1000)
                    await upstream.send(8, struct.pack(">H", code))
                    return
                if message.get("text") is not None:
                    await upstream.send(1, message["text"].encode())
                else:
                    await upstream.send(2, message.get("bytes") or b"")
        except (WebSocketDisconnect, OSError, ConnectionError):
            return

    async def upstream_to_client() -> None:
        try:
            while True:
                opcode, payload = await upstream.recv()
                if opcode == 8:
                    code = struct.unpack(">H", payload[:2])[0] if len(payload) >= 2 else 1000
                    await websocket.close(code=code if 1000 <= code < 5000 else 1000)
                    return
                if opcode == 1:
                    await websocket.send_text(payload.decode("utf-8", "replace"))
                else:
                    await websocket.send_bytes(payload)
        except (asyncio.IncompleteReadError, OSError, ConnectionError, BusyError):
            with contextlib.suppress(Exception):
                await websocket.close(code=1011)

    tasks = {
        asyncio.ensure_future(client_to_upstream()),
        asyncio.ensure_future(upstream_to_client()),
    }
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await upstream.close()


__all__ = ["UpstreamRefusedError", "UpstreamSocket", "connect_upstream", "relay"]
