"""HTTP reverse proxy from ``/v1/session/ports/{port}/…`` to ``localhost:port`` in the session.

Upstream connections are sockets made inside the session's network namespace
(``jail/netns.py``) and handed to an httpcore pool through a custom network backend,
so the runner reaches the jail's ports without the jail reaching the host's.
Requests lose the runner's own headers (bearer token, session id) and hop-by-hop
headers, and ask for identity encoding, so HTML comes back uncompressed and gets
the error reporter (``inject.py``) before ``</head>``. Everything else is
streamed through byte for byte. WebSocket upgrades take another path
(``ws_tunnel.py``): they need the raw connection.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpcore
from starlette.responses import Response, StreamingResponse

from sandcell_protocol import headers as wire_headers

from ..errors import AppNotRespondingError
from ..jail.netns import SessionNetns
from .inject import inject, reporter_tag

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"expect",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Never forwarded to the untrusted server: the runner's credentials and routing.
RUNNER_ONLY = frozenset(
    {
        wire_headers.AUTHORIZATION.lower().encode(),
        wire_headers.AWS_PROXY_AUTH.lower().encode(),
        wire_headers.RUNTIME_SESSION_ID.lower().encode(),
        wire_headers.PROTOCOL.lower().encode(),
        b"host",
        b"content-length",
        b"accept-encoding",
    }
)
# uvicorn always sends its own; a second copy from upstream would duplicate them.
_SERVER_SETS = frozenset({b"date", b"server"})
_NOT_FOR_REWRITTEN = frozenset({b"content-length", b"etag", b"last-modified"})
MAX_INJECT_BYTES = 8 * 1024 * 1024
_TIMEOUTS = {"connect": 5.0, "read": 300.0, "write": 60.0, "pool": 10.0}


class _SocketStream(httpcore.AsyncNetworkStream):
    """An httpcore stream over a connected non-blocking socket, driven by the event loop.

    (httpcore's interface passes timeouts as arguments; ASYNC109 is silenced for it.)
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        try:
            async with asyncio.timeout(timeout):
                return await self._loop.sock_recv(self._sock, max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout("upstream read timed out") from None
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                await self._loop.sock_sendall(self._sock, buffer)
        except TimeoutError:
            raise httpcore.WriteTimeout("upstream write timed out") from None
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._sock.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._sock
        if info == "is_readable":
            # httpcore asks whether an idle pooled connection was closed by the server.
            try:
                return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True
        return None


class _NetnsBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, netns: SessionNetns) -> None:
        self._netns = netns

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            sock = await self._netns.connect(port, timeout_s=timeout or 5.0)
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return _SocketStream(sock)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class PreviewUpstream:
    """Connections into one session's namespace, pooled per port."""

    def __init__(self, netns: SessionNetns) -> None:
        self.netns = netns
        self._pool = httpcore.AsyncConnectionPool(
            network_backend=_NetnsBackend(netns),
            max_connections=64,
            keepalive_expiry=5.0,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def forward(
        self,
        *,
        port: int,
        method: str,
        target: bytes,
        request_headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        script_prefix: str,
        files_version: int | None = None,
    ) -> Response:
        """Send one request upstream and answer with its response (HTML gets the reporter)."""
        outgoing = [(b"host", f"localhost:{port}".encode())]
        outgoing += [(k, v) for k, v in request_headers if not _dropped(k)]
        if body or method not in ("GET", "HEAD", "OPTIONS"):
            outgoing.append((b"content-length", str(len(body)).encode()))
        request = httpcore.Request(
            method.encode(),
            httpcore.URL(scheme=b"http", host=b"localhost", port=port, target=target),
            headers=outgoing,
            content=body,
            extensions={"timeout": _TIMEOUTS},
        )
        try:
            response = await self._pool.handle_async_request(request)
        except httpcore.ConnectError:
            raise AppNotRespondingError(
                f"the app did not answer: nothing is listening on port {port}"
                " (not started yet, or it exited: see the instance's logs)"
            ) from None
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise AppNotRespondingError(
                f"the app did not answer on port {port} ({type(exc).__name__})"
            ) from None
        kept = [
            (k.lower(), v)
            for k, v in response.headers
            if k.lower() not in HOP_BY_HOP and k.lower() not in _SERVER_SETS
        ]
        kept = _rewrite_location(kept, port, script_prefix)
        if _injectable(method, response.status, kept):
            return await self._with_reporter(
                response, kept, script_prefix, files_version=files_version
            )
        return _streamed(response, kept)

    async def _with_reporter(
        self,
        response: httpcore.Response,
        kept: list[tuple[bytes, bytes]],
        prefix: str,
        *,
        files_version: int | None,
    ) -> Response:
        chunks: list[bytes] = []
        size = 0
        stream = response.aiter_stream()
        async for chunk in stream:
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_INJECT_BYTES:
                # Too big to hold: pass it on untouched, as it came.
                return _streamed(response, kept, head=b"".join(chunks), rest=stream)
        await response.aclose()
        html = inject(b"".join(chunks), reporter_tag(prefix, files_version=files_version))
        # No validators on a page we rewrote: its body is not the upstream's, and a
        # reload after a file write must not be answered 304 by a server whose
        # Last-Modified has one-second resolution (http.server's), which kept the
        # old page in the tab when the write came within the second.
        headers = [(k, v) for k, v in kept if k not in _NOT_FOR_REWRITTEN]
        headers.append((b"content-length", str(len(html)).encode()))
        answer = Response(html, status_code=response.status)
        answer.raw_headers = headers
        return answer


def _dropped(name: bytes) -> bool:
    lowered = name.lower()
    return lowered in HOP_BY_HOP or lowered in RUNNER_ONLY


def _injectable(method: str, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    if method == "HEAD" or status in (204, 304) or status < 200:
        return False
    values = dict(headers)
    content_type = values.get(b"content-type", b"").split(b";")[0].strip().lower()
    encoding = values.get(b"content-encoding", b"identity").strip().lower()
    return content_type == b"text/html" and encoding in (b"", b"identity")


def _rewrite_location(
    headers: list[tuple[bytes, bytes]], port: int, prefix: str
) -> list[tuple[bytes, bytes]]:
    """Redirects to the server's own root or origin stay under the preview prefix."""
    origins = [f"http://{host}:{port}/".encode() for host in ("localhost", "127.0.0.1")]
    out = []
    for name, value in headers:
        if name == b"location":
            for origin in origins:
                if value.startswith(origin):
                    value = b"/" + value[len(origin) :]
            if value.startswith(b"/") and not value.startswith(b"//"):
                value = prefix.encode() + value[1:]
        out.append((name, value))
    return out


def _streamed(
    response: httpcore.Response,
    headers: list[tuple[bytes, bytes]],
    *,
    head: bytes = b"",
    rest: AsyncIterator[bytes] | None = None,
) -> Response:
    async def body() -> AsyncIterator[bytes]:
        try:
            if head:
                yield head
            async for chunk in rest if rest is not None else response.aiter_stream():
                yield chunk
        finally:
            await response.aclose()

    answer = StreamingResponse(body(), status_code=response.status)
    answer.raw_headers = list(headers)
    return answer


__all__ = ["HOP_BY_HOP", "RUNNER_ONLY", "PreviewUpstream"]
