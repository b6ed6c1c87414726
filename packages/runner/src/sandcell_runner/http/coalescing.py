"""uvicorn's httptools protocol with the writes of one event-loop pass sent as one.

uvicorn writes a response's status line and headers on ``http.response.start`` and
its body on ``http.response.body``: two sends, two TCP segments, two wake-ups of
the client, for every JSON answer (Starlette sends the two messages back to back).
On loopback a send also runs the receiver's side of TCP in the sender's context, so
on a runner answering a few hundred executions a second the second send was a
measurable share of its CPU (``scripts/bench_runner.py``, issue #21). Here the
transport a connection's protocol writes to gathers what is written during one
pass of the loop and sends it when the pass ends (``call_soon``): a head and its
body leave together, and a stream's chunks written in the same pass too. Nothing
waits longer than that pass, so a streamed head still leaves before the first
output does. uvicorn has no setting for this (its ``send`` is not ours to change),
hence the transport: the protocol is uvicorn's own, handed this wrapper.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport(asyncio.Transport):
    """A transport whose writes made in one loop pass reach the socket as one write.

    Everything else is the wrapped transport's: a close or ``write_eof`` sends what
    is gathered first, an abort drops it (as an abort drops the transport's buffer).
    """

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes | bytearray | memoryview] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if not pending or self._transport.is_closing():
            return
        self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        gathered = sum(len(data) for data in self._pending) if self._pending else 0
        return self._transport.get_write_buffer_size() + gathered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a ``CoalescingTransport``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))


__all__ = ["CoalescingHttpToolsProtocol", "CoalescingTransport"]
