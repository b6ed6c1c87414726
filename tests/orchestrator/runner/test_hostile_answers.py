"""A runner taken over by its tenant answers anything: every read of it stays bounded.

``HostileRunner`` speaks HTTP/1.1 over a real loopback socket (a raw asyncio
server: uvicorn would refuse to send most of these answers) and the real
``RunnerClient`` reads it. Each hostile answer offers far more than any cap
(``OFFERED`` bytes, or a drip that would last for minutes); the tests assert the
read fails with ``RunnerAnswerError`` and stopped early: the server got to send
no more than the cap plus the socket buffers, and the client's allocations
stayed near the cap (``tracemalloc``). Time budgets run on a fake clock that
advances one second a call, so no assertion depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from sandcell_orchestrator.errors import RunnerAnswerError, SandboxUnavailableError
from sandcell_orchestrator.providers.lambda_auth import MicrovmProxyAuth, ProxyTokenCache
from sandcell_orchestrator.runner.answers import DEFAULT_CAPS, AnswerCaps
from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_orchestrator.runner.sandbox import SandboxRunnerClient
from sandcell_protocol import PROTOCOL_VERSION, ExecuteRequest, Health, encode, routes
from sandcell_protocol import contexts as cx
from sandcell_protocol import sandbox_messages as sm

TOKEN = "hostile-runner-token"
SESSION = "rt_" + "a" * 64
CHUNK = 64 << 10
OFFERED = 128 << 20
"""What a hostile answer offers before the server gives up (far past every cap)."""
SOCKET_SLACK = 16 << 20
"""Loopback socket buffers the server may fill past what the client read."""
CAPS = AnswerCaps(
    stdout_bytes=4 << 10,
    stderr_bytes=4 << 10,
    output_scan_bytes=0,
    max_output_files=0,
    max_body_bytes=256 << 10,
    answer_bytes=256 << 10,
    error_bytes=16 << 10,
    event_line_bytes=64 << 10,
)

Handler = Callable[["HostileRunner", asyncio.StreamWriter], Awaitable[None]]


def _health() -> bytes:
    body = encode(Health(status="ok", protocol=PROTOCOL_VERSION, runner_version="0"))
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


class HostileRunner:
    """Answers ``/health`` properly and every other route with ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sent = 0
        self.done = asyncio.Event()

    async def write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                request_line, *lines = head.split("\r\n")
                fields = dict(line.split(":", 1) for line in lines if ":" in line)
                length = {k.lower(): v.strip() for k, v in fields.items()}.get("content-length")
                if length:
                    await reader.readexactly(int(length))
                if request_line.split(" ")[1].split("?")[0] == routes.HEALTH:
                    writer.write(_health())
                    await writer.drain()
                    continue
                await self.handler(self, writer)
                return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.done.set()
            writer.close()


@contextlib.asynccontextmanager
async def hostile(
    handler: Handler, **kwargs: object
) -> AsyncIterator[tuple[HostileRunner, RunnerClient]]:
    runner = HostileRunner(handler)
    server = await asyncio.start_server(runner.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = RunnerClient(
        f"http://127.0.0.1:{port}",
        token=TOKEN,
        caps=CAPS,
        **kwargs,  # type: ignore[arg-type]
    )
    try:
        yield runner, client
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


def _head(*fields: str, status: str = "200 OK") -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *fields]) + "\r\n\r\n").encode()


