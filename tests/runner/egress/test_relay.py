"""The gateway's relay over real TCP connections on loopback, without a gateway process:
short connections end on the event loop, bulk ones are handed to the splice threads
mid-stream, and either way every byte arrives in order and both sockets close once."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
from collections.abc import Callable

import pytest

from sandcell_runner.egress.relay import LoopRelay, relay

Pair = tuple[socket.socket, socket.socket]


def _pair() -> Pair:
    """A connected TCP pair: (the gateway's end, the far end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        far = socket.create_connection(listener.getsockname())
        near, _ = listener.accept()
    near.setblocking(False)
    return near, far


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while data := sock.recv(1 << 16):
        chunks.append(data)
    return b"".join(chunks)


class _Ends:
    """A relayed connection: the client program's end and the server's, with ``done``
    counted."""

    def __init__(
        self, start: Callable[..., object], *, small_buffers: bool = False, **kwargs: object
    ) -> None:
        gateway_client, self.client = _pair()
        gateway_upstream, self.server = _pair()
        if small_buffers:
            # The gateway's writes then stop part-way (as to a slow reader): what was read and not
            # yet written must still go first, from the thread that takes over.
            for sock in (gateway_client, gateway_upstream):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self.gateway = (gateway_client, gateway_upstream)
        self.finished = asyncio.Event()
        self.done_calls = 0
        loop = asyncio.get_running_loop()

        def done() -> None:
            self.done_calls += 1
            loop.call_soon_threadsafe(self.finished.set)

        start(gateway_client, gateway_upstream, done=done, **kwargs)

    async def closed(self) -> None:
        await asyncio.wait_for(self.finished.wait(), 30)
        await asyncio.sleep(0.05)  # a second call would come now
        assert self.done_calls == 1
        assert all(sock.fileno() == -1 for sock in self.gateway)
        self.client.close()
        self.server.close()


def _both_ways(ends: _Ends, up: bytes, down: bytes) -> tuple[bytes, bytes]:
    """Client sends ``up`` while the server sends ``down``; each then half-closes and reads
    the other side to its end."""
    got: dict[str, bytes] = {}

    def side(sock: socket.socket, data: bytes, key: str) -> None:
        reader = threading.Thread(target=lambda: got.__setitem__(key, _read_all(sock)))
        reader.start()
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        reader.join(30)

    threads = [
        threading.Thread(target=side, args=(ends.client, up, "client")),
        threading.Thread(target=side, args=(ends.server, down, "server")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got["server"], got["client"]


MIB = 1 << 20


@pytest.mark.parametrize(
    ("up", "down"),
    [(5, 7), (3 * MIB, 5 * MIB), (200, 2 * MIB), (2 * MIB, 0)],
    ids=["short", "bulk-both", "download", "upload"],
)
@pytest.mark.parametrize("small_buffers", [False, True], ids=["", "slow-reader"])
@pytest.mark.parametrize("start", [LoopRelay, relay], ids=["loop", "threads"])
async def test_every_byte_arrives_in_order(
    start: Callable[..., object], up: int, down: int, small_buffers: bool
) -> None:
    ends = _Ends(start, to_upstream=b"HEAD", to_client=b"200 ", small_buffers=small_buffers)
    up_data, down_data = os.urandom(up), os.urandom(down)
    at_server, at_client = await asyncio.to_thread(_both_ways, ends, up_data, down_data)
    assert hashlib.sha256(at_server).digest() == hashlib.sha256(b"HEAD" + up_data).digest()
    assert hashlib.sha256(at_client).digest() == hashlib.sha256(b"200 " + down_data).digest()
    await ends.closed()


async def test_the_answer_comes_before_a_server_that_speaks_first() -> None:
    """The server's banner, already waiting when the relay starts, reaches the client after
    the proxy's answer."""
    gateway_client, client = _pair()
    gateway_upstream, server = _pair()
    server.sendall(b"BANNER")
    await asyncio.sleep(0.05)
    finished = asyncio.Event()
    LoopRelay(gateway_client, gateway_upstream, done=finished.set, to_client=b"200 ")
    server.close()
    client.shutdown(socket.SHUT_WR)
    assert await asyncio.to_thread(_read_all, client) == b"200 BANNER"
    await asyncio.wait_for(finished.wait(), 30)
    client.close()


async def test_a_reset_ends_both_sides() -> None:
    ends = _Ends(LoopRelay)
    ends.server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    ends.server.close()

    def client_sees_the_end() -> bytes:
        try:
            return _read_all(ends.client)
        except ConnectionResetError:
            return b"reset"

    assert await asyncio.to_thread(client_sees_the_end) in (b"", b"reset")
    await asyncio.wait_for(ends.finished.wait(), 30)
    assert ends.done_calls == 1
    ends.client.close()
