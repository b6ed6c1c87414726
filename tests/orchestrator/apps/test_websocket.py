"""WebSocket (dev-server hot reload) through the preview, the runner and the jail."""

from __future__ import annotations

import pytest
import websockets
from websockets.asyncio.client import connect

from .conftest import StartApi
from .test_instances import eventually

# A stdlib HTTP + WebSocket echo server (text frames up to 125 bytes) that
# replaces python-web's app.py; dev.py restarts it when it is written.
WS_APP = r"""
import base64, hashlib, os, socketserver

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        head = {}
        request_line = self.rfile.readline().decode()
        while (line := self.rfile.readline().decode().strip()):
            name, _, value = line.partition(":")
            head[name.strip().lower()] = value.strip()
        if head.get("upgrade", "").lower() != "websocket":
            body = b"plain http"
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n" + body)
            return
        accept = base64.b64encode(hashlib.sha1(head["sec-websocket-key"].encode() + GUID).digest())
        self.wfile.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        self.wfile.flush()
        print("ws open " + request_line.split()[1], flush=True)
        while True:
            header = self.rfile.read(2)
            if len(header) < 2 or header[0] & 0x0F == 8:
                return
            length, mask = header[1] & 0x7F, self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            reply = b"echo:" + data
            self.wfile.write(bytes([0x81, len(reply)]) + reply)
            self.wfile.flush()


socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("", int(os.environ["PORT"])), Handler).serve_forever()
"""


async def test_websocket_frames_cross_the_preview_both_ways(start_api: StartApi) -> None:
    api = await start_api()
    created = await api.create("python-web")
    instance_id = created["instance_id"]
    assert (await api.write(instance_id, {"app.py": WS_APP})).status_code == 200
    ws_base = api.url.replace("http://", "ws://") + f"/preview/{instance_id}"
    token = created["url"].split("?token=", 1)[1]

    async def echoed() -> bool:
        try:
            async with connect(f"{ws_base}/hmr?token={token}", open_timeout=5) as socket:
                await socket.send("ping")
                return bool(await socket.recv() == "echo:ping")
        except (OSError, websockets.exceptions.WebSocketException):
            return False  # dev.py is still restarting the app

    assert await eventually(echoed)
    logs = (await api.get(f"/v1/instances/{instance_id}/logs", filter="ws open")).json()
    assert logs["lines"][-1].endswith("ws open /hmr")
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with connect(f"{ws_base}/hmr"):
            pass