def endless_chunked(content_type: str, piece: bytes = b"a", status: str = "200 OK") -> Handler:
    """A chunked body that never ends (until ``OFFERED`` bytes), with no newline."""

    async def handler(runner: HostileRunner, writer: asyncio.StreamWriter) -> None:
        await runner.write(
            writer,
            _head(f"Content-Type: {content_type}", "Transfer-Encoding: chunked", status=status),
        )
        data = piece * (CHUNK // len(piece))
        frame = f"{len(data):x}\r\n".encode() + data + b"\r\n"
        while runner.sent < OFFERED:
            await runner.write(writer, frame)
        await runner.write(writer, b"0\r\n\r\n")

    return handler


def huge_declared(content_type: str) -> Handler:
    """A ``Content-Length`` of 10 GiB, then bytes until ``OFFERED``."""

    async def handler(runner: HostileRunner, writer: asyncio.StreamWriter) -> None:
        await runner.write(
            writer, _head(f"Content-Type: {content_type}", f"Content-Length: {10 << 30}")
        )
        while runner.sent < OFFERED:
            await runner.write(writer, b"a" * CHUNK)

    return handler


def drip(content_type: str, piece: bytes, *, pause_s: float = 0.002, count: int = 5000) -> Handler:
    """A chunked body of ``count`` tiny chunks, each well inside any read timeout."""

    async def handler(runner: HostileRunner, writer: asyncio.StreamWriter) -> None:
        await runner.write(
            writer, _head(f"Content-Type: {content_type}", "Transfer-Encoding: chunked")
        )
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        for _ in range(count):
            await runner.write(writer, frame)
            await asyncio.sleep(pause_s)
        await runner.write(writer, b"0\r\n\r\n")

    return handler


def _gzip_of_zeros(size: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = bytes(1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(size >> 20)) + packer.flush()


def gzip_bomb(content_type: str) -> Handler:
    """A small gzip body that inflates to ``OFFERED`` bytes."""
    bomb = _gzip_of_zeros(OFFERED)

    async def handler(runner: HostileRunner, writer: asyncio.StreamWriter) -> None:
        await runner.write(
            writer,
            _head(
                f"Content-Type: {content_type}",
                "Content-Encoding: gzip",
                f"Content-Length: {len(bomb)}",
            ),
        )
        await runner.write(writer, bomb)

    return handler


def _fake_clock() -> Callable[[], float]:
    """One second a call: a budget of N seconds runs out after about N/2 reads."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


async def _drain(events: AsyncIterator[object]) -> None:
    async with contextlib.aclosing(events) as closing:  # type: ignore[type-var]
        async for _ in closing:
            pass


def _request() -> ExecuteRequest:
    return ExecuteRequest(language="python", code="print(1)")


# -- sizes ---------------------------------------------------------------------------


async def test_an_endless_execute_result_stops_at_its_cap() -> None:
    async with hostile(endless_chunked("application/json")) as (runner, client):
        with pytest.raises(RunnerAnswerError, match="exceeds"):
            await client.execute(_request())
        await runner.done.wait()
        assert runner.sent < CAPS.execute_bytes(_request()) + SOCKET_SLACK
        # The orchestrator's client is fine: its next request is answered.
        assert (await client.health()).status == "ok"


async def test_a_declared_huge_answer_is_refused_before_its_body() -> None:
    async with hostile(huge_declared("application/json")) as (runner, client):
        with pytest.raises(RunnerAnswerError, match="exceeds"):
            await client.egress()
        await runner.done.wait()
        assert runner.sent < SOCKET_SLACK


async def test_an_endless_error_body_stops_at_the_error_cap() -> None:
    handler = endless_chunked("application/json", status="500 Internal Server Error")
    async with hostile(handler) as (runner, client):
        with pytest.raises(RunnerAnswerError, match=f"exceeds {CAPS.error_bytes} bytes"):
            await client.release_session(session_id=SESSION)
        await runner.done.wait()
        assert runner.sent < SOCKET_SLACK


async def test_a_workspace_file_stops_at_the_runner_body_cap() -> None:
    async with hostile(endless_chunked("application/octet-stream")) as (runner, client):
        with pytest.raises(RunnerAnswerError, match=f"exceeds {CAPS.file_bytes} bytes"):
            await client.read_file("big.bin", session_id=SESSION)
        await runner.done.wait()
        assert runner.sent < CAPS.file_bytes + SOCKET_SLACK


async def test_a_gzip_bomb_never_inflates_past_the_cap() -> None:
    async with hostile(gzip_bomb("application/json")) as (_, client):
        await client.health()  # first contact outside the measurement
        tracemalloc.start()
        try:
            with pytest.raises(RunnerAnswerError, match="exceeds"):
                await client.list_files("", session_id=SESSION)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < CAPS.fs_bytes + (8 << 20)


async def test_a_refusal_behind_the_microvm_proxy_is_read_within_the_error_cap() -> None:
    """The proxy auth reads a 403's body to tell the runner's refusal from the proxy's."""

    async def mint() -> dict[str, str]:
        return {"X-aws-proxy-auth": "proxy-token-0001"}

    auth = MicrovmProxyAuth(ProxyTokenCache(mint, lifetime_s=3600))
    handler = endless_chunked("application/json", status="403 Forbidden")
    async with hostile(handler, auth=auth) as (runner, client):
        # The auth's own cap (the default error cap): it is not the client's to choose.
        with pytest.raises(RunnerAnswerError, match=f"exceeds {DEFAULT_CAPS.error_bytes} bytes"):
            await client.egress()
        await runner.done.wait()
        assert runner.sent < SOCKET_SLACK


# -- endless lines ---------------------------------------------------------------------


async def test_an_endless_line_in_an_execute_stream_stops_at_its_cap() -> None:
    async with hostile(endless_chunked(routes.NDJSON)) as (runner, client):
        with pytest.raises(RunnerAnswerError, match="exceeds"):
            await _drain(client.execute_stream(_request()))
        await runner.done.wait()
        assert runner.sent < CAPS.execute_bytes(_request()) + SOCKET_SLACK


async def test_an_endless_line_in_a_context_run_stream_stops_at_its_cap() -> None:
    async with hostile(endless_chunked(routes.NDJSON)) as (runner, client):
        stream = client.contexts.run_stream("c1", cx.ContextRun(code="1"), session_id=SESSION)
        with pytest.raises(RunnerAnswerError, match="exceeds"):
            await _drain(stream)
        await runner.done.wait()
        assert runner.sent < CAPS.execute_bytes() + SOCKET_SLACK


async def test_an_endless_line_in_a_process_stream_stops_at_the_line_cap() -> None:
    async with hostile(endless_chunked(routes.NDJSON)) as (runner, client):
        sandbox = SandboxRunnerClient(client, session_id=SESSION)
        events = await sandbox.attach(7)
        tracemalloc.start()
        try:
            with pytest.raises(RunnerAnswerError, match=f"exceeds {CAPS.event_line_bytes}"):
                async for _ in events:
                    pass
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await runner.done.wait()
        assert runner.sent < SOCKET_SLACK
        assert peak < CAPS.event_line_bytes + (4 << 20)


async def test_a_process_stream_of_many_short_lines_is_not_capped() -> None:
    """Legitimately long: a process's events last as long as it does (no total cap)."""
    line = encode(sm.ProcessKeepalive()) + b"\n"
    count = 4 * CAPS.event_line_bytes // (64 * len(line)) + 1
    handler = drip(routes.NDJSON, line * 64, pause_s=0, count=count)
    async with hostile(handler, clock=_fake_clock()) as (runner, client):
        sandbox = SandboxRunnerClient(client, session_id=SESSION)
        with contextlib.suppress(SandboxUnavailableError):
            async for _ in await sandbox.attach(7):
                pass
        await runner.done.wait()
        assert runner.sent > 4 * CAPS.event_line_bytes


# -- drips -----------------------------------------------------------------------------


async def test_a_dripping_answer_runs_out_of_time() -> None:
    async with hostile(drip("application/json", b" "), clock=_fake_clock()) as (runner, client):
        with pytest.raises(RunnerAnswerError, match="took over"):
            await client.egress()
        await runner.done.wait()
        assert runner.sent < 1000 * 6  # of 5000 drops (6 bytes a chunk)


async def test_a_dripping_execute_stream_runs_out_of_time() -> None:
    handler = drip(routes.NDJSON, b"\n")
    async with hostile(handler, clock=_fake_clock()) as (runner, client):
        with pytest.raises(RunnerAnswerError, match="took over"):
            await _drain(client.execute_stream(_request()))
        await runner.done.wait()
        assert runner.sent < 1000 * 6  # of 5000 drops


# -- headers -----------------------------------------------------------------------------


async def test_a_header_flood_is_refused_by_the_transport() -> None:
    """Guards an existing bound (httpcore's limit on a response head), not a new one."""

    async def flood(runner: HostileRunner, writer: asyncio.StreamWriter) -> None:
        await runner.write(writer, b"HTTP/1.1 200 OK\r\n")
        while runner.sent < OFFERED:
            await runner.write(writer, b"X-Flood: " + b"a" * 1000 + b"\r\n")

    async with hostile(flood) as (runner, client):
        with pytest.raises(SandboxUnavailableError):
            await client.egress()
        await runner.done.wait()
        assert runner.sent < SOCKET_SLACK
