"""Helpers for the input-cache tests: multipart bodies, snapshots, a loopback file server."""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import httpx

from sandcell_protocol import FileRef, InputManifest, InputObject, encode, input_cache_key

MAX_OBJECT_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Blob:
    """An input object as the orchestrator knows it."""

    storage_session: str
    object_id: str
    data: bytes
    read_only: bool = False

    @property
    def key(self) -> str:
        return input_cache_key(self.storage_session, self.object_id)

    @property
    def facts(self) -> InputObject:
        return InputObject(
            size=len(self.data),
            sha256=hashlib.sha256(self.data).hexdigest(),
            read_only=self.read_only,
        )

    def ref(self, name: str = "data/input.csv") -> FileRef:
        return FileRef(
            storage_session=self.storage_session,
            object_id=self.object_id,
            name=name,
            read_only=self.read_only,
        )


def manifest_json(*blobs: Blob) -> bytes:
    return encode(InputManifest(objects={blob.key: blob.facts for blob in blobs}))


def manifest_part(raw: bytes) -> tuple[str, tuple[None, bytes, str]]:
    return ("manifest", (None, raw, "application/json"))


def object_part(filename: str, data: bytes) -> tuple[str, tuple[str, bytes, str]]:
    return ("object", (filename, data, "application/octet-stream"))


Part = tuple[str, tuple[str | None, bytes, str]]


def multipart(parts: list[Part]) -> tuple[bytes, str]:
    """Encode ``parts`` in order as multipart/form-data with httpx; (body, content type)."""
    request = httpx.Request("POST", "http://runner.invalid/v1/inputs", files=parts)
    return request.read(), request.headers["content-type"]


def upload(*blobs: Blob) -> tuple[bytes, str]:
    """A well-formed upload of ``blobs``: manifest first, then one part per object."""
    return multipart(
        [manifest_part(manifest_json(*blobs)), *(object_part(b.key, b.data) for b in blobs)]
    )


async def chunks(body: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    """``body`` as an ASGI-like stream of ``size``-byte chunks."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def snapshot(path: Path) -> dict[str, tuple[int, bytes]]:
    """Every file in directory ``path`` (or file ``path`` itself): name -> (mode, contents)."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {file.name: (file.stat().st_mode, file.read_bytes()) for file in files}


@dataclass(frozen=True)
class Served:
    """What the file server answers for one path."""

    body: bytes
    status: int = 200
    content_length: int | None = None
    """Sent instead of ``len(body)`` when set; ``-1`` sends no Content-Length at all."""
    delay_s: float = 0.0


class FileServer:
    """A loopback ``GET /files/{storage_session}/{object_id}`` server that counts requests."""

    def __init__(self) -> None:
        self.routes: dict[str, Served] = {}
        self.hits: collections.Counter[str] = collections.Counter()
        self.authorizations: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.hits[self.path] += 1
                server.authorizations.append(self.headers.get("Authorization"))
                served = server.routes.get(self.path, Served(b"not found", status=404))
                time.sleep(served.delay_s)
                self.send_response(served.status)
                length = (
                    len(served.body) if served.content_length is None else served.content_length
                )
                if length >= 0:
                    self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(served.body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep pytest output clean

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that hangs up mid-body (over-cap tests) is expected

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @staticmethod
    def path_of(storage_session: str, object_id: str) -> str:
        return f"/files/{quote(storage_session, safe='')}/{quote(object_id, safe='')}"

    def serve(self, storage_session: str, object_id: str, served: Served) -> str:
        path = self.path_of(storage_session, object_id)
        self.routes[path] = served
        return path

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
