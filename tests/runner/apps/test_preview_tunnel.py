"""WebSocket through the preview where uvicorn has no WebSocket library: a raw tunnel.

Without one (an image built without ``websockets``, or ``ws="none"`` as here)
uvicorn passes an upgrade request on as plain HTTP, and the preview takes the
connection over.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.apps.helpers import (
    WS_ECHO_SERVER,
    AppClient,
    start_runner_without_ws,
    ws_connect,
    ws_recv,
    ws_send,
)

PORT = 8301


@pytest.fixture(scope="module")
def plain_runner() -> Iterator[RunnerProcess]:
    with traversable_dir() as root:
        runner = start_runner_without_ws(root)
        try:
            yield runner
        finally:
            runner.stop()


@pytest.fixture(scope="module")
def plain_app(plain_runner: RunnerProcess) -> Iterator[AppClient]:
    with AppClient(plain_runner) as client:
        yield client


def test_upgrade_is_tunnelled_byte_for_byte(plain_app: AppClient) -> None:
    plain_app.put("ws_echo.py", WS_ECHO_SERVER)
    plain_app.start("ws", f"exec python3 ws_echo.py {PORT}")
    plain_app.wait_log("ws", "ws listening")
    sock, head = ws_connect(plain_app.runner, plain_app.session_id, f"/v1/session/ports/{PORT}/s")
    try:
        assert head.startswith(b"HTTP/1.1 101"), head
        # The upstream's own handshake answer, not one the runner made up.
        assert b"server: uvicorn" not in head.lower()
        for size in (5, 300, 70_000):
            payload = os.urandom(size)
            ws_send(sock, payload, opcode=2)
            assert ws_recv(sock) == (2, payload)
        ws_send(sock, b"", opcode=8)
        assert ws_recv(sock)[0] == 8
    finally:
        sock.close()
    # Plain routes still answer after a tunnel closed.
    assert plain_app.http.get("/v1/session/processes").status_code == 200


def test_refused_upgrade_and_checks_without_a_tunnel(plain_app: AppClient) -> None:
    plain_app.put("index.html", "<html><head></head><body>plain</body></html>")
    plain_app.start("web", f"exec python3 -m http.server {PORT + 1} --bind 127.0.0.1")
    plain_app.wait_log("web", "Serving HTTP")
    runner, session_id = plain_app.runner, plain_app.session_id
    # http.server ignores Upgrade and answers the GET: relayed, nothing tunnelled.
    sock, head = ws_connect(runner, session_id, f"/v1/session/ports/{PORT + 1}/")
    sock.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    sock, head = ws_connect(runner, session_id, f"/v1/session/ports/{PORT + 2}/")
    sock.close()
    assert head.startswith(b"HTTP/1.1 502"), head  # nothing listens: app_not_responding
    sock, head = ws_connect(runner, "rt_" + "1" * 64, f"/v1/session/ports/{PORT + 1}/")
    sock.close()
    assert head.startswith(b"HTTP/1.1 409"), head
