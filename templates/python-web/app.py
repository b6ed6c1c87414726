"""The app: an HTML page and a JSON API on http.server, listening on $PORT.

Add routes to ROUTES; index.html is read on every request, so editing it needs
no restart (dev.py restarts the server when a .py file changes).
"""

from __future__ import annotations

import json
import os
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
STARTED = time.time()


def health() -> dict[str, object]:
    return {"status": "ok", "uptime_s": round(time.time() - STARTED, 3)}


def hello() -> dict[str, object]:
    return {"message": "Hello from sandcell", "time": time.strftime("%H:%M:%S")}


ROUTES = {
    "/api/health": health,
    "/api/hello": hello,
}


class Handler(BaseHTTPRequestHandler):
    server_version = "python-web/1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            page = (HERE / "index.html").read_bytes()
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", page)
        elif path in ROUTES:
            body = json.dumps(ROUTES[path]()).encode()
            self._send(HTTPStatus.OK, "application/json", body)
        else:
            self._send(HTTPStatus.NOT_FOUND, "application/json", b'{"error": "not found"}')

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        print(f"{self.address_string()} - {format % args}", flush=True)


def main() -> None:
    port = int(os.environ.get("PORT", "8000"))
    ThreadingHTTPServer.allow_reuse_address = True
    # "" is every interface of the sandbox's own network namespace: the preview
    # proxy reaches the port from inside it; nothing outside the sandbox can.
    server = ThreadingHTTPServer(("", port), Handler)
    print(f"serving on port {port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
