"""The preview's caps: at most N WebSockets (or tunnels) and N plain requests relayed at once.

Each relay holds sockets in the runner and the orchestrator that no job pays for; past
``SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS`` / ``_REQUESTS`` (3 here) the next one is
refused at once with ``503 busy`` naming the cap, and a relay that ends, however it
ends, gives its place back.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner
from tests.runner.apps.helpers import (
    WS_ECHO_SERVER,
    AppClient,
    start_runner_without_ws,
    ws_connect,
    ws_recv,
    ws_send,
)

CAP = 3
CAPS = {
    "SANDCELL_RUNNER_SESSIONS": "1",
    "SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS": str(CAP),
    "SANDCELL_RUNNER_MAX_RELAYED_REQUESTS": str(CAP),
}
WS_PORT = 8401
HOLD_PORT = 8402
TUNNEL_PORT = 8403

# Answers /hold only once the file "go" is in the workspace (written through the file
# routes, which the cap does not count), and tells (a line printed, one in the file
# "arrivals") as each request arrives.
HOLD_SERVER = r"""
import os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/hold":
            print("arrived", flush=True)
            with open("arrivals", "a") as arrivals:
                arrivals.write("arrived\n")
            while not os.path.exists("go"):
                time.sleep(0.02)
        body = b"done"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print("hold listening", flush=True)
server.serve_forever()
"""


@pytest.fixture(scope="module")
def capped_runner() -> Iterator[RunnerProcess]:
    with traversable_dir() as root, running_runner(root, env=CAPS) as process:
        yield process


@pytest.fixture
def capped(capped_runner: RunnerProcess) -> Iterator[AppClient]:
    """A session of its own per test, released at the end (which frees every slot)."""
    with AppClient(capped_runner) as client:
        yield client
        client.http.delete("/v1/session")


def _echo(app: AppClient, tag: str = "ws") -> None:
    app.put("ws_echo.py", WS_ECHO_SERVER)
    app.start(tag, f"exec python3 ws_echo.py {WS_PORT}")
    app.wait_log(tag, "ws listening")


def _open(app: AppClient, port: int = WS_PORT) -> tuple[socket.socket, bytes]:
    return ws_connect(app.runner, app.session_id, f"/v1/session/ports/{port}/")


def _refused(sock: socket.socket, head: bytes, setting: str) -> None:
    """``head`` (and its body on ``sock``) is the cap's 503 busy."""
    try:
        assert head.startswith(b"HTTP/1.1 503"), head
        length = int(
            next(line for line in head.lower().split(b"\r\n") if b"content-length" in line).split(
                b":"
            )[1]
        )
        body = b""
        while len(body) < length:
            chunk = sock.recv(length - len(body))
            assert chunk
            body += chunk
    finally:
        sock.close()
    error = json.loads(body)["error"]
    assert error["code"] == "busy", error
    assert f"{setting}={CAP}" in error["message"], error


def _open_once_free(app: AppClient, port: int = WS_PORT) -> socket.socket:
    """A WebSocket opened as soon as a place is free (a relay gives its place back just
    after its last frame reaches the client: this waits for that, not for a time)."""
    deadline = time.monotonic() + 20
    while True:
        sock, head = _open(app, port)
        if head.startswith(b"HTTP/1.1 101"):
            return sock
        sock.close()
        assert head.startswith(b"HTTP/1.1 503"), head
        assert time.monotonic() < deadline, "no place came free"
        time.sleep(0.05)


def _echoes(sock: socket.socket) -> None:
    ws_send(sock, b"ping")
    assert ws_recv(sock) == (1, b"ping")


