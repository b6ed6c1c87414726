"""Helpers for app tests: a session client with process helpers, servers to run, and a
raw-socket WebSocket client (it sees the exact bytes a tunnel passes on)."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.fixtures.runner_process import RunnerProcess, free_port, wait_healthy
from tests.runner.session.helpers import SessionClient

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

# A stdlib web app: files from the workspace, plus routes that show what the
# server received, fail on purpose, redirect and echo.
APP_SERVER = r"""
import json, sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

class Handler(SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/headers":
            seen = json.dumps(dict(self.headers.items())).encode()
            return self.reply(200, seen, "application/json")
        if self.path == "/boom":
            return undefined_helper()
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/target?x=1")
            self.send_header("Content-Length", "0")
            return self.end_headers()
        if self.path == "/gzipped":
            import gzip
            body = gzip.compress(b"<html><head></head><body>zipped</body></html>")
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return self.wfile.write(body)
        return super().do_GET()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return self.reply(200, body[::-1], "application/octet-stream")

    def reply(self, status, body, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print("app listening", flush=True)
server.serve_forever()
"""

# A WebSocket echo server in the standard library only (RFC 6455, no extensions).
WS_ECHO_SERVER = r"""
import base64, hashlib, socket, struct, sys, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

def serve(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return conn.close()
        data += chunk
    head, _, buf = data.partition(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"upgrade", b"").lower() != b"websocket":
        body = b"no upgrade"
        conn.sendall(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: %d\r\n\r\n" % len(body))
        conn.sendall(body)
        return conn.close()
    accept = base64.b64encode(hashlib.sha1(headers[b"sec-websocket-key"] + GUID).digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    def need(n):
        nonlocal buf
        while len(buf) < n:
            chunk = conn.recv(65536)
            if not chunk:
                raise EOFError
            buf += chunk
        out, buf = buf[:n], buf[n:]
        return out
    try:
        while True:
            b1, b2 = need(2)
            opcode, size = b1 & 0x0F, b2 & 0x7F
            if size == 126:
                size = struct.unpack(">H", need(2))[0]
            elif size == 127:
                size = struct.unpack(">Q", need(8))[0]
            mask = need(4) if b2 & 0x80 else b"\0\0\0\0"
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(need(size)))
            if opcode == 8:
                conn.sendall(b"\x88\x00")
                break
            if size < 126:
                header = bytes([0x80 | opcode, size])
            elif size < 65536:
                header = bytes([0x80 | opcode, 126]) + struct.pack(">H", size)
            else:
                header = bytes([0x80 | opcode, 127]) + struct.pack(">Q", size)
            conn.sendall(header + payload)
    except (EOFError, OSError):
        pass
    conn.close()

srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen()
print("ws listening", flush=True)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


class AppClient(SessionClient):
    """A session client with helpers for processes, logs and the preview."""

    def put(self, path: str, content: bytes | str) -> None:
        data = content.encode() if isinstance(content, str) else content
        response = self.http.put(f"/v1/session/files/{path}", content=data)
        assert response.status_code == 200, response.text

    def start(self, tag: str, command: str, **fields: Any) -> dict[str, Any]:
        response = self.http.post(
            "/v1/session/processes", json={"tag": tag, "command": command, **fields}
        )
        assert response.status_code == 201, response.text
        info: dict[str, Any] = response.json()
        assert info["state"] == "running"
        return info

    def process(self, tag: str) -> dict[str, Any]:
        listing = self.http.get("/v1/session/processes").json()["processes"]
        found = [p for p in listing if p["tag"] == tag]
        assert found, f"no process {tag} in {listing}"
        return dict(found[0])

    def wait_exited(self, tag: str, timeout_s: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.process(tag)
            if info["state"] == "exited":
                return info
            time.sleep(0.05)
        raise AssertionError(f"{tag} still running: {self.logs(tag)}")

    def logs(self, tag: str, **params: Any) -> dict[str, Any]:
        response = self.http.get(f"/v1/session/processes/{tag}/logs", params=params)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def wait_log(self, tag: str, text: str, timeout_s: float = 20) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines: list[str] = self.logs(tag, lines=1000)["lines"]
            if any(text in line for line in lines):
                return lines
            time.sleep(0.05)
        raise AssertionError(f"{text!r} never logged by {tag}: {self.logs(tag)}")

    def preview(self, port: int, path: str = "", **kwargs: Any) -> httpx.Response:
        return self.http.get(f"/v1/session/ports/{port}/{path}", **kwargs)

    def serve_app(self, tag: str, port: int) -> None:
        self.put("server_app.py", APP_SERVER)
        self.start(tag, f"exec python3 server_app.py {port}")
        self.wait_log(tag, "app listening")


def ws_connect(
    runner: RunnerProcess, session_id: str, path: str, *, extra: dict[str, str] | None = None
) -> tuple[socket.socket, bytes]:
    """Open a WebSocket to ``path`` on the runner; returns the socket and the response head."""
    key = base64.b64encode(os.urandom(16))
    sock = socket.create_connection(("127.0.0.1", runner.port), timeout=10)
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: 127.0.0.1:{runner.port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key.decode()}",
        "Sec-WebSocket-Version: 13",
        f"Authorization: Bearer {runner.token}",
        f"X-Runtime-Session-Id: {session_id}",
        *(f"{k}: {v}" for k, v in (extra or {}).items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            break
        head += chunk
    if head.startswith(b"HTTP/1.1 101"):
        expected = base64.b64encode(hashlib.sha1(key + WS_GUID).digest())
        assert (b"sec-websocket-accept: " + expected).lower() in head.lower(), head
    return sock, head


def ws_send(sock: socket.socket, payload: bytes, opcode: int = 1) -> None:
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        header = bytes([0x80 | opcode, 0x80 | size])
    elif size < 65536:
        header = bytes([0x80 | opcode, 0x80 | 126]) + struct.pack(">H", size)
    else:
        header = bytes([0x80 | opcode, 0x80 | 127]) + struct.pack(">Q", size)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    sock.sendall(header + mask + masked)


def ws_recv(sock: socket.socket) -> tuple[int, bytes]:
    def need(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            assert chunk, "connection closed mid-frame"
            out += chunk
        return out

    b1, b2 = need(2)
    size = b2 & 0x7F
    if size == 126:
        size = struct.unpack(">H", need(2))[0]
    elif size == 127:
        size = struct.unpack(">Q", need(8))[0]
    return b1 & 0x0F, need(size)


# The runner as __main__ serves it, but with uvicorn's WebSocket support off: how it
# runs where no WebSocket library is installed.
_NO_WS_LAUNCHER = """
import os, uvicorn
from sandcell_runner.http.app import create_app
from sandcell_runner.config import RunnerSettings
from sandcell_runner.service import RunnerService
settings = RunnerSettings.from_env(os.environ)
os.environ.pop("SANDCELL_RUNNER_TOKEN", None)
uvicorn.run(create_app(RunnerService(settings)), host=settings.host, port=settings.port,
            loop="asyncio", http="httptools", ws="none", lifespan="on", log_level="info")
"""


def start_runner_without_ws(root: Path, *, env: dict[str, str] | None = None) -> RunnerProcess:
    """A session runner whose uvicorn has no WebSocket protocol (the raw tunnel path);
    ``env``: more settings."""
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(24)
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SANDCELL_RUNNER_TOKEN": token,
        "SANDCELL_RUNNER_PORT": str(port),
        "SANDCELL_WORKSPACE_ROOT": str(root / "workspaces"),
        "SANDCELL_INPUT_CACHE_DIR": str(root / "input-cache"),
        "SANDCELL_RUNNER_REAP_INTERVAL_S": "3600",
        "SANDCELL_RUNNER_SESSIONS": "1",
        **(env or {}),
    }
    log_path = root / "runner.log"
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", _NO_WS_LAUNCHER],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    runner = RunnerProcess(process, port, token, root, log_path, env)
    wait_healthy(runner)
    return runner
