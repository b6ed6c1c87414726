"""A response's head and body leave the runner as one write (``http/coalescing.py``).

Counted where it shows: the TCP segments with data a real client receives for one
request from a real runner (``tcpi_data_segs_in`` of ``TCP_INFO``: uvicorn wrote
head and body apart, two segments on a ``TCP_NODELAY`` socket), and on a real
socket pair for the transport's own rules (close sends, abort drops).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import uvloop

from sandcell_runner.http.coalescing import CoalescingTransport
from tests.fixtures.runner_process import RunnerProcess

# struct tcp_info (linux/tcp.h): tcpi_data_segs_in, since Linux 4.6.
_DATA_SEGS_IN = 152


def _data_segments_in(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    count: int = struct.unpack_from("I", info, _DATA_SEGS_IN)[0]
    return count


def _exchange(runner: RunnerProcess, request: bytes) -> tuple[bytes, int]:
    """One request on a fresh connection: the whole response and its data segments."""
    with socket.create_connection(("127.0.0.1", runner.port), timeout=30) as sock:
        before = _data_segments_in(sock)
        sock.sendall(request)
        response = b""
        while b"\r\n\r\n" not in response:
            response += sock.recv(65536)
        head, _, body = response.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += sock.recv(65536)
        time.sleep(0.2)  # nothing more is coming, but let a straggler land if it were
        return head + b"\r\n\r\n" + body, _data_segments_in(sock) - before


def test_a_json_answer_is_one_segment(runner: RunnerProcess) -> None:
    response, segments = _exchange(
        runner, b"GET /health HTTP/1.1\r\nHost: runner\r\nConnection: close\r\n\r\n"
    )
    assert response.startswith(b"HTTP/1.1 200 ")
    assert segments == 1


def test_an_execute_answer_is_one_segment(runner: RunnerProcess) -> None:
    body = json.dumps({"language": "bash", "code": "echo coalesced"}).encode()
    request = (
        b"POST /v1/execute HTTP/1.1\r\nHost: runner\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {runner.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    response, segments = _exchange(runner, request)
    assert response.startswith(b"HTTP/1.1 200 ")
    assert json.loads(response.partition(b"\r\n\r\n")[2])["stdout"] == "coalesced\n"
    assert segments == 1


class _Peer(asyncio.Protocol):
    def __init__(self) -> None:
        self.received = b""
        self.closed = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.received += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()


async def _pair() -> tuple[asyncio.Transport, _Peer, list[bytes]]:
    """A real transport (the standard loop's, whose ``write`` can be watched) over a
    socket pair, the peer's protocol, and the list of what reached ``write``."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    peer = _Peer()
    await loop.connect_accepted_socket(lambda: peer, theirs)
    writes: list[bytes] = []
    original = transport.write

    def write(data: bytes | bytearray | memoryview) -> None:
        writes.append(bytes(data))
        original(data)

    transport.write = write  # type: ignore[method-assign]
    return transport, peer, writes


def test_writes_of_one_pass_reach_the_socket_as_one() -> None:
    async def main() -> None:
        transport, peer, writes = await _pair()
        coalescing = CoalescingTransport(transport, asyncio.get_running_loop())
        coalescing.write(b"HTTP/1.1 200 OK\r\n\r\n")
        coalescing.write(b"")
        coalescing.writelines([b"body", b"!"])
        assert writes == []  # nothing before the pass ends
        await asyncio.sleep(0)
        assert writes == [b"HTTP/1.1 200 OK\r\n\r\nbody!"]
        coalescing.write(b"next pass")
        await asyncio.sleep(0)
        assert writes[1:] == [b"next pass"]
        coalescing.write(b"then closed")
        coalescing.close()  # what was gathered goes first
        await asyncio.wait_for(peer.closed.wait(), 10)
        assert peer.received == b"HTTP/1.1 200 OK\r\n\r\nbody!next passthen closed"

    asyncio.run(main())


def test_an_abort_drops_what_was_gathered() -> None:
    async def main() -> None:
        transport, peer, writes = await _pair()
        coalescing = CoalescingTransport(transport, asyncio.get_running_loop())
        coalescing.write(b"never sent")
        coalescing.abort()
        await asyncio.wait_for(peer.closed.wait(), 10)
        await asyncio.sleep(0)  # the flush that was due finds the transport closed
        assert writes == []
        assert peer.received == b""

    asyncio.run(main())


def test_uvloop_transports_are_wrapped_alike() -> None:
    """The runner's loop is uvloop: its transports take the same wrapper."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
        peer = _Peer()
        await loop.connect_accepted_socket(lambda: peer, theirs)
        coalescing = CoalescingTransport(transport, loop)
        assert coalescing.get_protocol() is transport.get_protocol()
        coalescing.write(b"a")
        coalescing.write(b"b")
        assert coalescing.get_write_buffer_size() >= 2
        coalescing.close()
        await asyncio.wait_for(peer.closed.wait(), 10)
        assert peer.received == b"ab"

    uvloop.run(main())