def test_past_the_cap_a_websocket_is_refused_until_one_closes(capped: AppClient) -> None:
    _echo(capped)
    opened = [_open_once_free(capped) for _ in range(CAP)]
    for sock in opened:
        _echoes(sock)
    _refused(*_open(capped), "SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS")
    # The ones already open are untouched by the refusal.
    _echoes(opened[0])
    # A clean close gives its place back.
    ws_send(opened[0], struct.pack(">H", 1000), opcode=8)
    assert ws_recv(opened[0])[0] == 8
    opened[0].close()
    opened[0] = _open_once_free(capped)
    _echoes(opened[0])
    # So does a client that just drops its connection (no close frame), every one of them.
    for sock in opened:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    opened = [_open_once_free(capped) for _ in range(CAP)]
    for sock in opened:
        _echoes(sock)
    # And an upstream that goes away: the app's server is stopped under them.
    assert capped.http.delete("/v1/session/processes/ws").status_code in (200, 204)
    for sock in opened:
        assert ws_recv(sock)[0] == 8
        sock.close()
    _echo(capped, "ws-again")
    opened = [_open_once_free(capped) for _ in range(CAP)]
    for sock in opened:
        _echoes(sock)
        sock.close()


def test_releasing_the_session_frees_its_websockets(capped_runner: RunnerProcess) -> None:
    with AppClient(capped_runner) as first:
        _echo(first)
        held = [_open_once_free(first) for _ in range(CAP)]
        _refused(*_open(first), "SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS")
        assert first.http.delete("/v1/session").status_code == 204
        for sock in held:
            sock.close()
    with AppClient(capped_runner) as second:
        _echo(second)
        # All places are free at once: none is refused.
        opened = []
        for _ in range(CAP):
            sock, head = _open(second)
            opened.append(sock)
            assert head.startswith(b"HTTP/1.1 101"), head
        for sock in opened:
            _echoes(sock)
            sock.close()
        second.http.delete("/v1/session")


def test_past_the_cap_a_plain_request_is_refused_until_one_is_answered(
    capped: AppClient,
) -> None:
    capped.put("hold.py", HOLD_SERVER)
    capped.start("hold", f"exec python3 hold.py {HOLD_PORT}")
    capped.wait_log("hold", "hold listening")
    url = f"{capped.runner.url}/v1/session/ports/{HOLD_PORT}/hold"

    def held() -> httpx.Response:
        return httpx.get(url, headers=capped.http.headers, timeout=60)

    with ThreadPoolExecutor(CAP) as pool:
        waiting = [pool.submit(held) for _ in range(CAP)]
        deadline = time.monotonic() + 20
        # Counted, not by line: the server's threads print at once, and two "arrived"
        # can share one line of its log ("arrivedarrived", then an empty line).
        while sum(line.count("arrived") for line in capped.logs("hold")["lines"]) < CAP:
            assert time.monotonic() < deadline, capped.logs("hold")
            time.sleep(0.05)
        refused = capped.preview(HOLD_PORT, "other")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "busy", error
        assert f"SANDCELL_RUNNER_MAX_RELAYED_REQUESTS={CAP}" in error["message"]
        assert refused.headers["retry-after"] == "1"
        capped.put("go", "")
        assert [f.result().text for f in waiting] == ["done"] * CAP
    deadline = time.monotonic() + 20
    while (answer := capped.preview(HOLD_PORT, "other")).status_code == 503:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.05)
    assert answer.text == "done"
    # WebSockets have a cap of their own: plain requests do not count against it.
    _echo(capped)
    sock = _open_once_free(capped)
    _echoes(sock)
    sock.close()


@pytest.fixture(scope="module")
def capped_plain_runner() -> Iterator[RunnerProcess]:
    with traversable_dir() as root:
        runner = start_runner_without_ws(root, env=CAPS)
        try:
            yield runner
        finally:
            runner.stop()


def test_tunnels_count_against_the_websocket_cap(capped_plain_runner: RunnerProcess) -> None:
    """Where uvicorn has no WebSocket library an upgrade is a raw tunnel: capped alike."""
    with AppClient(capped_plain_runner) as app:
        app.put("ws_echo.py", WS_ECHO_SERVER)
        app.start("ws", f"exec python3 ws_echo.py {TUNNEL_PORT}")
        app.wait_log("ws", "ws listening")
        opened = [_open_once_free(app, TUNNEL_PORT) for _ in range(CAP)]
        for sock in opened:
            _echoes(sock)
        _refused(*_open(app, TUNNEL_PORT), "SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS")
        opened.pop().close()
        opened.append(_open_once_free(app, TUNNEL_PORT))
        for sock in opened:
            _echoes(sock)
            sock.close()
