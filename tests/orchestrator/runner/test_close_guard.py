"""Closing a client while another task's request is still connecting leaves no socket open.

httpcore's pool forgot such a connection: the request went on, was answered, and its
socket stayed open until the garbage collector found it (a ``ResourceWarning:
unclosed transport`` failing whichever later test it surfaced in). Real servers on
loopback and a unix socket; each counts the connections it still has open.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from sandcell_orchestrator.errors import SandboxUnavailableError
from sandcell_orchestrator.providers.docker_api import EngineClient
from sandcell_orchestrator.runner.client import RunnerClient

TOKEN = "t" * 32
# Enough loop turns to cover a loopback (or unix) connect from start to end: the race
# is lost at some of them, whichever they are on this machine.
TURNS = 12


class CountingServer:
    """Answers every request ``200 {}`` and counts the connections still open."""

    def __init__(self) -> None:
        self.open = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: 2\r\n\r\n{}"
                )
                await writer.drain()
        finally:
            self.open -= 1
            writer.close()

    async def settled(self) -> int:
        """The connections still open once closed ones had time to be seen closing."""
        for _ in range(100):
            if self.open == 0:
                return 0
            await asyncio.sleep(0.01)
        return self.open


async def _race(
    send: Callable[[], Awaitable[object]], close: Callable[[], Awaitable[None]], turns: int
) -> None:
    """Start ``send``, let ``turns`` loop turns pass, close, then let the request end."""
    request = asyncio.ensure_future(send())
    for _ in range(turns):
        await asyncio.sleep(0)
    await close()
    # Answered, or failed because the client closed first: either way, no socket left.
    with contextlib.suppress(RuntimeError, httpx.TransportError, SandboxUnavailableError):
        await request


async def _leaked_turns(
    counting: CountingServer, race: Callable[[int], Awaitable[None]]
) -> list[int]:
    """The loop turns after which a close raced against a request left a connection open."""
    leaked = []
    for turns in range(TURNS):
        await race(turns)
        if await counting.settled():
            leaked.append(turns)
    return leaked


async def test_a_runner_client_closed_mid_connect_leaves_no_connection() -> None:
    counting = CountingServer()
    server = await asyncio.start_server(counting.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:

        async def race(turns: int) -> None:
            client = RunnerClient(f"http://127.0.0.1:{port}", token=TOKEN)
            await _race(lambda: client.connection.http.get("/ping"), client.close, turns)

        leaked = await _leaked_turns(counting, race)
        assert leaked == [], f"connections left open when closed after {leaked} loop turns"
    finally:
        server.close()
        await server.wait_closed()


async def test_an_engine_client_closed_mid_connect_leaves_no_connection(tmp_path: Path) -> None:
    counting = CountingServer()
    path = tmp_path / "engine.sock"
    server = await asyncio.start_unix_server(counting.serve, path)
    try:

        async def race(turns: int) -> None:
            client = EngineClient(f"unix://{path}")
            await _race(client.ping, client.close, turns)

        leaked = await _leaked_turns(counting, race)
        assert leaked == [], f"connections left open when closed after {leaked} loop turns"
    finally:
        server.close()
        await server.wait_closed()
