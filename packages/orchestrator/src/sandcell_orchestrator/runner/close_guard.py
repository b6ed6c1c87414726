"""``CloseGuard``: an httpx transport whose ``aclose()`` also ends requests still connecting.

httpcore's pool closes the connections it holds when the client closes, but a
connection whose connect is still under way then has no socket to close, and the
pool forgets it. The request goes on, connects, is answered, and its connection
stays open: no pool will ever close it, and its socket is freed only when the
garbage collector gets to it (a ``ResourceWarning: unclosed transport`` in some
later test; in a long-running server, a socket per such race until then). That
happens whenever one task closes a client (a ``SandboxHandle`` dropped, a provider
closed) while another's request to it is connecting.

The guard lets such a request finish as it would have (its answer is delivered),
then closes its connection when its response is closed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpcore
import httpx

__all__ = ["CloseGuard"]


class CloseGuard(httpx.AsyncBaseTransport):
    """Wraps a transport; connections answered after ``aclose()`` are closed with their
    responses instead of outliving the client."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner
        self.closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        network = response.extensions.get("network_stream")
        stream = response.stream
        if not isinstance(network, httpcore.AsyncNetworkStream) or not isinstance(
            stream, httpx.AsyncByteStream
        ):
            return response  # not a pooled socket (an ASGI app, a mock): nothing to end
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_Guarded(self, stream, network),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        self.closed = True
        await self._inner.aclose()


class _Guarded(httpx.AsyncByteStream):
    """A response body that closes its connection too if the client closed meanwhile."""

    def __init__(
        self, guard: CloseGuard, stream: httpx.AsyncByteStream, network: httpcore.AsyncNetworkStream
    ) -> None:
        self._guard = guard
        self._stream = stream
        self._network = network

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            # Back in the pool (idle) if the client is open; if it closed while this
            # request was connecting, no pool holds the connection: end it here.
            if self._guard.closed:
                await self._network.aclose()
